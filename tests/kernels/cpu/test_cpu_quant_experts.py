"""The CPU expert kernel on FP8 and MXFP4 experts (strata.kernels.cpu.experts, csrc/cpu_experts_formats.h) against
the reference on their dequantized weights: `expert_swiglu` in fp32 on `ExpertLayout.dequantize(blob, float32)`,
experts added in the order given. Each backend stays within `tolerance(backend, kind)`; each AVX-512 backend is
bit-identical to its portable emulation (run everywhere the extension builds, so the conversions' lane layouts are
checked on any x86-64 machine); thread counts, split experts and warm-ahead change no bit. One-graph decode's worker
(csrc/cpu_mailbox.cpp) reads FP8, MXFP4 and GGUF slots as the kernel's call does."""

from __future__ import annotations

import array
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import experts as ce
from strata.kernels.cpu import library as cpu_lib
from strata.kernels.cpu.expert_args import slot_pointers
from strata.kernels.experts import expert_swiglu
from strata.kernels.quant import ExpertFormat, ExpertLayout

needs_kernel = pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")

FP8_16, FP8_64, FP8_128, MX = (ExpertFormat("fp8", block=(16, 16)), ExpertFormat("fp8", block=(32, 64)),
                               ExpertFormat("fp8", block=(128, 128)), ExpertFormat("mxfp4"))
# (format, H, I): blocks narrower than a vector step and partial ones (H = 130, 200), whole 64- and 128-wide
# blocks, MXFP4 groups in one and several vector steps, and rows of four steps (one scale load) and more
CASES = [(FP8_16, 64, 32), (FP8_16, 130, 48), (FP8_64, 192, 64), (FP8_128, 200, 128), (MX, 64, 32), (MX, 96, 64),
         (MX, 160, 96), (MX, 672, 576)]
EMULATED = {"avx512": "avx512_emulated", "avx512_bf16": "avx512_bf16_emulated"}


def make_blobs(fmt: ExpertFormat, H: int, inter: int, count: int, seed: int = 0):
    """`count` experts quantized from random weights: (layout, blobs, QuantMatrix pairs, dequantized fp32 pairs)."""
    layout = ExpertLayout.build(fmt, H, inter)
    g = torch.Generator().manual_seed(seed)
    blobs = [layout.pack(torch.randn(2 * inter, H, generator=g) / H**0.5, torch.randn(H, inter, generator=g) / inter**0.5)
             for _ in range(count)]
    return layout, blobs, [layout.matrices(b) for b in blobs], [layout.dequantize(b, torch.float32) for b in blobs]


def make_routing(N: int, E: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    idx, tw = [], []
    for e in range(E):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        idx.append(rows.to(torch.int64))
        tw.append(w[rows, slot].contiguous())
    return idx, tw


def reference(x, dequantized, idx, tw):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for (gu, dn), i, w in zip(dequantized, idx, tw, strict=True):
        if i.numel():
            out.index_add_(0, i, expert_swiglu(x.float()[i], gu, dn) * w[:, None])
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def backends() -> list[str]:
    """What runs here, plus the AVX-512 kernels' emulations wherever the extension loads."""
    names = ce.available_backends()
    return names + (list(EMULATED.values()) if len(names) > 1 else [])


@pytest.mark.parametrize("fmt,H,inter", CASES, ids=[f"{f.name}-{h}x{i}" for f, h, i in CASES])
@pytest.mark.parametrize("N", [1, 3, 9])
def test_matches_the_reference_on_the_dequantized_weights(fmt, H, inter, N):
    E = 4
    _, _, mats, deq = make_blobs(fmt, H, inter, E, seed=H + inter)
    idx, tw = make_routing(N, E, 3, seed=N)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 100 + H))
    ref = reference(x, deq, idx, tw)
    for name in backends():
        out = ce.cpu_experts_forward(x, mats, idx, tw, threads=2, backend=name)
        assert rel_err(out, ref) <= ce.tolerance(name, fmt.kind), (name, rel_err(out, ref))
    assert torch.equal(ce.cpu_experts_forward(x, mats, idx, tw, backend="torch"), ref)  # the torch path is the oracle


