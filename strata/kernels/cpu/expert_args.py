"""The CPU expert kernel's arguments for experts in a quantized format (strata.kernels.quant): what
`cpu_experts_forward` and the pinned-slot callers hand the kernel besides each expert's meta row.

    fmt = format_args(ExpertFormat("fp8", block=(128, 128)))   # int64 [format code, bn, bk]
    gu, dn, gus, dns = slot_pointers(layout, base)             # an expert's blob at address `base`
    gu, dn, gus, dns = matrix_pointers(gate_up, down, hidden)  # QuantMatrix views, checked
    act = form_args(SwiGLUForm(limit=7.0, alpha=1.702, up_offset=1.0, interleaved=True))  # double [4] or None
    rows, table = bias_rows(gate_up_bias, expert_ids, inter)   # int64 [E] addresses of fp32 [2I] bias rows

The kernel reads values and scales where they lie (a store blob, a pinned slot), converting them in registers; every
expert of one call has the same format (`call_format`). GGUF experts: each matrix in its own block type, named by the
blob's header (the "scales" pointers), up's rows `up_offset` bytes into gate_up; a backend reads the types of
`GGUF_TYPES`, other types take the torch path. Any `SwiGLUForm` (strata.kernels.experts) and per-expert gate_up biases
are the kernel's own (csrc/cpu_experts_act.h); `expert_swiglu` is their reference math. Experts the kernel does not run
take `torch_expert` (the reference, fp32) or `bf16_expert` (torch's bf16 GEMMs, prompt-sized bf16 experts).
"""

from __future__ import annotations

import array
import functools
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm, expert_swiglu
from strata.kernels.gguf_blocks import BY_ID
from strata.kernels.quant import GGUF_FAST_TYPES, MX_GROUP, ExpertFormat, ExpertLayout, QuantMatrix, gguf_half_bytes

Matrix = torch.Tensor | QuantMatrix
"""An expert matrix as `cpu_experts_forward` takes it: a bf16 (or other float) tensor, or a QuantMatrix."""

FORMAT_CODES = {"plain": 0, "fp8": 1, "mxfp4": 2, "gguf": 3}
"""csrc/cpu_experts_formats.h's FMT_* (plain means bf16 to the kernel)."""

GGUF_TYPES: dict[str, frozenset[str]] = {name: GGUF_FAST_TYPES["cpu_kernel"]
                                         for name in ("avx512_bf16", "avx512_bf16_emulated")}
"""The ggml block types each backend reads (csrc/cpu_experts_gguf.h's gguf_layout_of); none for the others."""


def reads_gguf(backend: str, fmt: ExpertFormat | None) -> bool:
    """Whether `backend` reads GGUF experts of `fmt` (every type of every matrix; fmt None: some GGUF type)."""
    types = GGUF_TYPES.get(backend, frozenset())
    return bool(types) if fmt is None else all(n in types for t in fmt.ggml for n in t)


def format_args(fmt: ExpertFormat, up_offset: int = 0) -> array.array:
    """int64 [format code, bn, bk] for `strata_cpu_experts_fmt` (bn, bk: fp8's block; gguf: up's byte offset in
    gate_up, 1; else 1, 1)."""
    bn, bk = fmt.block if fmt.kind == "fp8" else (up_offset, 1) if fmt.kind == "gguf" else (1, 1)
    return array.array("q", (FORMAT_CODES[fmt.kind], bn, bk))


@functools.lru_cache(maxsize=64)
def layout_up_offset(fmt: ExpertFormat, hidden: int, inter: int) -> int:
    """Where up's rows start in the gate_up section of a GGUF blob of `fmt` for an expert of hidden x inter."""
    return gguf_half_bytes(ExpertLayout.build(fmt, hidden, inter).gate_up.nbytes, 2)


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
    """The quantized format of a `cpu_experts_forward` call's experts with tokens (None: bf16 tensors; GGUF: the
    types their headers name); ValueError for a mix of formats or a type strata does not know."""
    quant = [(gate_up, down) for (gate_up, down), idx in zip(weights, token_idx, strict=True)
             if isinstance(gate_up, QuantMatrix) and gate_up.kind != "plain" and idx.numel()]
    kinds = {(gate_up.kind, tuple(gate_up.block) if gate_up.kind == "fp8" else None) for gate_up, _ in quant}
    if kinds == {("gguf", None)}:
        types: tuple[set, set, set] = (set(), set(), set())
        for gate_up, down in quant:
            for j, type_id in enumerate(gate_up.scales.tolist() + down.scales.tolist()[:1]):
                if type_id not in BY_ID:
                    raise ValueError(f"a GGUF expert's header names ggml type id {type_id}, not one of "
                                     f"{sorted(BY_ID)}; rebuild the store from its GGUF file")
                types[j].add(BY_ID[type_id].name)
        return ExpertFormat("gguf", ggml=tuple(tuple(sorted(t)) for t in types))
    return call_format({ExpertFormat(kind, block=block) if block else ExpertFormat(kind) for kind, block in kinds})


