"""Rotary position embeddings: default, linear and YaRN frequencies; half-split and interleaved rotation.

Frequencies follow transformers' `modeling_rope_utils` exactly (YaRN's ramp, truncation and attention
factor included), since long-context drift comes from getting these details slightly wrong.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from strata.runtime.model.config import RopeConfig


def inv_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Return (inverse frequencies [dim/2] fp32, attention factor applied to cos/sin)."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.rope_type == "linear":
        return 1.0 / pos_freqs / rope.factor, 1.0
    # YaRN (https://arxiv.org/abs/2309.00071), as transformers' _compute_yarn_parameters
    factor = rope.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 where the frequency is kept, 0 where it is interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary positions; `forward(positions [N]) -> (cos, sin) [N, dim]`."""

    def __init__(self, rope: RopeConfig):
        super().__init__()
        inv_freq, self.attention_factor = inv_frequencies(rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()  # [N, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, dim]
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate x [N, heads, dim] by cos/sin [N, rot]: the first `rot` dims of each head (rot < dim: GLM's
    partial_rotary_factor, the rest passing through unrotated, as transformers' apply_rotary_pos_emb).

    `interleave` (DeepSeek) rotates pairs (x0, x1), (x2, x3), ... and returns them de-interleaved
    ([evens..., odds...]), exactly as transformers does; q and k get the same permutation, so q·k is
    unchanged.
    """
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin, interleave), x[..., rot:]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    if not interleave:
        return x * cos + rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
