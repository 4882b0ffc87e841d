"""A CPU-only host's decode MoE layer in one compiled call (strata.kernels.cpu.expert_rows, csrc/cpu_experts_rows.h):
against the packed call it replaces (`run_packed` over the experts grouped in the Python path's order, then the bf16
cast and the residual add), bit for bit, for bf16, FP8, MXFP4 and GGUF (a Q4_K_M file's types) blobs; then a bf16 engine on a CPU-only host, whose
decode steps take it once every expert is pinned, against the same engine without it."""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch

from strata.kernels.cpu import experts as ce
from strata.kernels.cpu.expert_args import slot_pointers
from strata.kernels.cpu.expert_rows import PinnedLayer
from strata.kernels.quant import ExpertFormat, ExpertLayout

needs_kernel = pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")

FORMATS = [ExpertFormat(), ExpertFormat("fp8", block=(16, 16)), ExpertFormat("mxfp4"), "gguf"]
E = 6


def _blobs(fmt: ExpertFormat | str) -> tuple[ExpertLayout, list[torch.Tensor]]:
    """E experts' blobs in `fmt` ("gguf": Q4_K and Q6_K matrices mixed per expert, as a Q4_K_M file has them)."""
    if fmt == "gguf":
        if ce.backend(None, "gguf") == "torch":
            pytest.skip("this CPU's kernel does not read GGUF blocks")
        pytest.importorskip("gguf")
        from test_cpu_gguf_experts import gguf_experts

        types = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K"), ("Q6_K", "Q6_K", "Q6_K")] * 2
        layout, blobs, _, _ = gguf_experts(types, 256, 512, seed=3)
        return layout, blobs
    layout = ExpertLayout.build(fmt, 96, 64)
    g = torch.Generator().manual_seed(3)
    return layout, [layout.pack(torch.randn(128, 96, generator=g) / 96**0.5, torch.randn(96, 64, generator=g) / 8)
                    for _ in range(E)]


def _packed_then_added(layout, blobs, x, ids, weights, residual):
    """The path the call replaces: pairs grouped by expert (ascending, each one's pairs ascending), run_packed on the
    blobs' addresses, the fp32 sum cast to bf16, then the residual added in bf16."""
    k = ids.shape[1]
    flat = ids.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=flat.__getitem__)
    tok = torch.tensor([p // k for p in order], dtype=torch.int64)
    w = weights.reshape(-1)[order].float().contiguous()
    meta, scales, start, inter = array.array("q"), array.array("q"), 0, layout.intermediate
    for e in sorted(set(flat)):
        count = flat.count(e)
        gu, dn, gus, dns = slot_pointers(layout, blobs[e].data_ptr())
        meta.extend((gu, dn, tok.data_ptr() + 8 * start, w.data_ptr() + 4 * start, count, inter, inter))
        scales.extend((gus, dns))
        start += count
    fmt = layout.fmt if layout.fmt.quantized else None
    out = torch.zeros(x.shape, dtype=torch.float32)
    assert ce.run_packed(x.float(), meta, out, 2, fmt=fmt, scales=scales if fmt is not None else None)
    return out.to(torch.bfloat16) if residual is None else residual + out.to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "kind", f))
@pytest.mark.parametrize("n", [1, 3, 7])
def test_a_layer_by_address_equals_the_packed_call_cast_and_added(fmt, n):
    layout, blobs = _blobs(fmt)
    layer = PinnedLayer.build(np.array([b.data_ptr() for b in blobs]), layout)
    assert layer is not None
    g = torch.Generator().manual_seed(n)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n)])
    weights = torch.rand(n, 2, generator=g)
    x = torch.randn(n, layout.hidden, generator=g).bfloat16()
    residual = torch.randn(n, layout.hidden, generator=g).bfloat16()
    for res in (residual, None):
        got = layer.forward(x, ids, weights, res, threads=2)
        assert got is not None
        y, experts = got
        assert y.dtype == torch.bfloat16 and experts == len(set(ids.reshape(-1).tolist()))
        assert torch.equal(y, _packed_then_added(layout, blobs, x, ids, weights, res))


@needs_kernel
def test_an_expert_not_resident_or_outside_the_table():
    layout, blobs = _blobs(ExpertFormat())
    addresses = np.array([b.data_ptr() for b in blobs])
    addresses[4] = 0  # not in pinned RAM
    layer = PinnedLayer.build(addresses, layout)
    x = torch.randn(1, layout.hidden).bfloat16()
    assert layer.forward(x, torch.tensor([[1, 2]]), torch.rand(1, 2), None) is not None
    assert layer.forward(x, torch.tensor([[1, 4]]), torch.rand(1, 2), None) is None
    with pytest.raises(IndexError):
        layer.forward(x, torch.tensor([[1, E]]), torch.rand(1, 2), None)
    # not bf16 rows, or a prompt's many: the grouped path's
    assert layer.forward(x.float(), torch.tensor([[1, 2]]), torch.rand(1, 2), None) is None
    many = torch.randn(17, layout.hidden).bfloat16()
    assert layer.forward(many, torch.zeros(17, 2, dtype=torch.int64), torch.rand(17, 2), None) is None


@needs_kernel
def test_a_cpu_only_engine_decodes_through_it_once_every_expert_is_pinned(tmp_path, monkeypatch):
    """The bf16 demo checkpoint on a CPU-only host, every expert pinned: its decode steps run each MoE layer through
    one call, count the experts as pinned-tier hits, and give the same scores and greedy tokens as the grouped path
    (the call turned off)."""
    from strata import Engine
    from strata.runtime.demo.model import write_demo_model
    from strata.runtime.offload.cpu_compute import CpuCompute

    model = write_demo_model(tmp_path / "demo", "tiny", layers=2, engram=False, progress=False)
    cfg = {"runtime": {"dtype": "bfloat16", "max_context": 256}, "tiers": {"disk": {"scrub": False}}}
    calls = []
    forward = PinnedLayer.forward

    def counted(self, x, *args, **kwargs):
        out = forward(self, x, *args, **kwargs)
        calls.append((x.shape[0], out is not None))  # (rows, taken)
        return out

    monkeypatch.setattr(PinnedLayer, "forward", counted)
    prompt = list(range(5, 100, 7))
    results = {}
    for rows in (True, False):
        if not rows:
            monkeypatch.setattr(CpuCompute, "cpu_rows", lambda *a, **k: None)
        with Engine.from_pretrained(model, device="cpu", config=cfg) as engine:
            assert engine.wait_settled(60)
            calls.clear()
            hits = lambda: engine.stats()["tiers"]["tiers"]["pinned"]["hits"]  # noqa: E731
            before = hits()
            results[rows] = engine.generate(prompt, max_tokens=8).token_ids, engine.score(prompt)
            if rows:
                assert calls and all(taken for _, taken in calls)  # every layer of every pass it was offered
                # 8 tokens: the first is the prompt's; a prompt within the call's row limit (which depends on the CPU:
                # fewer rows where torch's GEMMs run on AMX) goes through it too, as does the scoring pass
                assert sum(n == 1 for n, _ in calls) == 7 * len(engine.executor.moe_layers)
                assert all(n in (1, len(prompt)) for n, _ in calls)
                assert hits() - before >= len(calls)
            else:
                assert not calls
    assert results[True][0] == results[False][0]
    assert torch.equal(results[True][1], results[False][1])
