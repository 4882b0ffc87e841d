"""The decode pair kernels for quantized experts: each (token, expert) pair's SwiGLU read from its slot's blob in the
blob's format (block-scaled FP8 or MXFP4), dequantized in registers: no bf16 copy of the expert anywhere.

Decode is bound by the bytes it reads, so the point is to read 1 byte (FP8) or ~0.53 bytes (MXFP4: half a byte and one
scale per 32) a weight instead of 2. The pair lookup, the `used` record, the split rows (`first_row`) and the in-place
reads by host address are the bf16 kernels' (`strata.kernels.gpu.experts.grouped`): only the weight tiles differ.

A tile of a matrix [N, K] (gate_up [2I, H], down [H, I]) is loaded as [rows, NG, G]: NG groups of G columns that
share one scale (FP8: G = the block's columns; MXFP4: G = 32, G/2 packed bytes). Each group's dot product with the
activation is summed first, then multiplied by its scale: one multiply a group, not a weight.
- FP8: the byte is bitcast to float8e4nv and converted (one instruction on sm89+).
- MXFP4: a group's 16 bytes are loaded as 4 words of 8 codes; codes j and j + 4 of a word become one f16x2 bit
  pattern in a few integer instructions (value / 2**14, `_e2m1_pair`; the activation carries the 2**14), and the
  values are put back in column order in registers (join / permute / reshape: no data movement).
The activation tile is loaded once per step, contiguous, and shared by the gate and up tiles. The SwiGLU's form
(clamp, alpha, up offset, interleaved gate/up rows) and the gate_up bias are the gate/up kernel's FORM and HAS_BIAS
constexprs (strata.kernels.gpu.experts.pair_forms), the plain SwiGLU without bias by default.
Results match the bf16 kernels on `ExpertLayout.dequantize`d weights to rounding: the scale is applied to a group's
sum instead of to each weight (in fp32), and a dequantized weight is not rounded to bf16 first.
GGUF blobs (the file's ggml blocks) take the same entry points and run their own kernels
(strata.kernels.gpu.experts.gguf_pairs).
"""

from __future__ import annotations

import torch

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
from strata.kernels.gpu import pdl
from strata.kernels.gpu.experts import gguf_pairs, pair_forms
from strata.kernels.gpu.experts.gguf_tiles import gguf_refusal
from strata.kernels.gpu.experts.pair_forms import activate, gate_row, pair_rows, pair_slot, up_row
from strata.kernels.gpu.experts.quant_slots import FP8, MXFP4, QuantSlotWeights, e8m0_scale, triton
from strata.kernels.quant import MX_GROUP, ExpertFormat, ExpertLayout

if triton is not None:
    import triton.language as tl

# Launch configurations, as grouped.PAIR_CONFIGS: gate/up (BLOCK_I, BLOCK_H, warps, stages), down (BLOCK_O, BLOCK_I,
# warps, stages). A tile holds fewer bytes than the bf16 kernels' at the same shape, so more rows a program keep as
# many reads in flight and reuse each activation load more. Not yet swept on the H200
# (bench/probes/pair_kernel_probe.py).
QUANT_PAIR_CONFIGS = {"small": ((8, 1024, 4, 3), (16, 256, 4, 3)), "large": ((8, 1024, 4, 3), (16, 256, 4, 3))}
QUANT_SMALL_PAIRS = 16
# pair_quant_in_place's tiles: gate/up rows, columns; down rows, columns. Swept on an H100 at the bench model's shapes
# (`bench/probes/quant_pair_probe.py --in-place --sweep`): 8 down rows a program read MXFP4 over PCIe 1.11-1.13x
# faster than 16 at 1 and 8 tokens; FP8, bound by the link, ran within 1% at every tile timed.
QUANT_IN_PLACE_BLOCKS = (8, 512, 8, 256)


def kernel_refusal(fmt: ExpertFormat) -> str | None:
    """None where these kernels compute `fmt` (fp8 with a power-of-two block width, mxfp4, or gguf blocks of the
    types strata.kernels.gpu.experts.gguf_pairs reads), else why not."""
    if triton is None:
        return "Triton is not installed"
    if fmt.kind == "gguf":
        return gguf_refusal(fmt.ggml)
    if fmt.kind == "fp8" and fmt.block[1] & (fmt.block[1] - 1):
        return f"the fp8 block's columns ({fmt.block[1]}) are not a power of two"
    if fmt.kind not in ("fp8", "mxfp4"):
        return f"{fmt.name} is not a quantized format"
    return None


def _format_args(fmt: ExpertFormat) -> dict:
    """The kernels' format constexprs: FMT, BN (fp8 rows per scale), G (columns per scale)."""
    if fmt.kind == "fp8":
        return {"FMT": FP8, "BN": fmt.block[0], "G": fmt.block[1]}
    return {"FMT": MXFP4, "BN": 1, "G": MX_GROUP}


