"""Quantized experts on the GPU path (strata.kernels.gpu.experts.quant_pairs, quant_slots, and their dispatch in grouped
and grouped_gemm) against the oracle: `ExpertLayout.dequantize` of each blob, then the plain experts' torch path.

The torch fallbacks, the scratch prefill and the format queries run on any CPU. The `kernel` tests run the Triton
kernels: natively on CUDA (marked gpu, bf16 and fp32), and on the CPU under Triton's interpreter in fp32
(tests/kernels/test_kernels_interpreted.py runs them in a subprocess: TRITON_INTERPRET is read when Triton is
imported)."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.gpu import fused
from strata.kernels.gpu.experts import grouped, quant_pairs
from strata.kernels.gpu.experts.grouped import HostExperts, SlotWeights, fast_path, fast_path_refusal, formats_supported
from strata.kernels.gpu.experts.grouped_gemm import grouped_experts, grouped_ok
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights, dequantize_blobs, dequantize_into
from strata.kernels.quant import ExpertFormat, ExpertLayout

CUDA = torch.cuda.is_available()
if CUDA:
    KERNEL, KERNEL_DTYPES = [pytest.mark.gpu], [torch.bfloat16, torch.float32]
elif fused._INTERPRET and quant_pairs.triton is not None:
    KERNEL, KERNEL_DTYPES = [], [torch.float32]  # the interpreter rounds to bf16 by truncation: fp32 only
else:  # no kernel can run here: the gpu mark skips them
    KERNEL, KERNEL_DTYPES = [pytest.mark.gpu], [torch.float32]
DEVICE = "cuda" if CUDA else "cpu"

# (format, hidden, intermediate): tests' 16 x 16 blocks; the real 128 x 128 on a shape that allows it; fp8 blocks
# that do not divide the hidden size (a partial last block along K) and with rows != columns; MXFP4
FORMATS = [(ExpertFormat("fp8", block=(16, 16)), 64, 32), (ExpertFormat("fp8", block=(128, 128)), 256, 128),
           (ExpertFormat("fp8", block=(16, 32)), 80, 48), (ExpertFormat("mxfp4"), 64, 32),
           (ExpertFormat("mxfp4"), 96, 64)]
IDS = ["fp8-16", "fp8-128", "fp8-16x32-partial", "mxfp4", "mxfp4-96x64"]
SLOT_OF = [2, -1, 0, 3, 1, -1]  # expert -> slot; experts 1 and 5 not resident


def _slots(fmt: ExpertFormat, h: int, i: int, seed: int = 0, device: str = "cpu", spare: int = 0):
    """Four slots holding experts 0, 2, 3, 4 of six random ones (weights ~ 1/sqrt(fan-in), outputs ~1), packed in
    `fmt`; slots of slot_bytes + spare bytes. Returns (QuantSlotWeights, layout, slot_of [6] int32)."""
    g = torch.Generator().manual_seed(seed)
    layout = ExpertLayout.build(fmt, h, i)
    slot_bytes = -(-layout.payload_bytes // 4096) * 4096 + spare
    slab = torch.zeros(4, slot_bytes, dtype=torch.uint8)
    for s in SLOT_OF:  # every expert drawn, so the packed ones do not depend on which are resident
        gu, dn = torch.randn(2 * i, h, generator=g) / h**0.5, torch.randn(h, i, generator=g) / i**0.5
        if s >= 0:
            layout.pack(gu * 2, dn * 2, out=slab[s])  # x2: MXFP4 scales meet values above and below 1
    slot_of = torch.tensor(SLOT_OF, dtype=torch.int32)
    return QuantSlotWeights(slab.to(device), layout), layout, slot_of.to(device)


def _dequantized(qs: QuantSlotWeights, dtype: torch.dtype) -> SlotWeights:
    """The oracle's weights: each slot's blob through `ExpertLayout.dequantize`, stacked."""
    mats = [qs.layout.dequantize(qs.slab[s].cpu(), dtype) for s in range(qs.num_slots)]
    return SlotWeights(torch.stack([m[0] for m in mats]).to(qs.slab.device),
                       torch.stack([m[1] for m in mats]).to(qs.slab.device))


def _pairs(n: int, k: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(len(SLOT_OF), generator=g)[:k] for _ in range(n)]).reshape(-1).to(device)


def _reference(x, sw: SlotWeights, slot_of, ids, k, rows=None):
    """The plain experts' torch path (`grouped._pair_torch`) on the dequantized weights: (y [P, H] fp32, used)."""
    p = ids.numel()
    rows = torch.arange(p, dtype=torch.int32, device=x.device) if rows is None else rows
    y = torch.zeros(p, x.shape[1], device=x.device)
    used = torch.empty(p, dtype=torch.int32, device=x.device)
    grouped._pair_torch(x, sw, slot_of, ids, rows, k, y, used)
    return y, used


