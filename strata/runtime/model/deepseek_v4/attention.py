"""DeepSeek-V4 attention (transformers' `DeepseekV4Attention`): one shared key = value head, a sliding window,
compressed entries, per-head sinks and a grouped output projection.

    q_residual = q_a_norm(q_a_proj(x))                         [N, q_lora]   (also the indexer's query input)
    q          = rope(rms(q_b_proj(q_residual)))               [N, heads, d] (rotary on each head's trailing slice)
    kv         = rope(kv_norm(kv_proj(x)))                     [N, d]        key and value at once
    keys       = the window's last W positions ++ the compressed entries (CSA: the indexer's top-k per query,
                 HCA: every complete entry; sliding_attention layers have none)
    out        = softmax(q k / sqrt(d) ++ sink) v, sink dropped; rotated back by the conjugate at the query position
    o          = o_b_proj(o_a_proj per group of heads (o_groups blocks, each to o_lora_rank))

Sliding-window layers use the "main" rotary, CSA / HCA layers the "compress" one. Each sequence of a `StepBatch`
(prompt chunks, and decode steps off CUDA) runs on its own (its window, entries and masks are its own); its new
positions enter the cache after it attended. A `DecodeBatch` (one token a sequence, fixed shapes: what a CUDA graph
captures) runs all its sequences at once over masked window keys and entries (strata.runtime.model.deepseek_v4.decode).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.cache import LayerCache
from strata.runtime.model.deepseek_v4.compressor import Compressor, entry_span
from strata.runtime.model.deepseek_v4.config import CSA, SLIDING
from strata.runtime.model.deepseek_v4.decode import attend_decode, compress_decode, select_decode
from strata.runtime.model.deepseek_v4.indexer import Indexer
from strata.runtime.model.deepseek_v4.norms import FloatRMSNorm
from strata.runtime.model.deepseek_v4.rope import InterleavedRope, normed_rotate, rotate
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.layers import project

SCORE_BUDGET = 1 << 22  # elements of a query block's scores (and gathered entries): 16 MB in fp32


class CSACompressor(Compressor):
    """The CSA layer's compressor (overlapping windows) with the lightning indexer inside, as transformers nests them."""

    def __init__(self, cfg: ModelConfig, rate: int):
        s = cfg.deepseek_v4
        super().__init__(cfg.hidden_size, cfg.head_dim, rate, overlap=True, eps=cfg.rms_norm_eps)
        self.indexer = Indexer(cfg.hidden_size, cfg.q_lora_rank, s.index_n_heads, s.index_head_dim, rate,
                               s.index_topk, cfg.rms_norm_eps)


