"""DeepSeek-V4's decode-step chains in single Triton launches, where torch needs several to ~130 each.

At one token a step a V4 layer's time is its launches, not its weights' bytes (docs/benchmarks.md counts them:
bench/decode_ops.py). Here, each one launch:

    hyper_weights(mixes [N, (2 + n) n] fp32, base [(2 + n) n], scale [3], streams [N, n, H], iters, eps, norm_eps)
        -> (post [N, n] fp32, comb [N, n, n] fp32, collapsed [N, H] in the streams' dtype)
        a hyper-connection's weights (strata.runtime.model.deepseek_v4.hyper: the streams' RMS norm factor, sigmoids
        for `pre` and `post`, a softmax and `iters` Sinkhorn-Knopp iterations for `comb`, ~135 launches in torch)
        and the streams' collapse
    mix_streams(streams [N, n, H], out [N, H], post [N, n], comb [N, n, n]) -> [N, n, H]
        the block's output spread back over the streams and the old streams mixed: post * out + comb^T @ streams
    rotate(x [N, heads, d], cos, sin [N, r/2], conjugate, norm_eps) -> [N, heads, d]
        the interleaved rotary embedding of each head's trailing r channels (runtime/model/deepseek_v4/rope.py),
        after the head's unweighted RMS norm with `norm_eps` (the queries')
    float_rms_norm(x [N, D], weight [D] fp32, eps) -> [N, D]: (weight * x / rms(x)) in fp32, rounded once
    clipped_swiglu(gate [N, I], up [N, I], limit) -> [N, I]: silu(min(gate, limit)) * clip(up, -limit, limit), the
        shared expert's activation (each op rounded as torch rounds it)
    route_weights(logits [N, E], scoring, scaling, ids [N, k] or (bias [E], k)) -> (weights [N, k], ids [N, k])
        a router's expert scores (sqrt(softplus) or sigmoid), the top k of score + bias where no ids are given (the
        hash layers give theirs), and the chosen scores renormalised and scaled (runtime/model/deepseek_v4/moe.py)
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

__all__ = ["hyper_fits", "hyper_weights", "mix_streams", "rotate", "float_rms_norm", "clipped_swiglu", "route_weights",
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


def route_weights(logits: torch.Tensor, scoring: str, scaling: float, ids: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, k: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`moe.TopKRouter` / `HashRouter` after the router's linear, in one launch: logits [N, E] -> (weights [N, k] in the
    logits' dtype, ids [N, k] int64). The scores (`scoring` "sqrtsoftplus" or "sigmoid") rounded to the logits' dtype
    as torch rounds each op; with `ids` (a hash layer's) those experts, else the top `k` of score + `bias` (fp32); the
    chosen scores over their sum (+ 1e-20) times `scaling`, each op rounded. None where the fused kernel does not
    apply."""
    if logits.dim() != 2 or not fused.fused_ok(logits) or scoring not in ("sqrtsoftplus", "sigmoid"):
        return None
    n, e = logits.shape
    k = ids.shape[1] if ids is not None else k
    if not 0 < k <= min(e, 16) or e > 8192 or (ids is None and (bias is None or bias.dtype != torch.float32)):
        return None
    logits = logits.contiguous()
    weights = torch.empty(n, k, dtype=logits.dtype, device=logits.device)
    chosen = ids.contiguous().long() if ids is not None else torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n:
        _router_weights_kernel[(n,)](logits, bias if bias is not None else logits, chosen, weights, e, float(scaling),
                                     K=k, BK=triton.next_power_of_2(k), SQRT_SOFTPLUS=scoring == "sqrtsoftplus",
                                     PICK=ids is None, BLOCK_E=triton.next_power_of_2(e), num_warps=4,
                                     **pdl.launch(logits))
    return weights, chosen


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor | None:
    """`F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)` in one launch (gate, up [..., I], same dtype and
    shape; silu and the product each rounded to their dtype); None where the fused kernel does not apply."""
    if not fused.fused_ok(gate) or up.shape != gate.shape or up.dtype != gate.dtype:
        return None
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _clipped_swiglu_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, float(limit), BLOCK=1024, num_warps=4,
                                                        **pdl.launch(gate))
    return out


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
    def _score(x, SQRT_SOFTPLUS: tl.constexpr, dt: tl.constexpr):
        # torch's ops on the logits' dtype: each computed in fp32 and rounded (softplus: x past 20 as it is)
        if SQRT_SOFTPLUS:
            sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))).to(dt).to(tl.float32)
            return tl.sqrt_rn(sp).to(dt).to(tl.float32)
        else:
            return tl.sigmoid(x).to(dt).to(tl.float32)

    @triton.jit
    def _router_weights_kernel(l_ptr, b_ptr, id_ptr, w_ptr, E, scaling, K: tl.constexpr, BK: tl.constexpr,
                      SQRT_SOFTPLUS: tl.constexpr, PICK: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
        # program r: row r's scores; PICK: the top K of score + bias (ties: the lowest expert id), else its K ids
        r = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, BK)
        km = kk < K
        dt = w_ptr.dtype.element_ty
        pdl.enter(PDL)
        if PICK:
            e = tl.arange(0, BLOCK_E)
            em = e < E
            x = tl.load(l_ptr + r * E + e, mask=em, other=0.0).to(tl.float32)
            choice = tl.where(em, _score(x, SQRT_SOFTPLUS, dt) + tl.load(b_ptr + e, mask=em, other=0.0),
                              float("-inf"))
            ids = tl.zeros([BK], tl.int64)
            for j in tl.static_range(K):
                top = tl.max(choice, axis=0)
                at = tl.min(tl.where(choice == top, e, BLOCK_E), axis=0)
                ids = tl.where(kk == j, at.to(tl.int64), ids)
                choice = tl.where(e == at, float("-inf"), choice)
            tl.store(id_ptr + r * K + kk, ids, mask=km)
        else:
            ids = tl.load(id_ptr + r * K + kk, mask=km, other=0)
        picked = tl.where(km, _score(tl.load(l_ptr + r * E + ids, mask=km, other=0.0).to(tl.float32), SQRT_SOFTPLUS,
                                     dt), 0.0)
        total = (tl.sum(picked, axis=0).to(dt).to(tl.float32) + 1e-20).to(dt).to(tl.float32)
        w = (picked / total).to(dt).to(tl.float32)
        tl.store(w_ptr + r * K + kk, (w * scaling).to(dt), mask=km)

    @triton.jit
    def _clipped_swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, BLOCK: tl.constexpr, PDL: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        pdl.enter(PDL)
        dt = out_ptr.dtype.element_ty
        g = tl.minimum(tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32), -limit), limit)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + i, (act * u).to(dt), mask=m)
