"""The decode pair kernels for GGUF experts: each (token, expert) pair's SwiGLU read from its slot's blob in the
file's ggml blocks (Q8_0, Q2_K-Q6_K, IQ4_XS), dequantized in registers (strata.kernels.gpu.experts.gguf_tiles).

What `strata.kernels.gpu.experts.quant_pairs` is for FP8 and MXFP4, with the same pair lookup, `used` record, split rows
(`first_row`) and in-place reads by host address: only the weight tiles differ. A tile of a matrix [N, K] is
[R rows, G groups, 16 values]; a group's dot product with the activation is summed over its 16 integer values
first, then mapped by the group's affine dequantization: sum(w * x) = scale * sum(q * x) - low * sum(x), two
multiplies a group, not a weight. Gate, up and down each carry their own type set (constexprs: Q4_K_M's gate and
up are Q4_K and its down Q6_K or Q4_K by layer), so a store of one type per tensor compiles one branch a matrix.
Results match the bf16 kernels on `ExpertLayout.dequantize`d weights to fp32 rounding (the scale applies to a
group's sum; a dequantized weight is not rounded to bf16 first).

The SwiGLU's clamp, alpha and up offset and the gate_up bias [E, 2I] are the gate/up kernel's FORM and HAS_BIAS
constexprs (strata.kernels.gpu.experts.pair_forms). Interleaved gate/up rows are refused (`check_form`): a GGUF blob
holds gate and up as two tensors of their own block types (as a GGUF file does), so its gate rows are always its first
I.
"""

from __future__ import annotations

import torch

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
from strata.kernels.gpu import pdl
from strata.kernels.gpu.experts import pair_forms
from strata.kernels.gpu.experts.gguf_tiles import gguf_group, matrix_parts, triton
from strata.kernels.gpu.experts.pair_forms import activate, pair_rows, pair_slot
from strata.kernels.quant import ExpertLayout

if triton is not None:
    import triton.language as tl

# Launch configurations: gate/up (BLOCK_I, BLOCK_H, warps, stages), down (BLOCK_O, BLOCK_I, warps, stages); a step of
# BLOCK_H columns is BLOCK_H / 16 groups. Swept on an H100 for Q4_K_M at the bench model's shapes
# (`bench/probes/quant_pair_probe.py --sweep`): these were fastest at 1, 4 and 8 tokens. Narrow gate/up programs
# (4 rows: twice the programs of 8) beat every wider one; fewer instructions a weight did not (docs/benchmarks.md).
GGUF_PAIR_CONFIG = ((4, 512, 4, 2), (16, 256, 2, 2))
# pair_gguf_in_place's tiles: gate/up rows, columns; down rows, columns. Swept as the quantized formats' (quant_pairs):
# 4 gate/up rows a program read Q4_K_M over PCIe 1.10x (1 token) and 1.13x (8 tokens) faster than 8.
GGUF_IN_PLACE_BLOCKS = (4, 512, 16, 256)


def _matrices(layout: ExpertLayout) -> dict:
    """The kernels' per-matrix arguments: gate's and up's byte offsets and type sets, down's."""
    (gate_off, _, gate_t, _, _), (up_off, _, up_t, _, _) = matrix_parts(layout, layout.gate_up)
    ((down_off, _, down_t, _, _),) = matrix_parts(layout, layout.down)
    return {"gate_up": (gate_off, up_off, gate_t, up_t), "down": (down_off, down_t)}


def check_form(form: SwiGLUForm) -> None:
    """Refuses a form these kernels cannot compute: interleaved gate/up rows (a blob's gate and up are two tensors)."""
    if form.interleaved:
        raise ValueError("GGUF experts hold gate and up as two tensors: the GPU kernels compute no interleaved "
                         "gate/up rows (give the experts gate rows first, and the bias in that order)")


