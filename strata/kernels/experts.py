"""Routed-expert compute over experts stacked in memory (the all-in-memory reference path).

`gate_up` [E, 2I, H] holds each expert's gate and up projections stacked (gate first, as transformers'
fused layout); `down` [E, H, I]. Tokens are grouped by expert so each hit expert runs one GEMM over
all its tokens, and experts accumulate in ascending order as transformers does, so fp32 results
match the reference to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert on a group of tokens: x [T, H], gate_up [2I, H], down [H, I] -> [T, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def moe_forward(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted sum of each token's routed experts. x [N, H], ids/weights [N, k] -> [N, H]."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-slots grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start : start + count]
        start += count
        tokens = sel // k
        y = expert_swiglu(x[tokens], gate_up[expert], down[expert])
        y = y * weights.reshape(-1)[sel, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