def _config(num_pairs: int, group: int, config=None):
    shipped = QUANT_PAIR_CONFIGS["small" if num_pairs <= QUANT_SMALL_PAIRS else "large"]
    (bi, bh, wg, sg), (bo, bk, wd, sd) = config or shipped
    return (bi, max(bh, group), wg, sg), (bo, max(bk, group), wd, sd)  # a tile holds whole scale groups


def pair_quant(x: torch.Tensor, weights: QuantSlotWeights, slot_of: torch.Tensor, ids: torch.Tensor,
               rows: torch.Tensor | None, k: int, y: torch.Tensor, used: torch.Tensor, config=None,
               form: SwiGLUForm = PLAIN_SWIGLU, gate_up_bias: torch.Tensor | None = None) -> None:
    """`grouped.pair_experts`' Triton path for quantized slots (same arguments): pair p runs expert ids[p] from slot
    slot_of[ids[p]] (-1: skipped) on token rows[p] // k (rows None: p), its row of y [., H] fp32 written; `form` the
    SwiGLU, gate_up_bias [E, 2I] (row ids[p]) added before it.
    config: a (gate/up, down) launch configuration in place of `QUANT_PAIR_CONFIGS`'
    (bench/probes/quant_pair_probe.py)."""
    lay = weights.layout
    pair_forms.check_bias(gate_up_bias, lay.intermediate)
    if lay.fmt.kind == "gguf":  # the file's ggml blocks: their own kernels
        gguf_pairs.pair_gguf(x, weights.slab, lay, slot_of, ids, rows, k, y, used, config, form, gate_up_bias)
        return
    fa = _format_args(lay.fmt)
    hidden, inter = lay.hidden, lay.intermediate
    p = ids.numel()
    x = x.contiguous()
    h = torch.empty((p, inter), dtype=torch.float32, device=x.device)  # SwiGLU(gate, up) per pair [P, I]
    (block_i, block_h, warps_gu, stages_gu), (block_o, block_k, warps_d, stages_d) = _config(p, fa["G"], config)
    has_rows = rows is not None
    rows = rows if has_rows else ids  # an unread pointer when HAS_ROWS is off
    slab, stride = weights.slab, weights.slab.stride(0)
    _quant_gate_up_kernel[(p, triton.cdiv(inter, block_i))](
        x, slab, slot_of, ids, rows, used, h, ids, hidden, inter, k, x.stride(0), stride, lay.gate_up.offset,
        lay.gate_up_scales.offset, lay.gate_up.shape[1], h.stride(0), **fa, BLOCK_I=block_i, BLOCK_H=block_h, HAS_ROWS=has_rows, ADDR=False,
        FIRST=False, num_warps=warps_gu, num_stages=stages_gu, **pair_forms.kernel_args(form, gate_up_bias),
        **pdl.launch(x))
    _quant_down_kernel[(p, triton.cdiv(hidden, block_o))](
        h, slab, used, rows, y, ids, ids, hidden, inter, h.stride(0), stride, lay.down.offset, lay.down_scales.offset,
        lay.down.shape[1], y.stride(0), **fa, BLOCK_O=block_o, BLOCK_I=block_k, HAS_ROWS=has_rows, ADDR=False, FIRST=False,
        num_warps=warps_d, num_stages=stages_d, **pdl.launch(x))


_BYTES: dict[str, torch.Tensor] = {}


