"""DeepSeek-V4's RMS norms: weighted (weight kept in fp32, the product rounded once) and unweighted."""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels.gpu import deepseek_v4 as v4_kernels


class FloatRMSNorm(nn.Module):
    """transformers' DeepseekV4RMSNorm: (weight * x / rms(x)) computed in fp32, rounded to x's dtype at the end
    (its weight stays fp32 whatever the model dtype: `keeps_fp32`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = v4_kernels.float_rms_norm(x, self.weight, self.eps)  # one launch on CUDA
        if fused is not None:
            return fused
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, the scale computed in fp32 and applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
