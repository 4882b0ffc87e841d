"""DeepSeek-V4's decode-step chains in single Triton launches, where torch needs several to ~130 each.

At one token a step a V4 layer's time is its launches, not its weights' bytes (docs/benchmarks.md counts them:
bench/decode_ops.py). Here, each one launch:

    hyper_weights(mixes [N, (2 + n) n] fp32, base [(2 + n) n], scale [3], streams [N, n, H], iters, eps)
        -> (post [N, n] fp32, comb [N, n, n] fp32, collapsed [N, H] in the streams' dtype)
        a hyper-connection's weights (strata.runtime.model.deepseek_v4.hyper: sigmoids for `pre` and `post`, a
        softmax and `iters` Sinkhorn-Knopp iterations for `comb`, ~130 launches in torch) and the streams' collapse
    mix_streams(streams [N, n, H], out [N, H], post [N, n], comb [N, n, n]) -> [N, n, H]
        the block's output spread back over the streams and the old streams mixed: post * out + comb^T @ streams
    rotate(x [N, heads, d], cos, sin [N, r/2], conjugate) -> [N, heads, d]
        the interleaved rotary embedding of each head's trailing r channels (runtime/model/deepseek_v4/rope.py)
    float_rms_norm(x [N, D], weight [D] fp32, eps) -> [N, D]: (weight * x / rms(x)) in fp32, rounded once
    compress_step(rings, entries, kv, gate [B, width], slots, pos [B], bias, norm weight, eps, cos, sin, m, overlap)
        a decode step's compressor (runtime/model/deepseek_v4/decode.py's compress_decode): the new sources into
        the rings, the window's softmax-pooled entry normed, rotated and written where the token completes it
    window_keys(window ring, kv [B, d], slots, pos, back, entries, span, rate, picked) -> keys [B, P, d], seen [B, P]
        a decode step's keys (runtime/model/deepseek_v4/decode.py's attend_decode): the window's last `back`
        positions from the ring, the new kv (then written into the ring), the compressed entries (HCA: the first
        `span`; CSA: the indexer's picks), and which of them each query sees
    sink_softmax(scores [B, heads, P], seen [B, P], sinks [heads] fp32, scale) -> probs [B, heads, P]
        a decode step's attention weights: the scores scaled (rounded as torch rounds them), the unseen keys at -inf,
        each head's sink logit in the softmax and dropped from its output (runtime/model/deepseek_v4/decode.py)

The hyper-connection weights stay in registers (n <= 16) through the iterations. Each kernel computes in fp32 with
the torch chain's operations and rounds where it rounds; sums (the softmax's, the Sinkhorn normalisations', the
norms') may add in another order, Triton's exp differs from torch's in the last bits, and products may fuse into
multiply-adds, so results agree to fp32 rounding before the final one (tests/kernels/test_deepseek_v4_kernels.py).
Callers check `fused_ok` (each returns None where it does not apply) and keep the torch chains, the reference, off
CUDA.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import fused, pdl
from strata.kernels.gpu.fused import triton

if triton is not None:
    import triton.language as tl

__all__ = ["hyper_fits", "hyper_weights", "mix_streams", "rotate", "float_rms_norm", "sink_softmax", "compress_step", "window_keys",
           "MAX_STREAMS"]

MAX_STREAMS = 16  # n x n weights a program keeps in registers


def hyper_fits(streams: torch.Tensor, iters: int) -> bool:
    """Whether `hyper_weights` runs on these streams [N, n, H] (else the caller's torch chain does)."""
    return streams.dim() == 3 and fused.fused_ok(streams) and streams.shape[1] <= MAX_STREAMS and iters >= 1


def hyper_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, iters: int,
                  eps: float, norm_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(post, comb, collapsed) of `HyperConnection.forward` from its projection `mixes` [N, (2 + n) n] (fp32), its
    `base` and `scale` parameters and the streams [N, n, H]; with `norm_eps`, `mixes` is the projection of the
    streams as they are, and the kernel applies their RMS norm's factor rsqrt(mean(streams^2) + norm_eps) (a scalar a
    row, so it commutes with the projection). None where the fused kernel does not apply (the caller runs the torch
    chain)."""
    if not hyper_fits(streams, iters):
        return None
    rows, n, hidden = streams.shape
    if (mixes.dtype != torch.float32 or base.dtype != torch.float32 or scale.dtype != torch.float32
            or tuple(mixes.shape) != (rows, (2 + n) * n)):
        return None
    mixes, streams = mixes.contiguous(), streams.contiguous()
    post = torch.empty(rows, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(rows, n, n, dtype=torch.float32, device=streams.device)
    collapsed = torch.empty(rows, hidden, dtype=streams.dtype, device=streams.device)
    if rows:
        _hyper_kernel[(rows,)](mixes, base.contiguous(), scale.contiguous(), streams, post, comb, collapsed, hidden, eps,
                               norm_eps or 0.0, N=n, BN=max(2, triton.next_power_of_2(n)), ITERS=iters,
                               NORM=norm_eps is not None,
                               BLOCK_H=min(1024, triton.next_power_of_2(hidden)), num_warps=4, **pdl.launch(streams))
    return post, comb, collapsed


def mix_streams(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                ) -> torch.Tensor | None:
    """`hyper.mix`: post.to(dtype) * out + comb.to(dtype)^T @ streams in the streams' dtype (post and comb fp32; each
    product and the matrix product rounded where torch rounds them), one launch; None where the fused kernel does
    not apply."""
    if streams.dim() != 3 or not fused.fused_ok(streams):
        return None
    rows, n, hidden = streams.shape
    if (n > MAX_STREAMS or out.shape != (rows, hidden) or out.dtype != streams.dtype or post.shape != (rows, n)
            or comb.shape != (rows, n, n)):
        return None
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        return None
    streams, out, post, comb = streams.contiguous(), out.contiguous(), post.contiguous(), comb.contiguous()
    mixed = torch.empty_like(streams)
    if rows:
        block = min(1024, triton.next_power_of_2(hidden))
        _mix_kernel[(rows, triton.cdiv(hidden, block))](streams, out, post, comb, mixed, hidden, N=n,
                                                        BLOCK_H=block, num_warps=4, **pdl.launch(streams))
    return mixed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, conjugate: bool = False,
           norm_eps: float | None = None) -> torch.Tensor | None:
    """`rope.rotate(x, cos, -sin if conjugate else sin)` in one launch: x [N, heads, d], cos/sin [N, r/2] (r <= d,
    d - r even) -> [N, heads, d] in x's dtype; with `norm_eps`, each head first through `unweighted_rms_norm` (x times
    its rsqrt(mean(x^2) + eps) rounded to x's dtype, rounded). None where the fused kernel does not apply."""
    if x.dim() != 3 or not fused.fused_ok(x) or cos.shape != sin.shape or cos.dim() != 2:
        return None
    n, heads, d = x.shape
    r = 2 * cos.shape[1]
    if cos.shape[0] != n or r > d or (d - r) % 2 or d > 8192:
        return None
    rows = x.reshape(n * heads, d)
    rows = rows if rows.stride(-1) == 1 and rows.stride(0) == d else rows.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, d, dtype=x.dtype, device=x.device)
    if n * heads:
        _rotate_kernel[(n * heads,)](rows, cos, sin, out, heads, d, r // 2, d - r, norm_eps or 0.0,
                                     SIGN=-1.0 if conjugate else 1.0, NORM=norm_eps is not None,
                                     BLOCK=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 2,
                                     **pdl.launch(x))
    return out