# ---- the torch paths and the format queries (any CPU) --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,h,i", FORMATS, ids=IDS)
def test_batched_dequantize_equals_the_layouts_dequantize(fmt, h, i, dtype):
    qs, layout, _ = _slots(fmt, h, i)
    gu, dn = dequantize_blobs(qs.slab, layout, dtype)
    ref = _dequantized(qs, dtype)
    assert torch.equal(gu, ref.gate_up) and torch.equal(dn, ref.down)
    assert gu.abs().max() > 0  # the slots hold experts, not zeros
    g1, d1 = qs.expert(2, dtype)
    assert torch.equal(g1, ref.gate_up[2]) and torch.equal(d1, ref.down[2])


@pytest.mark.parametrize("fmt,h,i", FORMATS[::3], ids=IDS[::3])
def test_pair_fallback_on_quantized_slots_equals_the_dequantized_experts(fmt, h, i):
    """The torch fallback (CPU, and CUDA formats without kernels) on quantized slots: exactly the plain path on the
    dequantized experts, non-resident pairs skipped (-1) and their rows left alone, rows addressed out of order."""
    qs, _, slot_of = _slots(fmt, h, i, seed=1)
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(2))
    ids = _pairs(3, 2, seed=3)
    rows = torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int32)
    y = torch.full((6, h), 7.0)
    used = grouped.pair_experts(x, qs, slot_of, ids, y, rows=rows)
    want, want_used = _reference(x, _dequantized(qs, torch.float32), slot_of, ids, 2, rows)
    assert torch.equal(used, slot_of[ids]) and torch.equal(used, want_used)
    skipped = rows[used < 0].long()
    assert skipped.numel() > 0 and torch.all(y[skipped] == 7.0)
    done = rows[used >= 0].long()
    assert torch.equal(y[done], want[done])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("scratch", [None, 1])
