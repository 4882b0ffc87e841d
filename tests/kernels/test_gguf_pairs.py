"""GGUF experts on the GPU path (strata.kernels.gpu.experts.gguf_pairs, gguf_tiles, and their dispatch in quant_pairs,
quant_slots, grouped and grouped_gemm) against the oracle: each blob's `ExpertLayout.dequantize` (bit for bit gguf's
numpy, tests/kernels/test_gguf_dequant.py), then the plain experts' torch path.

The torch fallbacks, the scratch prefill and the format queries run on any CPU. The `kernel` tests run the Triton
kernels: natively on CUDA (marked gpu, bf16 and fp32, the shipped launch configurations), and on the CPU under
Triton's interpreter in fp32 with tiles as large as the tiny shapes (tests/kernels/test_kernels_interpreted.py
runs them in a subprocess: TRITON_INTERPRET is read when Triton is imported)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks_random import random_blocks

from strata.kernels.gguf_blocks import BLOCK_TYPES
from strata.kernels.gpu import fused
from strata.kernels.gpu.experts import gguf_pairs, gguf_tiles, grouped, quant_pairs
from strata.kernels.gpu.experts.grouped import HostExperts, SlotWeights, fast_path, fast_path_refusal, formats_supported
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
# the interpreter's launches: whole tiny matrices a program or two (its seconds go by program); CUDA: the shipped ones
INTERPRETED_PAIRS = ((128, 256, 4, 1), (256, 256, 4, 1))
INTERPRETED_IN_PLACE = (128, 256, 256, 256)
INTERPRETED_DEQUANT = (256, 16)

# (gate, up, down types, hidden, intermediate): every block type alone; Q8_0 on sizes that leave partial tiles; a
# Q4_K_M-like store (gate and up Q4_K, down Q6_K) with hidden != intermediate; type sets whose slots differ (the
# kernels pick each expert's branch by its header)
UNIFORM = [(((n,), (n,), (n,)), 256, 256) for n in BLOCK_TYPES]
CASES = [*UNIFORM, ((("Q8_0",),) * 3, 96, 64), ((("Q4_K",), ("Q4_K",), ("Q6_K",)), 512, 256),
         ((("Q4_K", "Q2_K"), ("Q6_K", "Q8_0"), ("Q6_K", "IQ4_XS", "Q5_K")), 256, 256)]
IDS = [*BLOCK_TYPES, "Q8_0-96x64", "Q4_K_M-512x256", "mixed-per-slot"]
SLOT_OF = [2, -1, 0, 3, 1, -1]  # expert -> slot; experts 1 and 5 not resident


def _slots(ggml, h: int, i: int, seed: int = 0, device: str = "cpu"):
    """Four slots holding experts 0, 2, 3, 4 of six, as random valid blocks: slot s's tensor j in type
    ggml[j][s % len(ggml[j])]. Returns (QuantSlotWeights, layout, slot_of [6] int32)."""
    rng = np.random.default_rng(seed)
    layout = ExpertLayout.build(ExpertFormat("gguf", ggml=ggml), h, i)
    slot_bytes = -(-layout.payload_bytes // 4096) * 4096
    slab = torch.zeros(4, slot_bytes, dtype=torch.uint8)
    for s in range(4):
        names = [types[s % len(types)] for types in ggml]
        tensors = [(n, torch.from_numpy(random_blocks(n, r, k, rng, amax=0.2)))
                   for n, (r, k) in zip(names, ((i, h), (i, h), (h, i)), strict=True)]
        layout.pack_gguf(*tensors, out=slab[s])
    return QuantSlotWeights(slab.to(device), layout), layout, torch.tensor(SLOT_OF, dtype=torch.int32).to(device)


def _dequantized(qs: QuantSlotWeights, dtype: torch.dtype) -> SlotWeights:
    """The oracle's weights: each slot's blob through `ExpertLayout.dequantize`, stacked."""
    mats = [qs.layout.dequantize(qs.slab[s].cpu(), dtype) for s in range(qs.num_slots)]
    return SlotWeights(torch.stack([m[0] for m in mats]).to(qs.slab.device),
                       torch.stack([m[1] for m in mats]).to(qs.slab.device))


def _reference(x, sw: SlotWeights, slot_of, ids, k, rows=None):
    """The plain experts' torch path (`grouped._pair_torch`) on the dequantized weights: (y [P, H] fp32, used)."""
    p = ids.numel()
    rows = torch.arange(p, dtype=torch.int32, device=x.device) if rows is None else rows
    y = torch.zeros(p, x.shape[1], device=x.device)
    used = torch.empty(p, dtype=torch.int32, device=x.device)
    grouped._pair_torch(x, sw, slot_of, ids, rows, k, y, used)
    return y, used


