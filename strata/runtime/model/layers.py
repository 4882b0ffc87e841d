"""Small building blocks shared by every architecture: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.gpu import decode_gemv, fused


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (as transformers' LlamaRMSNorm family)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one Triton kernel on CUDA (torch needs four: float, rms_norm, to, mul); the torch chain elsewhere
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a residual add and this norm, one kernel where fused kernels run."""
        both = fused.add_rms_norm(x, delta, self.weight, self.eps)
        if both is not None:
            return both
        total = x + delta
        return total, self(total)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode token's row goes through the Triton GEMV on CUDA (strata.kernels.gpu.decode_gemv); else F.linear
        gate, up = decode_gemv.project(self.gate_proj, x), decode_gemv.project(self.up_proj, x)
        return decode_gemv.project(self.down_proj, F.silu(gate) * up)