def float_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`(weight * (x.float() * rsqrt(mean(x.float()^2) + eps))).to(x.dtype)` over the last dim (weight fp32), one
    launch; None where the fused kernel does not apply."""
    d = x.shape[-1]
    if not fused.fused_ok(x) or weight.dtype != torch.float32 or weight.shape != (d,) or d > 16384:
        return None
    rows = x.reshape(-1, d)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _float_norm_kernel[(rows.shape[0],)](rows, weight, out, d, rows.stride(0), eps, BLOCK=block,
                                             num_warps=8 if block >= 4096 else 4, **pdl.launch(x))
    return out.view(x.shape)


def sink_softmax(scores: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    """softmax over [scores * scale (rounded to the scores' dtype), unseen keys -inf, the head's sink] in fp32, the
    sink's weight dropped: scores [B, heads, P] (q k, unscaled), seen [B, P] bool, sinks [heads] fp32 -> [B, heads, P]
    in the scores' dtype, one launch; None where the fused kernel does not apply."""
    if scores.dim() != 3 or not fused.fused_ok(scores) or sinks.dtype != torch.float32:
        return None
    b, heads, p = scores.shape
    if seen.shape != (b, p) or seen.dtype != torch.bool or sinks.shape != (heads,) or p > 16384:
        return None
    scores, seen = scores.contiguous(), seen.contiguous()
    probs = torch.empty_like(scores)
    if b * heads:
        block = triton.next_power_of_2(p)
        _sink_softmax_kernel[(b * heads,)](scores, seen, sinks.contiguous(), probs, heads, p, float(scale), BLOCK=block,
                                           num_warps=4 if block >= 1024 else 2, **pdl.launch(scores))
    return probs



def compress_step(src_kv: torch.Tensor, src_gate: torch.Tensor, entries: torch.Tensor, kv: torch.Tensor,
                  gate: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, rate: int,
                  overlap: bool) -> bool:
    """One DecodeBatch step of a compressor in one launch, in place: the new tokens' kv, gate [B, width] into the
    source rings [slots, R, width] at p % R; the window p // m pooled as `compress_decode` pools it (per channel, a
    softmax over its source slots of gate + bias (fp32), the weights and each product rounded to kv's dtype, summed
    in fp32 and rounded), normed with `norm_weight` (fp32), rotated by cos, sin [B, r/2] (the window start's) and
    written to entries[slot, p // m] where the token completes the window. False (nothing done) where the fused
    kernel does not apply."""
    if kv.dim() != 2 or not fused.fused_ok(kv):
        return False
    b, width = kv.shape
    d = entries.shape[-1]
    ring = src_kv.shape[1]
    if (width != (2 * d if overlap else d) or ring != (2 * rate if overlap else rate) or gate.shape != kv.shape
            or src_kv.dtype != kv.dtype or src_gate.dtype != gate.dtype or entries.dtype != kv.dtype
            or bias.dtype != torch.float32 or bias.shape != (rate, width) or norm_weight.dtype != torch.float32
            or cos.shape != (b, cos.shape[1]) or 2 * cos.shape[1] > d or d % 2 or d > 4096
            or not all(t.is_contiguous() for t in (src_kv, src_gate, entries))):
        return False
    if b:
        half = triton.next_power_of_2(d // 2)
        rows = max(1, min(16, 4096 // half))
        _compress_kernel[(b,)](src_kv, src_gate, entries, kv.contiguous(), gate.contiguous(), slots.contiguous(),
                               pos.contiguous(), bias.contiguous(), norm_weight.contiguous(), cos.contiguous(),
                               sin.contiguous(), eps, entries.shape[1], d, cos.shape[1], M=rate, OVERLAP=overlap,
                               HALF=half, ROWS=rows, num_warps=8, **pdl.launch(kv))
    return True


def window_keys(window: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, back: int,
                entries: torch.Tensor | None, span: int, rate: int, picked: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's keys = values in one launch: window [slots, ring, d] rows of positions p - back .. p - 1 (those
    below 0 read as the ring holds them and unseen), the new kv [B, d], then entries [slots, E, d]: with `picked`
    [B, k] the picks (-1: unseen), else the first `span` (seen below (p + 1) // rate) -> (keys [B, back + 1 + k or
    span, d], seen [B, same] bool); kv then goes into the ring at p % ring (after it was read). None where the fused
    kernel does not apply."""
    if kv.dim() != 2 or not fused.fused_ok(kv) or window.dtype != kv.dtype or not window.is_contiguous():
        return None
    b, d = kv.shape
    ring = window.shape[1]
    if back > ring or d > 4096 or (entries is not None and (entries.dtype != kv.dtype or not entries.is_contiguous())):
        return None
    extra = 0 if entries is None else picked.shape[1] if picked is not None else span
    total = back + 1 + extra
    keys = torch.empty(b, total, d, dtype=kv.dtype, device=kv.device)
    seen = torch.empty(b, total, dtype=torch.bool, device=kv.device)
    if b:
        rows = 8
        ent = entries if entries is not None else window
        pick = picked.contiguous() if picked is not None else slots
        _keys_kernel[(b, triton.cdiv(total, rows))](
            window, kv.contiguous(), slots.contiguous(), pos.contiguous(), ent, pick, keys, seen, ring, back, total,
            ent.shape[1], max(1, rate), d, pick.shape[-1] if picked is not None else 0, MODE=0 if entries is None
            else 2 if picked is not None else 1, ROWS=rows, BLOCK_D=triton.next_power_of_2(d), num_warps=4,
            **pdl.launch(kv))
    return keys, seen

if triton is not None:

    @triton.jit
    def _mix_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, out_ptr, H, N: tl.constexpr, BLOCK_H: tl.constexpr,
                    PDL: tl.constexpr):
        # program (r, blk): token r's n output streams over hidden [blk BLOCK_H, +BLOCK_H); post and comb (fp32)
        # rounded to the streams' dtype as torch casts them; each stream's matrix product summed over j in fp32 and
        # rounded once, post_i * out rounded, then their sum
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        pdl.enter(PDL)
        dt = out_ptr.dtype.element_ty
        o = tl.load(o_ptr + r * H + h, mask=hm, other=0.0)
        base = s_ptr + r * N * H
        for i in tl.static_range(N):
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for j in tl.static_range(N):
                c = tl.load(comb_ptr + r * N * N + j * N + i).to(dt).to(tl.float32)  # comb[j, i]: comb^T's row i
                acc += c * tl.load(base + j * H + h, mask=hm, other=0.0).to(tl.float32)
            spread = (tl.load(post_ptr + r * N + i).to(dt).to(tl.float32) * o.to(tl.float32)).to(dt)
            total = spread.to(tl.float32) + acc.to(dt).to(tl.float32)
            tl.store(out_ptr + r * N * H + i * H + h, total.to(dt), mask=hm)

    @triton.jit
    def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, d, half, nope, eps, SIGN: tl.constexpr,
                       NORM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # program p: row p = token p // heads, head p % heads; channels [0, nope) copied, the rest rotated in pairs
        # (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), in fp32, rounded once; NORM: the row first times its rsqrt(mean
        # square + eps), that factor and each product rounded to x's dtype
        p = tl.program_id(0).to(tl.int64)
        t = p // heads
        ch = tl.arange(0, BLOCK)
        ok = ch < d
        pdl.enter(PDL)
        x = tl.load(x_ptr + p * d + ch, mask=ok, other=0.0)
        i = ch - nope
        rot = ok & (i >= 0)
        partner = tl.load(x_ptr + p * d + (ch ^ 1), mask=rot, other=0.0).to(tl.float32)  # nope even: pairs align
        if NORM:
            xf = x.to(tl.float32)
            scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / d + eps).to(x.dtype).to(tl.float32)
            x = (xf * scale).to(x.dtype)
            partner = (partner * scale).to(x.dtype).to(tl.float32)
        c = tl.load(cos_ptr + t * half + i // 2, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * half + i // 2, mask=rot, other=0.0).to(tl.float32) * SIGN
        swapped = tl.where(i % 2 == 0, -partner, partner)
        rotated = (x.to(tl.float32) * c + swapped * s).to(x.dtype)
        tl.store(out_ptr + p * d + ch, tl.where(rot, rotated, x), mask=ok)

    @triton.jit
    def _float_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        pdl.enter(PDL)
        h = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        tl.store(out_ptr + row * D + offs, (w * h).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _hyper_kernel(mix_ptr, base_ptr, scale_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, H, eps, norm_eps,
                      N: tl.constexpr, BN: tl.constexpr, ITERS: tl.constexpr, NORM: tl.constexpr,
                      BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        # program r: token r's weights; mixes row [pre n | post n | comb n x n (row a, column b at a n + b)]
        r = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BN)
        im = i < N
        a, b = i[:, None], i[None, :]
        m2 = (a < N) & (b < N)
        pdl.enter(PDL)  # (base and scale are parameters, a few bytes: read after it with the rest)
        pre_b = tl.load(base_ptr + i, mask=im, other=0.0)
        post_b = tl.load(base_ptr + N + i, mask=im, other=0.0)
        comb_b = tl.load(base_ptr + 2 * N + a * N + b, mask=m2, other=0.0)
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
        row = mix_ptr + r * ((2 + N) * N)
        streams = s_ptr + r * N * H
        unit = 1.0
        if NORM:  # the flat streams' RMS norm factor: mixes were projected from the streams as they are
            sq = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, N * H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                v = tl.load(streams + h, mask=h < N * H, other=0.0).to(tl.float32)
                sq += v * v
            unit = tl.rsqrt(tl.sum(sq, axis=0) / (N * H) + norm_eps)
        pre = tl.sigmoid(tl.load(row + i, mask=im, other=0.0) * unit * s_pre + pre_b) + eps
        post = 2 * tl.sigmoid(tl.load(row + N + i, mask=im, other=0.0) * unit * s_post + post_b)
        z = tl.load(row + 2 * N + a * N + b, mask=m2, other=0.0) * unit * s_comb + comb_b
        z = tl.where(m2, z, float("-inf"))
        zmax = tl.max(z, axis=1)
        zmax = tl.where(zmax > float("-inf"), zmax, 0.0)  # padded rows (a >= N): exp(-inf) = 0, not NaN
        e = tl.where(m2, tl.exp(z - zmax[:, None]), 0.0)
        total = tl.sum(e, axis=1)
        comb = tl.where(m2, e / tl.where(total > 0, total, 1.0)[:, None] + eps, 0.0)  # softmax over b, + eps
        comb = tl.where(m2, comb / (tl.sum(comb, axis=0)[None, :] + eps), 0.0)  # columns (sum over a)
        for _ in tl.static_range(ITERS - 1):  # then rows and columns
            comb = tl.where(m2, comb / (tl.sum(comb, axis=1)[:, None] + eps), 0.0)
            comb = tl.where(m2, comb / (tl.sum(comb, axis=0)[None, :] + eps), 0.0)
        tl.store(post_ptr + r * N + i, post, mask=im)
        tl.store(comb_ptr + r * (N * N) + a * N + b, comb, mask=m2)
        # collapsed[h] = sum_j pre_j streams[j, h], in fp32, streams in order, rounded once
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hm = h < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for j in tl.static_range(N):
                p_j = tl.sum(tl.where(i == j, pre, 0.0), axis=0)
                acc += p_j * tl.load(streams + j * H + h, mask=hm, other=0.0).to(tl.float32)
            tl.store(out_ptr + r * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def _sink_softmax_kernel(s_ptr, seen_ptr, sink_ptr, out_ptr, heads, P, scale, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        # program r: sequence r // heads, head r % heads; the sink joins the maximum and the sum, not the output
        r = tl.program_id(0).to(tl.int64)
        b = r // heads
        k = tl.arange(0, BLOCK)
        km = k < P
        pdl.enter(PDL)
        dt = out_ptr.dtype.element_ty
        raw = tl.load(s_ptr + r * P + k, mask=km, other=0.0).to(tl.float32)
        ok = km & (tl.load(seen_ptr + b * P + k, mask=km, other=0).to(tl.int1))
        x = tl.where(ok, (raw * scale).to(dt).to(tl.float32), float("-inf"))
        sink = tl.load(sink_ptr + r % heads)
        top = tl.maximum(tl.max(x, axis=0), sink)
        e = tl.where(ok, tl.exp(x - top), 0.0)
        total = tl.sum(e, axis=0) + tl.exp(sink - top)
        tl.store(out_ptr + r * P + k, (e / total).to(dt), mask=km)

    @triton.jit
    def _compress_kernel(kv_ring, g_ring, ent_ptr, kv_ptr, g_ptr, slot_ptr, pos_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr,
                         eps, E, D, PAIRS, M: tl.constexpr, OVERLAP: tl.constexpr, HALF: tl.constexpr,
                         ROWS: tl.constexpr, PDL: tl.constexpr):
        # program b: sequence b's new source row, then its window's entry over the window's source slots j (HCA: the
        # ring's M rows; CSA: window e - 1's first half channels in slots [0, M), window e's second half in [M, 2M)),
        # channels kept as even / odd halves (the rotary pairs) [HALF] each
        bq = tl.program_id(0).to(tl.int64)
        W = 2 * D if OVERLAP else D  # ring width
        R = 2 * M if OVERLAP else M  # ring rows
        k = tl.arange(0, HALF)
        km = k < D // 2
        pdl.enter(PDL)
        slot = tl.load(slot_ptr + bq).to(tl.int64)
        p = tl.load(pos_ptr + bq).to(tl.int64)
        e = p // M
        new_row = p % R
        dt = ent_ptr.dtype.element_ty
        # the new sources into the rings (all W channels); the loads below take them from registers for new_row
        for c0 in tl.static_range(0, 2 if OVERLAP else 1):
            cw = c0 * D + k * 2
            for par in tl.static_range(2):
                new_v = tl.load(kv_ptr + bq * W + cw + par, mask=km)
                tl.store(kv_ring + (slot * R + new_row) * W + cw + par, new_v, mask=km)
                new_g = tl.load(g_ptr + bq * W + cw + par, mask=km)
                tl.store(g_ring + (slot * R + new_row) * W + cw + par, new_g, mask=km)
        # pass 1: each channel's maximum and sum of exp over the window's slots (online, fp32)
        mx_e = tl.full([HALF], float("-inf"), tl.float32)
        mx_o = tl.full([HALF], float("-inf"), tl.float32)
        sm_e = tl.zeros([HALF], tl.float32)
        sm_o = tl.zeros([HALF], tl.float32)
        SLOTS: tl.constexpr = 2 * M if OVERLAP else M
        for j0 in range(0, SLOTS, ROWS):
            j = j0 + tl.arange(0, ROWS)
            ring_row, coff, brow, ok = _window_slots(j, e, M, D, OVERLAP)
            jm = (j < SLOTS) & ok
            m2 = jm[:, None] & km[None, :]
            for par in tl.static_range(2):
                ch = coff[:, None] + 2 * k[None, :] + par
                fresh = (ring_row == new_row)[:, None]
                g_old = tl.load(g_ring + (slot * R + ring_row[:, None]) * W + ch, mask=m2, other=0.0)
                g_new = tl.load(g_ptr + bq * W + ch, mask=m2 & fresh, other=0.0)
                g = tl.where(fresh, g_new, g_old).to(tl.float32) + tl.load(bias_ptr + brow[:, None] * W + ch, mask=m2,
                                                                          other=0.0)
                g = tl.where(m2, g, float("-inf"))
                if par == 0:
                    new_mx = tl.maximum(mx_e, tl.max(g, axis=0))
                    safe = tl.where(new_mx > float("-inf"), new_mx, 0.0)
                    sm_e = sm_e * tl.exp(mx_e - safe) + tl.sum(tl.exp(g - safe[None, :]), axis=0)
                    mx_e = new_mx
                else:
                    new_mx = tl.maximum(mx_o, tl.max(g, axis=0))
                    safe = tl.where(new_mx > float("-inf"), new_mx, 0.0)
                    sm_o = sm_o * tl.exp(mx_o - safe) + tl.sum(tl.exp(g - safe[None, :]), axis=0)
                    mx_o = new_mx
        # pass 2: the weights and products rounded to the entries' dtype, summed in fp32
        acc_e = tl.zeros([HALF], tl.float32)
        acc_o = tl.zeros([HALF], tl.float32)
        for j0 in range(0, SLOTS, ROWS):
            j = j0 + tl.arange(0, ROWS)
            ring_row, coff, brow, ok = _window_slots(j, e, M, D, OVERLAP)
            jm = (j < SLOTS) & ok
            m2 = jm[:, None] & km[None, :]
            fresh = (ring_row == new_row)[:, None]
            for par in tl.static_range(2):
                ch = coff[:, None] + 2 * k[None, :] + par
                g_old = tl.load(g_ring + (slot * R + ring_row[:, None]) * W + ch, mask=m2, other=0.0)
                g_new = tl.load(g_ptr + bq * W + ch, mask=m2 & fresh, other=0.0)
                g = tl.where(fresh, g_new, g_old).to(tl.float32) + tl.load(bias_ptr + brow[:, None] * W + ch, mask=m2,
                                                                          other=0.0)
                v_old = tl.load(kv_ring + (slot * R + ring_row[:, None]) * W + ch, mask=m2, other=0.0)
                v_new = tl.load(kv_ptr + bq * W + ch, mask=m2 & fresh, other=0.0)
                v = tl.where(fresh, v_new, v_old).to(tl.float32)
                if par == 0:
                    w = (tl.exp(g - mx_e[None, :]) / sm_e[None, :]).to(dt).to(tl.float32)
                    acc_e += tl.sum(tl.where(m2, (v * w).to(dt).to(tl.float32), 0.0), axis=0)
                else:
                    w = (tl.exp(g - mx_o[None, :]) / sm_o[None, :]).to(dt).to(tl.float32)
                    acc_o += tl.sum(tl.where(m2, (v * w).to(dt).to(tl.float32), 0.0), axis=0)
        # the entry: rounded, normed with the fp32 weight (rounded), its trailing 2 PAIRS channels rotated (rounded)
        x_e = tl.where(km, acc_e.to(dt).to(tl.float32), 0.0)
        x_o = tl.where(km, acc_o.to(dt).to(tl.float32), 0.0)
        inv = tl.rsqrt((tl.sum(x_e * x_e, axis=0) + tl.sum(x_o * x_o, axis=0)) / D + eps)
        x_e = (tl.load(w_ptr + 2 * k, mask=km, other=0.0) * (x_e * inv)).to(dt).to(tl.float32)
        x_o = (tl.load(w_ptr + 2 * k + 1, mask=km, other=0.0) * (x_o * inv)).to(dt).to(tl.float32)
        pair = k - (D // 2 - PAIRS)  # rotary pair index of channels (2k, 2k + 1); < 0: not rotated
        rot = km & (pair >= 0)
        c = tl.load(cos_ptr + bq * PAIRS + pair, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + bq * PAIRS + pair, mask=rot, other=0.0).to(tl.float32)
        r_e = tl.where(rot, x_e * c - x_o * s, x_e)
        r_o = tl.where(rot, x_o * c + x_e * s, x_o)
        pv = tl.zeros([HALF], tl.int64) + p  # (a vector: Triton's interpreter takes no scalar condition in a mask)
        done = km & ((pv + 1) % M == 0) & (pv // M < E)
        base = ent_ptr + (slot * E + e) * D
        tl.store(base + 2 * k, r_e.to(dt), mask=done)
        tl.store(base + 2 * k + 1, r_o.to(dt), mask=done)

    @triton.jit
    def _window_slots(j, e, M: tl.constexpr, D, OVERLAP: tl.constexpr):
        # source slot j of window e: its ring row, the first channel it reads, its bias row, whether it counts
        if OVERLAP:  # [0, M): window e - 1's rows (ring half (e + 1) % 2), channels [0, D); [M, 2M): window e's, [D, 2D)
            cur = j >= M
            jj = tl.where(cur, j - M, j)
            ev = tl.zeros_like(j).to(tl.int64) + e
            half = tl.where(cur, ev % 2, (ev + 1) % 2)
            return half * M + jj, tl.where(cur, D, 0), jj, cur | (ev > 0)
        else:
            return j, tl.zeros_like(j), j, j >= 0

    @triton.jit
    def _keys_kernel(win_ptr, kv_ptr, slot_ptr, pos_ptr, ent_ptr, pick_ptr, keys_ptr, seen_ptr, RING, BACK, P, E,
                     RATE, D, K, MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        # program (b, blk): sequence b's keys [blk ROWS, +ROWS): i < BACK the ring's position p - BACK + i, i == BACK
        # the new kv, past it entry t = i - BACK - 1 (MODE 1: entry t, seen below (p + 1) // RATE; MODE 2: pick t)
        bq = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK_D)
        cm = c < D
        pdl.enter(PDL)
        slot = tl.load(slot_ptr + bq).to(tl.int64)
        p = tl.load(pos_ptr + bq).to(tl.int64)
        im = i < P
        kpos = p - BACK + i
        in_win = im & (i < BACK)
        row = ((kpos % RING) + RING) % RING  # (Python's modulo: a position below 0 reads the row torch's gather reads)
        old = tl.load(win_ptr + (slot * RING + row[:, None]) * D + c[None, :], mask=in_win[:, None] & cm[None, :],
                      other=0.0)
        new = tl.load(kv_ptr + bq * D + c, mask=cm, other=0.0)[None, :]
        is_new = im & (i == BACK)
        vals = tl.where(is_new[:, None], new, old)
        seen = in_win & (kpos >= 0) | is_new
        if MODE != 0:
            t = i - BACK - 1
            in_ent = im & (t >= 0)
            if MODE == 1:
                entry = t
                seen = seen | in_ent & (t < (p + 1) // RATE)
            else:
                entry = tl.load(pick_ptr + bq * K + t, mask=in_ent, other=0).to(tl.int64)
                seen = seen | in_ent & (entry >= 0)
                entry = tl.maximum(entry, 0)
            ent = tl.load(ent_ptr + (slot * E + entry[:, None]) * D + c[None, :], mask=in_ent[:, None] & cm[None, :],
                          other=0.0)
            vals = tl.where(in_ent[:, None], ent, vals)
        tl.store(keys_ptr + (bq * P + i[:, None]) * D + c[None, :], vals, mask=im[:, None] & cm[None, :])
        tl.store(seen_ptr + bq * P + i, seen, mask=im)
        if tl.program_id(1) == 0:  # the only program reading ring row p % RING (position p - RING, key 0): after it
            tl.debug_barrier()
            tl.store(win_ptr + (slot * RING + p % RING) * D + c, tl.load(kv_ptr + bq * D + c, mask=cm), mask=cm)
