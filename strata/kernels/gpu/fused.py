"""Fused GPU kernels for a decode step's small ops: one launch where torch needs four to ten.

A decode step of the bench model (Qwen3-30B-A3B's shape) is made of tiny ops: one token's RMSNorm is
four kernels in torch (`float`, `rms_norm`, `to`, `mul`), q/k norm plus rotary embedding about twenty,
the router's softmax and top-k six, the weighted sum of the experts' outputs three. Each costs 2-5 us on
an H200 even inside a CUDA graph, so a layer spent ~220 us where its weights take ~30 us to read. Each
function here does one of those chains in one Triton kernel and reproduces torch's rounding steps (every
intermediate rounded to the model dtype where torch rounds it); only reductions (the RMS, the softmax
sum) add in another order, so results agree with the torch chain to the last bf16 bit in almost every
element and never by more than one rounding step.

Every function falls back to the torch chain off CUDA, without Triton, or in a forward pass whose engine has
`[debug] fused_kernels = false` (`strata.kernels.options`), so CPU runs and the reference path are unchanged.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

from strata.kernels import options  # noqa: E402 - after the optional Triton import, which pdl repeats
from strata.kernels.gpu import pdl

# Launches folded into a neighbour: the decode step's key/value cache writes into the key's rotary kernel, the
# attention residual's add into the next RMSNorm, the q/k/v projections into one GEMM (`GQAAttention`). Module
# flags, not settings: tests turn them off to compare a fold with the ops it replaces.
FOLDS = True
# The folds save launches, which is what a decode step's few rows are bound by; a prefill chunk is bound by its
# GEMMs and attention, where a launch saved is worth nothing measurable, so batches of more rows than this take
# the unfolded ops.
FOLD_MAX_ROWS = 256
RESIDUAL_FOLD = True  # a MoE layer's residual add in the experts' combine launch (`combine(..., residual=)`)
QK_FOLD = True  # a decode step's query norm and rotary in the keys' cache-write launch (`norm_rope_into_cache(..., q=)`)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (kernel tests without a GPU)


def fused_ok(x: torch.Tensor) -> bool:
    """Whether `x`'s ops run as fused Triton kernels: on CUDA (or under Triton's interpreter), unless the running
    forward pass turned them off (`options.current().fused`)."""
    return triton is not None and (x.is_cuda or _INTERPRET) and options.current().fused


def fold_ok(x: torch.Tensor) -> bool:
    """Whether a fold may take x [rows, ...]: folds on, fused kernels run here, and decode-sized."""
    return FOLDS and fused_ok(x) and x.numel() <= FOLD_MAX_ROWS * x.shape[-1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * rms_norm(x.float()).to(x.dtype)` (transformers' RMSNorm) over the last dim, in one kernel.

    x [..., D], weight [D] -> [..., D] in x's dtype (weight's dtype must match, else the torch chain runs)."""
    d = x.shape[-1]
    if not fused_ok(x) or weight.dtype != x.dtype or d > 16384:
        return weight * F.rms_norm(x.float(), (d,), eps=eps).to(x.dtype)
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, d, rows.stride(0), eps, BLOCK=block,
                                           BF16=x.dtype == torch.bfloat16, num_warps=8 if block >= 4096 else 4,
                                           **pdl.launch(x))
    return out.view(x.shape)


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None,
              eps: float) -> torch.Tensor:
    """Per-head RMSNorm (Qwen3's q/k norm; none when `weight` is None) then half-split rotary embedding.

    x [N, heads, d] (last dim contiguous), cos/sin [N, d] in x's dtype -> [N, heads, d]. Equals
    `apply_rope(norm(x), cos, sin)`; call `norm_rope_ok` first (power-of-two d, CUDA)."""
    n, heads, d = x.shape
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if n * heads:
        w = weight if weight is not None else x  # unused pointer when NORM is off
        _norm_rope_kernel[(n * heads,)](x, cos, sin, w, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                                        sin.stride(0), eps, D=d, NORM=weight is not None, BF16=x.dtype == torch.bfloat16,
                                        num_warps=1 if d <= 128 else 2, **pdl.launch(x))
    return out


