"""The SwiGLU forms (strata.kernels.experts.SwiGLUForm) and the gate_up bias in the decode pair kernels' gate/up step.

Every gate/up kernel (plain slots: strata.kernels.gpu.experts.plain_pairs; FP8 / MXFP4: quant_pairs; GGUF: gguf_pairs)
computes, for the intermediate rows j [BLOCK_I] of its tile, the dot products of gate_up's rows `gate_row(j)` and
`up_row(j)` with the token, adds the expert's bias [E, 2I] at those rows, and applies the form's activation
(`activate`), all in fp32. A form is a constexpr bit set, `FORM` (`form_code`): 0, the plain SwiGLU, takes no
argument (`kernel_args` passes none: the form and bias parameters keep their None defaults, which Triton folds as
constexprs), so its build is the same code as a kernel without those parameters (checked on the sm_90 PTX). The other forms take the form's limit, alpha
and up_offset as fp32 arguments, so each form is one build whatever its values. The bias is a second constexpr,
`HAS_BIAS`, its pointer and row stride arguments only when on.

- CLAMP: gate = min(gate, limit), up = clamp(up, -limit, limit)
- SCALED: h = (up + up_offset) * gate * sigmoid(alpha * gate) (else silu(gate) * up)
- INTERLEAVED: intermediate row j is gate_up's rows 2j (gate) and 2j + 1 (up) (else j and I + j)

Every gate/up kernel also starts the same way: `pair_slot` (the pair's expert, slot or host address, recorded for
the down kernel) and `pair_rows` (its first intermediate row and its token's row); every down kernel with
`pair_rows` too.
"""

from __future__ import annotations

import torch

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

CLAMP, SCALED, INTERLEAVED = 1, 2, 4  # FORM's bits


def form_code(form: SwiGLUForm) -> int:
    """The kernels' FORM constexpr of `form` (0: the plain SwiGLU)."""
    return ((CLAMP if form.limit is not None else 0) | (SCALED if form.alpha != 1.0 or form.up_offset != 0.0 else 0)
            | (INTERLEAVED if form.interleaved else 0))


def check_bias(gate_up_bias: torch.Tensor | None, inter: int) -> None:
    """A gate_up bias must be [E, 2I] with contiguous rows (any float dtype)."""
    if gate_up_bias is None:
        return
    if gate_up_bias.dim() != 2 or gate_up_bias.shape[1] != 2 * inter or gate_up_bias.stride(1) != 1:
        raise ValueError(f"gate_up_bias must be [E, {2 * inter}] with contiguous rows, "
                         f"not {tuple(gate_up_bias.shape)} (strides {gate_up_bias.stride()})")
    if not gate_up_bias.is_floating_point():
        raise ValueError(f"gate_up_bias must be floating point, not {gate_up_bias.dtype}")


def kernel_args(form: SwiGLUForm = PLAIN_SWIGLU, gate_up_bias: torch.Tensor | None = None,
                expert_ids: torch.Tensor | None = None) -> dict:
    """The gate/up kernels' keyword arguments for `form` and the bias [E, 2I] (row: the pair's expert, read from
    `expert_ids` [P] where the kernel reads weights by address, else from its ids): empty for the plain form
    without bias, so the kernel's defaults (None: constexprs) give the plain build."""
    args: dict = {}
    code = form_code(form)
    if code:
        args.update(FORM=code, limit=float(form.limit if form.limit is not None else 0.0), alpha=float(form.alpha),
                    up_offset=float(form.up_offset))
    if gate_up_bias is not None:
        args.update(HAS_BIAS=True, bias_ptr=gate_up_bias, stride_b=gate_up_bias.stride(0))
        if expert_ids is not None:
            args["eid_ptr"] = expert_ids
    return args


if triton is not None:

    @triton.jit
    def pair_slot(ids_ptr, slot_of_ptr, eid_ptr, used_ptr, p, ib, ADDR: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Pair p's (address, slot, expert), as every gate/up kernel starts: with ADDR, ids[p] is the pair's
        address in pinned host memory (0: not in this pass, slot -1; else slot 0) and its expert, read only for the
        bias row, eid[p]; else the expert is ids[p] and its slot slot_of[expert] (-1: not resident). The pair's
        first row block records the slot in used[p], which the down kernel reads."""
        if ADDR:
            addr = tl.load(ids_ptr + p)
            slot = tl.where(addr != 0, 0, -1).to(tl.int64)
            expert = p  # (read only with HAS_BIAS)
            if HAS_BIAS:
                expert = tl.load(eid_ptr + p)
        else:
            expert = tl.load(ids_ptr + p)
            slot = tl.load(slot_of_ptr + expert).to(tl.int64)
            addr = slot  # (read only with ADDR)
        if ib == 0:
            tl.store(used_ptr + p, slot.to(tl.int32))
        return addr, slot, expert

    @triton.jit
    def pair_rows(first_ptr, rows_ptr, p, K, FIRST: tl.constexpr, HAS_ROWS: tl.constexpr):
        """Pair p's first intermediate row (FIRST: first[p], the rows before it another's part of a split expert;
        else 0) and its row, int64 (HAS_ROWS: rows[p] // K, else p // K): with K the experts a token, the token's
        row of x (the gate/up kernels); with K = 1, the pair's own row of the output (the down kernels)."""
        if FIRST:
            first = tl.load(first_ptr + p)
        else:
            first = p * 0
        if HAS_ROWS:
            tok = tl.load(rows_ptr + p).to(tl.int64) // K
        else:
            tok = p.to(tl.int64) // K
        return first, tok

    @triton.jit
    def gate_row(offs_i, FORM: tl.constexpr):
        """gate_up's row holding gate's intermediate row offs_i (any shape)."""
        if FORM & 4:
            return offs_i * 2
        else:
            return offs_i

    @triton.jit
    def up_row(offs_i, INTER, FORM: tl.constexpr):
        """gate_up's row holding up's intermediate row offs_i (any shape)."""
        if FORM & 4:
            return offs_i * 2 + 1
        else:
            return offs_i + INTER

    @triton.jit
    def activate(acc_g, acc_u, expert, rows_g, rows_u, mask, bias_ptr, stride_b, limit, alpha, up_offset,
                 FORM: tl.constexpr, HAS_BIAS: tl.constexpr):
        """h [R] fp32 of the gate and up dot products acc_g, acc_u [R] (rows rows_g, rows_u of gate_up): the
        expert's bias at those rows (bias_ptr [E, 2I], row stride stride_b) added, then the form's SwiGLU."""
        if HAS_BIAS:
            b = bias_ptr + expert.to(tl.int64) * stride_b
            acc_g += tl.load(b + rows_g, mask=mask, other=0.0).to(tl.float32)
            acc_u += tl.load(b + rows_u, mask=mask, other=0.0).to(tl.float32)
        if FORM & 1:
            acc_g = tl.minimum(acc_g, limit)
            acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        if FORM & 2:
            h = acc_g / (1.0 + tl.exp(-alpha * acc_g)) * (acc_u + up_offset)
        else:
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        return h