def pair_gguf(x: torch.Tensor, slab: torch.Tensor, layout: ExpertLayout, slot_of: torch.Tensor, ids: torch.Tensor,
              rows: torch.Tensor | None, k: int, y: torch.Tensor, used: torch.Tensor, config=None,
              form: SwiGLUForm = PLAIN_SWIGLU, gate_up_bias: torch.Tensor | None = None) -> None:
    """`quant_pairs.pair_quant` for gguf slots of slab [S, slot_bytes] (same arguments): pair p runs expert ids[p]
    from slot slot_of[ids[p]] (-1: skipped) on token rows[p] // k (rows None: p), its row of y [., H] fp32 written;
    `form` the SwiGLU (not interleaved: `check_form`), gate_up_bias [E, 2I] (row ids[p]) added before it.
    config: a (gate/up, down) launch configuration in place of `GGUF_PAIR_CONFIG`."""
    check_form(form)
    m = _matrices(layout)
    hidden, inter = layout.hidden, layout.intermediate
    p = ids.numel()
    x = x.contiguous()
    h = torch.empty((p, inter), dtype=torch.float32, device=x.device)  # SwiGLU(gate, up) per pair [P, I]
    (block_i, block_h, warps_gu, stages_gu), (block_o, block_k, warps_d, stages_d) = config or GGUF_PAIR_CONFIG
    has_rows = rows is not None
    rows = rows if has_rows else ids  # an unread pointer when HAS_ROWS is off
    gate_off, up_off, gate_t, up_t = m["gate_up"]
    _gguf_gate_up_kernel[(p, triton.cdiv(inter, block_i))](
        x, slab, slot_of, ids, rows, used, h, ids, hidden, inter, k, x.stride(0), slab.stride(0), gate_off, up_off,
        h.stride(0), GATE_T=gate_t, UP_T=up_t, BLOCK_I=block_i, BLOCK_H=block_h, HAS_ROWS=has_rows, ADDR=False,
        FIRST=False, num_warps=warps_gu, num_stages=stages_gu, **pair_forms.kernel_args(form, gate_up_bias),
        **pdl.launch(x))
    down_off, down_t = m["down"]
    _gguf_down_kernel[(p, triton.cdiv(hidden, block_o))](
        h, slab, used, rows, y, ids, ids, hidden, inter, h.stride(0), slab.stride(0), down_off, y.stride(0),
        DOWN_T=down_t, BLOCK_O=block_o, BLOCK_I=block_k, HAS_ROWS=has_rows, ADDR=False, FIRST=False,
        num_warps=warps_d, num_stages=stages_d, **pdl.launch(x))


_BYTES: dict[str, torch.Tensor] = {}


def pair_gguf_in_place(x: torch.Tensor, layout: ExpertLayout, addresses: torch.Tensor, y: torch.Tensor,
                       first_row: torch.Tensor | None = None, form: SwiGLUForm = PLAIN_SWIGLU,
                       gate_up_bias: torch.Tensor | None = None, expert_ids: torch.Tensor | None = None,
                       blocks: tuple[int, int, int, int] | None = None) -> None:
    """`quant_pairs.pair_quant_in_place` for gguf blobs: pairs with `addresses[p]` != 0 (the host address of the
    page-locked slot holding its expert's blob of `layout`) read their blocks in place over PCIe; first_row [P]
    int32 (or None): only the intermediate rows from first_row[p] on; `form` (not interleaved), gate_up_bias
    [E, 2I] and expert_ids [P] (its row for pair p) as there; blocks: tiles in place of `GGUF_IN_PLACE_BLOCKS`."""
    check_form(form)
    m = _matrices(layout)
    p = addresses.numel()
    hidden, inter = layout.hidden, layout.intermediate
    x = x.contiguous()
    key = str(x.device)
    if key not in _BYTES:  # a uint8 tensor for the kernels' pointer type (the slab argument is never read)
        _BYTES[key] = torch.zeros(16, dtype=torch.uint8, device=x.device)
    dummy = _BYTES[key]
    h = torch.empty((p, inter), dtype=torch.float32, device=x.device)
    used = torch.empty(p, dtype=torch.int32, device=x.device)
    block_i, block_h, block_o, block_k = blocks or GGUF_IN_PLACE_BLOCKS
    first = first_row is not None
    first_row = first_row if first else addresses  # an unread pointer when FIRST is off
    gate_off, up_off, gate_t, up_t = m["gate_up"]
    _gguf_gate_up_kernel[(p, triton.cdiv(inter, block_i))](
        x, dummy, addresses, addresses, addresses, used, h, first_row, hidden, inter, y.shape[0] // x.shape[0],
        x.stride(0), 0, gate_off, up_off, h.stride(0), GATE_T=gate_t, UP_T=up_t, BLOCK_I=block_i, BLOCK_H=block_h,
        HAS_ROWS=False, ADDR=True, FIRST=first, num_warps=4, **pair_forms.kernel_args(form, gate_up_bias, expert_ids),
        **pdl.launch(x))
    down_off, down_t = m["down"]
    _gguf_down_kernel[(p, triton.cdiv(hidden, block_o))](
        h, dummy, used, addresses, y, addresses, first_row, hidden, inter, h.stride(0), 0, down_off, y.stride(0),
        DOWN_T=down_t, BLOCK_O=block_o, BLOCK_I=block_k, HAS_ROWS=False, ADDR=True, FIRST=first, num_warps=4,
        **pdl.launch(x))