def _pairs(n: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(len(SLOT_OF), generator=g)[:k] for _ in range(n)]).reshape(-1).to(device)


# ---- the torch paths and the format queries (any CPU) --------------------------------------------------------------

@pytest.mark.parametrize("ggml,h,i", CASES[-3:], ids=IDS[-3:])
def test_batched_dequantize_of_gguf_blobs_equals_the_layouts(ggml, h, i):
    """`dequantize_blobs` (the torch fallback's gather, prefill's scratch off CUDA): each blob as its own header's
    types, bit for bit `layout.dequantize`, with no host synchronisation."""
    qs, layout, _ = _slots(ggml, h, i, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        gu, dn = dequantize_blobs(qs.slab, layout, dtype)
        ref = _dequantized(qs, dtype)
        assert torch.equal(gu, ref.gate_up) and torch.equal(dn, ref.down) and gu.abs().max() > 0.01
        g1, d1 = qs.expert(3, dtype)
        assert torch.equal(g1, ref.gate_up[3]) and torch.equal(d1, ref.down[3])


def test_pair_fallback_on_gguf_slots_equals_the_dequantized_experts():
    """The torch fallback on gguf slots whose types differ per slot: exactly the plain path on the dequantized
    experts, non-resident pairs skipped and their rows left alone."""
    qs, _, slot_of = _slots(*CASES[-1], seed=2)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    ids = _pairs(3, 2, seed=4)
    rows = torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int32)
    y = torch.full((6, 256), 7.0)
    used = grouped.pair_experts(x, qs, slot_of, ids, y, rows=rows)
    want, want_used = _reference(x, _dequantized(qs, torch.float32), slot_of, ids, 2, rows)
    assert torch.equal(used, want_used) and torch.equal(used, slot_of[ids])
    skipped, done = rows[used < 0].long(), rows[used >= 0].long()
    assert skipped.numel() > 0 and torch.all(y[skipped] == 7.0)
    assert torch.equal(y[done], want[done]) and want[done].abs().max() > 0.1


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_prefill_on_gguf_slots_equals_the_dequantized_experts():
    from strata.kernels.gpu.experts.grouped_gemm import grouped_experts, grouped_ok

    qs, _, slot_of = _slots(*CASES[-2], seed=5)
    g = torch.Generator().manual_seed(6)
    n, k = 9, 3
    x = torch.randn(n, 512, generator=g)
    ids = torch.stack([torch.randperm(len(SLOT_OF), generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    want = grouped_experts(x, w, slot_of[ids], _dequantized(qs, torch.float32), ids)
    assert grouped_ok(x, qs)
    got = grouped_experts(x, w, slot_of[ids], qs, ids)
    assert torch.equal(got, want) and want.abs().max() > 0


def test_format_queries_list_gguf_where_triton_is():
    have = quant_pairs.triton is not None
    assert ("gguf" in formats_supported()) == have
    fmt = ExpertFormat("gguf", ggml=(("Q4_K",), ("Q4_K",), ("Q6_K", "Q4_K")))
    assert (fast_path_refusal(fmt) is None) == have
    assert gguf_tiles.gguf_refusal(fmt.ggml) is None and gguf_tiles.gguf_refusal((("Q4_0",), ("Q4_K",), ("Q4_K",)))
    assert gguf_tiles.type_mask(("Q4_K", "Q6_K", "Q4_K")) == (1 << 12) | (1 << 14)
    qs, layout, _ = _slots(*CASES[-1])
    assert fast_path(qs) == fast_path(HostExperts.of_layout(layout)) == ("quant" if have else "torch")


# ---- the Triton kernels (CUDA; or the CPU under TRITON_INTERPRET=1) ------------------------------------------------

def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: to fp32 rounding (a group's scale applies to its sum); bf16: the bf16 pair kernels' tolerance."""
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _run_pairs(x, qs, slot_of, ids, y, rows=None) -> torch.Tensor:
    """`pair_experts` on CUDA; its Triton path directly under the interpreter (pair_experts takes the torch path on
    CPU tensors), with whole-matrix tiles."""
    if CUDA:
        return grouped.pair_experts(x, qs, slot_of, ids, y, rows=rows)
    used = torch.empty(ids.numel(), dtype=torch.int32)
    quant_pairs.pair_quant(x, qs, slot_of, ids, rows, y.shape[0] // x.shape[0], y, used, config=INTERPRETED_PAIRS)
    return used


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("ggml,h,i", CASES, ids=IDS)
def test_kernel_pairs_on_gguf_slots_equal_the_dequantized_experts(ggml, h, i, dtype):
    """The gguf pair kernels (slot lookup in the kernel, blocks dequantized in registers, fp32 math) against the
    torch path in fp32 on the dequantized weights, to fp32 rounding; skipped pairs' rows untouched."""
    qs, _, slot_of = _slots(ggml, h, i, seed=7, device=DEVICE)
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    ids = _pairs(3, 2, seed=9, device=DEVICE)
    y = torch.full((6, h), 7.0, device=DEVICE)
    used = _run_pairs(x, qs, slot_of, ids, y)
    want, want_used = _reference(x.float(), _dequantized(qs, torch.float32), slot_of, ids, 2)
    assert torch.equal(used, want_used)
    ok = used >= 0
    assert torch.all(y[~ok] == 7.0)
    _close(y[ok], want[ok], torch.float32)
    assert want[ok].abs().max() > 0.1  # outputs of order one: the tolerance means something


def test_kernel_pairs_with_rows_address_their_output_rows():
    """`rows`: pair p writes row rows[p], token rows[p] // k."""
    qs, _, slot_of = _slots(*CASES[-2], seed=10, device=DEVICE)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    ids = _pairs(3, 2, seed=12, device=DEVICE)
    rows = torch.tensor([5, 1, 3, 0, 2, 4], dtype=torch.int32, device=DEVICE)
    y = torch.full((6, 512), 7.0, device=DEVICE)
    used = _run_pairs(x, qs, slot_of, ids, y, rows=rows)
    want, _ = _reference(x, _dequantized(qs, torch.float32), slot_of, ids, 2, rows)
    done, skipped = rows[used >= 0].long(), rows[used < 0].long()
    assert torch.all(y[skipped] == 7.0)
    _close(y[done], want[done], torch.float32)


@pytest.mark.parametrize("ggml,h,i", [CASES[3], *CASES[-2:]], ids=["Q4_K", *IDS[-2:]])
def test_kernel_in_place_reads_of_gguf_blobs(monkeypatch, ggml, h, i):
    """`pair_experts_in_place` on gguf blobs (read by host address, in their blocks) gives the torch path's result
    on the dequantized weights; address 0 is left alone; first_row computes an expert's rows from first_row on."""
    if not CUDA:
        monkeypatch.setattr(gguf_pairs, "GGUF_IN_PLACE_BLOCKS", INTERPRETED_IN_PLACE)
    qs, layout, slot_of = _slots(ggml, h, i, seed=13, device=DEVICE)
    sw = _dequantized(qs, torch.float32)
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    ids = torch.tensor([0, 2, 3, 4, 0, 3], device=DEVICE)  # resident experts only
    if CUDA:
        from strata.tiers.storage.pinned import PinnedPool

        pool = PinnedPool(qs.slab.shape[1], qs.num_slots, background=False)
        for s in range(qs.num_slots):
            pool.slot(s).copy_(qs.slab[s].cpu())
        address, close = pool.slot_address, pool.close
    else:
        address, close = (lambda s: qs.slab[s].data_ptr()), (lambda: None)
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
        _close(y[keep], want[keep], torch.float32)
        first = torch.tensor([0, 5, i // 2, i - 1, 0, i], dtype=torch.int32, device=DEVICE)
        part = torch.full((6, h), 7.0, device=DEVICE)
        grouped.pair_experts_in_place(x, experts, addr, part, first_row=first)
        for p, e in enumerate(ids.tolist()):
            if p == 4:
                assert torch.all(part[4] == 7.0)
                continue
            f, tok, s = int(first[p]), p // 2, SLOT_OF[e]
            gu, dn = sw.gate_up[s], sw.down[s]
            act = torch.nn.functional.silu(gu[f:i] @ x[tok]) * (gu[i + f :] @ x[tok])
            _close(part[p], act @ dn[:, f:].T, torch.float32)
    finally:
        if CUDA:
            torch.cuda.synchronize()
        close()


@pytest.mark.parametrize("ggml,h,i", CASES, ids=IDS)
def test_kernel_dequantize_gguf_into_a_scratch_equals_the_layouts(monkeypatch, ggml, h, i):
    """Prefill's scratch dequantizer (one launch a tensor over a list of slots) writes `ExpertLayout.dequantize`'s
    values bit for bit: the GPU's bf16 and fp32, the interpreter's fp32 (and fp16 for the last cases)."""
    if not CUDA:
        monkeypatch.setattr(gguf_tiles, "DEQUANT_BLOCK", INTERPRETED_DEQUANT)
    qs, layout, _ = _slots(ggml, h, i, seed=15, device=DEVICE)
    index = torch.tensor([3, 0], device=DEVICE)
    more = (ggml, h, i) in CASES[-3:]
    for dtype in [torch.bfloat16, torch.float32] if CUDA else [torch.float32, torch.float16][: 1 + more]:
        ref = _dequantized(qs, dtype)
        gu = torch.empty(2, 2 * i, h, dtype=dtype, device=DEVICE)
        dn = torch.empty(2, h, i, dtype=dtype, device=DEVICE)
        dequantize_into(qs.slab, layout, index, layout.gate_up, layout.gate_up_scales, gu)
        dequantize_into(qs.slab, layout, index, layout.down, layout.down_scales, dn)
        assert torch.equal(gu, ref.gate_up[index]) and torch.equal(dn, ref.down[index])


for _name in [n for n in list(globals()) if n.startswith("test_kernel_")]:
    for _mark in KERNEL:
        globals()[_name] = _mark(globals()[_name])


# ---- CUDA only ------------------------------------------------------------------------------------------------------

Q4_K_M = (("Q4_K",), ("Q4_K",), ("Q6_K", "Q4_K"))  # a Q4_K_M file's experts: down Q6_K in some layers, Q4_K in others


@pytest.mark.gpu
def test_gguf_pairs_in_bf16_on_a_model_sized_expert():
    """A Qwen3-30B-A3B-sized expert (H 2048, I 768) of a Q4_K_M store in bf16: within the bf16 pair kernels' distance
    of the fp32 oracle on the dequantized weights."""
    qs, _, slot_of = _slots(Q4_K_M, 2048, 768, seed=16, device="cuda")
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    ids = _pairs(4, 2, seed=17, device="cuda")
    y = torch.full((8, 2048), 7.0, device="cuda")
    used = grouped.pair_experts(x, qs, slot_of, ids, y)
    want, want_used = _reference(x.float(), _dequantized(qs, torch.float32), slot_of, ids, 2)
    ok = used >= 0
    assert torch.equal(used, want_used) and want[ok].abs().max() > 0.1
    _close(y[ok], want[ok], torch.bfloat16)
    plain = torch.full((8, 2048), 7.0, device="cuda")
    grouped.pair_experts(x, _dequantized(qs, torch.bfloat16), slot_of, ids, plain)
    assert (y[ok] - want[ok]).abs().max() <= 1.25 * (plain[ok] - want[ok]).abs().max() + 1e-4


@pytest.mark.gpu
def test_gguf_pairs_replay_in_a_cuda_graph():
    """Captured in a CUDA graph (as decode captures them): replays follow new activations and slot maps."""
    qs, _, slot_of = _slots(Q4_K_M, 512, 256, seed=18, device="cuda")
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    ids = _pairs(2, 2, seed=19, device="cuda")
    y = torch.zeros(4, 512, device="cuda")
    grouped.pair_experts(x, qs, slot_of, ids, y)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        used = grouped.pair_experts(x, qs, slot_of, ids, y)
    for seed in (20, 21):
        x.copy_(torch.randn(2, 512, generator=torch.Generator().manual_seed(seed)).cuda())
        slot_of.copy_(torch.tensor([3, 1, 0, 2, -1, -1] if seed == 21 else SLOT_OF, dtype=torch.int32))
        y.zero_()
        graph.replay()
        want = torch.zeros(4, 512, device="cuda")
        want_used = grouped.pair_experts(x, qs, slot_of, ids, want)
        torch.cuda.synchronize()
        assert torch.equal(used, want_used) and torch.equal(y, want)


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (9, 0)), reason="needs sm90+ (grouped GEMM)")
def test_grouped_prefill_on_gguf_slots_on_cuda():
    """Prefill in bf16 on gguf slots: the scratch-dequantized grouped GEMMs equal the bf16 grouped GEMMs on the
    dequantized experts exactly (same scratch values, same GEMMs)."""
    from strata.kernels.gpu.experts import grouped_gemm
    from strata.kernels.gpu.experts.grouped_gemm import grouped_experts, grouped_ok

    qs, _, slot_of = _slots(Q4_K_M, 512, 256, seed=22, device="cuda")
    g = torch.Generator().manual_seed(23)
    n, k = 300, 2
    x = torch.randn(n, 512, generator=g).cuda().bfloat16()
    ids = torch.stack([torch.tensor([0, 2, 3, 4])[torch.randperm(4, generator=g)[:k]] for _ in range(n)]).cuda()
    w = torch.rand(n, k, generator=g).cuda()
    assert grouped_ok(x, qs)
    got = grouped_experts(x, w, slot_of[ids], qs, ids)
    assert not grouped_gemm._refused
    assert torch.equal(got, grouped_experts(x, w, slot_of[ids], _dequantized(qs, torch.bfloat16), ids))
