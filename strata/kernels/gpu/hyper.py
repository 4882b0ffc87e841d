"""DeepSeek-V4's hyper-connection weights in one Triton launch, where torch needs about 130 a block.

`HyperConnection.forward` (strata.runtime.model.deepseek_v4.hyper) turns one projection of the residual streams
into the weights its block mixes them with: sigmoids for `pre` and `post`, a softmax for `comb` and then
`hc_sinkhorn_iters` Sinkhorn-Knopp iterations (20 in the released config, each two sums, two adds and two
divisions of an n x n matrix), then the collapse of the streams by `pre`. At one token those are ~130 launches of a
few microseconds, twice a layer, about half of a V4 decode step's launches. Here, one program a token:

    hyper_weights(mixes [N, (2 + n) n] fp32, base [(2 + n) n], scale [3], streams [N, n, H], iters, eps)
        -> (post [N, n] fp32, comb [N, n, n] fp32, collapsed [N, H] in the streams' dtype)

The weights stay in registers (n <= 16) through the iterations; the collapse sums the streams in order, in fp32,
and rounds once to the streams' dtype, as the torch chain does. Only the few-term sums of the softmax and the
Sinkhorn normalisations may add in another order, and Triton's exp differs from torch's in the last bits, so results
agree to fp32 rounding (tests/kernels/test_hyper_kernel.py). Callers check `fused_ok` and keep the torch chain, the
reference, off CUDA.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import fused, pdl
from strata.kernels.gpu.fused import triton

if triton is not None:
    import triton.language as tl

__all__ = ["hyper_weights", "MAX_STREAMS"]

MAX_STREAMS = 16  # n x n weights a program keeps in registers


def hyper_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, iters: int,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(post, comb, collapsed) of `HyperConnection.forward` from its projection `mixes` [N, (2 + n) n] (fp32), its
    `base` and `scale` parameters and the streams [N, n, H]; None where the fused kernel does not apply (the caller
    runs the torch chain)."""
    if streams.dim() != 3 or not fused.fused_ok(streams):
        return None
    rows, n, hidden = streams.shape
    if (n > MAX_STREAMS or iters < 1 or mixes.dtype != torch.float32 or base.dtype != torch.float32
            or scale.dtype != torch.float32 or tuple(mixes.shape) != (rows, (2 + n) * n)):
        return None
    mixes, streams = mixes.contiguous(), streams.contiguous()
    post = torch.empty(rows, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(rows, n, n, dtype=torch.float32, device=streams.device)
    collapsed = torch.empty(rows, hidden, dtype=streams.dtype, device=streams.device)
    if rows:
        _hyper_kernel[(rows,)](mixes, base.contiguous(), scale.contiguous(), streams, post, comb, collapsed, hidden, eps,
                               N=n, BN=max(2, triton.next_power_of_2(n)), ITERS=iters,
                               BLOCK_H=min(1024, triton.next_power_of_2(hidden)), num_warps=4, **pdl.launch(streams))
    return post, comb, collapsed


if triton is not None:

    @triton.jit
    def _hyper_kernel(mix_ptr, base_ptr, scale_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, H, eps, N: tl.constexpr,
                      BN: tl.constexpr, ITERS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        # program r: token r's weights; mixes row [pre n | post n | comb n x n (row a, column b at a n + b)]
        r = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BN)
        im = i < N
        a, b = i[:, None], i[None, :]
        m2 = (a < N) & (b < N)
        pre_b = tl.load(base_ptr + i, mask=im, other=0.0)
        post_b = tl.load(base_ptr + N + i, mask=im, other=0.0)
        comb_b = tl.load(base_ptr + 2 * N + a * N + b, mask=m2, other=0.0)
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
        pdl.enter(PDL)
        row = mix_ptr + r * ((2 + N) * N)
        pre = tl.sigmoid(tl.load(row + i, mask=im, other=0.0) * s_pre + pre_b) + eps
        post = 2 * tl.sigmoid(tl.load(row + N + i, mask=im, other=0.0) * s_post + post_b)
        z = tl.load(row + 2 * N + a * N + b, mask=m2, other=0.0) * s_comb + comb_b
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
        streams = s_ptr + r * N * H
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hm = h < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for j in tl.static_range(N):
                p_j = tl.sum(tl.where(i == j, pre, 0.0), axis=0)
                acc += p_j * tl.load(streams + j * H + h, mask=hm, other=0.0).to(tl.float32)
            tl.store(out_ptr + r * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)
