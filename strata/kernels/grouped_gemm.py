"""Prefill-sized expert compute in a few launches: every (token, expert) pair of a chunk in two grouped GEMMs.

`apply_experts` runs each hit expert as its own chain of ~12 ops (gather, two GEMMs, SiLU, multiply,
index_add). An 8K-token prefill chunk of the bench model hits all 128 experts of every layer, and on the
H200 box the host launching those ops took 0.63 s for ~94 ms of GPU work (bench/RESULTS.md, ninth session:
`bench/profile_prefill.py`). Here the pairs are sorted by slot and run through `torch._grouped_mm` (CUTLASS
grouped GEMMs on sm90; a reference loop elsewhere), once for gate/up and once for down, whatever the number
of experts: about ten launches a layer.

Weights are addressed by slot, like the decode pair kernels: `SlotWeights` over the stacked in-memory
experts (slot = expert id) or over the GPU tier's slab. Each token's k outputs are added in ascending
expert order in fp32 and rounded once, so the in-memory and tiered engines give identical results (the
order of their slots does not enter the sum). `runtime.grouped_prefill = "auto"` uses it on CUDA (an 8K prefill
all in VRAM ran 7.3x the loop on the H200 box); on the CPU torch's grouped GEMM is a reference loop.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from strata.kernels.grouped import SlotWeights

log = logging.getLogger(__name__)
_refused: set[str] = set()  # operand kinds torch's grouped GEMM refused here (the per-expert loop serves them)


def grouped_ok(x: torch.Tensor, weights: SlotWeights) -> bool:
    """Whether `grouped_experts` can run these operands: torch's grouped GEMM, bf16 weights on CUDA (sm90+)
    or any float dtype on the CPU (its reference loop), rows 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or _kind(x, weights) in _refused:
        return False
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device) < (9, 0) or weights.gate_up.dtype != torch.bfloat16:
            return False
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in (weights.gate_up, weights.down))


def _kind(x: torch.Tensor, weights: SlotWeights) -> str:
    return f"{x.device.type}:{weights.gate_up.dtype}:{weights.gate_up.stride(0)}"


def refuse(x: torch.Tensor, weights: SlotWeights, error: Exception) -> None:
    """torch's grouped GEMM rejected these operands (a layout or dtype it does not take): log it once and
    serve them with the per-expert loop from now on."""
    _refused.add(_kind(x, weights))
    log.warning("grouped prefill GEMM unavailable for these experts (%s); using the per-expert loop", error)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, sw: SlotWeights,
                    experts: torch.Tensor) -> torch.Tensor:
    """x [N, H], weights [N, k] routing weights, slots [N, k] the slot of each pair's expert (-1: not in this
    call, contributes nothing), experts [N, k] the expert ids (the summation order) -> fp32 [N, H], each
    token's pairs weighted and summed in ascending expert order."""
    n, k = slots.shape
    flat = slots.reshape(-1).long()  # [P]
    keep = flat >= 0
    order = torch.argsort(torch.where(keep, flat, sw.gate_up.shape[0]), stable=True)  # by slot, skipped last
    kept = int(keep.sum())  # one host sync: the grouped GEMM's row count
    order = order[:kept]
    counts = torch.bincount(flat[order], minlength=sw.gate_up.shape[0])  # [S] rows of each slot
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k].to(sw.gate_up.dtype)  # [P', H]
    gu = torch._grouped_mm(xs, sw.gate_up.transpose(1, 2), offs=offs)  # [P', 2I]
    gate, up = gu.chunk(2, dim=-1)
    h = (F.silu(gate.float()) * up.float()).to(sw.down.dtype)
    y = torch._grouped_mm(h, sw.down.transpose(1, 2), offs=offs).float()  # [P', H]
    pairs = torch.zeros((n * k, x.shape[1]), dtype=torch.float32, device=x.device)
    pairs.index_copy_(0, order, y * weights.reshape(-1)[order].float()[:, None])  # back in pair order
    rank = torch.argsort(experts, dim=1, stable=True)  # [N, k] each token's pairs by ascending expert
    by_expert = pairs.view(n, k, -1).gather(1, rank[..., None].expand(-1, -1, x.shape[1]))
    out = by_expert[:, 0].clone()
    for j in range(1, k):  # sequential: the same rounding whichever slots served the pairs
        out += by_expert[:, j]
    return out