def gguf_up_offset(weights, token_idx) -> int:
    """Where up's rows start in the gate_up sections of a call's GGUF experts (half the first one's section; each
    expert's is checked by `matrix_pointers`)."""
    for (gate_up, _), idx in zip(weights, token_idx, strict=True):
        if isinstance(gate_up, QuantMatrix) and gate_up.kind == "gguf" and idx.numel():
            return gguf_half_bytes(gate_up.values.numel(), 2)
    return 0


def kernel_format_args(fmt: ExpertFormat | None, scales: array.array | None, experts: int, up_offset: int = 0) -> tuple:
    """(format args or None, their address, scales' address) for `strata_cpu_experts_fmt` (the first must outlive
    the call); ValueError unless a quantized `fmt` comes with two scale addresses an expert (GGUF: and up's offset)."""
    if fmt is None or not fmt.quantized:
        return None, None, None
    if scales is None or len(scales) != 2 * experts:
        raise ValueError(f"{fmt.name} experts need scales: 2 addresses per expert ({2 * experts}), got "
                         f"{None if scales is None else len(scales)}")
    if fmt.kind == "gguf" and up_offset <= 0:
        raise ValueError("GGUF experts need up's offset in their gate_up sections (layout_up_offset)")
    args = format_args(fmt, up_offset)
    return args, args.buffer_info()[0], scales.buffer_info()[0]


def form_args(form: SwiGLUForm) -> array.array | None:
    """double [limit (+inf: none), alpha, up_offset, interleaved] for `strata_cpu_experts_act` (csrc/cpu_experts_act.h);
    None for the plain SwiGLU (the kernel's default). ValueError for a form no SwiGLU has (limit <= 0, a NaN)."""
    if form.plain:
        return None
    limit = float("inf") if form.limit is None else float(form.limit)
    if not limit > 0 or form.alpha != form.alpha or form.up_offset != form.up_offset:
        raise ValueError(f"not a SwiGLU form the CPU kernel computes: {form} (limit must be > 0, no NaN)")
    return array.array("d", (limit, float(form.alpha), float(form.up_offset), 1.0 if form.interleaved else 0.0))


def bias_table(gate_up_bias: torch.Tensor, inter: int | None = None) -> torch.Tensor:
    """A layer's gate_up bias table [E, 2I] as the kernel reads it: fp32, contiguous, on the CPU (a copy only where it
    is not; hand the kernel such a table, converted once, to skip that copy each call). ValueError for another shape."""
    if gate_up_bias.dim() != 2 or (inter is not None and gate_up_bias.shape[1] != 2 * inter):
        raise ValueError(f"gate_up_bias must be a [E, 2I] table{f' with 2I = {2 * inter}' if inter else ''}, got "
                         f"{tuple(gate_up_bias.shape)}")
    if gate_up_bias.dtype is torch.float32 and gate_up_bias.is_contiguous() and gate_up_bias.is_cpu:
        return gate_up_bias
    return gate_up_bias.detach().to("cpu", torch.float32).contiguous()


def bias_rows(gate_up_bias: torch.Tensor, expert_ids, inter: int) -> tuple[array.array, torch.Tensor]:
    """(int64 [len(expert_ids)] addresses of each expert's fp32 gate_up bias row [2I] in the layer's table [E, 2I],
    the table they point into: `bias_table`'s, which must outlive the kernel call) for `run_packed`'s gate_up_bias.
    IndexError for an expert id outside the table."""
    table = bias_table(gate_up_bias, inter)
    rows = array.array("q", expert_ids)
    if rows and (min(rows) < 0 or max(rows) >= table.shape[0]):
        raise IndexError(f"expert ids {min(rows)}..{max(rows)} outside the {table.shape[0]} rows of gate_up_bias")
    base, row_bytes = table.data_ptr(), 4 * table.shape[1]
    return array.array("q", (base + row_bytes * e for e in rows)), table