def norm_rope_into_cache(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, pos: torch.Tensor, q: torch.Tensor | None = None,
                         q_weight: torch.Tensor | None = None, q_eps: float = 0.0) -> torch.Tensor | None:
    """A decode step's keys: `norm_rope(k)` written with the values straight into the caches at each
    sequence's (slot, position), one launch where `norm_rope` and two `index_put_` take three; given the
    queries q, also `norm_rope(q, cos, sin, q_weight, q_eps)` in the same launch, returned (else None).

    k, v [B, kv_heads, d], q [B, heads, d] (last dims contiguous); caches [slots, max_len, kv_heads, d]
    contiguous; slots, pos [B]. Call `cache_write_ok` first (and `norm_rope_ok(q, ...)` for q)."""
    b, heads, d = k.shape
    q_heads = q.shape[1] if q is not None else 0
    q_out = torch.empty((b, q_heads, d), dtype=q.dtype, device=q.device) if q is not None else None
    if b * (heads + q_heads):
        w = weight if weight is not None else k
        qw = q_weight if q_weight is not None else k
        qx = q if q is not None else k  # unread pointers without q
        _norm_rope_cache_kernel[(b * (heads + q_heads),)](
            k, v, cos, sin, w, k_cache, v_cache, slots, pos, heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
            qx, qw, q_out if q_out is not None else k, q_heads, b * q_heads, qx.stride(0), qx.stride(1), q_eps, D=d,
            NORM=weight is not None, NORM_Q=q_weight is not None, BF16=k.dtype == torch.bfloat16,
            num_warps=1 if d <= 128 else 2, **pdl.launch(k))
    return q_out