@needs_kernel
@pytest.mark.parametrize("fmt", [FP8_128, FP8_16, MX], ids=lambda f: f.name)
@pytest.mark.parametrize("name", ["avx512", "avx512_bf16"])
def test_avx512_kernels_are_bit_identical_to_their_emulation(fmt, name):
    """Same conversions, lanes and order as the real kernel: equal bits, for every tile width (1, 3, 5 and 8+1
    tokens) and tails (a partial FP8 block, H = 200; MXFP4 rows of 128-value steps and whole groups past them,
    H = 288)."""
    if name not in ce.available_backends():
        pytest.skip(f"{name} not available on this CPU")
    for H, inter in [(2048, 768), (200, 128)] if fmt.kind == "fp8" and fmt.block[0] == 128 else [(256, 96), (288, 32)]:
        if fmt.kind == "fp8" and inter % fmt.block[0]:
            continue
        _, _, mats, _ = make_blobs(fmt, H, inter, 3, seed=H)
        for N in (1, 3, 5, 9):
            idx, tw = make_routing(N, 3, 2, seed=N)
            x = torch.randn(N, H, generator=torch.Generator().manual_seed(N))
            got = ce.cpu_experts_forward(x, mats, idx, tw, threads=3, backend=name)
            emu = ce.cpu_experts_forward(x, mats, idx, tw, threads=2, backend=EMULATED[name])
            assert torch.equal(got, emu), (fmt.name, H, inter, N, rel_err(got, emu))


@needs_kernel
@pytest.mark.parametrize("fmt", [FP8_128, MX], ids=lambda f: f.name)
def test_the_default_backend_within_its_tolerance_on_a_real_shape(fmt):
    """Qwen3-30B-A3B's expert (H = 2048, I = 768), a decode step's tokens."""
    _, _, mats, deq = make_blobs(fmt, 2048, 768, 4, seed=5)
    idx, tw = make_routing(4, 4, 4, seed=2)
    x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(3))
    out = ce.cpu_experts_forward(x, mats, idx, tw)
    assert rel_err(out, reference(x, deq, idx, tw)) <= ce.tolerance(ce.backend(kind=fmt.kind), fmt.kind)


@needs_kernel
@pytest.mark.parametrize("fmt", [FP8_64, MX], ids=lambda f: f.name)
def test_thread_counts_and_knobs_change_no_bit(fmt):
    _, _, mats, _ = make_blobs(fmt, 192, 64, 6, seed=1)
    idx, tw = make_routing(5, 6, 4, seed=4)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(9))
    for name in [b for b in backends() if b != "torch"]:
        outs = [ce.cpu_experts_forward(x, mats, idx, tw, threads=t, backend=name) for t in (1, 2, 3, 5)]
        old = ce.tune(claim_ahead=0, down_split=0, chunk_min=600)
        try:
            outs.append(ce.cpu_experts_forward(x, mats, idx, tw, threads=3, backend=name))
        finally:
            ce.tune(**old)
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), name


def _packed(layout, blobs, rows, idx, w):
    """run_packed's arguments for blobs at their addresses (as pinned slots hold them), each expert's first rows."""
    meta, scales = array.array("q"), array.array("q")
    for blob, r in zip(blobs, rows, strict=True):
        gu, dn, gus, dns = slot_pointers(layout, blob.data_ptr())
        meta.extend((gu, dn, idx.data_ptr(), w.data_ptr(), idx.numel(), r, layout.intermediate))
        scales.extend((gus, dns))
    return meta, scales