def act_pointers(form: SwiGLUForm, gate_up_bias: array.array | None,
                 experts: int) -> tuple[array.array | None, int | None, int | None]:
    """`strata_cpu_experts_act`'s act and bias arguments for `experts` meta rows: (act's buffer, which must outlive
    the call, its address, the bias rows' address); None for the plain form and for no bias."""
    if gate_up_bias is not None and len(gate_up_bias) != experts:
        raise ValueError(f"gate_up_bias has {len(gate_up_bias)} addresses for {experts} experts")
    act = form_args(form)
    return (act, act.buffer_info()[0] if act is not None else None,
            gate_up_bias.buffer_info()[0] if gate_up_bias is not None and len(gate_up_bias) else None)


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


def matrix_pointers(gate_up: QuantMatrix, down: QuantMatrix, hidden: int, keep: list,
                    up_offset: int = 0) -> tuple[int, int, int, int]:
    """(gate_up values, down values, gate_up scales, down scales) addresses of one expert given as QuantMatrix
    views (gate_up [2I, H], down [H, I]) of one quantized kind, after checking their shapes, dtypes and device;
    contiguous copies made here are appended to `keep` (they must outlive the call). GGUF: the scales are the
    header's type ids, up's rows `up_offset` bytes into gate_up's values. ValueError naming the problem otherwise."""
    inter = down.shape[1]
    if gate_up.kind != down.kind or (gate_up.kind == "fp8" and tuple(gate_up.block) != tuple(down.block)):
        raise ValueError(f"gate_up ({gate_up.kind}) and down ({down.kind}) of an expert must share one format")
    if tuple(gate_up.shape) != (2 * inter, hidden) or tuple(down.shape) != (hidden, inter):
        raise ValueError(f"expert matrices {tuple(gate_up.shape)} / {tuple(down.shape)} do not match H={hidden} "
                         "(want [2I, H] and [H, I])")
    if gate_up.kind == "gguf":
        return _gguf_pointers(gate_up, down, hidden, inter, up_offset)
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


def _gguf_pointers(gate_up: QuantMatrix, down: QuantMatrix, hidden: int, inter: int,
                   up_offset: int) -> tuple[int, int, int, int]:
    """`matrix_pointers` of a GGUF expert: its sections hold every row of each matrix's type, up's from up_offset."""
    ids = gate_up.scales.tolist() + down.scales.tolist()
    need = [BY_ID[t].row_bytes(k) * rows if t in BY_ID else -1
            for t, k, rows in zip(ids, (hidden, hidden, inter), (inter, inter, hidden), strict=True)]
    have = (up_offset, gate_up.values.numel() - up_offset, down.values.numel())
    for m in (gate_up, down):
        if not (m.values.dtype is torch.uint8 and m.values.is_cpu and m.values.is_contiguous() and m.scales.is_cpu):
            raise ValueError("GGUF expert sections must be contiguous uint8 CPU tensors for the CPU kernel")
    if min(need) < 0 or any(n > h for n, h in zip(need, have, strict=True)) or up_offset * 2 != gate_up.values.numel():
        raise ValueError(f"GGUF expert of types {ids} ({hidden} x {inter}) does not fit its sections of "
                         f"{gate_up.values.numel()} / {down.values.numel()} bytes with up at {up_offset}; "
                         "the experts of one call must share one layout")
    return gate_up.values.data_ptr(), down.values.data_ptr(), gate_up.scales.data_ptr(), down.scales.data_ptr()


def calibration_blob(layout: ExpertLayout, byte: int = 0x38) -> torch.Tensor:
    """A blob of one constant byte the kernel reads at full speed (0x38: finite FP8 values and scales, mid-range e8m0
    scales and f16 GGUF scales), a GGUF one's header naming each matrix's first type."""
    blob = torch.full((layout.payload_bytes,), byte, dtype=torch.uint8)
    if layout.fmt.kind == "gguf":
        from strata.kernels.gguf_blocks import BLOCK_TYPES

        blob[:3] = torch.tensor([BLOCK_TYPES[t[0]].ggml_id for t in layout.fmt.ggml], dtype=torch.uint8)
    return blob


def as_float(m: Matrix) -> torch.Tensor:
    """The matrix in fp32 (a quantized one dequantized: the kernels' oracle)."""
    return m.dequantize(torch.float32) if isinstance(m, QuantMatrix) else m.float()


