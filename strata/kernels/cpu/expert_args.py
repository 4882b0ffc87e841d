"""The CPU expert kernel's arguments for experts in a quantized format (strata.kernels.quant): what
`cpu_experts_forward` and the pinned-slot callers hand the kernel besides each expert's meta row.

    fmt = format_args(ExpertFormat("fp8", block=(128, 128)))   # int64 [format code, bn, bk]
    gu, dn, gus, dns = slot_pointers(layout, base)             # an expert's blob at address `base`
    gu, dn, gus, dns = matrix_pointers(gate_up, down, hidden)  # QuantMatrix views, checked

The kernel reads values and scales where they lie (a store blob, a pinned slot), converting them in registers; every
expert of one call has the same format (`call_format`).
"""

from __future__ import annotations

import array

import torch

from strata.kernels.experts import expert_swiglu
from strata.kernels.quant import MX_GROUP, ExpertFormat, ExpertLayout, QuantMatrix

Matrix = torch.Tensor | QuantMatrix
"""An expert matrix as `cpu_experts_forward` takes it: a bf16 (or other float) tensor, or a QuantMatrix."""

FORMAT_CODES = {"plain": 0, "fp8": 1, "mxfp4": 2}
"""csrc/cpu_experts_formats.h's FMT_* (plain means bf16 to the kernel)."""


def format_args(fmt: ExpertFormat) -> array.array:
    """int64 [format code, bn, bk] for `strata_cpu_experts_fmt` (bn, bk: fp8's block, else 1)."""
    bn, bk = fmt.block if fmt.kind == "fp8" else (1, 1)
    return array.array("q", (FORMAT_CODES[fmt.kind], bn, bk))


def matrix_format(m: QuantMatrix) -> ExpertFormat:
    """The format of a quantized matrix (its kind and, for fp8, its block)."""
    return ExpertFormat(m.kind, block=tuple(m.block)) if m.kind == "fp8" else ExpertFormat(m.kind)


def call_format(formats: set[ExpertFormat]) -> ExpertFormat | None:
    """The one quantized format of a call's experts (None: bf16 tensors); ValueError naming the fix for a mix."""
    if len(formats) > 1:
        names = ", ".join(sorted(f.name for f in formats))
        raise ValueError(f"experts of one CPU kernel call come in one format, got {names}; call the kernel once "
                         "per format")
    return next(iter(formats), None)


def weights_format(weights, token_idx) -> ExpertFormat | None:
    """The quantized format of a `cpu_experts_forward` call's experts with tokens (None: bf16 tensors); ValueError
    for a mix of formats."""
    kinds = {(gate_up.kind, tuple(gate_up.block) if gate_up.kind == "fp8" else None)
             for (gate_up, _), idx in zip(weights, token_idx, strict=True)
             if isinstance(gate_up, QuantMatrix) and gate_up.kind != "plain" and idx.numel()}
    return call_format({ExpertFormat(kind, block=block) if block else ExpertFormat(kind) for kind, block in kinds})


def kernel_format_args(fmt: ExpertFormat | None, scales: array.array | None, experts: int) -> tuple:
    """(format args or None, their address, scales' address) for `strata_cpu_experts_fmt` (the first must outlive
    the call); ValueError unless a quantized `fmt` comes with two scale addresses an expert."""
    if fmt is None or not fmt.quantized:
        return None, None, None
    if scales is None or len(scales) != 2 * experts:
        raise ValueError(f"{fmt.name} experts need scales: 2 addresses per expert ({2 * experts}), got "
                         f"{None if scales is None else len(scales)}")
    args = format_args(fmt)
    return args, args.buffer_info()[0], scales.buffer_info()[0]