@needs_kernel
@pytest.mark.parametrize("fmt", [FP8_16, MX], ids=lambda f: f.name)
def test_split_experts_compute_their_leading_rows(fmt):
    """A split expert's CPU part (the first r of I intermediate rows, r not a multiple of MXFP4's 32-value groups):
    down's partial rows (150: a 128-value step and a partial group; 45: a group and a partial one), and the
    activations of a partial group kept in order."""
    H, inter = 160, 160
    layout, blobs, _, deq = make_blobs(fmt, H, inter, 3, seed=7)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    idx, w = torch.tensor([0, 2]), torch.tensor([0.7, 0.4])
    rows = [inter, 150, 45]
    ref = torch.zeros(3, H)
    for (gu, dn), r in zip(deq, rows, strict=True):
        h = F.silu(x[idx] @ gu[:r].T) * (x[idx] @ gu[inter: inter + r].T)
        ref.index_add_(0, idx, (h @ dn[:, :r].T) * w[:, None])
    meta, scales = _packed(layout, blobs, rows, idx, w)
    outs = {}
    for name in [b for b in backends() if b != "torch"]:
        outs[name] = torch.zeros(3, H)
        assert ce.run_packed(x, meta, outs[name], threads=2, backend=name, fmt=fmt, scales=scales)
        assert rel_err(outs[name], ref) <= ce.tolerance(name, fmt.kind), name
    for real, emu in EMULATED.items():
        if real in outs:
            assert torch.equal(outs[real], outs[emu]), real


@needs_kernel
@pytest.mark.parametrize("fmt", [FP8_128, MX], ids=lambda f: f.name)
def test_warm_ahead_rows_of_quantized_experts_change_no_result(fmt):
    """warm_rows over gate_up rows of the format's bytes (the mailbox worker's warm-ahead), then the kernel computing
    each thread's piece first: the same bits as a cold call."""
    layout, blobs, _, _ = make_blobs(fmt, 256, 128, 3, seed=2)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    idx, w = torch.tensor([0, 1]), torch.tensor([0.5, 0.25])
    meta, scales = _packed(layout, blobs, [128, 128, 100], idx, w)
    ref = torch.zeros(2, 256)
    assert ce.run_packed(x, meta, ref, threads=1, fmt=fmt, scales=scales)
    row_bytes = layout.gate_up.nbytes // (2 * layout.intermediate)
    for warm, threads in [([128, 0, 50], 2), ([3, 128, 128], 3)]:
        read = ce.warm_rows([b.data_ptr() for b in blobs], warm, 256, 128, threads, row_bytes=row_bytes)
        assert read == 2 * row_bytes * sum(warm)
        got = torch.zeros(2, 256)
        assert ce.run_packed(x, meta, got, threads=threads, fmt=fmt, scales=scales, warm=array.array("q", warm))
        assert torch.equal(got, ref), (warm, threads)


@needs_kernel
def test_more_tokens_than_the_kernel_takes_stay_on_it_in_groups(monkeypatch):
    """A quantized expert with more tokens than one kernel pass takes is computed by the kernel in groups of
    `max_tokens(backend)` of its tokens (not dequantized for torch): bit for bit the same call with the groups given as
    experts of their own, and within the kernel's tolerance of the reference."""
    monkeypatch.setattr(ce, "MAX_TOKENS", 2)
    _, _, mats, deq = make_blobs(MX, 64, 32, 2)
    idx, tw = [torch.arange(5), torch.tensor([1])], [torch.rand(5), torch.rand(1)]
    x = torch.randn(5, 64)
    out = ce.cpu_experts_forward(x, mats, idx, tw, threads=2)
    limit = ce.max_tokens(ce.backend(kind="mxfp4"))  # MAX_TOKENS, times the backend's tile factor
    groups = [slice(s0, min(5, s0 + limit)) for s0 in range(0, 5, limit)]
    assert len(groups) > 1
    want = ce.cpu_experts_forward(x, [mats[0]] * len(groups) + [mats[1]], [idx[0][g] for g in groups] + [idx[1]],
                                  [tw[0][g] for g in groups] + [tw[1]], threads=2)
    assert torch.equal(out, want)
    ref = reference(x, deq, idx, tw)
    assert rel_err(out, ref) <= ce.tolerance(ce.backend(kind="mxfp4"), "mxfp4")


