"""Grouped-query attention of one new token per sequence, read straight from the KV cache (split-KV).

torch's route for a decode step gathers each sequence's cache window (`k_cache[slots, :L]`, a copy of
[B, L, kv_heads, d] per tensor), builds a position mask and runs SDPA: six to eight kernels. This is two:
1. `_split_kernel`, grid (B, kv_heads, splits): the G = heads / kv_heads query heads sharing one KV head
   attend over one stretch of the cache window (online softmax, keys past the sequence's position or
   outside its sliding window skipped), reading the slot's rows in place; it writes a partial output
   with its running max and sum;
2. `_merge_kernel`, grid (B, heads): rescales and adds the splits.
Shapes depend only on (B, L), so the step stays CUDA-graph friendly. Scores and sums are fp32; the
probabilities are rounded to the cache dtype before the value product, as flash attention does.

Options, each a constexpr (a build of its own; with both off the kernels compile to the same code as without them):
- WINDOW (split kernel): a sliding window, keys at positions <= pos - window skipped;
- SINKS (merge kernel): gpt-oss's attention sinks, a learned logit per query head that joins the softmax's
  denominator and takes no value. It is one more term of the merge's sum, exp(sink - m), so the splits'
  passes over the cache do not change. Plain, the sinks pointer is None (a constexpr: no argument at all).
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import pdl
from strata.kernels.gpu.fused import fused_ok

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

BLOCK_N = 64  # cache positions per inner step
MAX_SPLITS = 64  # stretches of the window per (sequence, KV head)


def decode_attention_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` takes q [B, heads, d] over k_cache [slots, L, kv_heads, d] (any strides but a
    contiguous last dimension: a head-major cache's transposed view too)."""
    d, heads, kv_heads = q.shape[-1], q.shape[1], k_cache.shape[2]
    return (fused_ok(q) and 16 <= d <= 256 and d & (d - 1) == 0 and heads % kv_heads == 0
            and heads // kv_heads <= 64 and k_cache.shape[-1] == d and k_cache.stride(-1) == 1
            and q.dtype == k_cache.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     pos: torch.Tensor, length: int, window: int | None, scale: float,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, heads, d]; caches [slots, max_len, kv_heads, d]; slots/pos [B] (the new token's position,
    its key already written); attend over cache positions < `length` that are <= pos (and > pos - window)
    -> [B, heads, d] in q's dtype. Equals `attention.attend_decode` over the gathered window. `sinks` [heads]
    (any float dtype): a logit per query head added to the softmax's denominator only (gpt-oss), as
    `gpt_oss.attention.attend_decode_sinks` computes it. The caches may be views (v_cache with k_cache's strides)."""
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"decode_attention reads both caches with one set of strides: keys {k_cache.stride()}, "
                         f"values {v_cache.stride()}")
    b, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    splits = max(1, min(MAX_SPLITS, triton.cdiv(length, BLOCK_N * 2)))
    chunk = triton.cdiv(triton.cdiv(length, splits), BLOCK_N) * BLOCK_N  # positions per split, whole blocks
    splits = triton.cdiv(length, chunk)
    q = q.contiguous()
    part = torch.empty((b, heads, splits, d), dtype=torch.float32, device=q.device)
    stats = torch.empty((b, heads, splits, 2), dtype=torch.float32, device=q.device)  # running max, sum
    out = torch.empty((b, heads, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    _split_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, slots, pos, part, stats, length, chunk, window if window is not None else 0, scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), heads, splits,
        D=d, G=group, GB=max(16, triton.next_power_of_2(group)), BLOCK=BLOCK_N, WINDOW=window is not None, num_warps=4,
        **pdl.launch(q))
    _merge_kernel[(b, heads)](part, stats, sinks, out, splits, D=d, SB=triton.next_power_of_2(splits),
                              SINKS=sinks is not None, num_warps=1, **pdl.launch(q))
    return out


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, part_ptr, stats_ptr, length, chunk, window, scale,
                      stride_cs, stride_cl, stride_ch, HEADS, SPLITS,
                      D: tl.constexpr, G: tl.constexpr, GB: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                      PDL: tl.constexpr):
        pdl.enter(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        p = tl.load(pos_ptr + b).to(tl.int32)
        rows = tl.arange(0, GB)  # query heads kvh*G .. kvh*G+G-1, padded to a dot-friendly GB
        row_ok = rows < G
        offs_d = tl.arange(0, D)
        head = kvh * G + rows
        q = tl.load(q_ptr + (b * HEADS + head)[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lo = sp * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, length), p + 1)  # keys after the new token are not written yet
        if WINDOW:
            first = tl.maximum(p - window + 1, 0)
            lo = tl.maximum(lo, first - first % BLOCK)  # whole blocks; the mask drops the rest
        m_i = tl.full([GB], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GB], dtype=tl.float32)
        acc = tl.zeros([GB, D], dtype=tl.float32)
        base = slot * stride_cs + kvh * stride_ch
        for start in range(lo, hi, BLOCK):
            offs_n = start + tl.arange(0, BLOCK)
            ok = offs_n < hi
            if WINDOW:
                ok = ok & (offs_n > p - window)
            kv_off = base + offs_n[:, None].to(tl.int64) * stride_cl + offs_d[None, :]
            k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)  # [BLOCK, D]
            s = tl.dot(q, tl.trans(k)) * scale  # [GB, BLOCK] fp32
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            prob = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(prob, axis=1)
            v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
            m_i = m_new
        dst = (b * HEADS + head) * SPLITS + sp
        tl.store(part_ptr + dst[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + dst * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + dst * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _merge_kernel(part_ptr, stats_ptr, sinks_ptr, out_ptr, SPLITS, D: tl.constexpr, SB: tl.constexpr,
                      SINKS: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        row = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # b * heads + head
        sp = tl.arange(0, SB)
        ok = sp < SPLITS
        m = tl.load(stats_ptr + (row * SPLITS + sp) * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(stats_ptr + (row * SPLITS + sp) * 2 + 1, mask=ok, other=0.0)
        m_all = tl.max(m, axis=0)  # finite: the split holding the new token's own position has a key
        if SINKS:  # the head's sink logit: one more exp in the denominator, none in the numerator
            sink = tl.load(sinks_ptr + tl.program_id(1)).to(tl.float32)
            m_all = tl.maximum(m_all, sink)
        w = tl.where(ok, tl.exp(m - m_all), 0.0)
        denom = tl.sum(l_s * w, axis=0)
        if SINKS:
            denom += tl.exp(sink - m_all)
        offs_d = tl.arange(0, D)
        acc = tl.load(part_ptr + (row * SPLITS + sp)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], axis=0) / denom
        tl.store(out_ptr + row * D + offs_d, o.to(out_ptr.dtype.element_ty))