def cache_write_ok(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, weight: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `norm_rope_into_cache` can take this step (folds on, shapes and layouts it handles)."""
    return (FOLDS and norm_rope_ok(k, cos, weight) and v.shape == k.shape and v.stride(-1) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.shape[2:] == k.shape[1:] and k_cache.dtype == v_cache.dtype == k.dtype == v.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, rms_norm(x + delta)): a residual add and the RMSNorm after it in one kernel, rounding the
    sum to x's dtype first as torch's add does. x, delta [..., D]; None when it cannot run fused (the caller
    runs the add and `rms_norm`)."""
    d = x.shape[-1]
    if (not fold_ok(x) or weight.dtype != x.dtype or delta.dtype != x.dtype or d > 16384
            or delta.shape != x.shape):
        return None
    rows, drows = x.reshape(-1, d).contiguous(), delta.reshape(-1, d).contiguous()
    total = torch.empty_like(rows)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _add_rms_norm_kernel[(rows.shape[0],)](rows, drows, weight, total, out, d, eps, BLOCK=block,
                                               BF16=x.dtype == torch.bfloat16, num_warps=8 if block >= 4096 else 4,
                                               **pdl.launch(x))
    return total.view(x.shape), out.view(x.shape)


def norm_rope_ok(x: torch.Tensor, cos: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether `norm_rope` can take x [N, heads, d] (else run the norm and `apply_rope` in torch)."""
    d = x.shape[-1]
    return (fused_ok(x) and d >= 16 and d & (d - 1) == 0 and x.stride(-1) == 1 and cos.shape[-1] == d
            and cos.dtype == x.dtype and (weight is None or weight.dtype == x.dtype))


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Softmax over experts in fp32, top-k, optional renormalise: logits [N, E] -> (weights [N, k] fp32,
    ids [N, k] int64), in one kernel; None when it cannot run fused (the caller runs torch's ops)."""
    n, e = logits.shape
    if not fused_ok(logits) or e > 4096 or k > 64 or k > e or logits.stride(-1) != 1:
        return None
    weights = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n:
        _softmax_topk_kernel[(n,)](logits, weights, ids, e, logits.stride(0), K=k, KB=triton.next_power_of_2(k),
                                   BLOCK=triton.next_power_of_2(e), NORMALIZE=normalize,
                                   num_warps=1 if e <= 256 else 4, **pdl.launch(logits))  # one warp: its reductions are shuffles alone
    return weights, ids


def combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, extra: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """Each token's weighted sum of its k expert rows (plus `extra`), cast, plus `residual` (the layer's input,
    added as torch's `x + mlp(h)` adds it: after the cast, rounded again): y [N*k, H] fp32, weights [N, k],
    extra [N, H] fp32, residual [N, H] `dtype` -> [N, H] `dtype`; None when it cannot run fused (the caller
    runs torch's ops)."""
    n, k = weights.shape
    hidden = y.shape[1]
    if not fused_ok(y) or y.dtype != torch.float32 or y.stride(-1) != 1 or y.shape[0] != n * k:
        return None
    if extra is not None and (extra.dtype != torch.float32 or not extra.is_contiguous()):
        return None
    if residual is not None and (residual.dtype != dtype or not residual.is_contiguous() or residual.shape != (n, hidden)):
        return None
    w = weights.float().contiguous()
    out = torch.empty((n, hidden), dtype=dtype, device=y.device)
    if n:
        block = 1024
        _combine_kernel[(n, triton.cdiv(hidden, block))](
            y, w, extra if extra is not None else y, residual if residual is not None else out, out, hidden,
            y.stride(0), K=k, BLOCK=block, EXTRA=extra is not None, RESIDUAL=residual is not None,
            BF16=dtype == torch.bfloat16, num_warps=4, **pdl.launch(y))
    return out


if triton is not None:

    @triton.jit
    def round_to(x, dt: tl.constexpr, BF16: tl.constexpr):
        """fp32 x rounded to `dt` and back, as torch rounds each op's result. For bf16 by integer
        round-to-nearest-even on the bits: the compiler may fold a truncf/extf pair away (and then
        contract a later add into an FMA), which torch's separately rounded ops never do."""
        if BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dt).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, eps, BLOCK: tl.constexpr, BF16: tl.constexpr,
                         PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
        pdl.enter(PDL)
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = round_to(x * r, out_ptr.dtype.element_ty, BF16)  # rms_norm(x.float()).to(dtype)
        tl.store(out_ptr + row * D + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope_row(base, w_ptr, cos_row, sin_row, eps, dt: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr,
                       BF16: tl.constexpr):
        """One head's row at `base`: optional RMSNorm, then rotate_half rotary; fp32 [D] holding `dt` values."""
        half: tl.constexpr = D // 2
        offs = tl.arange(0, D)
        rot = tl.where(offs < half, offs + half, offs - half)  # rotate_half's source element
        x = tl.load(base + offs).to(tl.float32)
        xr = tl.load(base + rot).to(tl.float32)
        if NORM:  # weight * rms_norm(x.float()).to(dtype), on the element and on its rotation partner
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            x = round_to(tl.load(w_ptr + offs).to(tl.float32) * round_to(x * r, dt, BF16), dt, BF16)
            xr = round_to(tl.load(w_ptr + rot).to(tl.float32) * round_to(xr * r, dt, BF16), dt, BF16)
        xr = tl.where(offs < half, -xr, xr)  # rotate_half: cat(-x2, x1)
        c = tl.load(cos_row + offs).to(tl.float32)
        s = tl.load(sin_row + offs).to(tl.float32)
        a = round_to(x * c, dt, BF16)  # x * cos, rounded as torch rounds it
        b = round_to(xr * s, dt, BF16)  # rotate_half(x) * sin
        return a + b

    @triton.jit
    def _norm_rope_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, out_ptr, HEADS, stride_xn, stride_xh, stride_c, stride_s,
                          eps, D: tl.constexpr, NORM: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        pid = tl.program_id(0)
        n = (pid // HEADS).to(tl.int64)
        h = pid % HEADS
        dt = out_ptr.dtype.element_ty
        y = _norm_rope_row(x_ptr + n * stride_xn + h * stride_xh, w_ptr, cos_ptr + n * stride_c, sin_ptr + n * stride_s,
                           eps, dt, D, NORM, BF16)
        tl.store(out_ptr + (n * HEADS + h) * D + tl.arange(0, D), y.to(dt))

    @triton.jit(do_not_specialize=("NQ",))  # B * Q_HEADS: one build for every batch size (tests/kernels/test_kernel_builds.py)
    def _norm_rope_cache_kernel(k_ptr, v_ptr, cos_ptr, sin_ptr, w_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, HEADS,
                                stride_kn, stride_kh, stride_vn, stride_vh, stride_c, stride_s, stride_cs, stride_cl,
                                stride_ch, eps, q_ptr, qw_ptr, qo_ptr, Q_HEADS, NQ, stride_qn, stride_qh, q_eps,
                                D: tl.constexpr, NORM: tl.constexpr, NORM_Q: tl.constexpr, BF16: tl.constexpr,
                                PDL: tl.constexpr):
        pdl.enter(PDL)
        pid = tl.program_id(0)
        dt = kc_ptr.dtype.element_ty
        offs = tl.arange(0, D)
        if pid < NQ:  # programs [0, B * Q_HEADS): a query head: normed and rotated into qo [B, Q_HEADS, D]
            n = (pid // Q_HEADS).to(tl.int64)
            h = pid % Q_HEADS
            y = _norm_rope_row(q_ptr + n * stride_qn + h * stride_qh, qw_ptr, cos_ptr + n * stride_c,
                               sin_ptr + n * stride_s, q_eps, dt, D, NORM_Q, BF16)
            tl.store(qo_ptr + (n * Q_HEADS + h) * D + offs, y.to(dt))
        else:  # a key head: normed and rotated into the cache at (slot, pos), its value beside it
            pk = pid - NQ
            n = (pk // HEADS).to(tl.int64)
            h = pk % HEADS
            y = _norm_rope_row(k_ptr + n * stride_kn + h * stride_kh, w_ptr, cos_ptr + n * stride_c,
                               sin_ptr + n * stride_s, eps, dt, D, NORM, BF16)
            dst = (tl.load(slots_ptr + n).to(tl.int64) * stride_cs + tl.load(pos_ptr + n).to(tl.int64) * stride_cl
                   + h * stride_ch)
            tl.store(kc_ptr + dst + offs, y.to(dt))
            tl.store(vc_ptr + dst + offs, tl.load(v_ptr + n * stride_vn + h * stride_vh + offs))

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, D, eps, BLOCK: tl.constexpr, BF16: tl.constexpr,
                             PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        dt = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
        pdl.enter(PDL)
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + tl.load(d_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32), dt, BF16)  # x + delta
        tl.store(sum_ptr + row * D + offs, x.to(dt), mask=mask)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = round_to(x * r, dt, BF16)
        tl.store(out_ptr + row * D + offs, (w * y).to(dt), mask=mask)

    @triton.jit
    def _softmax_topk_row(x, offs, mask, K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr,
                          NORMALIZE: tl.constexpr):
        """One row's fp32 logits x [BLOCK] (padding -inf) -> (weights [KB], ids [KB] int64): softmax, top-k
        (ties: the lowest expert id), optional renormalise; entries past K are padding. Each round is one max
        over int64 keys, a probability's bits (>= 0, so ordered as the floats) above BLOCK - id (the lower id
        wins a tie), instead of a max then a min: a decode router's top-k is a chain of these reductions."""
        ex = tl.where(mask, tl.exp(x - tl.max(x, axis=0)), 0.0)
        p = ex / tl.sum(ex, axis=0)  # probabilities
        bits = p.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(mask, (bits << 32) | (BLOCK - offs).to(tl.int64), -1)  # padding below every expert
        slots = tl.arange(0, KB)
        top_w = tl.zeros([KB], dtype=tl.float32)
        top_i = tl.zeros([KB], dtype=tl.int64)
        for j in tl.static_range(K):  # k rounds of argmax
            best = tl.max(key, axis=0)
            idx = BLOCK - (best & 0xFFFFFFFF)
            top_w = tl.where(slots == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top_w)
            top_i = tl.where(slots == j, idx, top_i)
            key = tl.where(offs == idx, -1, key)
        if NORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=0)
        return top_w, top_i

    @triton.jit
    def _softmax_topk_kernel(l_ptr, w_ptr, id_ptr, E, stride_l, K: tl.constexpr, KB: tl.constexpr,
                             BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < E
        x = tl.load(l_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        top_w, top_i = _softmax_topk_row(x, offs, mask, K, KB, BLOCK, NORMALIZE)
        slots = tl.arange(0, KB)
        keep = slots < K
        tl.store(w_ptr + row * K + slots, top_w, mask=keep)
        tl.store(id_ptr + row * K + slots, top_i, mask=keep)

    @triton.jit
    def _combine_kernel(y_ptr, w_ptr, extra_ptr, res_ptr, out_ptr, H, stride_y, K: tl.constexpr, BLOCK: tl.constexpr,
                        EXTRA: tl.constexpr, RESIDUAL: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        if RESIDUAL:  # loaded first: its latency overlaps the rows' loads
            res = tl.load(res_ptr + n * H + offs, mask=mask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):  # experts in routing order, whatever tier computed each row
            w = tl.load(w_ptr + n * K + j)
            acc += tl.load(y_ptr + (n * K + j) * stride_y + offs, mask=mask, other=0.0) * w
        if EXTRA:  # the CPU's weighted partial sum of the cold pairs
            acc += tl.load(extra_ptr + n * H + offs, mask=mask, other=0.0)
        if RESIDUAL:  # x + mlp(h): the MoE output rounded to the model dtype first, then the add, rounded again
            acc = round_to(acc, out_ptr.dtype.element_ty, BF16) + res
        tl.store(out_ptr + n * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
