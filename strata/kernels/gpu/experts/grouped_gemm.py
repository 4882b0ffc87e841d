"""Prefill-sized expert compute in a few launches: every (token, expert) pair of a chunk in two grouped GEMMs.

`apply_experts` runs each hit expert as its own chain of ~12 ops (gather, two GEMMs, SiLU, multiply,
index_add). An 8K-token prefill chunk of the bench model hits all 128 experts of every layer, and on the
H200 box the host launching those ops took 0.63 s for ~94 ms of GPU work (`bench/tools/profile_prefill.py`, code
9331683). Here the pairs are sorted by slot and run through `torch._grouped_mm` (CUTLASS grouped GEMMs on sm90;
a reference loop elsewhere), once for gate/up and once for down, whatever the number
of experts: about ten launches a layer, in pieces of about 8K pairs so the temporaries stay bounded. Each
pair's weighted output lands in one [N*k, H] fp32 buffer (a tiered prefill fills it batch by batch) that is
summed once.

Weights are addressed by slot, like the decode pair kernels: `SlotWeights` over the stacked in-memory
experts (slot = expert id) or over the GPU tier's slab. Each token's k outputs are added in ascending
expert order in fp32 and rounded once, so the in-memory and tiered engines give identical results (the
order of their slots does not enter the sum). `[debug] grouped_prefill = "auto"` uses it on CUDA (an 8K prefill
all in VRAM ran 7.3x the loop on the H200 box: docs/benchmarks.md, section "What changed the figures most",
ecaf011); on the CPU torch's grouped GEMM is a reference loop.

Quantized slots (`QuantSlotWeights`: FP8, MXFP4, GGUF) are dequantized per piece into a scratch buffer in the activations'
dtype (strata.kernels.gpu.experts.quant_slots.dequantize_slots: one Triton launch a matrix on CUDA), rounding as
`ExpertLayout.dequantize`, and the same grouped GEMMs run on it: a piece then also holds at most
`SCRATCH_BYTES` of dequantized experts. torch's FP8 grouped GEMM (`torch.nn.functional.scaled_grouped_mm`) is not
used: whether it takes 128 x 128 block scales on sm90, and beats dequantize-then-bf16, is for a run on the H200.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from strata.kernels.gpu.experts.grouped import SlotWeights
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights, dequantize_slots

log = logging.getLogger(__name__)
_refused: set[str] = set()  # operand kinds torch's grouped GEMM refused here (the per-expert loop serves them)


def grouped_ok(x: torch.Tensor, weights: SlotWeights | QuantSlotWeights) -> bool:
    """Whether `grouped_experts` can run these operands: torch's grouped GEMM, bf16 weights on CUDA (sm90+)
    or any float dtype on the CPU (its reference loop), rows 16-byte aligned. Quantized slots compute in x's
    dtype (bf16 on CUDA)."""
    if not hasattr(torch, "_grouped_mm") or _kind(x, weights) in _refused:
        return False
    if isinstance(weights, QuantSlotWeights):
        dtype, widths = x.dtype, [k for _, k in weights.shapes]
    else:
        dtype, widths = weights.gate_up.dtype, [weights.gate_up.shape[-1], weights.down.shape[-1]]
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device) < (9, 0) or dtype != torch.bfloat16:
            return False
    size = torch.empty((), dtype=dtype).element_size()
    return all(k * size % 16 == 0 for k in widths)


def _kind(x: torch.Tensor, weights: SlotWeights | QuantSlotWeights) -> str:
    if isinstance(weights, QuantSlotWeights):
        return f"{x.device.type}:{weights.layout.fmt.name}:{x.dtype}"
    return f"{x.device.type}:{weights.gate_up.dtype}:{weights.gate_up.stride(0)}"


def refuse(x: torch.Tensor, weights: SlotWeights | QuantSlotWeights, error: Exception) -> None:
    """torch's grouped GEMM rejected these operands (a layout or dtype it does not take): log it once and
    serve them with the per-expert loop from now on."""
    _refused.add(_kind(x, weights))
    log.warning("grouped prefill GEMM unavailable for these experts (%s); using the per-expert loop", error)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, sw: SlotWeights | QuantSlotWeights,
                    experts: torch.Tensor) -> torch.Tensor:
    """x [N, H], weights [N, k] routing weights, slots [N, k] the slot of each pair's expert (-1: not in this
    call, contributes nothing), experts [N, k] the expert ids (the summation order) -> fp32 [N, H], each
    token's pairs weighted and summed in ascending expert order."""
    pairs = torch.zeros((slots.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
    grouped_pairs(x, weights, slots, sw, pairs)
    return sum_pairs(pairs, experts)


PIECE_ROWS = 8192  # pairs per grouped GEMM: bounds a long prompt's temporaries (~14 KB a pair for the bench model)
SCRATCH_BYTES = 512 << 20  # dequantized experts a piece holds at most (quantized slots): ~54 of the bench model's


def grouped_pairs(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, sw: SlotWeights | QuantSlotWeights,
                  pairs: torch.Tensor) -> None:
    """Write each pair's weighted expert output into `pairs` [N*k, H] fp32 (row p: token p // k's (p % k)-th
    pair), for the pairs with a slot (slots [N, k], -1: not in this call; their rows are left as they are)."""
    n_slots = sw.num_slots
    flat = slots.reshape(-1).long()  # [P]
    by_slot = torch.where(flat >= 0, flat, n_slots)  # skipped pairs sort last
    counts = torch.bincount(by_slot, minlength=n_slots + 1)[:n_slots].cpu()  # one host sync: rows per slot
    used = torch.nonzero(counts).flatten()
    slot_rows = list(zip(used.tolist(), counts[used].tolist(), strict=True))
    order = torch.argsort(by_slot, stable=True)[: int(counts.sum())]
    slot_pairs(x, weights, order, slot_rows, sw, pairs)


def slot_pairs(x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, slot_rows: list[tuple[int, int]],
               sw: SlotWeights | QuantSlotWeights, pairs: torch.Tensor) -> None:
    """`grouped_pairs` with the pairs already sorted: order [P'] pair indices grouped by slot in slot order,
    slot_rows the (slot, rows) of each slot in it, ascending. A tiered prefill knows both per batch of staged
    experts without a sort or a host synchronisation, and calls this once per batch over one buffer, summing
    once (`sum_pairs`): each batch costs only its own pairs, and the sum keeps the all-in-memory order whichever
    batch served a pair. Runs in pieces of about `PIECE_ROWS` pairs cut between slots, so each expert's GEMM
    sees the same rows (and rounds the same) however the pairs were batched. Quantized slots: each piece's experts
    dequantized into a scratch first (`SCRATCH_BYTES` bounds a piece's experts)."""
    k = weights.shape[1]
    w = weights.reshape(-1)
    start = 0
    quant = isinstance(sw, QuantSlotWeights)
    per_expert = 3 * sw.layout.hidden * sw.layout.intermediate * x.element_size() if quant else 0
    for piece in _pieces(slot_rows, max(1, SCRATCH_BYTES // per_expert) if quant else None):
        rows = sum(r for _, r in piece)
        part = order[start : start + rows]
        start += rows
        psw = sw
        if quant:  # the piece's experts in x's dtype, expert j of the scratch = the piece's j-th slot
            psw = SlotWeights(*dequantize_slots(sw, [s for s, _ in piece], x.dtype))
            piece = [(j, r) for j, (_, r) in enumerate(piece)]
        n_slots = psw.num_slots
        counts = torch.zeros(n_slots, dtype=torch.int32)
        counts[torch.tensor([s for s, _ in piece])] = torch.tensor([r for _, r in piece], dtype=torch.int32)
        offs = counts.cumsum(0, dtype=torch.int32).to(x.device, non_blocking=True)  # [S] each slot's row end
        xs = x[part // k].to(psw.gate_up.dtype)  # [R, H]
        gu = torch._grouped_mm(xs, psw.gate_up.transpose(1, 2), offs=offs)  # [R, 2I]
        del xs
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate.float()).mul_(up)  # fp32 (up promoted on the fly), in place
        h = act.to(psw.down.dtype)
        del gu, gate, up, act
        y = torch._grouped_mm(h, psw.down.transpose(1, 2), offs=offs)  # [R, H] in the weights' dtype
        # y * w in fp32 (type promotion: no fp32 copy of y first), back in pair order
        pairs.index_copy_(0, part, y * w[part].float()[:, None])


def _pieces(slot_rows: list[tuple[int, int]], max_slots: int | None = None) -> list[list[tuple[int, int]]]:
    """slot_rows cut into runs of about PIECE_ROWS rows each (a slot with more rows is a piece of its own), and of
    at most `max_slots` slots."""
    pieces: list[list[tuple[int, int]]] = []
    rows = 0
    for slot, r in slot_rows:
        if not pieces or rows + r > PIECE_ROWS or (max_slots is not None and len(pieces[-1]) >= max_slots):
            pieces.append([])
            rows = 0
        pieces[-1].append((slot, r))
        rows += r
    return pieces


def sum_pairs(pairs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """pairs [N*k, H] fp32 weighted pair outputs, experts [N, k] -> fp32 [N, H]: each token's pairs added in
    ascending expert order, sequentially (the same rounding whichever slots or batches served them)."""
    n, k = experts.shape
    # row of each token's j-th pair by ascending expert [N, k]: one [N, H] row gather a term, not [N, k, H] at once
    rows = torch.argsort(experts, dim=1, stable=True) + torch.arange(0, n * k, k, device=experts.device)[:, None]
    out = pairs.index_select(0, rows[:, 0])
    for j in range(1, k):
        out += pairs.index_select(0, rows[:, j])
    return out
