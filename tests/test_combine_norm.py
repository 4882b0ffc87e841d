"""The MoE combine that also applies the next block's RMSNorm and, in a split decode step, waits for the CPU worker's
answer itself (strata.kernels.combine_norm). The kernel against the unfused launches is in
tests/test_fused_kernels.py (on the GPU, and under Triton's interpreter on CPU CI); here, which norms a layer may
take ahead, and whole engines with the folds on and off."""

from __future__ import annotations

import pytest
import torch

from strata.kernels import combine_norm


def test_a_layer_takes_the_next_norm_ahead_except_before_an_engram_layer(tiny_engine, monkeypatch):
    """Layer i's combine may apply layer i + 1's input norm, or the final norm after the last layer; never the norm
    of an Engram layer (its lookup is added before its norm), and none with the fold off."""
    model = tiny_engine.model
    n = len(model.layers)
    engram = [i for i in range(n) if model.layers[i].engram is not None]
    assert engram and engram[0] > 0  # the tiny model has Engram layers after the first
    monkeypatch.setattr(combine_norm, "NORM_AHEAD", True)
    for i in range(n):
        ahead = model._norm_ahead(i)
        if i + 1 in engram:
            assert ahead is None
            continue
        norm = model.layers[i + 1].input_layernorm if i + 1 < n else model.norm
        assert ahead is not None and ahead.weight is norm.weight and ahead.eps == norm.eps and ahead.out is None
    monkeypatch.setattr(combine_norm, "NORM_AHEAD", False)
    assert all(model._norm_ahead(i) is None for i in range(n))


def test_the_cpu_engine_is_unchanged_by_the_norm_ahead(tiny_model_dir, tiny_engine, monkeypatch):
    """Where no fused kernel runs (CPU), a layer handed the next norm leaves it to that block: same scores."""
    from strata import Engine

    ids = tiny_engine.tokenizer.encode("The river runs through the valley")
    monkeypatch.setattr(combine_norm, "NORM_AHEAD", False)
    off = Engine.from_pretrained(tiny_model_dir, device="cpu")
    assert torch.equal(tiny_engine.score(ids), off.score(ids))


@pytest.mark.gpu
def test_engine_with_the_folds_equals_engine_without(tmp_path, monkeypatch):
    """The all-in-memory engine (decode graphs on) scores and decodes identically with the combine applying the
    next norm and without; the folded kernel ran."""
    from strata import Engine
    from strata.runtime.demo_model import write_demo_model

    path = write_demo_model(tmp_path / "tiny", size="tiny", engram=False)
    cfg = {"runtime": {"experts": "memory"}}
    monkeypatch.setattr(combine_norm, "NORM_AHEAD", False)
    off = Engine.from_pretrained(path, device="cuda", config=cfg)
    ids = off.tokenizer.encode("The river runs through the valley and the town")
    want_scores, want = off.score(ids), off.generate(ids, max_tokens=32).token_ids
    monkeypatch.setattr(combine_norm, "NORM_AHEAD", True)
    calls = []
    real = combine_norm.combine_norm
    monkeypatch.setattr(combine_norm, "combine_norm", lambda *a, **k: calls.append(a[3] is not None) or real(*a, **k))
    on = Engine.from_pretrained(path, device="cuda", config=cfg)
    assert torch.equal(on.score(ids), want_scores)
    assert on.generate(ids, max_tokens=32).token_ids == want
    assert on.model.graphs.replays > 0 and any(calls)


@pytest.mark.gpu
@pytest.mark.parametrize("wait", ["1", "0"])
def test_one_graph_split_decode_with_the_combine_waiting_follows_memory(tmp_path, monkeypatch, wait):
    """A split decode step whose combine waits for the CPU worker's answer itself ("1", the default) or after
    `wait_and_fetch` ("0"): the in-memory engine's tokens (within the forked numerics' tolerance), one graph a
    step, the worker's answers all seen (no generation given up on)."""
    from mailbox_engines import one_graph_decode, tiny_split_setup

    monkeypatch.setattr(combine_norm, "WAIT_COMBINE", wait == "1")
    calls = []
    real = combine_norm.combine_norm
    monkeypatch.setattr(combine_norm, "combine_norm",
                        lambda *a, **k: calls.append(isinstance(a[5] if len(a) > 5 else None, combine_norm.HostAnswer))
                        or real(*a, **k))
    model, cfg, ids, want = tiny_split_setup(tmp_path)
    with one_graph_decode(model, cfg, ids, want) as (tiered, read, groups):
        assert read > 0 and groups > 0
        box = tiered._compute.mailbox
        assert all(int(h[3]) == 0 for h in box.headers)
        assert any(calls) == (wait == "1")
