"""DeepSeek-V4 attention (transformers' `DeepseekV4Attention`): one shared key = value head, a sliding window,
compressed entries, per-head sinks and a grouped output projection.

    q_residual = q_a_norm(q_a_proj(x))                         [N, q_lora]   (also the indexer's query input)
    q          = rope(rms(q_b_proj(q_residual)))               [N, heads, d] (rotary on each head's trailing slice)
    kv         = rope(kv_norm(kv_proj(x)))                     [N, d]        key and value at once
    keys       = the window's last W positions ++ the compressed entries (CSA: the indexer's top-k per query,
                 HCA: every complete entry; sliding_attention layers have none)
    out        = softmax(q k / sqrt(d) ++ sink) v, sink dropped; rotated back by the conjugate at the query position
    o          = o_b_proj(o_a_proj per group of heads (o_groups blocks, each to o_lora_rank))

Sliding-window layers use the "main" rotary, CSA / HCA layers the "compress" one. Each sequence of a step runs on
its own (its window, entries and masks are its own); its new positions enter the cache after it attended.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.cache import LayerCache
from strata.runtime.model.deepseek_v4.compressor import Compressor
from strata.runtime.model.deepseek_v4.config import CSA, SLIDING
from strata.runtime.model.deepseek_v4.indexer import Indexer
from strata.runtime.model.deepseek_v4.norms import FloatRMSNorm, unweighted_rms_norm
from strata.runtime.model.deepseek_v4.rope import InterleavedRope, rotate
from strata.runtime.model.layers import project


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, sequences, cache: LayerCache,
                ropes: dict[str, InterleavedRope]) -> torch.Tensor:
        """x [N, H] (normed), positions [N], `sequences`: (slot, start, offset, length) of each sequence of the step
        (its rows x[offset : offset + length] at positions start..) -> [N, H]."""
        n, nh, d = x.shape[0], self.num_heads, self.head_dim
        rope = ropes[self.rope_kind]
        cos, sin = rope(positions, x.dtype)
        q_residual = self.q_a_norm(project(self.q_a_proj, x))
        q = unweighted_rms_norm(project(self.q_b_proj, q_residual).view(n, nh, d), self.eps)
        q = rotate(q, cos, sin)
        kv = rotate(self.kv_norm(project(self.kv_proj, x))[:, None, :], cos, sin)[:, 0]  # [N, d]
        if self.compressor is not None:
            src_kv, src_gate = self.compressor.project(x)
        out = torch.empty(n, nh, d, dtype=x.dtype, device=x.device)
        for slot, start, off, length in sequences:
            rows = slice(off, off + length)
            keys, mask = self._window(cache, slot, start, kv[rows])
            if self.compressor is not None:
                count = self.compressor.update(cache.compressor, slot, start, src_kv[rows], src_gate[rows],
                                               ropes["compress"])
                entries = cache.compressor.entries[slot, :count]
                keys = torch.cat([keys, entries])
                mask = torch.cat([mask, self._entry_mask(cache, slot, start, length, count, x[rows],
                                                         q_residual[rows], ropes["compress"])], dim=-1)
            out[rows] = self._attend(q[rows], keys, mask)
            self._remember(cache, slot, start, kv[rows])
        out = rotate(out, cos, -sin)  # values carried the keys' rotation: undo it at the query's position
        grouped = out.reshape(n, self.groups, -1)  # [N, g, heads * d / g]
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [g, o_lora, heads * d / g]
        mixed = torch.bmm(grouped.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)  # [N, g, o_lora]
        return project(self.o_b_proj, mixed.reshape(n, -1))

    def _window(self, cache: LayerCache, slot: int, start: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's window keys (the cached positions it still sees ++ its own) [P, d] and the additive mask
        [L, P] (0: attended; -inf: outside the window or in the future)."""
        ring = cache.window.shape[1]
        back = min(start, self.window - 1, ring)
        old = torch.arange(start - back, start, device=kv.device)
        keys = torch.cat([cache.window[slot, old % ring], kv]) if back else kv
        qpos = torch.arange(start, start + kv.shape[0], device=kv.device)[:, None]
        kpos = torch.arange(start - back, start + kv.shape[0], device=kv.device)[None, :]
        seen = (kpos <= qpos) & (kpos > qpos - self.window)
        mask = torch.zeros(seen.shape, dtype=torch.float32, device=kv.device).masked_fill_(~seen, float("-inf"))
        return keys, mask

    def _entry_mask(self, cache: LayerCache, slot: int, start: int, length: int, count: int, x: torch.Tensor,
                    q_residual: torch.Tensor, rope: InterleavedRope) -> torch.Tensor:
        """[L, count] additive mask over the sequence's compressed entries: HCA every complete one, CSA the
        indexer's picks among them."""
        device = x.device
        ready = (torch.arange(start, start + length, device=device) + 1) // self.compressor.rate  # [L]
        if self.kind != CSA:
            seen = torch.arange(count, device=device)[None, :] < ready[:, None]
        else:
            picked = self.compressor.indexer.select(cache.indexer, slot, start, x, q_residual, rope)  # [L, k]
            seen = torch.zeros(length, count + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, torch.where(picked >= 0, picked, count), True)
            seen = seen[:, :count]
        return torch.zeros(seen.shape, dtype=torch.float32, device=device).masked_fill_(~seen, float("-inf"))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [L, heads, d], keys = values [S, d], mask [L, S] -> [L, heads, d], with each head's sink logit."""
        scores = torch.matmul(q.transpose(0, 1), keys.t()[None]) * self.scale  # [heads, L, S]
        scores = scores + mask.to(scores.dtype)[None]
        sinks = self.sinks[:, None, None].expand(-1, q.shape[0], 1)  # fp32: the concatenation promotes to it
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys[None]).transpose(0, 1)  # [L, heads, d]

    def _remember(self, cache: LayerCache, slot: int, start: int, kv: torch.Tensor) -> None:
        """The chunk's last positions into the window ring (after it attended: the ring held older ones)."""
        ring, n = cache.window.shape[1], kv.shape[0]
        keep = min(n, ring)
        cache.window[slot, torch.arange(start + n - keep, start + n, device=kv.device) % ring] = kv[n - keep :]