if triton is not None:

    @triton.jit
    def _activation(v_ptr, k0, KDIM, first, G: tl.constexpr):
        """The activation's columns k0 .. k0 + 16 G as [1, G, 16] fp32 (shaped as the weight tiles), zero outside
        [first, KDIM)."""
        cols = k0 + tl.arange(0, G)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        return tl.load(v_ptr + cols, mask=(cols < KDIM) & (cols >= first), other=0.0).to(tl.float32)

    @triton.jit
    def _typed_dot(base, val_off, rows, mask_r, K, g, xv, xs, T: tl.constexpr):
        """sum over the groups g [G] of W[r, c] * v[c] for rows [R] (int64) of a type-T matrix: fp32 [R]; xv: v as
        `_activation` loads it, xs [1, G] its sums a group."""
        mask = mask_r[:, None] & (g < K // 16)[None, :]
        q, scale, low = gguf_group(base, val_off, rows, K, g, mask, T)
        part = tl.sum(q * xv, axis=2)  # [R, G]
        return tl.sum(part * scale - low * xs, axis=1)

    @triton.jit
    def _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES: tl.constexpr, T: tl.constexpr):
        """acc plus the tile's dot product if the matrix is of type T: always where T is the set's only type, else
        where its header byte t says so (one branch for the whole program)."""
        if (TYPES >> T) & 1:
            if TYPES == (1 << T):
                acc += _typed_dot(base, val_off, rows, mask_r, K, g, xv, xs, T)
            else:
                if t == T:
                    acc += _typed_dot(base, val_off, rows, mask_r, K, g, xv, xs, T)
        return acc

    @triton.jit
    def _tile_dot(acc, t, base, val_off, rows, mask_r, K, g, xv, TYPES: tl.constexpr):
        """acc [R] plus sum over the groups g of W[r, c] * v[c], W the matrix of type set TYPES at val_off."""
        xs = tl.sum(xv, axis=2)  # [1, G]
        acc = _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES, 8)
        acc = _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES, 10)
        acc = _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES, 11)
        acc = _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES, 12)
        acc = _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES, 13)
        acc = _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES, 14)
        acc = _dot_if(acc, t, base, val_off, rows, mask_r, K, g, xv, xs, TYPES, 23)
        return acc

    @triton.jit
    def _gguf_gate_up_kernel(x_ptr, slab_ptr, slot_of_ptr, ids_ptr, rows_ptr, used_ptr, h_ptr, first_ptr, H, INTER, K,
                             stride_x, stride_slot, gate_off, up_off, stride_h, GATE_T: tl.constexpr,
                             UP_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ROWS: tl.constexpr,
                             ADDR: tl.constexpr, FIRST: tl.constexpr, PDL: tl.constexpr, bias_ptr=None, eid_ptr=None,
                             stride_b=None, limit=None, alpha=None, up_offset=None, FORM: tl.constexpr = 0,
                             HAS_BIAS: tl.constexpr = False):
        """`plain_pairs._gate_up_kernel` on gguf blobs: gate's rows at gate_off, up's at up_off (block types from
        GATE_T, UP_T and the blob's header). FORM may not be interleaved."""
        pdl.enter(PDL)
        p = tl.program_id(0)
        ib = tl.program_id(1)
        addr, slot, expert = pair_slot(ids_ptr, slot_of_ptr, eid_ptr, used_ptr, p, ib, ADDR, HAS_BIAS)
        first, tok = pair_rows(first_ptr, rows_ptr, p, K, FIRST, HAS_ROWS)
        if (slot >= 0) & ((ib + 1) * BLOCK_I > first):
            offs_i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
            mask_i = (offs_i < INTER) & (offs_i >= first)
            if ADDR:  # read over PCIe, in place (unified addressing maps the page-locked slot, 4 KiB aligned)
                base = tl.multiple_of(addr.to(tl.pointer_type(tl.uint8)), 4096)
            else:
                base = slab_ptr + slot * stride_slot
            t_gate = tl.load(base).to(tl.int32)  # the blob's header: gate's, up's block type ids
            t_up = tl.load(base + 1).to(tl.int32)
            rows = offs_i.to(tl.int64)
            acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                xv = _activation(x_ptr + tok * stride_x, h0, H, 0, BLOCK_H // 16)
                g = h0 // 16 + tl.arange(0, BLOCK_H // 16)
                acc_g = _tile_dot(acc_g, t_gate, base, gate_off, rows, mask_i, H, g, xv, GATE_T)
                acc_u = _tile_dot(acc_u, t_up, base, up_off, rows, mask_i, H, g, xv, UP_T)
            h = activate(acc_g, acc_u, expert, offs_i, offs_i + INTER, mask_i, bias_ptr, stride_b, limit, alpha,
                         up_offset, FORM, HAS_BIAS)  # (bias rows in gate_up's order: gate j, up I + j)
            tl.store(h_ptr + p * stride_h + offs_i, h, mask=mask_i)

    @triton.jit
    def _gguf_down_kernel(h_ptr, slab_ptr, used_ptr, rows_ptr, y_ptr, addr_ptr, first_ptr, H, INTER, stride_h,
                          stride_slot, down_off, stride_y, DOWN_T: tl.constexpr, BLOCK_O: tl.constexpr,
                          BLOCK_I: tl.constexpr, HAS_ROWS: tl.constexpr, ADDR: tl.constexpr, FIRST: tl.constexpr,
                          PDL: tl.constexpr):
        pdl.enter(PDL)
        p = tl.program_id(0)
        ob = tl.program_id(1)
        slot = tl.load(used_ptr + p).to(tl.int64)
        first, row = pair_rows(first_ptr, rows_ptr, p, 1, FIRST, HAS_ROWS)  # from `first` on: a split expert's GPU part
        if slot >= 0:
            offs_o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
            mask_o = offs_o < H
            if ADDR:
                base = tl.multiple_of(tl.load(addr_ptr + p).to(tl.pointer_type(tl.uint8)), 4096)
            else:
                base = slab_ptr + slot * stride_slot
            t_down = tl.load(base + 2).to(tl.int32)
            rows = offs_o.to(tl.int64)
            acc = tl.zeros([BLOCK_O], dtype=tl.float32)
            for i0 in range((first // BLOCK_I) * BLOCK_I, INTER, BLOCK_I):  # h below `first` was never written
                xv = _activation(h_ptr + p * stride_h, i0, INTER, first, BLOCK_I // 16)
                g = i0 // 16 + tl.arange(0, BLOCK_I // 16)
                acc = _tile_dot(acc, t_down, base, down_off, rows, mask_o, INTER, g, xv, DOWN_T)
            tl.store(y_ptr + row * stride_y + offs_o, acc, mask=mask_o)
