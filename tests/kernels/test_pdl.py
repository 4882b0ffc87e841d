"""Programmatic dependent launch (strata.kernels.gpu.pdl): off where it cannot run, in force on Hopper, and never a
change in results: a chain of dependent decode kernels captured in a CUDA graph with PDL equals the same chain
launched without it, bit for bit, replay after replay; so do an all-in-memory engine's scores and tokens."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.gpu import pdl
from strata.kernels.options import KernelOptions, kernel_options

NO_PDL = KernelOptions(pdl=False)


def test_off_on_cpu_and_when_disabled(monkeypatch):
    x = torch.zeros(4)
    assert not pdl.on(x)
    # no launch_pdl keyword: CPU and interpreter launches stay as before; FP fusion named either way
    assert pdl.launch(x) == {"PDL": False, "enable_fp_fusion": True}
    with kernel_options(NO_PDL):
        assert pdl.launch(x) == {"PDL": False, "enable_fp_fusion": True}


def test_a_forward_pass_without_pdl_launches_without_it(monkeypatch):
    """On a GPU that has it, kernels launch with PDL unless the running forward pass's options turn it off
    (`[debug] pdl = false`); the default comes back after the pass."""
    from types import SimpleNamespace

    monkeypatch.setattr(pdl, "_device_ok", lambda index: True)  # a Hopper card, as far as `on` can tell
    x = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    assert pdl.launch(x) == {"PDL": True, "launch_pdl": True, "enable_fp_fusion": True}
    with kernel_options(NO_PDL):
        assert not pdl.on(x) and pdl.launch(x) == {"PDL": False, "enable_fp_fusion": True}
    assert pdl.on(x)


@pytest.mark.gpu
def test_in_force_on_hopper_and_later():
    x = torch.zeros(4, device="cuda")
    major = torch.cuda.get_device_capability()[0]
    assert pdl.on(x) == (major >= 9)
    if pdl.on(x):
        assert pdl.launch(x) == {"PDL": True, "launch_pdl": True}


def _chain(x, layers):
    """A decode layer's dependent kernels, several times over: add+norm -> GEMV -> q norm+rope -> GEMV -> norm ->
    router -> pair experts -> combine (with the residual). Each reads what the one before wrote."""
    from strata.kernels.gpu import decode_gemv, decode_router, fused
    from strata.kernels.gpu.experts import grouped

    for lay in layers:
        total, h = fused.add_rms_norm(x, lay["delta"], lay["norm"], 1e-6)
        q = decode_gemv.linear(h, lay["wq"]).view(1, -1, 128)  # [1, 8, 128]
        q = fused.norm_rope(q, lay["cos"], lay["sin"], lay["qnorm"], 1e-6)
        h2 = fused.rms_norm(decode_gemv.linear(q.reshape(1, -1), lay["wo"]), lay["norm"], 1e-6)
        w, ids, used = decode_router.route(h2, lay["router"], 4, True, lay["counts"], lay["slot_of"])
        y = torch.zeros((4, h2.shape[1]), dtype=torch.float32, device=x.device)
        grouped.pair_experts(h2, lay["experts"], lay["slot_of"], ids.view(-1), y, used=used)
        x = grouped.combine_pairs(y, w, x.dtype, residual=total)
    return x


def _layers(n, hidden=1024, inter=256, experts=8, device="cuda"):
    from strata.kernels.gpu.experts.grouped import SlotWeights

    g = torch.Generator(device="cpu").manual_seed(7)

    def rnd(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    out = []
    for _ in range(n):
        out.append({
            "delta": rnd(1, hidden), "norm": rnd(hidden, scale=1.0), "wq": rnd(1024, hidden),
            "qnorm": rnd(128, scale=1.0), "wo": rnd(hidden, 1024), "router": rnd(experts, hidden, scale=0.5),
            "cos": rnd(1, 128, scale=1.0), "sin": rnd(1, 128, scale=1.0),
            "counts": torch.zeros(16, dtype=torch.int32, device=device),
            "slot_of": torch.arange(experts, dtype=torch.int32, device=device),
            "experts": SlotWeights(rnd(experts, 2 * inter, hidden), rnd(experts, hidden, inter)),
        })
    return out


@pytest.mark.gpu
def test_a_dependent_chain_in_a_graph_equals_it_without_pdl(monkeypatch):
    """Eight layers' chains (~70 kernels) in one CUDA graph: replayed 20 times with new inputs, with PDL on, each
    output equals the chain launched eagerly without PDL. A kernel reading before its producer finished would
    show as a mismatch in some replay."""
    layers = _layers(8)
    x = torch.zeros((1, 1024), dtype=torch.bfloat16, device="cuda")
    inputs = [(torch.randn(1, 1024, generator=torch.Generator().manual_seed(i)) * 0.5).to("cuda", torch.bfloat16)
              for i in range(20)]
    with kernel_options(NO_PDL):
        want = [_chain(v, layers).clone() for v in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.copy_(inputs[0])
        _chain(x, layers)  # compile and warm up off the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, layers)
    for v, ref in zip(inputs, want, strict=True):
        x.copy_(v)
        graph.replay()
        assert torch.equal(out, ref)


@pytest.mark.gpu
def test_engine_with_pdl_equals_engine_without(tmp_path):
    """The all-in-memory engine (decode graphs on) scores and decodes identically with PDL on and off (`[debug] pdl`),
    the two engines side by side in one process."""
    from strata import Engine
    from strata.runtime.demo.model import write_demo_model

    path = write_demo_model(tmp_path / "tiny", size="tiny", engram=False)
    cfg = {"runtime": {"experts": "memory"}}
    off = Engine.from_pretrained(path, device="cuda", config={**cfg, "debug": {"pdl": False}})
    ids = off.tokenizer.encode("The river runs through the valley and the town")
    want_scores, want = off.score(ids), off.generate(ids, max_tokens=32).token_ids
    on = Engine.from_pretrained(path, device="cuda", config=cfg)
    assert torch.equal(on.score(ids), want_scores)
    assert on.generate(ids, max_tokens=32).token_ids == want
    assert on.model.graphs.replays > 0


def _pdl_kernels():
    """(module, kernel name, function node) of every Triton kernel in strata.kernels that takes a PDL constexpr."""
    import ast
    import pathlib

    import strata.kernels

    root = pathlib.Path(strata.kernels.__file__).parent
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args) and node.name != "enter":
                yield path.stem, node.name, node


def test_every_pdl_kernel_waits_before_it_reads_activations_or_writes():
    """The contract that keeps PDL from changing results (strata.kernels.gpu.pdl): a kernel launched with it calls
    `pdl.enter(PDL)` in its body, and before that call it stores nothing, does no atomics, and loads only weights
    (pointers named w_ptr). Checked on the source of every kernel that takes the constexpr."""
    import ast

    found = []
    for module, name, fn in _pdl_kernels():
        found.append(f"{module}.{name}")
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        enters = [c for c in calls if c.func.attr == "enter" and getattr(c.func.value, "id", "") == "pdl"]
        assert enters, f"{module}.{name} takes PDL but never calls pdl.enter(PDL)"
        line = min(c.lineno for c in enters)
        for c in calls:
            if c.lineno >= line:
                continue
            assert c.func.attr not in ("store", "atomic_add", "atomic_xchg", "atomic_cas"), \
                f"{module}.{name} writes before pdl.enter (line {c.lineno})"
            if c.func.attr == "load":
                names = {n.id for n in ast.walk(c.args[0]) if isinstance(n, ast.Name)}
                assert names & {"w_ptr"} and not names & {"x_ptr", "q_ptr", "k_ptr", "v_ptr"}, \
                    f"{module}.{name} loads {sorted(names)} before pdl.enter (line {c.lineno}): only weights may be"
    # the decode step's kernels all take part (a new one should too, or say why not in strata.kernels.gpu.pdl)
    for kernel in ("fused._rms_norm_kernel", "fused._add_rms_norm_kernel", "fused._norm_rope_cache_kernel",
                   "decode_gemv._gemv_kernel", "decode_attention._split_kernel", "decode_attention._merge_kernel",
                   "decode_router._route_kernel", "plain_pairs._gate_up_kernel", "plain_pairs._down_kernel",
                   "fused._combine_kernel", "mailbox_pack._pack_kernel"):
        assert kernel in found, kernel