def torch_expert(x32: torch.Tensor, gate_up: Matrix, down: Matrix, idx: torch.Tensor, w: torch.Tensor,
                 out: torch.Tensor, form: SwiGLUForm = PLAIN_SWIGLU, bias: torch.Tensor | None = None) -> None:
    """The reference: fp32 math on the upcast (or dequantized) weights of one expert, added into out [N, H] (`form`,
    `bias`: `expert_swiglu`'s)."""
    idx = idx.to(torch.int64)
    y = expert_swiglu(x32.index_select(0, idx), as_float(gate_up), as_float(down), form, bias) * w.float()[:, None]
    out.index_add_(0, idx, y)


def bf16_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                out: torch.Tensor, form: SwiGLUForm = PLAIN_SWIGLU, bias: torch.Tensor | None = None) -> None:
    """One expert's tokens by torch's bf16 GEMMs on the weights as stored (products summed in fp32; the
    activations and gate/up outputs in bf16, about the avx512_bf16 kernel's rounding), added into out [N, H]:
    several times the fp32 path's rate on upcast weights, where a prompt's tokens make an expert compute-bound.
    `form`, `bias` [2I]: the SwiGLU form and the expert's gate_up bias, applied in fp32 (as `expert_swiglu`)."""
    idx = idx.to(torch.int64)
    t = idx.numel()
    xs = x.new_empty(gemm_rows(t), x.shape[1], dtype=torch.bfloat16)  # [T', H]: T' >= T, rows past T zero
    xs[:t] = x.index_select(0, idx)
    xs[t:].zero_()
    gu = F.linear(xs, gate_up)  # [T', 2I]
    if form.plain and bias is None:
        gate, up = gu.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = form.apply(gu.float() if bias is None else gu.float() + bias.float()).to(torch.bfloat16)
    y = F.linear(h, down)[:t].float() * w.float()[:, None]
    out.index_add_(0, idx, y)


def gemm_rows(t: int) -> int:
    """The rows an expert's `t` tokens are computed in by `bf16_expert`: t rounded up to an eighth of its power of
    two (16 at least), so a prompt's experts take a few dozen GEMM shapes, not one per token count (oneDNN keeps a
    primitive for each bf16 shape it meets: a long prompt's token counts per expert held hundreds of MB of them),
    at most 15 or an eighth more rows (the padded rows are computed too: coarser steps give fewer shapes and
    more wasted work)."""
    step = max(16, (1 << max(0, t.bit_length() - 1)) // 8)
    return -(-t // step) * step


def mailbox_forms(layers: list[int], form: SwiGLUForm | Mapping[int, SwiGLUForm],
                  gate_up_bias: Mapping[int, torch.Tensor] | None, inter: int, experts: int
                  ) -> tuple[np.ndarray | None, np.ndarray | None, list[torch.Tensor | None]]:
    """The mailbox worker's per-layer SwiGLU forms and biases, for its `layers` in order: `form` (one for all, or
    one a layer) as float64 [layers, 4] (`form_args`; None: every one plain), each layer's gate_up bias [E, 2I] as
    an fp32 host table (`bias_table`) and their addresses int64 [layers] (None: no layer has one). The tables are
    returned too: the caller holds them while the worker reads them."""
    forms = [form.get(layer, None) if isinstance(form, Mapping) else form for layer in layers]
    missing = [layer for layer, f in zip(layers, forms, strict=True) if f is None]
    if missing:
        raise ValueError(f"no SwiGLU form for the mailbox's layers {missing}")
    acts = None
    if not all(f.plain for f in forms):
        plain = [float("inf"), 1.0, 0.0, 0.0]  # csrc/cpu_experts_act.h's plain form
        acts = np.array([list(form_args(f) or plain) for f in forms], dtype=np.float64)
    tables = [bias_table(gate_up_bias[layer], inter) if gate_up_bias and layer in gate_up_bias else None
              for layer in layers]
    for layer, t in zip(layers, tables, strict=True):
        if t is not None and t.shape[0] != experts:
            raise ValueError(f"layer {layer}'s gate_up_bias has {t.shape[0]} rows for {experts} experts")
    biases = None
    if any(t is not None for t in tables):
        biases = np.array([0 if t is None else t.data_ptr() for t in tables], dtype=np.int64)
    return acts, biases, tables
