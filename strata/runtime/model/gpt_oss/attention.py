"""gpt-oss's attention (transformers' `GptOssAttention`): grouped-query attention with q/k/v/o biases, sliding-window
or full by layer, and a learned sink logit per head that joins each query's softmax denominator:

    p_j = exp(s_j) / (exp(sink_h) + sum_j' exp(s_j'))      s = q.k * scale, masked causally (and by the window)

so a head may put part of its mass nowhere. The sink takes no value: the output is sum_j p_j v_j.

Keys and values are cached in the shared `KVCache` for every position of every layer (a sliding-window layer keeps
its full history too: what the planner counts and the scheduler allocates, `KVCache.bytes_per_token`); a
sliding-window layer reads only the keys its queries can see.

A `StepBatch` (prompt chunks, and decode steps off CUDA) attends sequence by sequence (`attend_with_sinks`). A
`DecodeBatch` (one token a sequence, fixed shapes: what a CUDA graph can capture) takes `GQAAttention`'s decode path,
projections, rotary and cache write included, and attends with sinks over the step's `kv_len` cache positions: the
split-KV Triton kernel with its SINKS option on CUDA (`decode_attention`), else `attend_decode_sinks`.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels.gpu.decode_attention import decode_attention, decode_attention_ok
from strata.runtime.model.attention import GQAAttention
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.layers import project

SCORE_BUDGET = 256 << 20  # bytes of fp32 scores one block of queries may hold (long prompts attend in blocks)


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int | None,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """L queries of one sequence over its S cached keys, with a sink logit per head.

    q [L, heads, d], k and v [S, kv_heads, d], sinks [heads] -> [L, heads, d] in q's dtype. Query i sits at key
    position `first` + i; it sees keys j <= first + i and, with a `window`, j > first + i - window. q.k in the
    model's dtype (as transformers' eager attention: no fp32 copy of the cache), then scaled, masked and softmaxed in
    fp32 with the sink column appended (and dropped), the probabilities rounded to v's dtype for the value product.
    Queries run in blocks whose scores stay under `SCORE_BUDGET`."""
    length, heads, d = q.shape
    size, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads  # query head h reads KV head h // group
    qg = q.reshape(length, kv_heads, group, d).permute(1, 2, 0, 3)  # [kv, group, L, d]
    kt = k.permute(1, 2, 0)[:, None]  # [kv, 1, d, S]
    vv = v.permute(1, 0, 2)[:, None]  # [kv, 1, S, d]
    sink = sinks.float().reshape(kv_heads, group, 1, 1)  # [kv, group, 1, 1]
    kpos = torch.arange(size, device=q.device)
    out = torch.empty(kv_heads, group, length, d, dtype=q.dtype, device=q.device)
    block = max(1, SCORE_BUDGET // (heads * size * 4))
    for b0 in range(0, length, block):
        b1 = min(length, b0 + block)
        qpos = torch.arange(first + b0, first + b1, device=q.device)[:, None]
        hidden = kpos[None, :] > qpos  # [blk, S] keys after the query
        if window is not None:
            hidden |= kpos[None, :] <= qpos - window
        scores = torch.matmul(qg[:, :, b0:b1], kt).float() * scale  # [kv, group, blk, S]
        probs = sink_softmax(scores.masked_fill_(hidden, float("-inf")), sink.expand(-1, -1, b1 - b0, 1))
        out[:, :, b0:b1] = torch.matmul(probs.to(v.dtype), vv).to(q.dtype)
    return out.permute(2, 0, 1, 3).reshape(length, heads, d)


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """scores [..., S] fp32 (masked keys -inf), sink [..., 1] fp32 -> probabilities [..., S]: the softmax over the
    keys and the sink column, the sink's share dropped (it takes no value)."""
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def attend_decode_sinks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        pos: torch.Tensor, length: int, window: int | None, scale: float,
                        sinks: torch.Tensor) -> torch.Tensor:
    """One new query per sequence over its cache, with a sink logit per head: the torch counterpart of the SINKS build
    of `decode_attention`.

    q [B, heads, d]; caches [slots, max_len, kv_heads, d]; slots, pos [B] (the new token's position, its key already
    written); sinks [heads] -> [B, heads, d] in q's dtype. A full layer reads positions < `length` (the step's
    bucket) and masks those after pos; a sliding-window layer reads only the last min(window, length) positions up
    to pos (those before 0 masked). Shapes depend only on B, `length` and the window (CUDA-graph friendly). The
    numerics of `attend_with_sinks`: q.k in the cache's dtype, scaled, masked and softmaxed in fp32 with the sink,
    the probabilities rounded to v's dtype for the value product."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads  # query head h reads KV head h // group
    if window is None:
        kpos = torch.arange(length, device=q.device)[None, :]  # [1, S]
        k, v = k_cache[slots, :length], v_cache[slots, :length]  # [B, S, kv, d]
        hidden = kpos > pos[:, None]  # [B, S] keys after the new token (not written for this sequence yet)
    else:
        span = min(window, length)  # the window ends at pos < length: it holds at most `length` positions
        kpos = pos[:, None] - (span - 1) + torch.arange(span, device=q.device)[None, :]  # [B, S] pos-span+1 .. pos
        rows = kpos.clamp(min=0)
        k, v = k_cache[slots[:, None], rows], v_cache[slots[:, None], rows]  # [B, S, kv, d]
        hidden = kpos < 0  # before the sequence's start: clamped duplicates of position 0
    qg = q.reshape(b, kv_heads, group, d)  # [B, kv, group, d]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, kv, group, S]
    sink = sinks.float().reshape(1, kv_heads, group, 1).expand(b, -1, -1, 1)
    probs = sink_softmax(scores.masked_fill_(hidden[:, None, None, :], float("-inf")), sink)
    out = torch.matmul(probs.to(v.dtype), v.permute(0, 2, 1, 3))  # [B, kv, group, d]
    return out.reshape(b, heads, d).to(q.dtype)


class GptOssAttention(GQAAttention):
    """`GQAAttention`'s projections (q/k/v/o with biases) and rotary, attending with sinks (`attend_with_sinks` over a
    StepBatch, `attend_decode_batch` over a DecodeBatch)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))

    def forward(self, x, cos, sin, batch: StepBatch | DecodeBatch,
                cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, hidden] of the step's sequences -> [N, hidden]; the new keys and values written into `cache`
        ([slots, max_len, kv_heads, d] each)."""
        if isinstance(batch, DecodeBatch):  # GQAAttention's decode path (the fused cache write on CUDA), sinks below
            return super().forward(x, cos, sin, batch, cache)
        n = x.shape[0]
        q, k, v = self._project(x)
        q = self._norm_rope(q.view(n, self.num_heads, self.head_dim), cos, sin, None)
        k = self._norm_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin, None)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = cache
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for slot, start, off, length in batch.sequences():
            end = start + length
            k_cache[slot, start:end] = k[off : off + length]
            v_cache[slot, start:end] = v[off : off + length]
            # a window's first query sees nothing before start - window + 1: older keys are not read
            lo = 0 if self.window is None else max(0, start - self.window + 1)
            out[off : off + length] = attend_with_sinks(q[off : off + length], k_cache[slot, lo:end],
                                                        v_cache[slot, lo:end], start - lo, self.window, self.scale,
                                                        self.sinks)
        return project(self.o_proj, out.reshape(n, -1))

    def attend_decode_batch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            batch: DecodeBatch) -> torch.Tensor:
        """q [B, heads, d] over the caches [slots, max_len, kv_heads, d] (the step's keys written), with the sinks,
        over positions < `batch.kv_len` (and this layer's window) -> [B, heads, d]."""
        args = (q, k_cache, v_cache, batch.slots_t, batch.pos_t, batch.kv_len, self.window, self.scale)
        if decode_attention_ok(q, k_cache):  # the split-KV kernel, its SINKS build: reads the cache in place
            return decode_attention(*args, sinks=self.sinks)
        return attend_decode_sinks(*args, self.sinks)
