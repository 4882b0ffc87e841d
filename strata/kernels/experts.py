"""Routed-expert compute: group a batch's tokens by expert, run each hit expert once on its tokens.

Expert weights come from a callable, so the same loop serves experts stacked in memory
(`gate_up` [E, 2I, H], `down` [E, H, I]) and experts the tier manager holds in GPU or pinned slots.
The callable may give an expert as stored (`QuantMatrix` pairs, block-scaled FP8 or MXFP4): each is then
dequantized into a scratch of the activations' dtype just before it runs, the fallback of every path whose
kernel does not read the format itself (strata.kernels.quant.FAST_PATHS). Experts accumulate in ascending
order, as transformers does, so fp32 results match the reference to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.quant import QuantMatrix

# expert -> (gate_up [2I, H], down [H, I]): tensors, or matrices as stored (dequantized here)
ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor] | tuple[QuantMatrix, QuantMatrix]]
# an expert's whole math, where a caller has its own: (expert, x [T, H], gate_up [2I, H], down [H, I]) -> [T, H]
# (gpt-oss's in-memory experts, both biases included: strata.runtime.model.gpt_oss.moe)
ExpertMath = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SwiGLUForm:
    """The SwiGLU between an expert's two matrices, as every expert kernel computes it (gu = x gate_up^T [+ bias]):

        gate, up = gu[:, :I], gu[:, I:]                      (interleaved: gu[:, 0::2], gu[:, 1::2])
        gate = min(gate, limit); up = clamp(up, -limit, limit)  (limit None: neither)
        h = (up + up_offset) * gate * sigmoid(alpha * gate)

    Plain SwiGLU (Qwen3, DeepSeek-V3, Mixtral, ...) is the default; DeepSeek-V4 clips (`limit` = swiglu_limit);
    gpt-oss clips, with alpha 1.702, up_offset 1 and interleaved gate/up rows, and adds per-expert biases: the
    gate_up bias [E, 2I] (in gate_up's row order) inside the kernels, before the activation; the down bias [E, H]
    outside them, once per token (`down_bias_term`), so a split expert's two parts never both add it."""

    limit: float | None = None
    alpha: float = 1.0
    up_offset: float = 0.0
    interleaved: bool = False

    @property
    def plain(self) -> bool:
        """Whether this is the plain SwiGLU (silu(gate) * up, gate rows first)."""
        return self == PLAIN_SWIGLU

    def apply(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (bias already added) -> h [T, I] in gu's dtype, rounded as torch's ops round."""
        if self.interleaved:
            gate, up = gu[..., 0::2], gu[..., 1::2]
        else:
            gate, up = gu.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        if self.alpha == 1.0 and self.up_offset == 0.0:
            return F.silu(gate) * up
        return (up + self.up_offset) * (gate * torch.sigmoid(gate * self.alpha))


PLAIN_SWIGLU = SwiGLUForm()


def down_bias_term(weights: torch.Tensor, ids: torch.Tensor, down_bias: torch.Tensor) -> torch.Tensor:
    """The down projections' biases of each token's routed experts, weighted as their outputs are: weights [N, k],
    ids [N, k], down_bias [E, H] -> fp32 [N, H] (sum over k of weights * down_bias[ids]), added once to the
    experts' sum whichever tier computed each expert."""
    return torch.einsum("nk,nkh->nh", weights.float(), down_bias[ids.long()].float())


def as_weights(pair: tuple[torch.Tensor, torch.Tensor] | tuple[QuantMatrix, QuantMatrix],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's (gate_up, down) as tensors: stored matrices dequantized (or converted) to `dtype`, tensors as given."""
    gate_up, down = pair
    if isinstance(gate_up, QuantMatrix):
        return gate_up.dequantize(dtype), down.dequantize(dtype)
    return gate_up, down


def expert_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, form: SwiGLUForm = PLAIN_SWIGLU,
                  gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on a group of tokens: x [T, H], gate_up [2I, H], down [H, I] -> [T, H], its SwiGLU in `form`
    (DeepSeek-V4's clip, gpt-oss's clamped form) with `gate_up_bias` [2I] added first; no down bias (the caller's,
    `down_bias_term`)."""
    gu = F.linear(x, gate_up, None if gate_up_bias is None else gate_up_bias.to(x.dtype))
    return F.linear(form.apply(gu), down)


def group_by_expert(ids: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor]]:
    """ids [N, k] -> [(expert, token-slot indices into ids.flatten())] for every expert hit, ascending."""
    order, counts = _pairs_by_expert(ids, num_experts)
    return _groups(order, counts.tolist())  # one host sync per layer


def group_by_expert_with_host(ids: torch.Tensor, num_experts: int
                              ) -> tuple[list[tuple[int, torch.Tensor]], dict[int, np.ndarray]]:
    """`group_by_expert`'s groups, and each hit expert's indices on the host too ({expert: [n_e] int64}), brought over
    in the same host sync: a caller that hands some experts to the CPU reads their pairs without a second one."""
    order, counts = _pairs_by_expert(ids, num_experts)
    both = torch.cat([counts, order]).cpu().numpy()  # [E + N k]: the counts, then the pairs expert by expert
    host_counts, host_order = both[:num_experts], both[num_experts:]
    starts = np.concatenate([[0], np.cumsum(host_counts)])
    host = {int(e): host_order[starts[e] : starts[e + 1]] for e in np.flatnonzero(host_counts)}
    return _groups(order, host_counts.tolist()), host


def _pairs_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, k] -> (pair indices into ids.flatten() [N k], stably sorted by expert; each expert's count [E])."""
    flat = ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def _groups(order: torch.Tensor, counts: list[int]) -> list[tuple[int, torch.Tensor]]:
    groups, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            groups.append((expert, order[start : start + count]))
            start += count
    return groups


def apply_experts(x: torch.Tensor, weights: torch.Tensor, k: int, groups: list[tuple[int, torch.Tensor]],
                  expert_weights: ExpertWeights, out: torch.Tensor | None = None, form: SwiGLUForm = PLAIN_SWIGLU,
                  gate_up_bias: torch.Tensor | None = None, math: ExpertMath | None = None) -> torch.Tensor:
    """Weighted sum of each token's routed experts. x [N, H], weights [N, k] -> [N, H].

    `out` continues an earlier partial sum (experts served in chunks accumulate in the same order); `form` and
    `gate_up_bias` [E, 2I]: the experts' SwiGLU (`expert_swiglu`; no down bias); `math`: each expert's own math
    instead (all of it, down bias included).
    """
    out = torch.zeros_like(x) if out is None else out
    flat_weights = weights.reshape(-1)
    for expert, sel in groups:
        tokens = sel // k
        gate_up, down = as_weights(expert_weights(expert), x.dtype)
        if math is not None:
            y = math(expert, x[tokens], gate_up, down)
        else:
            y = expert_swiglu(x[tokens], gate_up, down, form, None if gate_up_bias is None else gate_up_bias[expert])
        y = y * flat_weights[sel, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def moe_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, form: SwiGLUForm = PLAIN_SWIGLU) -> torch.Tensor:
    """All experts stacked in memory: x [N, H], ids/weights [N, k] -> [N, H] (`form`: the experts' SwiGLU)."""
    groups = group_by_expert(ids, gate_up.shape[0])
    return apply_experts(x, weights, ids.shape[1], groups, lambda e: (gate_up[e], down[e]), form=form)