@pytest.mark.parametrize("fmt,h,i", FORMATS[::3], ids=IDS[::3])
def test_grouped_prefill_on_quantized_slots_equals_the_dequantized_experts(monkeypatch, fmt, h, i, scratch):
    """Prefill's grouped GEMMs on quantized slots (each piece dequantized into a scratch) give exactly what they
    give on the dequantized experts; a scratch of one expert a piece changes nothing."""
    import strata.kernels.gpu.experts.grouped_gemm as gg

    qs, _, slot_of = _slots(fmt, h, i, seed=4)
    g = torch.Generator().manual_seed(5)
    n, k = 9, 3
    x = torch.randn(n, h, generator=g)
    ids = torch.stack([torch.randperm(len(SLOT_OF), generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    plain = _dequantized(qs, torch.float32)
    want = grouped_experts(x, w, slot_of[ids], plain, ids)
    if scratch is not None:
        monkeypatch.setattr(gg, "SCRATCH_BYTES", scratch)
    assert grouped_ok(x, qs)
    got = grouped_experts(x, w, slot_of[ids], qs, ids)
    assert torch.equal(got, want) and want.abs().max() > 0


def test_format_queries_say_which_formats_have_the_gpu_path():
    kinds = formats_supported()
    assert "plain" in kinds
    assert ({"fp8", "mxfp4"} <= kinds) == (quant_pairs.triton is not None)
    for fmt in (ExpertFormat(), ExpertFormat("fp8", block=(128, 128)), ExpertFormat("mxfp4")):
        assert (fast_path_refusal(fmt) is None) == (fmt.kind in kinds)
    odd = ExpertFormat("fp8", block=(128, 96))  # blocks 96 columns wide: no kernel, the torch fallback
    assert "power of two" in fast_path_refusal(odd) if quant_pairs.triton is not None else "Triton" in fast_path_refusal(odd)
    qs, layout, _ = _slots(ExpertFormat("mxfp4"), 64, 32)
    assert fast_path(qs) == ("quant" if quant_pairs.triton is not None else "torch")
    assert fast_path(HostExperts.of_layout(layout)) == fast_path(qs)
    odd_layout = ExpertLayout.build(odd, 192, 128)
    assert fast_path(QuantSlotWeights(torch.zeros(1, 1 << 17, dtype=torch.uint8), odd_layout)) == "torch"
    assert not grouped.in_place_ok(HostExperts.of_layout(odd_layout))


def test_the_runtimes_gpu_fast_paths_list_only_formats_the_kernels_read():
    """strata.kernels.quant.FAST_PATHS' GPU entries (what the runtime and the planner take) may list a format only
    where these kernels read it."""
    from strata.kernels.quant import FAST_PATHS

    for path in ("gpu_pairs", "gpu_in_place", "gpu_grouped"):
        assert FAST_PATHS[path] <= formats_supported() | {"plain"}, path


def test_slot_weights_of_a_layout():
    """`grouped.slot_weights`: typed views for a plain layout, QuantSlotWeights for fp8 / mxfp4 (too short a slot
    or a plain layout is refused); `HostExperts.of_layout` keeps a quantized layout, and a plain one's offsets."""
    plain = ExpertLayout.build(ExpertFormat("plain", "F32"), 8, 4)
    slab = torch.arange(2 * 4096, dtype=torch.int32).view(torch.uint8).view(2, -1)[:, :4096]
    sw = grouped.slot_weights(slab, plain)
    assert isinstance(sw, SlotWeights) and sw.gate_up.shape == (2, 8, 8) and sw.down.shape == (2, 8, 4)
    gu, dn = plain.dequantize(slab[1], torch.float32)
    assert torch.equal(sw.gate_up[1], gu) and torch.equal(sw.down[1], dn)
    host = HostExperts.of_layout(plain)
    assert host.layout is None and host.down_offset == plain.down.offset and host.dtype == torch.float32
    fp8 = ExpertLayout.build(ExpertFormat("fp8", block=(16, 16)), 64, 32)
    assert isinstance(grouped.slot_weights(torch.zeros(3, 8192, dtype=torch.uint8), fp8), QuantSlotWeights)
    assert HostExperts.of_layout(fp8).layout == fp8 and HostExperts.of_layout(fp8).down_shape == (64, 32)
    with pytest.raises(ValueError, match="cannot hold"):
        QuantSlotWeights(torch.zeros(3, 512, dtype=torch.uint8), fp8)
    with pytest.raises(ValueError, match="plain experts take SlotWeights"):
        QuantSlotWeights(torch.zeros(3, 8192, dtype=torch.uint8), plain)


# ---- the Triton kernels (CUDA; or the CPU under TRITON_INTERPRET=1) ---------------------------------------------------

def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: to fp32 rounding (the scale applies to a group's sum, sums reorder); bf16: the tolerance the bf16 pair
    kernels are held to against the torch path (tests/model/test_decode_path.py)."""
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _run_pairs(x, qs, slot_of, ids, y, rows=None) -> torch.Tensor:
    """The quantized kernels as the decode step runs them: `pair_experts` on CUDA; its Triton path directly under
    the interpreter (pair_experts takes the torch path on CPU tensors)."""
    if CUDA:
        return grouped.pair_experts(x, qs, slot_of, ids, y, rows=rows)
    used = torch.empty(ids.numel(), dtype=torch.int32)
    quant_pairs.pair_quant(x, qs, slot_of, ids, rows, y.shape[0] // x.shape[0], y, used)
    return used


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("fmt,h,i", FORMATS, ids=IDS)
@pytest.mark.parametrize("n", [1, 3] if CUDA else [3])  # (the interpreter's seconds: one batch size there)
def test_kernel_pairs_on_quantized_slots_equal_the_dequantized_experts(fmt, h, i, n, dtype):
    """The quantized pair kernels (slot lookup in the kernel, weights dequantized in registers, fp32 math) against
    the torch path in fp32 on the dequantized weights, to fp32 rounding; with bf16 activations no further from that
    oracle than the bf16 pair kernels on the weights rounded to bf16 (FP8 x scale is not a bf16 number, so the two
    bf16 paths round differently and are each compared with the oracle). Skipped pairs' rows untouched."""
    qs, _, slot_of = _slots(fmt, h, i, seed=6, device=DEVICE)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    ids = _pairs(n, 2, seed=8, device=DEVICE)
    y = torch.full((2 * n, h), 7.0, device=DEVICE)
    used = _run_pairs(x, qs, slot_of, ids, y)
    want, want_used = _reference(x.float(), _dequantized(qs, torch.float32), slot_of, ids, 2)
    assert torch.equal(used, want_used)
    ok = used >= 0
    assert torch.all(y[~ok] == 7.0)
    _close(y[ok], want[ok], torch.float32)
    assert want[ok].abs().max() > 0.1  # outputs of order one: the tolerance means something
    if dtype == torch.bfloat16:  # no further from the oracle than the bf16 kernels on the weights rounded to bf16
        plain = torch.full((2 * n, h), 7.0, device=DEVICE)
        grouped.pair_experts(x, _dequantized(qs, torch.bfloat16), slot_of, ids, plain)
        # (the weights rounded to bf16 are not the oracle's: an output of ~0.25 may be 0.03 off, so the plain
        # kernels' own bf16 tolerance against the torch path on the same weights does not apply here)
        plain_err = (plain[ok] - want[ok]).abs().max()
        assert plain_err < 0.1 and (y[ok] - want[ok]).abs().max() <= 1.25 * plain_err + 1e-4


@pytest.mark.parametrize("fmt,h,i", FORMATS[::3], ids=IDS[::3])
def test_kernel_pairs_with_rows_address_their_output_rows(fmt, h, i):
    """`rows` (the late pass over copied experts, chunked copies): pair p writes row rows[p], token rows[p] // k."""
    dtype = KERNEL_DTYPES[-1]
    qs, _, slot_of = _slots(fmt, h, i, seed=9, device=DEVICE)
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    ids = _pairs(3, 2, seed=11, device=DEVICE)
    rows = torch.tensor([5, 1, 3, 0, 2, 4], dtype=torch.int32, device=DEVICE)
    y = torch.full((6, h), 7.0, device=DEVICE)
    used = _run_pairs(x, qs, slot_of, ids, y, rows=rows)
    want, _ = _reference(x, _dequantized(qs, dtype), slot_of, ids, 2, rows)
    done, skipped = rows[used >= 0].long(), rows[used < 0].long()
    assert torch.all(y[skipped] == 7.0)
    _close(y[done], want[done], dtype)


def _host_blobs(qs: QuantSlotWeights):
    """The slots' blobs where the in-place kernels read them: page-locked host memory on CUDA (the store's pinned
    slots), the slab itself under the interpreter. Returns (address of slot s, a closer)."""
    if not CUDA:
        return (lambda s: qs.slab[s].data_ptr()), (lambda: None)
    from strata.tiers.storage.pinned import PinnedPool

    pool = PinnedPool(qs.slab.shape[1], qs.num_slots, background=False)
    for s in range(qs.num_slots):
        pool.slot(s).copy_(qs.slab[s].cpu())
    return pool.slot_address, pool.close


@pytest.mark.parametrize("fmt,h,i", FORMATS, ids=IDS)
def test_kernel_in_place_reads_of_quantized_blobs(fmt, h, i):
    """`pair_experts_in_place` on quantized blobs (read by host address, in their format) gives what the plain
    torch path gives on the dequantized weights; a pair with address 0 is left alone; a split expert's GPU part
    (first_row) is the sum over its intermediate rows from first_row on."""
    dtype = KERNEL_DTYPES[-1]
    qs, layout, slot_of = _slots(fmt, h, i, seed=12, device=DEVICE)
    sw = _dequantized(qs, dtype)
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(13)).to(DEVICE, dtype)
    ids = torch.tensor([0, 2, 3, 4, 0, 3], device=DEVICE)  # resident experts only
    address, close = _host_blobs(qs)
    try:
        addr = torch.tensor([address(SLOT_OF[e]) for e in ids.tolist()], dtype=torch.int64)
        addr[4] = 0  # not in this pass
        addr = addr.to(DEVICE)
        experts = HostExperts.of_layout(layout)
        y = torch.full((6, h), 7.0, device=DEVICE)
        grouped.pair_experts_in_place(x, experts, addr, y)
        want, _ = _reference(x, sw, slot_of, ids, 2)
        keep = [0, 1, 2, 3, 5]
        assert torch.all(y[4] == 7.0)
        _close(y[keep], want[keep], dtype)
        first = torch.tensor([0, 5, i // 2, i - 1, 0, i], dtype=torch.int32, device=DEVICE)
        part = torch.full((6, h), 7.0, device=DEVICE)
        grouped.pair_experts_in_place(x, experts, addr, part, first_row=first)
        xf = x.float()
        for p, e in enumerate(ids.tolist()):
            if p == 4:
                assert torch.all(part[4] == 7.0)
                continue
            f, tok, s = int(first[p]), p // 2, SLOT_OF[e]
            gu, dn = sw.gate_up[s].float(), sw.down[s].float()
            act = torch.nn.functional.silu(gu[f:i] @ xf[tok]) * (gu[i + f :] @ xf[tok])
            _close(part[p], act @ dn[:, f:].T, dtype)
    finally:
        if CUDA:
            torch.cuda.synchronize()
        close()


NO_KERNEL = (ExpertFormat("fp8", block=(16, 24)), 72, 32)  # blocks 24 columns wide: no pair kernel, the torch path


@pytest.mark.parametrize("fmt,h,i", [*FORMATS, NO_KERNEL], ids=[*IDS, "fp8-16x24"])
def test_kernel_dequantize_into_a_scratch_equals_the_layouts(fmt, h, i):
    """Prefill's scratch dequantizer (one launch a matrix over a list of slots) rounds as `ExpertLayout.dequantize`:
    bit for bit, in the GPU's bf16 and the interpreter's fp32 and fp16."""
    qs, layout, _ = _slots(fmt, h, i, seed=14, device=DEVICE)
    index = torch.tensor([3, 0, 2], device=DEVICE)
    for dtype in [torch.bfloat16, torch.float32] if CUDA else [torch.float32, torch.float16]:
        ref = _dequantized(qs, dtype)
        gu = torch.empty(3, 2 * i, h, dtype=dtype, device=DEVICE)
        dn = torch.empty(3, h, i, dtype=dtype, device=DEVICE)
        dequantize_into(qs.slab, layout, index, layout.gate_up, layout.gate_up_scales, gu)
        dequantize_into(qs.slab, layout, index, layout.down, layout.down_scales, dn)
        assert torch.equal(gu, ref.gate_up[index]) and torch.equal(dn, ref.down[index])


for _name in [n for n in list(globals()) if n.startswith("test_kernel_")]:
    for _mark in KERNEL:
        globals()[_name] = _mark(globals()[_name])


# ---- CUDA only ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt,h,i", FORMATS[::3], ids=IDS[::3])
def test_quantized_pairs_replay_in_a_cuda_graph(fmt, h, i):
    """A decode step's quantized pairs captured in a CUDA graph (the decode graphs and the mailbox step capture
    them): replays follow new activations and a slot map updated in place, as eager runs do."""
    qs, _, slot_of = _slots(fmt, h, i, seed=15, device="cuda")
    x = torch.randn(2, h, device="cuda", dtype=torch.bfloat16)
    ids = _pairs(2, 2, seed=16, device="cuda")
    y = torch.zeros(4, h, device="cuda")
    grouped.pair_experts(x, qs, slot_of, ids, y)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        used = grouped.pair_experts(x, qs, slot_of, ids, y)
    for seed in (17, 18):
        x.copy_(torch.randn(2, h, generator=torch.Generator().manual_seed(seed)).cuda())
        slot_of.copy_(torch.tensor([3, 1, 0, 2, -1, -1] if seed == 18 else SLOT_OF, dtype=torch.int32))
        y.zero_()
        graph.replay()
        want = torch.zeros(4, h, device="cuda")
        want_used = grouped.pair_experts(x, qs, slot_of, ids, want)
        torch.cuda.synchronize()
        assert torch.equal(used, want_used) and torch.equal(y, want)


@pytest.mark.gpu
def test_a_format_without_pair_kernels_takes_the_torch_path_on_cuda():
    """fp8 blocks that are not a power of two wide: decode on CUDA gathers the pairs' experts, dequantized by the
    scratch kernel (bit for bit the layout's), and runs the torch path: exactly the plain path's result."""
    fmt, h, i = NO_KERNEL
    qs, layout, slot_of = _slots(fmt, h, i, seed=21, device="cuda")
    assert fast_path(qs) == "torch" and not grouped.in_place_ok(HostExperts.of_layout(layout))
    x = torch.randn(3, h, device="cuda", dtype=torch.bfloat16)
    ids = _pairs(3, 2, seed=22, device="cuda")
    y = torch.zeros(6, h, device="cuda")
    used = grouped.pair_experts(x, qs, slot_of, ids, y)
    want, want_used = _reference(x, _dequantized(qs, torch.bfloat16), slot_of, ids, 2)
    assert torch.equal(used, want_used) and torch.equal(y, want)


def _sm90() -> bool:
    return CUDA and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm90+ GPU (torch's CUTLASS grouped GEMM)")
@pytest.mark.parametrize("fmt,h,i", [(ExpertFormat("fp8", block=(128, 128)), 256, 128), (ExpertFormat("mxfp4"), 256, 128)],
                         ids=["fp8-128", "mxfp4"])
def test_grouped_prefill_on_quantized_slots_on_cuda(fmt, h, i):
    """On the GPU in bf16: the scratch-dequantized grouped GEMMs equal the bf16 grouped GEMMs on the dequantized
    experts exactly (same scratch values, same GEMMs), and the fp32 per-expert loop within bf16 rounding."""
    from strata.kernels.experts import moe_forward
    from strata.kernels.gpu.experts import grouped_gemm

    qs, _, slot_of = _slots(fmt, h, i, seed=19, device="cuda")
    g = torch.Generator().manual_seed(20)
    n, k = 300, 2
    x = torch.randn(n, h, generator=g).cuda().bfloat16()
    ids = torch.stack([torch.tensor([0, 2, 3, 4])[torch.randperm(4, generator=g)[:k]] for _ in range(n)]).cuda()
    w = torch.rand(n, k, generator=g).cuda()
    plain = _dequantized(qs, torch.bfloat16)
    assert grouped_ok(x, qs)
    got = grouped_experts(x, w, slot_of[ids], qs, ids)
    assert not grouped_gemm._refused
    assert torch.equal(got, grouped_experts(x, w, slot_of[ids], plain, ids))
    by_expert = torch.full((len(SLOT_OF),), 0, dtype=torch.long)
    by_expert[[0, 2, 3, 4]] = torch.tensor([SLOT_OF[e] for e in (0, 2, 3, 4)])
    want = moe_forward(x.float(), plain.gate_up.float()[by_expert.cuda()], plain.down.float()[by_expert.cuda()], ids, w)
    assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item()
