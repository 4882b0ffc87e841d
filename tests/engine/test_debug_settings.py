"""`[debug]` settings reach the engine they configure, and only it: engines of one process may differ."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.kernels import options
from strata.kernels.cpu import experts as ce
from strata.kernels.options import KernelOptions

PROMPT = "The river runs through the valley"


def test_cpu_kernel_is_chosen_per_engine(tiny_model_dir):
    """`cpu_kernel = "torch"`: that engine's cold experts run the reference math, so its scores equal those of the
    engine that computes them without the CPU kernel at all (cpu_numerics "gpu"), bit for bit; an engine beside it
    keeps the compiled kernel, whose rounding differs, and the process default is untouched."""
    default_backend = ce.backend()
    exact = {"dtype": "float32"}  # the dense layers exact too, so the experts' path is the only difference
    configs = {"torch": {"runtime": exact, "debug": {"cpu_kernel": "torch"}},
               "reference": {"runtime": {**exact, "cpu_numerics": "gpu"}}, "auto": {"runtime": exact}}
    scores = {}
    for name, cfg in configs.items():
        with Engine.from_pretrained(tiny_model_dir, device="cpu", config=cfg) as engine:
            assert engine.executor.cpu_kernel == cfg.get("debug", {}).get("cpu_kernel", "auto")
            scores[name] = engine.score(engine.tokenizer.encode(PROMPT))
    assert torch.equal(scores["torch"], scores["reference"])
    if default_backend != "torch":  # the compiled kernel's own summation order (and bf16 rounding where it has it)
        assert not torch.equal(scores["auto"], scores["reference"])
    assert ce.backend() == default_backend


def test_cpu_threads_fix_the_kernels_thread_count(tiny_model_dir):
    with Engine.from_pretrained(tiny_model_dir, device="cpu", config={"debug": {"cpu_threads": 3}}) as engine:
        assert engine.executor.cpu_threads == 3 and engine.executor.fixed_threads
    with Engine.from_pretrained(tiny_model_dir, device="cpu") as engine:
        assert not engine.executor.fixed_threads


def test_kernel_options_hold_in_their_own_engines_forward_passes(tiny_model_dir):
    """`fused_kernels` and `pdl` are read deep inside the kernels: each engine's forward passes run under its own
    options (seen from inside a layer), and outside them the defaults hold."""
    seen: dict[str, list[KernelOptions]] = {}
    engines = {"default": Engine.from_pretrained(tiny_model_dir, device="cpu"),
               "off": Engine.from_pretrained(tiny_model_dir, device="cpu",
                                             config={"debug": {"fused_kernels": False, "pdl": False}})}
    try:
        for name, engine in engines.items():
            seen[name] = []
            engine.model.layers[0].register_forward_hook(lambda *_, log=seen[name]: log.append(options.current()))
        for engine in engines.values():
            engine.score(engine.tokenizer.encode(PROMPT))
    finally:
        for engine in engines.values():
            engine.close()
    assert seen["default"] and set(seen["default"]) == {KernelOptions()}
    assert seen["off"] and set(seen["off"]) == {KernelOptions(fused=False, pdl=False)}
    assert options.current() == options.DEFAULT


def test_fused_kernels_follow_the_running_options(monkeypatch):
    """Under Triton's interpreter (so the fused path would run on the CPU), `fused_ok` says no inside a pass whose
    options turn the fused kernels off, and yes again after it."""
    pytest.importorskip("triton")
    from strata.kernels.gpu import fused

    monkeypatch.setattr(fused, "_INTERPRET", True)
    x = torch.zeros(2, 64)
    assert fused.fused_ok(x)
    with options.kernel_options(KernelOptions(fused=False)):
        assert not fused.fused_ok(x) and not fused.fold_ok(x)
    assert fused.fused_ok(x)