class DeepseekV4Attention(nn.Module):
    """One layer's attention; `forward(x [N, H], batch, cache, ropes) -> [N, H]`."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        s = cfg.deepseek_v4
        h, nh, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.num_heads, self.head_dim, self.eps = nh, d, cfg.rms_norm_eps
        self.window, self.scale, self.groups = s.sliding_window, d**-0.5, s.o_groups
        self.kind = s.layer_types[layer]
        self.rope_kind = "main" if self.kind == SLIDING else "compress"
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_norm = FloatRMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * d, bias=False)
        self.kv_proj = nn.Linear(h, d, bias=False)
        self.kv_norm = FloatRMSNorm(d, cfg.rms_norm_eps)
        # grouped output projection: o_groups blocks of (heads * d / o_groups) -> o_lora_rank, stacked
        self.o_a_proj = nn.Linear(nh * d // s.o_groups, s.o_groups * s.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(s.o_groups * s.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(nh, dtype=torch.float32))
        rate = s.rate(layer)
        if self.kind == SLIDING:
            self.compressor = None
        elif self.kind == CSA:
            self.compressor = CSACompressor(cfg, rate)
        else:
            self.compressor = Compressor(h, d, rate, overlap=False, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: StepBatch | DecodeBatch, cache: LayerCache,
                ropes: dict[str, InterleavedRope]) -> torch.Tensor:
        """x [N, H] (normed), positions [N], the step's `batch` (a StepBatch's sequence i: rows x[offset : offset +
        length] at positions start..; a DecodeBatch: row b at pos_t[b]) -> [N, H]."""
        n, nh, d = x.shape[0], self.num_heads, self.head_dim
        rope = ropes[self.rope_kind]
        cos, sin = rope(positions, x.dtype)
        q_residual = self.q_a_norm(project(self.q_a_proj, x))
        q = normed_rotate(project(self.q_b_proj, q_residual).view(n, nh, d), self.eps, cos, sin)
        kv = rotate(self.kv_norm(project(self.kv_proj, x))[:, None, :], cos, sin)[:, 0]  # [N, d]
        if self.compressor is not None:
            src_kv, src_gate = self.compressor.project(x)
        if isinstance(batch, DecodeBatch):
            picked = None
            if self.compressor is not None:
                compress_decode(self.compressor, cache.compressor, batch, src_kv, src_gate, ropes["compress"])
                if self.kind == CSA:
                    picked = select_decode(self.compressor.indexer, cache.indexer, batch, x, q_residual,
                                           ropes["compress"])  # [B, k]
            return self._output(attend_decode(self, q, kv, cache, batch, picked), cos, sin)
        out = torch.empty(n, nh, d, dtype=x.dtype, device=x.device)
        for slot, start, off, length in batch.sequences():
            rows = slice(off, off + length)
            entries, picked = None, None
            if self.compressor is not None:
                count = self.compressor.update(cache.compressor, slot, start, src_kv[rows], src_gate[rows],
                                               ropes["compress"])
                # [T, d]: whole steps of entries (those from `count` on are masked like incomplete ones)
                entries = cache.compressor.entries[slot, :entry_span(count, cache.compressor.entries.shape[1])]
                if self.kind == CSA:
                    picked = self.compressor.indexer.select(cache.indexer, slot, start, x[rows], q_residual[rows],
                                                            ropes["compress"])  # [L, k]
            out[rows] = self._sequence(q[rows], kv[rows], cache, slot, start, entries, picked)
            self._remember(cache, slot, start, kv[rows])
        return self._output(out, cos, sin)

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [N, heads, d] -> [N, H]: rotated back, then the grouped output projection."""
        n = out.shape[0]
        out = rotate(out, cos, sin, conjugate=True)  # values carried the keys' rotation: undo it at the query's position
        grouped = out.reshape(n, self.groups, -1)  # [N, g, heads * d / g]
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [g, o_lora, heads * d / g]
        mixed = torch.bmm(grouped.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)  # [N, g, o_lora]
        return project(self.o_b_proj, mixed.reshape(n, -1))

    def _sequence(self, q: torch.Tensor, kv: torch.Tensor, cache: LayerCache, slot: int, start: int,
                  entries: torch.Tensor | None, picked: torch.Tensor | None) -> torch.Tensor:
        """One sequence's chunk: q [L, heads, d], its new keys kv [L, d], the compressed entries [T, d] it may see
        and (CSA) the indexer's picks [L, k] -> [L, heads, d]. Queries go in blocks whose scores stay within
        `SCORE_BUDGET` elements: each block reads the window positions it can see and its own entries."""
        n, nh, dev = kv.shape[0], self.num_heads, kv.device
        ring = cache.window.shape[1]
        back = min(start, self.window - 1, ring)
        old = torch.arange(start - back, start, device=dev) % ring
        window = torch.cat([cache.window[slot, old], kv]) if back else kv  # positions start - back ..
        seen_entries = 0 if entries is None else picked.shape[1] if picked is not None else entries.shape[0]
        gathered = picked.shape[1] * self.head_dim if picked is not None else 0  # CSA: [k, d] per query

        def cost(b: int) -> int:  # elements a block of b queries holds: scores, and CSA's gathered entries
            return b * (nh * (b + self.window + seen_entries) + gathered)

        block = min(n, 1024)
        while block > 1 and cost(block) > SCORE_BUDGET:
            block //= 2
        out = torch.empty_like(q)
        for b0 in range(0, n, block):
            b1 = min(n, b0 + block)
            lo = max(0, back + b0 - (self.window - 1))  # the first window key the block's first query sees
            keys = window[lo : back + b1]
            qpos = torch.arange(start + b0, start + b1, device=dev)[:, None]
            kpos = torch.arange(start - back + lo, start + b1, device=dev)[None, :]
            seen = (kpos <= qpos) & (kpos > qpos - self.window)
            sel = None
            if picked is not None:  # CSA: each query's own entries
                sel = picked[b0:b1]
                ent = entries[sel.clamp(min=0)]  # [Lb, k, d]
                ent_seen = sel >= 0
            elif entries is not None:  # HCA: every entry complete at the query
                ent = entries
                ent_seen = torch.arange(entries.shape[0], device=dev)[None, :] < (qpos + 1) // self.compressor.rate
            else:
                ent = ent_seen = None
            out[b0:b1] = self._attend(q[b0:b1], keys, seen, ent, ent_seen, per_query=sel is not None)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, ent: torch.Tensor | None,
                ent_seen: torch.Tensor | None, per_query: bool) -> torch.Tensor:
        """q [L, heads, d] over window keys = values [P, d] (`seen` [L, P]) and compressed entries (shared [T, d], or
        per query [L, k, d] with `per_query`; `ent_seen` [L, T or k]), with each head's sink logit -> [L, heads, d].
        The logits are transformers' (q k / sqrt(d) + mask, the sink appended, the maximum subtracted) over the keys
        a query may see; the ones it may not would weigh exactly 0 there."""
        scores = torch.matmul(q.transpose(0, 1), keys.t()[None]) * self.scale  # [heads, L, P]
        parts = [scores.masked_fill(~seen[None], float("-inf"))]
        if ent is not None:
            if per_query:
                s_ent = torch.einsum("lhd,lkd->hlk", q, ent) * self.scale  # [heads, L, k]
            else:
                s_ent = torch.matmul(q.transpose(0, 1), ent.t()[None]) * self.scale  # [heads, L, T]
            parts.append(s_ent.masked_fill(~ent_seen[None], float("-inf")))
        parts.append(self.sinks[:, None, None].expand(-1, q.shape[0], 1))  # fp32: the concatenation promotes to it
        logits = torch.cat(parts, dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1, dtype=logits.dtype).to(keys.dtype)
        p = keys.shape[0]
        o = torch.matmul(probs[..., :p], keys[None])  # [heads, L, d]
        if ent is not None:
            p_ent = probs[..., p:-1]
            o = o + (torch.einsum("hlk,lkd->hld", p_ent, ent) if per_query else torch.matmul(p_ent, ent[None]))
        return o.transpose(0, 1)

    def _remember(self, cache: LayerCache, slot: int, start: int, kv: torch.Tensor) -> None:
        """The chunk's last positions into the window ring (after it attended: the ring held older ones)."""
        ring, n = cache.window.shape[1], kv.shape[0]
        keep = min(n, ring)
        cache.window[slot, torch.arange(start + n - keep, start + n, device=kv.device) % ring] = kv[n - keep :]
