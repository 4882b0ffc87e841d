"""The decode pair kernels for plain (bf16 / fp16 / fp32) experts, launched by strata.kernels.gpu.experts.grouped.

Pair p's gate/up kernel finds its expert's slot (`slot_of[ids[p]]`, or a host address with ADDR), records it in
`used[p]` and writes h[p, j] = SwiGLU(gate_j . x, up_j . x) for its block of intermediate rows j (from `first[p]` on
with FIRST), fp32; the down kernel reads that record and writes y[row] = down . h[p]. The SwiGLU's form and the gate_up
bias are the gate/up kernel's FORM and HAS_BIAS constexprs (strata.kernels.gpu.experts.pair_forms); their default is the
plain SwiGLU without bias, so callers that pass neither get the plain build.
"""

from __future__ import annotations

from strata.kernels.gpu import pdl
from strata.kernels.gpu.experts.pair_forms import activate, gate_row, pair_rows, pair_slot, triton, up_row

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gate_up_kernel(x_ptr, gu_ptr, slot_of_ptr, ids_ptr, rows_ptr, used_ptr, h_ptr, first_ptr, H, INTER, K,
                        stride_x, stride_gs, stride_gr, stride_h, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                        HAS_ROWS: tl.constexpr, ADDR: tl.constexpr, FIRST: tl.constexpr, PDL: tl.constexpr,
                        bias_ptr=None, eid_ptr=None, stride_b=None, limit=None, alpha=None, up_offset=None,
                        FORM: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False):
        """x [N, H]; slot_of [E] int32; ids [P] (expert ids, or with ADDR each pair's host address, 0: skip); rows
        [P] (HAS_ROWS; else p) its output row, token row // K; used [P] int32 out; h [P, I] fp32 out; first [P]
        int32 (FIRST); gate_up slots [S, 2I, H] (row stride stride_gr); bias [E, 2I] (HAS_BIAS: row expert, with
        ADDR read from eid [P]); limit, alpha, up_offset: fp32 (FORM != 0)."""
        pdl.enter(PDL)
        p = tl.program_id(0)
        ib = tl.program_id(1)
        addr, slot, expert = pair_slot(ids_ptr, slot_of_ptr, eid_ptr, used_ptr, p, ib, ADDR, HAS_BIAS)
        first, tok = pair_rows(first_ptr, rows_ptr, p, K, FIRST, HAS_ROWS)
        if (slot >= 0) & ((ib + 1) * BLOCK_I > first):
            offs_i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
            mask_i = (offs_i < INTER) & (offs_i >= first)
            acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
            if ADDR:  # read over PCIe, in place (unified addressing maps the page-locked slot)
                w = addr.to(tl.pointer_type(gu_ptr.dtype.element_ty))
            else:
                w = gu_ptr + slot * stride_gs
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                mask_h = offs_h < H
                xv = tl.load(x_ptr + tok * stride_x + offs_h, mask=mask_h, other=0.0).to(tl.float32)
                m = mask_i[:, None] & mask_h[None, :]
                g = tl.load(w + gate_row(offs_i[:, None], FORM) * stride_gr + offs_h[None, :], mask=m,
                            other=0.0).to(tl.float32)
                u = tl.load(w + up_row(offs_i[:, None], INTER, FORM) * stride_gr + offs_h[None, :], mask=m,
                            other=0.0).to(tl.float32)
                acc_g += tl.sum(g * xv[None, :], axis=1)
                acc_u += tl.sum(u * xv[None, :], axis=1)
            h = activate(acc_g, acc_u, expert, gate_row(offs_i, FORM), up_row(offs_i, INTER, FORM), mask_i, bias_ptr,
                         stride_b, limit, alpha, up_offset, FORM, HAS_BIAS)  # [BLOCK_I]
            tl.store(h_ptr + p * stride_h + offs_i, h, mask=mask_i)

    @triton.jit
    def _down_kernel(h_ptr, d_ptr, used_ptr, rows_ptr, y_ptr, addr_ptr, first_ptr, down_off, H, INTER, stride_h,
                     stride_ds, stride_dr, stride_y, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
                     HAS_ROWS: tl.constexpr, ADDR: tl.constexpr, FIRST: tl.constexpr, PDL: tl.constexpr):
        """h [P, I] fp32 (the gate/up kernel's); down slots [S, H, I] (or with ADDR at the pair's address +
        down_off bytes); y [., H] fp32: row rows[p] (HAS_ROWS; else p) = down . h[p] over the rows from first[p]."""
        pdl.enter(PDL)
        p = tl.program_id(0)
        ob = tl.program_id(1)
        slot = tl.load(used_ptr + p).to(tl.int64)
        first, row = pair_rows(first_ptr, rows_ptr, p, 1, FIRST, HAS_ROWS)  # from `first` on: a split expert's GPU part
        if slot >= 0:
            offs_o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
            mask_o = offs_o < H
            acc = tl.zeros([BLOCK_O], dtype=tl.float32)
            if ADDR:  # the slot holds gate_up, then down at `down_off` bytes
                w = (tl.load(addr_ptr + p) + down_off).to(tl.pointer_type(d_ptr.dtype.element_ty))
            else:
                w = d_ptr + slot * stride_ds
            for i0 in range((first // BLOCK_I) * BLOCK_I, INTER, BLOCK_I):
                offs_i = i0 + tl.arange(0, BLOCK_I)
                mask_i = (offs_i < INTER) & (offs_i >= first)  # h below `first` was never written
                hv = tl.load(h_ptr + p * stride_h + offs_i, mask=mask_i, other=0.0)
                wv = tl.load(w + offs_o[:, None] * stride_dr + offs_i[None, :],
                             mask=mask_o[:, None] & mask_i[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(wv * hv[None, :], axis=1)
            tl.store(y_ptr + row * stride_y + offs_o, acc, mask=mask_o)