def slot_pointers(layout: ExpertLayout, base: int) -> tuple[int, int, int, int]:
    """(gate_up values, down values, gate_up scales, down scales) addresses of an expert blob at `base` (the
    scales' 0 for a plain layout)."""
    gus = base + layout.gate_up_scales.offset if layout.gate_up_scales else 0
    dns = base + layout.down_scales.offset if layout.down_scales else 0
    return base + layout.gate_up.offset, base + layout.down.offset, gus, dns


def _contiguous(t: torch.Tensor, keep: list) -> torch.Tensor:
    if not t.is_contiguous():
        t = t.contiguous()
        keep.append(t)
    return t


def matrix_pointers(gate_up: QuantMatrix, down: QuantMatrix, hidden: int, keep: list) -> tuple[int, int, int, int]:
    """(gate_up values, down values, gate_up scales, down scales) addresses of one expert given as QuantMatrix
    views (gate_up [2I, H], down [H, I]) of one quantized kind, after checking their shapes, dtypes and device;
    contiguous copies made here are appended to `keep` (they must outlive the call). ValueError naming the
    problem otherwise."""
    inter = down.shape[1]
    if gate_up.kind != down.kind or (gate_up.kind == "fp8" and tuple(gate_up.block) != tuple(down.block)):
        raise ValueError(f"gate_up ({gate_up.kind}) and down ({down.kind}) of an expert must share one format")
    if tuple(gate_up.shape) != (2 * inter, hidden) or tuple(down.shape) != (hidden, inter):
        raise ValueError(f"expert matrices {tuple(gate_up.shape)} / {tuple(down.shape)} do not match H={hidden} "
                         "(want [2I, H] and [H, I])")
    if gate_up.kind == "mxfp4" and (hidden % MX_GROUP or inter % MX_GROUP):
        raise ValueError(f"mxfp4 experts need H ({hidden}) and I ({inter}) that are multiples of {MX_GROUP}")
    out = []
    for m in (gate_up, down):  # a few us an expert: this is part of a layer's Python overhead
        n, k = m.shape
        values, scales = m.values, m.scales
        if values.dtype is torch.float8_e4m3fn:
            values = values.view(torch.uint8)
        if m.kind == "fp8":
            bn, bk = m.block
            want_values, want_scales, scale_dtype = n * k, -(-n // bn) * -(-k // bk), torch.float32
        else:
            want_values, want_scales, scale_dtype = n * k // 2, n * k // MX_GROUP, torch.uint8
        if (values.dtype is not torch.uint8 or scales is None or scales.dtype is not scale_dtype
                or values.numel() != want_values or scales.numel() != want_scales):
            raise ValueError(f"{m.kind} matrix {tuple(m.shape)}: want {want_values} uint8 values and {want_scales} "
                             f"{scale_dtype} scales, got {values.numel()} {values.dtype} and "
                             f"{None if scales is None else (scales.numel(), scales.dtype)}")
        if not (values.is_cpu and scales.is_cpu):
            raise ValueError(f"{m.kind} expert matrices must be CPU tensors for the CPU kernel")
        if not values.is_contiguous():
            values = _contiguous(values, keep)
        if not scales.is_contiguous():
            scales = _contiguous(scales, keep)
        out.append(values.data_ptr())
        out.append(scales.data_ptr())
    gu, gus, dn, dns = out
    return gu, dn, gus, dns


def as_float(m: Matrix) -> torch.Tensor:
    """The matrix in fp32 (a quantized one dequantized: the kernels' oracle)."""
    return m.dequantize(torch.float32) if isinstance(m, QuantMatrix) else m.float()


def torch_expert(x32: torch.Tensor, gate_up: Matrix, down: Matrix, idx: torch.Tensor, w: torch.Tensor,
                 out: torch.Tensor) -> None:
    """The reference: fp32 math on the upcast (or dequantized) weights of one expert, added into out [N, H]."""
    idx = idx.to(torch.int64)
    y = expert_swiglu(x32.index_select(0, idx), as_float(gate_up), as_float(down)) * w.float()[:, None]
    out.index_add_(0, idx, y)