def test_plain_matrices_take_the_bf16_path():
    layout = ExpertLayout.build(ExpertFormat("plain", "BF16"), 64, 32)
    blob = layout.pack(torch.randn(64, 64).bfloat16(), torch.randn(64, 32).bfloat16())
    gu, dn = layout.matrices(blob)
    x, idx, tw = torch.randn(2, 64), [torch.tensor([0, 1])], [torch.tensor([0.5, 1.0])]
    assert torch.equal(ce.cpu_experts_forward(x, [(gu, dn)], idx, tw), ce.cpu_experts_forward(x, [(gu.values, dn.values)], idx, tw))


def test_one_format_a_call_and_checked_matrices():
    _, blobs8, fp8, _ = make_blobs(FP8_16, 64, 32, 1)
    _, _, mx, _ = make_blobs(MX, 64, 32, 1)
    x, one = torch.randn(2, 64), [torch.tensor([0]), torch.tensor([1])]
    w = [torch.ones(1), torch.ones(1)]
    with pytest.raises(ValueError, match="one format"):
        ce.cpu_experts_forward(x, [fp8[0], mx[0]], one, w)
    with pytest.raises(ValueError, match="one format"):
        ce.cpu_experts_forward(x, [fp8[0], (torch.zeros(64, 64).bfloat16(), torch.zeros(64, 32).bfloat16())], one, w)
    gu, dn = fp8[0]
    bad = type(gu)(gu.kind, gu.values, gu.scales[:1], gu.shape, gu.block)  # too few scales for its blocks
    with pytest.raises(ValueError, match="scales"):
        ce.cpu_experts_forward(x, [(bad, dn)], one[:1], w[:1])
    if ce.backend() != "torch":
        meta = array.array("q", (*slot_pointers(ExpertLayout.build(FP8_16, 64, 32), blobs8[0].data_ptr())[:2],
                                 one[0].data_ptr(), w[0].data_ptr(), 1, 32, 32))
        with pytest.raises(ValueError, match="2 addresses per expert"):
            ce.run_packed(x, meta, torch.zeros(2, 64), fmt=FP8_16, scales=array.array("q", [0]))


@needs_kernel
def test_fp8_without_vbmi_takes_avx512(monkeypatch, caplog):
    """avx512_bf16 reads FP8 with AVX512_VBMI's byte lookups; a CPU without it computes FP8 experts with avx512."""
    if "avx512_bf16" not in ce.available_backends():
        pytest.skip("no avx512_bf16 here")
    monkeypatch.setattr(cpu_lib, "_isa_mask", cpu_lib._isa_mask & ~(1 << cpu_lib._VBMI))
    monkeypatch.setattr(cpu_lib, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=cpu_lib.__name__):
        assert ce.backend(kind="fp8") == "avx512" and ce.backend(kind="mxfp4") == "avx512_bf16"
    assert any("AVX512_VBMI" in r.message for r in caplog.records)


GGUF_MIX = "gguf"  # experts of a Q4_K_M file's types, mixed per expert in one layout (`_quantized_mailbox`)
MAILBOX_FORMATS = [FP8_16, MX, GGUF_MIX]


def _quantized_mailbox(fmt, seed: int):
    """A mailbox worker over 6 experts (top-2) stored in `fmt` blobs for two layers (H 64, I 32; GGUF_MIX: H 256, I
    512, Q4_K gate/up and Q4_K or Q6_K down, as a Q4_K_M file mixes them): (box, layout, the blobs (the box reads them
    by address: hold them while it runs), their QuantMatrix views, their dequantized weights); the caller closes the
    box."""
    from strata.runtime.offload.mailbox import CpuMailbox

    if fmt == GGUF_MIX:
        pytest.importorskip("gguf")
        from test_cpu_gguf_experts import gguf_experts

        H, inter = 256, 512
        types = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K"), ("Q6_K", "Q6_K", "Q6_K")] * 2
        layout, blobs, mats, dense = gguf_experts(types, H, inter, seed=seed)
    else:
        H, inter = 64, 32
        layout, blobs, mats, dense = make_blobs(fmt, H, inter, 6, seed=seed)
    addr = np.array([[b.data_ptr() for b in blobs]] * 2, dtype=np.int64)
    box = CpuMailbox([0, 1], addr, hidden=H, inter=inter, gu_bytes=0, payload=0, top_k=2, max_tokens=4, threads=2,
                     device=torch.device("cpu"), layout=layout)
    return box, layout, blobs, mats, dense


