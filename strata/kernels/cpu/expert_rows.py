"""A CPU-only host's decode MoE layer in one compiled call, on experts pinned in RAM for good, read by address.

    layer = PinnedLayer.build(addresses, layout, backend="auto")   # None: the compiled kernel does not apply
    out = layer.forward(x, ids, weights, residual)   # (residual + the routed experts' sum in bf16, experts) or None

Where every expert of a layer stays at one address for the life of the engine (the pinned tier holds them all, so
nothing evicts: `TierManager.all_pinned`), a decode step needs no holds and no per-expert views: the call takes the
router's picks, groups them by expert, points the kernel at each expert's blob through the layer's address table and
adds the residual to the rounded sum (csrc/cpu_experts_rows.cpp). The plain SwiGLU without biases, in any format the
kernel reads. The result equals, bit for bit, the packed path's (`CpuCompute.start_cpu` over the same groups, then
the bf16 cast and the residual add), which spent ~20 small ops a layer on the same in Python, each slowed
several-fold by the weights the layer had just streamed through the caches.
"""

from __future__ import annotations

import array
import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels.cpu import expert_args
from strata.kernels.cpu.library import _ISA, _resolve, default_threads, library
from strata.kernels.quant import ExpertLayout

MAX_ROWS = 16
"""Rows a call takes: a decode step's, or a short prompt's within `CpuCompute.cpu_rows`' per-expert token limit
(longer prompts take the grouped path)."""

_NOT_RESIDENT = -7


@dataclass(frozen=True)
class PinnedLayer:
    """One MoE layer's experts at fixed pinned-RAM addresses, with the kernel's per-layer arguments packed once."""

    isa: int  # the kernel's instruction-set code
    addresses: np.ndarray  # [E] int64 each expert's blob address (0: not resident)
    offsets: array.array  # int64 [gate_up values, down values, gate_up scales, down scales] in a blob
    inter: int  # each expert's intermediate size I
    fmt_args: array.array | None  # `expert_args.format_args` (None: bf16 experts)

    @classmethod
    def build(cls, addresses: np.ndarray, layout: ExpertLayout, backend: str | None = None) -> PinnedLayer | None:
        """The layer whose expert e's blob (in `layout`) is at addresses[e]. None where the compiled kernel does not
        compute these experts here (the torch path, or a format this CPU's kernel cannot read)."""
        fmt = layout.fmt if layout.fmt.quantized else None
        name = _resolve(backend, fmt or "plain")
        if name == "torch" or library() is None:
            return None
        offsets = array.array("q", (layout.gate_up.offset, layout.down.offset,
                                    layout.gate_up_scales.offset if layout.gate_up_scales else 0,
                                    layout.down_scales.offset if layout.down_scales else 0))
        inter = layout.intermediate
        up = expert_args.layout_up_offset(fmt, layout.hidden, inter) if fmt is not None and fmt.kind == "gguf" else 0
        return cls(_ISA[name], np.ascontiguousarray(addresses, dtype=np.int64), offsets,
                   inter, expert_args.format_args(fmt, up) if fmt is not None else None)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None,
                threads: int | None = None) -> tuple[torch.Tensor, int] | None:
        """x [N, H] bf16, ids [N, k] and weights [N, k] (the router's picks), residual [N, H] bf16 or None ->
        (residual + the experts' weighted sum rounded to bf16, [N, H] bf16; how many distinct experts ran), or None
        where the call does not apply (not bf16 rows on the CPU, more than MAX_ROWS of them, an expert not
        resident). Raises IndexError for an expert id outside the table."""
        n, k = ids.shape
        if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or not 0 < n <= MAX_ROWS
                or x.shape[0] != n or residual is not None and (residual.shape != x.shape
                                                                  or residual.dtype != torch.bfloat16)):
            return None
        x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        residual = residual.contiguous() if residual is not None else None
        y = torch.empty_like(x)
        experts = ctypes.c_int64(0)
        rc = library().strata_cpu_experts_rows(
            self.isa, x.data_ptr(), n, x.shape[1], k, ids.data_ptr(), weights.data_ptr(), self.addresses.ctypes.data,
            len(self.addresses), self.offsets.buffer_info()[0], self.inter,
            self.fmt_args.buffer_info()[0] if self.fmt_args is not None else None,
            residual.data_ptr() if residual is not None else None, y.data_ptr(), int(threads or default_threads()),
            ctypes.byref(experts))
        if rc == _NOT_RESIDENT:
            return None
        if rc == -2:
            raise IndexError(f"expert ids outside the layer's {len(self.addresses)} experts")
        if rc != 0:
            raise RuntimeError(f"CPU expert kernel (rows) failed with code {rc}")
        return y, experts.value
