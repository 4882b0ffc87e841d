"""DeepSeek-V4's rotary embedding: interleaved pairs (x0, x1), (x2, x3), ... of a head's trailing `dim` channels
rotated in place (no de-interleaving, unlike DeepSeek-V3's), in fp32, as transformers' `apply_rotary_pos_emb` for
deepseek_v4. Keys double as values, so attention outputs are rotated back by the conjugate (`sign=-1`).

Two frequency sets: "main" (sliding-window layers: plain RoPE at rope_theta) and "compress" (CSA / HCA layers, their
compressors and indexer: compress_rope_theta, with YaRN where configured). The tables are computed on first use per
device, not held as buffers, so loading a checkpoint never looks for them.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import deepseek_v4 as v4_kernels
from strata.runtime.model.config import RopeConfig
from strata.runtime.model.deepseek_v4.norms import unweighted_rms_norm
from strata.runtime.model.rope import inv_frequencies


class InterleavedRope:
    """cos/sin [N, dim/2] for positions, from one `RopeConfig`; `rotate(x, cos, sin)` applies them.

    Within one pass over the layers (`begin_pass` ... `end_pass`) the tables of a positions tensor are computed once
    and shared by every layer that asks for them (each layer's attention, compressor and indexer ask with the pass's
    own positions tensor): the same ops on the same inputs, so the same values, ~8 launches a layer fewer."""

    def __init__(self, rope: RopeConfig):
        inv_freq, self.attention_factor = inv_frequencies(rope)
        self.inv_freq = inv_freq  # [dim/2] fp32, CPU
        self._on: dict[torch.device, torch.Tensor] = {}
        # (id(positions), m, dtype) -> (positions, cos, sin) for the pass running; positions kept so its id stays its
        self._pass: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def begin_pass(self) -> None:
        """Share tables between the layers until `end_pass`."""
        self._pass = {}

    def end_pass(self) -> None:
        self._pass = None

    def window_starts(self, positions: torch.Tensor, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at each position's window start, (positions // m) * m (a compressor's entries)."""
        return self._shared(positions, m, dtype)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int64 -> (cos, sin) [N, dim/2] in `dtype` (one entry per rotated pair)."""
        return self._shared(positions, 1, dtype)

    def _shared(self, positions: torch.Tensor, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(positions), m, dtype)
        hit = self._pass.get(key) if self._pass is not None else None
        if hit is not None and hit[0] is positions:
            return hit[1], hit[2]
        cos, sin = self._tables(positions // m * m if m > 1 else positions, dtype)
        if self._pass is not None:
            self._pass[key] = (positions, cos, sin)
        return cos, sin

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv[None, :]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, conjugate: bool = False) -> torch.Tensor:
    """x [N, heads, d] with cos/sin [N, r/2]: the trailing r channels rotated pairwise (fp32 math, x's dtype); by the
    conjugate rotation (-sin) with `conjugate`. One launch on CUDA (strata.kernels.gpu.deepseek_v4.rotate)."""
    fused = v4_kernels.rotate(x, cos, sin, conjugate)
    if fused is not None:
        return fused
    sin = -sin if conjugate else sin
    r = 2 * cos.shape[-1]
    c = cos.repeat_interleave(2, dim=-1)[:, None, :].float()  # [N, 1, r]
    s = sin.repeat_interleave(2, dim=-1)[:, None, :].float()
    nope, rope = x[..., :-r], x[..., -r:]
    swapped = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
    rotated = (rope.float() * c + swapped.float() * s).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def normed_rotate(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate(unweighted_rms_norm(x, eps), cos, sin)`: the queries' per-head norm and rotary, one launch on CUDA."""
    fused = v4_kernels.rotate(x, cos, sin, norm_eps=eps)
    return fused if fused is not None else rotate(unweighted_rms_norm(x, eps), cos, sin)
