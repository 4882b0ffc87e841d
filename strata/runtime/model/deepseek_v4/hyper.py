"""Manifold-constrained hyper-connections (transformers' `DeepseekV4HyperConnection` / `DeepseekV4HyperHead`).

The residual stream is `hc_mult` parallel streams [N, n, H]. Around each block (attention, then the MoE), one
projection of the flattened, RMS-normed streams gives three sets of weights (all fp32):

    pre  [N, n]     sigmoid(...) + eps           collapse the streams into the block's input: sum_j pre_j * s_j
    post [N, n]     2 * sigmoid(...)             spread the block's output back over the streams
    comb [N, n, n]  softmax(...) + eps, then Sinkhorn-Knopp iterations (columns, then rows and columns
                    hc_sinkhorn_iters - 1 times) towards a doubly-stochastic matrix mixing the old streams

    streams' = post * block(collapse) + comb^T @ streams

`HyperHead` collapses the streams once more (its own `pre` weights) before the final norm. On CUDA everything after
the projection is one Triton launch (strata.kernels.gpu.deepseek_v4); the torch chain here is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.gpu.deepseek_v4 import hyper_fits, hyper_weights, mix_streams


def _flat_rms(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [N, n, H] -> [N, n * H] fp32, RMS-normalised (no weight)."""
    flat = streams.reshape(streams.shape[0], -1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """The weights one block mixes its streams with (parameters `fn`, `base`, `scale`, kept in fp32)."""

    def __init__(self, hidden: int, n: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [N, n, H] -> (post [N, n] fp32, comb [N, n, n] fp32, collapsed [N, H] in the streams' dtype)."""
        n, eps = self.n, self.hc_eps
        if hyper_fits(streams, self.iters):  # CUDA: the projection, then one launch (which applies the norm's factor)
            raw = F.linear(streams.reshape(streams.shape[0], -1).float(), self.fn.float())
            fused = hyper_weights(raw, self.base, self.scale, streams, self.iters, eps, norm_eps=self.norm_eps)
            if fused is not None:
                return fused
        mixes = F.linear(_flat_rms(streams, self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [N, n, H], a block's output out [N, H] -> post * out + comb^T @ streams, in the streams' dtype."""
    mixed = mix_streams(streams, out, post, comb)  # one launch on CUDA
    if mixed is not None:
        return mixed
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams (parameters `hc_fn`, `hc_base`, `hc_scale`, kept in fp32)."""

    def __init__(self, hidden: int, n: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [N, n, H] -> [N, H] in the streams' dtype."""
        mixes = F.linear(_flat_rms(streams, self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
