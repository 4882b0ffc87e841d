"""GGUF experts' ggml blocks dequantized in Triton registers, and prefill's scratch dequantizer for them.

A GGUF blob (strata.kernels.quant, kind "gguf") holds gate's rows, then up's at gate_up's middle, then down's, each
in the block type its header byte names (header bytes 0, 1, 2). The kernels read a matrix [N, K] as tiles of
[R rows, G groups, 16 values]: every block type splits into 16-value groups whose bytes are 16 consecutive bytes
of the block (K-quants' 32-value runs, Q8_0's halves, IQ4_XS's 16-byte runs), so a group is one 16-byte load a
plane (low bits, high bits) and a few integer instructions a weight. `gguf_group` gives a group's integer values
q [R, G, 16] and its affine map (scale, low) [R, G]: w = q * scale - low, with scale and low computed as
llama.cpp's `gguf` package computes them (d * sub-scale, dmin * sub-min, each one fp32 rounding), so the scratch
dequantizer (`dequantize_gguf_into`, launched without FMA contraction) writes `ExpertLayout.dequantize`'s values
bit for bit, and the pair kernels (strata.kernels.gpu.experts.gguf_pairs) sum q * x over a group before one scale.

A matrix's block type is a constexpr set (`type_mask`: one bit per ggml id, from the store's `ExpertFormat.ggml`):
one type compiles one branch; several (a file whose layers differ, as Q4_K_M's down tensors do) compile one branch
each and pick per expert by its header byte, a branch uniform across the program.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from strata.kernels.gguf_blocks import BLOCK_TYPES, BY_ID
from strata.kernels.gguf_dequant import IQ4_GRID, dequantize_blocks
from strata.kernels.quant import ExpertLayout, Section, gguf_half_bytes

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

KERNEL_TYPES = frozenset(BLOCK_TYPES)  # every block type strata keeps experts in has a branch here
DEQUANT_BLOCK = (16, 16)  # (rows, 16-value groups) a scratch-dequantizing program writes


def type_mask(names: Iterable[str]) -> int:
    """The kernels' type-set constexpr: bit ggml_id set for each block type name."""
    return sum(1 << BLOCK_TYPES[n].ggml_id for n in set(names))


def gguf_refusal(ggml: tuple[tuple[str, ...], ...]) -> str | None:
    """None where the kernels here read every block type of gate, up and down (`ExpertFormat.ggml`), else why not."""
    missing = sorted({n for types in ggml for n in types} - KERNEL_TYPES)
    return f"no GPU kernel reads GGUF {', '.join(missing)} blocks" if missing else None


def matrix_parts(layout: ExpertLayout, section: Section) -> list[tuple[int, int, int, int, int]]:
    """The tensors of a gguf blob's section (gate_up: gate, then up; down: down) as (byte offset, header byte,
    type mask, first row in the matrix, rows)."""
    fmt, i = layout.fmt, layout.intermediate
    if section == layout.down:
        return [(section.offset, 2, type_mask(fmt.ggml[2]), 0, layout.hidden)]
    half = gguf_half_bytes(section.nbytes, 2)
    return [(section.offset, 0, type_mask(fmt.ggml[0]), 0, i), (section.offset + half, 1, type_mask(fmt.ggml[1]), i, i)]


