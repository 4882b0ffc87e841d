"""DeepSeek-V4 decode steps as `DecodeBatch` steps: B sequences, one new token each, at positions `pos_t` [B] in slots
`slots_t` [B] (device tensors). Every shape below depends on B, the step's `kv_len` bucket and the cache's fixed sizes
only, and nothing is read back to the host, so a step can be captured in a CUDA graph and replayed.

Per layer (W = min(sliding_window - 1, ring) earlier window positions, T = `entry_reads(kv_len, state)`):

    compressor   the new token's kv, gate [B, width] into the source ring at p % R; entry e = p // m pooled from the
                 ring as `Compressor.pool` pools it ([B, m or 2m, dim] rows of window e, and CSA's window e - 1) and
                 written to entries[slot, e] only where the token completes it ((p + 1) % m == 0): a window still
                 filling is pooled over stale ring rows, and `torch.where` keeps the entry it had
    indexer      (CSA) the same at index_head_dim, then scores [B, T] over entries[slot, :T], entries >= (p + 1) // m
                 at -inf; the top k = min(index_topk, T) [B, k], those pointing at an incomplete entry as -1 (the
                 StepBatch path takes k = min(index_topk, count): its picks are these, less the -1s)
    window keys  ring rows of positions p - W .. p - 1 [B, W, d] ++ the new kv [B, 1, d]; positions < 0 masked; the new
                 kv then enters the ring at p % ring
    entries      HCA: entries[slot, :T] [B, T, d], those >= (p + 1) // m masked; CSA: entries[slot, picks] [B, k, d],
                 picks of -1 masked; sliding-window layers: none
    attention    softmax(q k / sqrt(d) ++ sink) over window keys ++ entries [B, heads, W + 1 + T or k + 1], the masked
                 ones at -inf, the sink dropped -> [B, heads, d]

Masked keys weigh exactly 0, so a step equals the StepBatch path's (`DeepseekV4Attention._sequence`) to rounding.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu.deepseek_v4_attention import compress_step, sink_softmax, window_keys
from strata.runtime.model.deepseek_v4.cache import CompressedState, LayerCache
from strata.runtime.model.deepseek_v4.compressor import Compressor
from strata.runtime.model.deepseek_v4.indexer import Indexer
from strata.runtime.model.deepseek_v4.rope import InterleavedRope, rotate
from strata.runtime.model.kv_cache import DecodeBatch
from strata.runtime.model.layers import project


def entry_reads(kv_len: int, state: CompressedState) -> int:
    """Entries a step over `kv_len` positions reads per sequence: every one complete at a position < kv_len
    (kv_len // m), at least 1 (all masked while none is), at most the cache's capacity."""
    return min(state.entries.shape[1], max(1, kv_len // state.rate))


def compress_decode(comp: Compressor, state: CompressedState, batch: DecodeBatch, kv: torch.Tensor,
                    gate: torch.Tensor, rope: InterleavedRope) -> None:
    """The new tokens' kv, gate [B, width] into the source rings, and entry p // m written where it completes."""
    slots, pos = batch.slots_t, batch.pos_t
    m, ring, d = comp.rate, state.ring, comp.dim
    cos, sin = rope.window_starts(pos, m, kv.dtype)  # at e * m
    if compress_step(state.src_kv, state.src_gate, state.entries, kv, gate, slots, pos, comp.position_bias,
                     comp.kv_norm.weight, comp.kv_norm.eps, cos, sin, m, comp.overlap):  # one launch on CUDA
        return
    state.src_kv[slots, pos % ring] = kv
    state.src_gate[slots, pos % ring] = gate
    e = pos // m  # [B] the window each token is in
    if not comp.overlap:  # HCA: ring row j holds window e's position e*m + j (R = m), once it is written
        win_kv = state.src_kv[slots]  # [B, m, d]
        g = state.src_gate[slots] + comp.position_bias  # [B, m, d] fp32 (the bias by position in the window)
        weights = g.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    else:  # CSA: R = 2m; window w's rows are ring rows (w % 2) * m + j; window e - 1's first half, window e's second
        j = torch.arange(m, device=pos.device)
        rows = torch.cat([((e + 1) % 2)[:, None] * m + j, (e % 2)[:, None] * m + j], dim=1)  # [B, 2m]
        src_kv = state.src_kv[slots[:, None], rows]  # [B, 2m, 2d]
        src_g = state.src_gate[slots[:, None], rows] + comp.position_bias.repeat(2, 1)  # [B, 2m, 2d] fp32
        first = (e == 0)[:, None, None]  # window 0 has no Ca: its slots weigh 0
        win_kv = torch.cat([src_kv[:, :m, :d].masked_fill(first, 0), src_kv[:, m:, d:]], dim=1)  # [B, 2m, d]
        win_g = torch.cat([src_g[:, :m, :d].masked_fill(first, float("-inf")), src_g[:, m:, d:]], dim=1)
        weights = win_g.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    pooled = comp.kv_norm((win_kv * weights).sum(dim=1))  # [B, d]
    pooled = rotate(pooled[:, None, :], cos, sin)[:, 0]
    complete = ((pos + 1) % m == 0)[:, None]  # [B, 1]
    state.entries[slots, e] = torch.where(complete, pooled, state.entries[slots, e])


def select_decode(indexer: Indexer, state: CompressedState, batch: DecodeBatch, x: torch.Tensor,
                  q_residual: torch.Tensor, rope: InterleavedRope) -> torch.Tensor:
    """`Indexer.select` for a DecodeBatch: x [B, hidden], q_residual [B, q_lora] -> picks [B, k] int64 (k =
    min(index_topk, entries read); -1: none). Updates the indexer's entries and source ring."""
    pos, b = batch.pos_t, x.shape[0]
    kv, gate = indexer.project(x)
    compress_decode(indexer, state, batch, kv, gate, rope)
    span = entry_reads(batch.kv_len, state)
    keys = state.entries[batch.slots_t, :span]  # [B, T, dim], gathered per sequence
    cos, sin = rope(pos, x.dtype)
    q = rotate(project(indexer.q_b_proj, q_residual).view(b, indexer.heads, indexer.dim), cos, sin)  # [B, heads, dim]
    weights = project(indexer.scorer.weights_proj, x).float() * indexer.heads**-0.5  # [B, heads]
    scores = torch.matmul(q.float(), keys.float().transpose(1, 2)).relu_().mul_(indexer.dim**-0.5)  # [B, heads, T]
    scores = scores.mul_(weights[:, :, None]).sum(dim=1)  # [B, T]
    ready = ((pos + 1) // indexer.rate)[:, None]  # [B, 1] entries complete at each query
    future = torch.arange(span, device=x.device)[None, :] >= ready
    picked = scores.masked_fill(future, float("-inf")).topk(min(indexer.topk, span), dim=-1).indices
    return torch.where(picked >= ready, torch.full_like(picked, -1), picked)


def attend_decode(attn, q: torch.Tensor, kv: torch.Tensor, cache: LayerCache, batch: DecodeBatch,
                  picked: torch.Tensor | None) -> torch.Tensor:
    """One DecodeBatch step of `attn` (a `DeepseekV4Attention`): q [B, heads, d], the new keys kv [B, d], its
    compressor's entries already updated and (CSA) the indexer's picks [B, k] -> [B, heads, d]; the new keys then
    enter the window ring."""
    slots, pos = batch.slots_t, batch.pos_t
    ring = cache.window.shape[1]
    back = min(attn.window - 1, ring)  # earlier positions a query sees in the window (all held by the ring)
    state = cache.compressor
    got = window_keys(cache.window, kv, slots, pos, back, None if state is None else state.entries,
                      0 if state is None else entry_reads(batch.kv_len, state), 1 if state is None else state.rate,
                      picked)  # one launch on CUDA
    keys, seen = got if got is not None else _window_keys(cache, kv, batch, back, picked)
    probs = sink_probs(torch.matmul(q, keys.transpose(1, 2)), seen, attn.sinks, attn.scale)  # [B, heads, P]
    return torch.matmul(probs, keys)  # [B, heads, d]


def _window_keys(cache: LayerCache, kv: torch.Tensor, batch: DecodeBatch, back: int,
                 picked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_keys` in torch: (keys [B, P, d], seen [B, P]); kv then enters the ring."""
    slots, pos = batch.slots_t, batch.pos_t
    ring = cache.window.shape[1]
    kpos = pos[:, None] + torch.arange(-back, 0, device=pos.device)  # [B, W]
    old = cache.window[slots[:, None], kpos % ring]  # [B, W, d]
    keys = [old, kv[:, None]]
    seen = [kpos >= 0, torch.ones_like(pos, dtype=torch.bool)[:, None]]
    state = cache.compressor
    if picked is not None:  # CSA: each query's own picks
        keys.append(state.entries[slots[:, None], picked.clamp(min=0)])  # [B, k, d]
        seen.append(picked >= 0)
    elif state is not None:  # HCA: every entry complete at the query
        span = entry_reads(batch.kv_len, state)
        keys.append(state.entries[slots, :span])  # [B, T, d]
        seen.append(torch.arange(span, device=pos.device)[None, :] < ((pos + 1) // state.rate)[:, None])
    keys, seen = torch.cat(keys, dim=1), torch.cat(seen, dim=1)  # [B, P, d], [B, P]
    cache.window[slots, pos % ring] = kv  # after the gather: the ring row it replaces held position p - ring
    return keys, seen


def sink_probs(scores: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [B, heads, P] (q k) -> the attention weights [B, heads, P] in their dtype: softmax over the scaled scores
    (unseen keys [B, P] at -inf) and each head's sink logit (fp32), the sink's own weight dropped."""
    probs = sink_softmax(scores, seen, sinks, scale)  # one launch on CUDA
    if probs is not None:
        return probs
    scores = scores * scale
    sink = sinks[None, :, None].expand(scores.shape[0], -1, 1)  # fp32: the concatenation promotes to it
    logits = torch.cat([scores.masked_fill(~seen[:, None], float("-inf")), sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return logits.softmax(dim=-1, dtype=logits.dtype)[..., :-1].to(scores.dtype)