def pair_quant_in_place(x: torch.Tensor, layout: ExpertLayout, addresses: torch.Tensor, y: torch.Tensor,
                        first_row: torch.Tensor | None = None, form: SwiGLUForm = PLAIN_SWIGLU,
                        gate_up_bias: torch.Tensor | None = None, expert_ids: torch.Tensor | None = None,
                        blocks: tuple[int, int, int, int] | None = None) -> None:
    """`grouped.pair_experts_in_place` for quantized blobs: pairs with `addresses[p]` != 0 (the host address of the
    page-locked slot holding its expert's blob of `layout`) read their weights in place over PCIe in the blob's
    format; first_row [P] int32 (or None), `form`, gate_up_bias [E, 2I] and expert_ids [P] (its row for pair p,
    required with a bias) as there; blocks: (gate/up rows, columns, down rows, columns) in place of the shipped tiles
    (bench/probes/quant_pair_probe.py --in-place sweeps them)."""
    if gate_up_bias is not None and expert_ids is None:
        raise ValueError("a gate_up bias read in place needs expert_ids (each pair's expert)")
    pair_forms.check_bias(gate_up_bias, layout.intermediate)
    if layout.fmt.kind == "gguf":
        gguf_pairs.pair_gguf_in_place(x, layout, addresses, y, first_row, form, gate_up_bias, expert_ids, blocks)
        return
    p = addresses.numel()
    fa = _format_args(layout.fmt)
    hidden, inter = layout.hidden, layout.intermediate
    x = x.contiguous()
    key = str(x.device)
    if key not in _BYTES:  # a uint8 tensor for the kernels' pointer type (the slab argument is never read)
        _BYTES[key] = torch.zeros(16, dtype=torch.uint8, device=x.device)
    dummy = _BYTES[key]
    h = torch.empty((p, inter), dtype=torch.float32, device=x.device)
    used = torch.empty(p, dtype=torch.int32, device=x.device)
    block_i, block_h, block_o, block_k = blocks or QUANT_IN_PLACE_BLOCKS
    block_h, block_k = max(block_h, fa["G"]), max(block_k, fa["G"])
    first = first_row is not None
    first_row = first_row if first else addresses  # an unread pointer when FIRST is off
    _quant_gate_up_kernel[(p, triton.cdiv(inter, block_i))](
        x, dummy, addresses, addresses, addresses, used, h, first_row, hidden, inter, y.shape[0] // x.shape[0],
        x.stride(0), 0, layout.gate_up.offset, layout.gate_up_scales.offset, layout.gate_up.shape[1], h.stride(0), **fa, BLOCK_I=block_i,
        BLOCK_H=block_h, HAS_ROWS=False, ADDR=True, FIRST=first, num_warps=4,
        **pair_forms.kernel_args(form, gate_up_bias, expert_ids), **pdl.launch(x))
    _quant_down_kernel[(p, triton.cdiv(hidden, block_o))](
        h, dummy, used, addresses, y, addresses, first_row, hidden, inter, h.stride(0), 0, layout.down.offset,
        layout.down_scales.offset, layout.down.shape[1], y.stride(0), **fa, BLOCK_O=block_o, BLOCK_I=block_k, HAS_ROWS=False, ADDR=True,
        FIRST=first, num_warps=4, **pdl.launch(x))