def dequantize_gguf_blobs(blobs: torch.Tensor, layout: ExpertLayout, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """blobs [P, B] uint8 of gguf `layout` -> (gate_up [P, 2I, H], down [P, H, I]) in `dtype` by torch on the blobs'
    device, as `layout.dequantize` each (bit for bit): a tensor whose format lists several types is dequantized as
    each and every blob keeps the one its header names (no host synchronisation)."""
    p, h = blobs.shape[0], layout.hidden
    out = []
    for section, k in ((layout.gate_up, h), (layout.down, layout.intermediate)):
        parts = []
        for off, at, mask, _, rows in matrix_parts(layout, section):
            w = None
            for tid in sorted(b for b in range(32) if mask >> b & 1):
                t = BY_ID[tid]
                raw = blobs[:, off : off + rows * t.row_bytes(k)].reshape(-1, t.block_bytes)
                wt = dequantize_blocks(raw, t.name).reshape(p, rows, k)
                w = wt if w is None else torch.where((blobs[:, at] == tid)[:, None, None], wt, w)
            parts.append(w)
        out.append(torch.cat(parts, dim=1).to(dtype))
    return tuple(out)


def dequantize_gguf_into(slab: torch.Tensor, layout: ExpertLayout, index: torch.Tensor, section: Section,
                         out: torch.Tensor) -> None:
    """One matrix (`section`: layout.gate_up or layout.down) of the gguf blobs in slots `index` [n] int64 of slab
    [S, slot_bytes] into out [n, N, K] (its dtype): one Triton launch a tensor (CUDA, or the interpreter)."""
    k = out.shape[2]
    rows_b, groups_b = DEQUANT_BLOCK
    for off, at, mask, first, rows in matrix_parts(layout, section):
        part = out[:, first : first + rows]
        grid = (index.numel(), triton.cdiv(rows, rows_b), triton.cdiv(k // 16, groups_b))
        # no FMA contraction: q * scale - low rounds twice, as gguf's numpy does
        _gguf_dequant_kernel[grid](slab, index, part, rows, k, slab.stride(0), off, at, part.stride(0), part.stride(1),
                                   TYPES=mask, BLOCK_R=rows_b, BLOCK_G=groups_b, num_warps=4, enable_fp_fusion=False)


if triton is not None:
    # IQ4_NL's 16 grid values as int8 bytes, four to an int32 word (little-endian)
    _IQ4_WORDS = [sum((v & 0xFF) << (8 * j) for j, v in enumerate(IQ4_GRID[w : w + 4])) for w in range(0, 16, 4)]
    _IQ4_W0, _IQ4_W1, _IQ4_W2, _IQ4_W3 = (tl.constexpr(w - (1 << 32) if w >= 1 << 31 else w) for w in _IQ4_WORDS)

    @triton.jit
    def _bytes(base, boff, at, lane, mask):
        """int32 [R, G, 16]: the bytes base[boff + at + lane], boff [R, G] each group's block, at [G] its first
        byte, lane [16] 0..15."""
        return tl.load(base + boff[:, :, None] + at[None, :, None] + lane[None, None, :], mask=mask[:, :, None],
                       other=0).to(tl.int32)

    @triton.jit
    def _field(base, boff, at, shift, lane, mask, BITS: tl.constexpr):
        """int32 [R, G, 16]: the BITS-bit fields at bit `shift` [G] of `_bytes`(base, boff, at, lane, mask)."""
        return (_bytes(base, boff, at, lane, mask) >> shift[None, :, None]) & ((1 << BITS) - 1)

    @triton.jit
    def _byte(base, boff, at, mask):
        """int32 [R, G]: the byte base[boff + at] (at [1, G] or one offset)."""
        return tl.load(base + boff + at, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _half(base, boff, at: tl.constexpr, mask):
        """fp32 [R, G]: the f16 at byte boff + at (even offsets: every block type's f16s are 2-byte aligned)."""
        hp = base.to(tl.pointer_type(tl.float16), bitcast=True)
        return tl.load(hp + (boff + at) // 2, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _int8(b):
        return (b ^ 0x80) - 0x80

    @triton.jit
    def _iq4_value(idx):
        """IQ4_NL's grid value of each 4-bit index (int32), from constant words: no table in memory."""
        word = tl.where(idx < 8, tl.where(idx < 4, _IQ4_W0, _IQ4_W1), tl.where(idx < 12, _IQ4_W2, _IQ4_W3))
        return _int8((word >> (8 * (idx & 3))) & 0xFF)

    @triton.jit
    def _scale_min_k4(base, boff, sb, mask):
        """Q4_K / Q5_K: (scale, min) int32 [R, G] of sub-blocks sb [1, G] (0..7) from the 12 bytes at 4: 6 bits each,
        sub-blocks 4-7 keeping their high 2 bits in the top bits of bytes 0-7."""
        a = _byte(base, boff, 4 + sb, mask)
        b = _byte(base, boff, 8 + sb, mask)
        c = _byte(base, boff, 4 + (sb & 3), mask)
        low = sb < 4
        sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc, mn

    @triton.jit
    def _superblocks(val_off, rows, K, g, BB: tl.constexpr):
        """Byte offsets [R, G] of the 256-value, BB-byte blocks holding groups g [G] of rows [R] (K values a row)."""
        return val_off + rows[:, None] * ((K // 256) * BB) + ((g // 16) * BB)[None, :]

    @triton.jit
    def gguf_group(base, val_off, rows, K, g, mask, T: tl.constexpr):
        """Groups g [G] (16 values each, along K) of rows [R] (int64) of a matrix [N, K] of block type T (ggml id)
        whose rows start at byte val_off of base: (q [R, G, 16] fp32, scale [R, G], low [R, G]) with
        w[r, 16 g + l] = q * scale - low. mask [R, G]: the groups to read (others read as 0)."""
        lane = tl.arange(0, 16)
        if T == 8:  # Q8_0: 34-byte blocks of 32 values: d, 32 int8
            boff = val_off + rows[:, None] * ((K // 32) * 34) + ((g // 2) * 34)[None, :]
            gi = g % 2
            q = _int8(_bytes(base, boff, 2 + 16 * gi, lane, mask))
            scale = _half(base, boff, 0, mask)
            low = tl.zeros_like(scale)
        else:  # the K-quants and IQ4_XS: 256-value superblocks of 16 groups
            gi = g % 16
            half = gi & 1  # which 16 of a 32-value run
            sb = gi >> 1  # the 32-value sub-block
            if T == 10:  # Q2_K: scales (lo: scale, hi: min), 2-bit qs, d, dmin
                boff = _superblocks(val_off, rows, K, g, 84)
                q = _field(base, boff, 16 + 32 * (gi >> 3) + 16 * half, 2 * (sb & 3), lane, mask, 2)
                sc = _byte(base, boff, gi[None, :], mask)
                scale = _half(base, boff, 80, mask) * (sc & 15).to(tl.float32)
                low = _half(base, boff, 82, mask) * (sc >> 4).to(tl.float32)
            elif T == 11:  # Q3_K: hmask, 2-bit qs, 6-bit scales, d
                boff = _superblocks(val_off, rows, K, g, 110)
                ql = _field(base, boff, 32 + 32 * (gi >> 3) + 16 * half, 2 * (sb & 3), lane, mask, 2)
                hm = _field(base, boff, 16 * half, sb, lane, mask, 1)
                q = ql - ((hm ^ 1) << 2)
                ls = (_byte(base, boff, (96 + (gi & 7))[None, :], mask) >> (4 * (gi >> 3))[None, :]) & 15
                hs = (_byte(base, boff, (104 + (gi & 3))[None, :], mask) >> (2 * (gi >> 2))[None, :]) & 3
                scale = _half(base, boff, 108, mask) * ((ls | (hs << 4)) - 32).to(tl.float32)
                low = tl.zeros_like(scale)
            elif T == 12:  # Q4_K: d, dmin, scales and mins, 4-bit qs (two sub-blocks a 32-byte run)
                boff = _superblocks(val_off, rows, K, g, 144)
                q = _field(base, boff, 16 + 32 * (gi >> 2) + 16 * half, 4 * (sb & 1), lane, mask, 4)
                sc, mn = _scale_min_k4(base, boff, sb[None, :], mask)
                scale = _half(base, boff, 0, mask) * sc.to(tl.float32)
                low = _half(base, boff, 2, mask) * mn.to(tl.float32)
            elif T == 13:  # Q5_K: as Q4_K, the fifth bits in 32 qh bytes (bit sb)
                boff = _superblocks(val_off, rows, K, g, 176)
                ql = _field(base, boff, 48 + 32 * (gi >> 2) + 16 * half, 4 * (sb & 1), lane, mask, 4)
                qh = _field(base, boff, 16 + 16 * half, sb, lane, mask, 1)
                q = ql | (qh << 4)
                sc, mn = _scale_min_k4(base, boff, sb[None, :], mask)
                scale = _half(base, boff, 0, mask) * sc.to(tl.float32)
                low = _half(base, boff, 2, mask) * mn.to(tl.float32)
            elif T == 14:  # Q6_K: 4-bit ql, 2-bit qh, int8 scales, d
                boff = _superblocks(val_off, rows, K, g, 210)
                s = sb & 3  # the 32-value run within the 128-value half gi >> 3
                ql = _field(base, boff, 64 * (gi >> 3) + 32 * (s & 1) + 16 * half, 4 * (s >> 1), lane, mask, 4)
                qh = _field(base, boff, 128 + 32 * (gi >> 3) + 16 * half, 2 * s, lane, mask, 2)
                q = (ql | (qh << 4)) - 32
                sc = _int8(_byte(base, boff, (192 + gi)[None, :], mask))
                scale = _half(base, boff, 208, mask) * sc.to(tl.float32)
                low = tl.zeros_like(scale)
            else:  # IQ4_XS: d, high scale bits (2 a sub-block), low scale bits (4), 4-bit grid indices
                boff = _superblocks(val_off, rows, K, g, 136)
                q = _iq4_value(_field(base, boff, 8 + 16 * sb, 4 * half, lane, mask, 4))
                sl = (_byte(base, boff, (4 + (sb >> 1))[None, :], mask) >> (4 * (sb & 1))[None, :]) & 15
                sh = ((_byte(base, boff, 2, mask) | (_byte(base, boff, 3, mask) << 8)) >> (2 * sb)[None, :]) & 3
                scale = _half(base, boff, 0, mask) * ((sl | (sh << 4)) - 32).to(tl.float32)
                low = tl.zeros_like(scale)
        return q.to(tl.float32), scale, low

    @triton.jit
    def _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES: tl.constexpr, T: tl.constexpr):
        """Write the groups' weights (q * scale - low, rounded once to the output's dtype) if the tensor is of type T:
        always where T is the set's only type, else where its header byte t says so."""
        if (TYPES >> T) & 1:
            if TYPES == (1 << T):
                q, scale, low = gguf_group(base, val_off, rows, K, g, mask, T)
                w = q * scale[:, :, None] - low[:, :, None]
                tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])
            else:
                if t == T:
                    q, scale, low = gguf_group(base, val_off, rows, K, g, mask, T)
                    w = q * scale[:, :, None] - low[:, :, None]
                    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])

    @triton.jit
    def _gguf_dequant_kernel(slab_ptr, index_ptr, out_ptr, N, K, stride_slot, val_off, type_at, stride_out, stride_row,
                             TYPES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        e = tl.program_id(0)
        rows = (tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)
        base = slab_ptr + tl.load(index_ptr + e) * stride_slot
        t = tl.load(base + type_at).to(tl.int32)
        mask = (rows < N)[:, None] & (g < K // 16)[None, :]
        cols = g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        ptrs = out_ptr + e.to(tl.int64) * stride_out + rows[:, None, None] * stride_row + cols
        _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES, 8)
        _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES, 10)
        _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES, 11)
        _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES, 12)
        _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES, 13)
        _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES, 14)
        _store_type(out_ptr, ptrs, base, val_off, rows, K, g, mask, t, TYPES, 23)
