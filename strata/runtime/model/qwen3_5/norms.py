"""Qwen3.5-MoE's two RMS norms, as transformers 5.25 computes them.

    ZeroCenteredRMSNorm   x / rms(x) * (1 + weight), in fp32, rounded once (the layer norms, the final norm and
                          the full-attention layers' q/k norms; the checkpoint stores weight - 1, zero at init)
    GatedRMSNorm          (weight * (x / rms(x)).to(dtype)) * silu(gate), the gate in fp32 (the Gated DeltaNet
                          output, per value head)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.gpu import gated_delta


class ZeroCenteredRMSNorm(nn.Module):
    """transformers' Qwen3_5MoeRMSNorm: `forward(x [..., dim]) -> [..., dim]` in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = gated_delta.zero_centered_rms_norm(x, self.weight, self.eps)  # one launch on CUDA
        if fused is not None:
            return fused
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): the residual add and this norm."""
        both = gated_delta.zero_centered_rms_norm(x, self.weight, self.eps, delta)
        if both is not None:
            return both
        total = x + delta
        return total, self(total)


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3_5MoeRMSNormGated: `forward(x [..., dim], gate [..., dim]) -> [..., dim]` in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        fused = gated_delta.gated_rms_norm(x, gate, self.weight, self.eps)  # one launch on CUDA
        if fused is not None:
            return fused
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)