if triton is not None:

    @triton.jit
    def _activation(v_ptr, k0, KDIM, first, FMT: tl.constexpr, G: tl.constexpr, NG: tl.constexpr):
        """The activation's columns k0 .. k0 + NG*G as [1, NG, G] fp32 (shaped as the weight tiles [R, NG, G]), zero
        outside [first, KDIM); for MXFP4 times 2**14 (`_e2m1_pair`'s values are / 2**14)."""
        cols = k0 + tl.arange(0, NG)[None, :, None] * G + tl.arange(0, G)[None, None, :]
        v = tl.load(v_ptr + cols, mask=(cols < KDIM) & (cols >= first), other=0.0).to(tl.float32)
        if FMT == 1:
            v = v * 16384.0
        return v

    @triton.jit
    def _e2m1_pair(t):
        """uint32 words whose bits 0-3 and 16-19 hold e2m1 codes -> (values of the low, of the high) fp32, / 2**14.
        Both become fp16 bit patterns in one pass (magnitude to bits 9-11 and 25-27, sign to 15 and 31: e2m1's
        subnormal 0.5 lands on fp16's), then each half is converted: ~3 integer instructions a weight."""
        p = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
        lo = p.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _tile_dot(base, val_off, scale_off, row_bytes, rows, mask_r, xv, k0, KDIM, FMT: tl.constexpr,
                  BN: tl.constexpr, G: tl.constexpr, NG: tl.constexpr):
        """sum over columns k0 .. k0 + NG*G of W[r, c] * v[c] for each row r of `rows` [R] (fp32 [R]; xv: v as
        `_activation` loads it), W [N, KDIM]
        the matrix whose values start at base + val_off (`row_bytes` a row: an argument, so Triton knows its
        divisibility and loads 16 bytes at once) and scales at base + scale_off."""
        g = tl.arange(0, NG)
        g0 = k0 + g * G  # [NG] each group's first column
        groups = (KDIM + G - 1) // G  # scale columns a row
        if FMT == 0:
            cols = g0[:, None] + tl.arange(0, G)[None, :]  # [NG, G]
            m = mask_r[:, None, None] & (cols < KDIM)[None, :, :]
            q = tl.load(base + val_off + rows[:, None, None].to(tl.int64) * row_bytes + cols[None, :, :], mask=m, other=0)
            part = tl.sum(q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * xv, axis=2)  # [R, NG]
            sp = (base + scale_off).to(tl.pointer_type(tl.float32), bitcast=True)
            s = tl.load(sp + (rows // BN)[:, None] * groups + (k0 // G + g)[None, :],
                        mask=mask_r[:, None] & (g0 < KDIM)[None, :], other=0.0)
        else:  # a group's 16 bytes as 4 words of 8 codes each (code j of a word: bits 4j .. 4j + 3)
            word = (g0 // 8)[:, None] + tl.arange(0, 4)[None, :]  # [NG, 4]
            # KDIM is a multiple of G: whole groups are in or out (a mask constant along a group's words keeps
            # its loads 16 bytes wide)
            m = mask_r[:, None, None] & (g0 < KDIM)[None, :, None]
            wp = (base + val_off).to(tl.pointer_type(tl.uint32), bitcast=True)
            w = tl.load(wp + rows[:, None, None].to(tl.int64) * (row_bytes // 4) + word[None, :, :], mask=m, other=0)
            lo0, hi0 = _e2m1_pair(w)  # columns j and j + 4 of every word: one f16x2 pattern
            lo1, hi1 = _e2m1_pair(w >> 4)
            lo2, hi2 = _e2m1_pair(w >> 8)
            lo3, hi3 = _e2m1_pair(w >> 12)
            # back in column order, in registers: [.., j0, j1] -> [.., j1, j0], then [.., j1, j0, h] -> [.., h, j1, j0]
            lo = tl.permute(tl.join(tl.join(lo0, lo1), tl.join(lo2, lo3)), [0, 1, 2, 4, 3])
            hi = tl.permute(tl.join(tl.join(hi0, hi1), tl.join(hi2, hi3)), [0, 1, 2, 4, 3])
            vals = tl.reshape(tl.permute(tl.join(lo, hi), [0, 1, 2, 5, 3, 4]), [lo0.shape[0], NG, G])
            part = tl.sum(vals * xv, axis=2)  # [R, NG]
            s = e8m0_scale(tl.load(base + scale_off + rows[:, None].to(tl.int64) * groups + (k0 // G + g)[None, :],
                                   mask=mask_r[:, None] & (g0 < KDIM)[None, :], other=0))
        return tl.sum(part * s, axis=1)

    @triton.jit
    def _quant_gate_up_kernel(x_ptr, slab_ptr, slot_of_ptr, ids_ptr, rows_ptr, used_ptr, h_ptr, first_ptr, H, INTER,
                              K, stride_x, stride_slot, val_off, scale_off, row_bytes, stride_h, FMT: tl.constexpr,
                              BN: tl.constexpr, G: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                              HAS_ROWS: tl.constexpr, ADDR: tl.constexpr, FIRST: tl.constexpr, PDL: tl.constexpr,
                              bias_ptr=None, eid_ptr=None, stride_b=None, limit=None, alpha=None, up_offset=None,
                              FORM: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False):
        """`plain_pairs._gate_up_kernel` on blobs of format FMT: each slot (slab + slot * stride_slot, or with ADDR
        the pair's address) holds gate_up's values at val_off, its scales at scale_off, `row_bytes` bytes a row."""
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
            acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                xv = _activation(x_ptr + tok * stride_x, h0, H, 0, FMT, G, BLOCK_H // G)
                acc_g += _tile_dot(base, val_off, scale_off, row_bytes, gate_row(offs_i, FORM), mask_i, xv, h0, H, FMT,
                                   BN, G, BLOCK_H // G)
                acc_u += _tile_dot(base, val_off, scale_off, row_bytes, up_row(offs_i, INTER, FORM), mask_i, xv, h0, H,
                                   FMT, BN, G, BLOCK_H // G)
            h = activate(acc_g, acc_u, expert, gate_row(offs_i, FORM), up_row(offs_i, INTER, FORM), mask_i, bias_ptr,
                         stride_b, limit, alpha, up_offset, FORM, HAS_BIAS)  # [BLOCK_I]
            tl.store(h_ptr + p * stride_h + offs_i, h, mask=mask_i)

    @triton.jit
    def _quant_down_kernel(h_ptr, slab_ptr, used_ptr, rows_ptr, y_ptr, addr_ptr, first_ptr, H, INTER, stride_h,
                           stride_slot, val_off, scale_off, row_bytes, stride_y, FMT: tl.constexpr, BN: tl.constexpr,
                           G: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, HAS_ROWS: tl.constexpr,
                           ADDR: tl.constexpr, FIRST: tl.constexpr, PDL: tl.constexpr):
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
            acc = tl.zeros([BLOCK_O], dtype=tl.float32)
            for i0 in range((first // BLOCK_I) * BLOCK_I, INTER, BLOCK_I):  # h below `first` was never written
                xv = _activation(h_ptr + p * stride_h, i0, INTER, first, FMT, G, BLOCK_I // G)
                acc += _tile_dot(base, val_off, scale_off, row_bytes, offs_o, mask_o, xv, i0, INTER, FMT, BN, G,
                                 BLOCK_I // G)
            tl.store(y_ptr + row * stride_y + offs_o, acc, mask=mask_o)
