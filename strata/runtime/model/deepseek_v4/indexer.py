"""DeepSeek-V4's lightning indexer (transformers' `DeepseekV4Indexer`): which compressed entries each query of a
compressed-sparse-attention (CSA) layer attends to.

It compresses the same windows as the layer's compressor, at `index_head_dim` (its own overlapping CSA-style
compressor), and scores query t against entry s as

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) / sqrt(index_head_dim),   w = weights_proj(x) / sqrt(heads)

with q = q_b_proj(the attention's normed low-rank query), rotated at t by the "compress" rotary. Entries not yet
complete at t (s >= (t + 1) // m) score -inf; the top `index_topk` of the sequence's entries so far are kept, and
those that point at an incomplete entry come back as -1 (nothing to attend).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.runtime.model.deepseek_v4.cache import CompressedState
from strata.runtime.model.deepseek_v4.compressor import Compressor, entry_span
from strata.runtime.model.deepseek_v4.rope import InterleavedRope, rotate
from strata.runtime.model.layers import project

SCORE_BUDGET = 1 << 23  # elements of a query block's scores over every entry ([b, heads, T] in fp32: 32 MB)


class IndexerScorer(nn.Module):
    """Holds `weights_proj` (transformers' `scorer` submodule): per-query head weights."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """The indexer's compressor (inherited) plus its query projection and scorer."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, dim: int, rate: int, topk: int, eps: float):
        super().__init__(hidden, dim, rate, overlap=True, eps=eps)
        self.heads, self.topk = heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * dim, bias=False)
        self.scorer = IndexerScorer(hidden, heads)

    def select(self, state: CompressedState, slot: int, start: int, x: torch.Tensor, q_residual: torch.Tensor,
               rope: InterleavedRope) -> torch.Tensor:
        """One sequence's chunk: x [L, hidden] (the attention's input), q_residual [L, q_lora] -> the entries each
        query attends to, [L, k] int64 (k = min(index_topk, entries so far); -1: none). Updates the indexer's
        entries and source ring."""
        n = x.shape[0]
        kv, gate = self.project(x)
        count = self.update(state, slot, start, kv, gate, rope)
        span = entry_span(count, state.entries.shape[1])
        keys = state.entries[slot, :span]  # [T, dim], entries from `count` on masked as not yet complete
        positions = torch.arange(start, start + n, device=x.device)
        cos, sin = rope(positions, x.dtype)
        q = rotate(project(self.q_b_proj, q_residual).view(n, self.heads, self.dim), cos, sin)  # [L, heads, dim]
        weights = project(self.scorer.weights_proj, x).float() * self.heads**-0.5  # [L, heads]
        k = min(self.topk, count)
        if count == 0:
            return torch.zeros((n, 0), dtype=torch.int64, device=x.device)
        ready = (positions + 1) // self.rate  # [L] entries complete at each query
        keys_t = keys.t().float()[None]  # [1, dim, T]
        picks = []
        block = max(1, min(n, SCORE_BUDGET // (self.heads * span)))  # a block's scores [b, heads, T] in budget
        for b0 in range(0, n, block):
            b1 = min(n, b0 + block)
            scores = torch.matmul(q[b0:b1].float(), keys_t).relu_().mul_(self.dim**-0.5)  # [b, heads, T], one buffer
            scores = scores.mul_(weights[b0:b1, :, None]).sum(dim=1)  # [b, T]
            future = torch.arange(span, device=x.device)[None, :] >= ready[b0:b1, None]
            picked = scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
            picks.append(torch.where(picked >= ready[b0:b1, None], torch.full_like(picked, -1), picked))
        return torch.cat(picks)
