"""Small building blocks shared by every architecture: RMSNorm, the SwiGLU MLP and the projections' fast paths."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import options
from strata.kernels.cpu import dense, rows
from strata.kernels.gpu import decode_gemv, fused


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in `out_dtype` (None: x's dtype), through the decode-sized fast path where there
    is one: a few rows of bf16 activations on the CPU go to the CPU kernel's pool (strata.kernels.cpu.dense: the
    weights read at RAM bandwidth, on the threads the experts run on); a decode row on CUDA to the Triton GEMV."""
    if x.device.type == "cpu":
        y = dense.linear(x, weight, bias, out_dtype, threads=options.current().cpu_threads)
        if y is not None:
            return y
        y = F.linear(x, weight, bias)
    else:
        y = decode_gemv.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def use_pass_threads(input_ids: torch.Tensor, prompt_threads: int) -> None:
    """torch's intra-op threads on this thread for a CPU forward pass over `input_ids` [N] (and the sampling after
    it), left so until the next pass: one for a pass of at most `dense.MAX_ROWS` tokens (decode: its products run
    on the CPU kernel's pool, `linear` and the experts; what torch has left is small), `prompt_threads` for longer
    ones (oneDNN's GEMMs). An OpenMP team in decode only waits: each parallel region wakes its other thread, and
    on a busy host that thread waits for a core (a decode step's attention took ~8 ms on two threads on the
    development machine with another process running, 0.6 ms on one). Changing the count is cheap; OpenMP's
    count is per thread, so other threads (a caller's) keep theirs."""
    if input_ids.device.type != "cpu":
        return
    want = 1 if input_ids.numel() <= dense.MAX_ROWS else prompt_threads
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a projection: a plain `nn.Linear` through `linear`'s fast paths, any other module (a
    quantized or wrapped one) as itself."""
    if type(module) is nn.Linear:
        return linear(x, module.weight, module.bias)
    return module(x)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (as transformers' LlamaRMSNorm family)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one Triton kernel on CUDA (torch needs four: float, rms_norm, to, mul), one compiled call for CPU decode
        # rows (strata.kernels.cpu.rows), the torch chain elsewhere
        if x.device.type == "cpu" and (y := rows.rms_norm(x, self.weight, self.eps)) is not None:
            return y
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a residual add and this norm, one kernel where fused kernels run."""
        if x.device.type == "cpu":
            both = rows.add_rms_norm(x, delta, self.weight, self.eps)
        else:
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
        # decode rows through the fast paths (`project`: the Triton GEMV on CUDA, the CPU kernel's pool on the CPU)
        gate, up = project(self.gate_proj, x), project(self.up_proj, x)
        return project(self.down_proj, F.silu(gate) * up)