def _name(fmt) -> str:
    return fmt if isinstance(fmt, str) else fmt.name


@needs_kernel
@pytest.mark.parametrize("fmt", MAILBOX_FORMATS, ids=_name)
def test_the_mailbox_worker_reads_quantized_slots(fmt):
    """The native worker given the store's layout computes cold pairs from blobs in the format, bit for bit as the
    host path's kernel call on the same experts does (csrc/cpu_mailbox.cpp: values at the layout's offsets, GGUF's
    past the blob's header; scales, GGUF's type ids, where the layout puts them), and counts the blobs' bytes."""
    from strata.kernels.experts import group_by_expert

    E, K = 6, 2
    box, layout, blobs, mats, _ = _quantized_mailbox(fmt, seed=3)
    H = box.hidden
    try:
        assert box.self_test() is None
        g = torch.Generator().manual_seed(5)
        x = torch.randn(3, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3)])
        w = torch.rand(3, K, generator=g)
        slots = torch.where(ids.reshape(-1) % 3 == 0, 4, -1).to(torch.int32)  # experts 0 and 3 resident on the GPU
        box.begin_step()
        out = box.exchange(1, ids.reshape(-1), slots, x, w)
        cold = [(e, sel) for e, sel in group_by_expert(ids, E) if e % 3]
        want = ce.cpu_experts_forward(x.float(), [mats[e] for e, _ in cold], [sel // K for _, sel in cold],
                                      [w.reshape(-1)[sel] for _, sel in cold], threads=2)
        assert torch.equal(out, want) and want.abs().sum() > 0
        assert box.experts_computed == len(cold)
        assert box.kernel_rate()[0] == len(cold) * layout.payload_bytes  # the format's bytes, not bf16's
    finally:
        box.close()


def test_the_cost_model_takes_the_formats_bytes_and_weights():
    from strata.runtime.offload.cost_model import Rates, cpu_seconds, split_cold

    layout = ExpertLayout.build(MX, 2048, 768)
    params = 3 * 2048 * 768
    rates = Rates(cpu_bytes_per_s=20e9, cpu_flops=1e12)
    assert cpu_seconds(layout.payload_bytes, 1, rates, params) == layout.payload_bytes / 20e9  # memory-bound
    many = cpu_seconds(layout.payload_bytes, 32, rates, params)
    assert many == 2 * params * 32 / 1e12 > cpu_seconds(layout.payload_bytes, 32, rates)  # bf16's params undercount
    split = split_cold({0: 1, 1: 1}, layout.payload_bytes, rates, params=params)
    assert split.cpu_seconds == pytest.approx(sum(cpu_seconds(layout.payload_bytes, 1, rates, params)
                                                  for _ in split.cpu))


@needs_kernel
@pytest.mark.parametrize("experts", ["fp8", "mxfp4"])
def test_an_engine_computes_quantized_experts_with_the_kernel(experts, tmp_path, monkeypatch):
    """The tiered runtime's CPU share (pinned slots by address, and handles' QuantMatrix views once the pinned tier
    overflows) runs the compiled kernel on the experts as stored, with the kernel listed in
    strata.kernels.quant.FAST_PATHS for the format: scores within 1e-4 of the fp32 reference on the dequantized
    checkpoint, the same greedy tokens."""
    from quantized_models import dequantized_checkpoint

    from strata import Engine
    from strata.kernels import quant
    from strata.runtime.demo.model import write_demo_model

    fp32_kernel = next(b for b in ("avx512", "avx2") if b in ce.available_backends())
    monkeypatch.setitem(quant.FAST_PATHS, "cpu_kernel", quant.FAST_PATHS["cpu_kernel"] | {experts})
    calls: list[str] = []
    run_packed = ce.run_packed

    def spy(*args, fmt=None, **kwargs):
        calls.append(fmt.kind if fmt is not None else "bf16")
        return run_packed(*args, fmt=fmt, **kwargs)

    monkeypatch.setattr(ce, "run_packed", spy)
    quantized = write_demo_model(tmp_path / experts, "tiny", layers=2, engram=False, progress=False, experts=experts)
    fp32 = {"dtype": "float32", "max_context": 256}
    reference = Engine.from_pretrained(dequantized_checkpoint(quantized, tmp_path / "dequantized"), device="cpu",
                                       config={"runtime": {**fp32, "cpu_numerics": "gpu", "experts": "memory"}})
    prompt = list(range(5, 100, 7))
    want, tokens = reference.score(prompt), reference.generate(prompt, max_tokens=6).token_ids
    for budget in ("64MiB", "40KiB"):  # every expert pinned (slot addresses), then evictions (handles)
        cfg = {"runtime": fp32, "debug": {"cpu_kernel": fp32_kernel},
               "tiers": {"pinned": {"budget": budget}, "disk": {"scrub": False}}}
        calls.clear()
        with Engine.from_pretrained(quantized, device="cpu", config=cfg) as tiered:
            assert tiered.tiers.store.expert_format.kind == experts
            assert (tiered.score(prompt) - want).abs().max().item() < 1e-4
            assert tiered.generate(prompt, max_tokens=6).token_ids == tokens
            evictions = tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"]
        assert (evictions > 0) == (budget == "40KiB")
        assert calls and set(calls) == {experts}, (budget, set(calls))


@needs_kernel
@pytest.mark.parametrize("fmt, cut", [(f, c) for f in (FP8_16, MX) for c in (8, 16, 24)] + [(GGUF_MIX, 256)],
                         ids=lambda v: _name(v) if not isinstance(v, int) else str(v))
def test_the_mailbox_worker_computes_a_quantized_experts_first_rows(fmt, cut):
    """A cold pair's `rows` < I on blobs in the format (the GPU share's split, the GPU reading the rest in place): the
    worker computes gate and up's first `cut` rows and down's first `cut` columns, values and scales where the
    layout puts them, even where the cut falls inside an FP8 block (a GGUF expert's between down's superblocks);
    with the rest added (the GPU's part) the two partial sums make the whole expert, against the dequantized
    weights within the backend's tolerance."""
    K = 2
    box, _, blobs, _, dense = _quantized_mailbox(fmt, seed=4)
    H, inter = box.hidden, box.inter
    try:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, H, generator=g).to(torch.bfloat16).float()
        ids = torch.tensor([[3, 5], [3, 1]])
        w = torch.rand(2, K, generator=g)
        slots = torch.tensor([-1, 4, -1, -1], dtype=torch.int32)  # expert 3 (both tokens) and 1 cold, 5 resident
        rows = torch.tensor([cut, inter, cut, inter], dtype=torch.int32)  # expert 3 split at `cut`, 1 whole
        box.begin_step()
        out = box.exchange(1, ids.reshape(-1), slots, x, w, rows=rows)

        def part(e, lo, hi):  # rows [lo, hi) of expert e on x, fp32, from the dequantized weights: [N, H]
            gu, dn = dense[e]
            gate, up = gu[lo:hi], gu[inter + lo : inter + hi]
            return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ dn[:, lo:hi].T

        rest = w[:, :1] * part(3, cut, inter)
        whole = w[:, :1] * part(3, 0, inter) + torch.stack([torch.zeros(H), w[1, 1] * part(1, 0, inter)[1]])
        kind = "gguf" if fmt == GGUF_MIX else fmt.kind
        tol = ce.tolerance(ce.backend(kind=kind), kind)
        assert rel_err(out + rest, whole) <= tol and rel_err(out, whole - rest) <= 2 * tol
        assert box.experts_computed == 2
    finally:
        box.close()
