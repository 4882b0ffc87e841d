"""Qwen3.5-MoE's full-attention layers (transformers' Qwen3_5MoeAttention): GQA with an output gate.

    q, gate = q_proj(x) split per head             [N, heads, d] each (q_proj's rows: q then gate, head by head)
    q, k    = rotary(norm(q)), rotary(norm(k))     zero-centred RMS norms per head; rotary on the first
                                                   partial_rotary_factor of each head
    out     = o_proj(attention(q, k, v) * sigmoid(gate))

Keys and values go to the layer's cache slabs [slots, kv_heads, max_len, d] (head-major: a sequence's keys of one head
are one contiguous run, read in place by the CPU's decode product); each sequence of a `StepBatch` attends over its
own prefix. A `DecodeBatch` (one token a sequence, fixed shapes: what a CUDA graph captures) writes its keys at each
sequence's position and attends over the step's `kv_len` positions, masked by position: the split-KV Triton kernel
on CUDA, reading the slabs in place through their position-major view, else `attend_decode`.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels.gpu.decode_attention import decode_attention, decode_attention_ok
from strata.runtime.model.attention import attend, attend_decode
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.layers import project
from strata.runtime.model.qwen3_5.norms import ZeroCenteredRMSNorm
from strata.runtime.model.rope import apply_rope


def attend_decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head over every cached key of one sequence on the CPU: q [heads, 1, d], k, v [kv_heads, S, d]
    (each head's rows contiguous, as the cache holds them) -> [heads, 1, d] in q's dtype. Per KV head two matrix
    products in the cache's dtype (accumulated in fp32) with that head's query heads as rows, the softmax in fp32, as
    transformers' eager attention: the keys and values are read in place, once. (A batched product over the heads
    copies the keys transposed first, and an fp32 copy of them costs more than the products: at 8K context either
    took several times a CPU decode step's attention.)"""
    kv_heads, d = k.shape[0], q.shape[-1]
    qg = q.reshape(kv_heads, -1, d)  # [kv_heads, group, d]: query head h reads KV head h // group
    out = torch.empty(qg.shape, dtype=v.dtype, device=v.device)
    for h in range(kv_heads):
        scores = torch.mm(qg[h].to(k.dtype), k[h].t()).float().mul_(scale)  # [group, S]
        torch.mm(scores.softmax(-1).to(v.dtype), v[h], out=out[h])  # [group, d]
    return out.reshape(q.shape[0], 1, d).to(q.dtype)


class GatedAttention(nn.Module):
    """`forward(x [N, H], cos, sin, batch, (k_cache, v_cache)) -> [N, H]` for the flat tokens of a `StepBatch`."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = cfg.num_heads, cfg.num_kv_heads, d, cfg.attention_scale
        self.q_proj = nn.Linear(h, cfg.num_heads * d * 2, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch | DecodeBatch,
                cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, gate = project(self.q_proj, x).view(n, self.num_heads, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(n, self.num_heads * d)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(project(self.k_proj, x).view(n, self.num_kv_heads, d)), cos, sin)
        v = project(self.v_proj, x).view(n, self.num_kv_heads, d)
        k_cache, v_cache = cache
        if isinstance(batch, DecodeBatch):
            out = self.attend_decode_batch(q, k, v, k_cache, v_cache, batch)
            return project(self.o_proj, out.reshape(n, -1) * torch.sigmoid(gate))
        out = torch.empty(n, self.num_heads, d, dtype=x.dtype, device=x.device)
        for slot, start, off, length in batch.sequences():
            end = start + length
            k_cache[slot, :, start:end] = k[off : off + length].transpose(0, 1)
            v_cache[slot, :, start:end] = v[off : off + length].transpose(0, 1)
            qs = q[off : off + length].transpose(0, 1)  # [heads, L, d]
            ks, vs = k_cache[slot, :, :end], v_cache[slot, :, :end]  # [kv_heads, S, d]
            if length == 1 and x.device.type == "cpu":
                o = attend_decode_row(qs, ks, vs, self.scale)
            else:
                o = attend(qs, ks, vs, start, None, self.scale)
            out[off : off + length] = o.transpose(0, 1)
        return project(self.o_proj, out.reshape(n, -1) * torch.sigmoid(gate))

    def attend_decode_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """A decode step's attention: q [B, heads, d], the new k, v [B, kv_heads, d] written at each sequence's
        position of the slabs [slots, kv_heads, max_len, d], then attended over positions < `batch.kv_len` that are
        <= each sequence's -> [B, heads, d]."""
        k_cache[batch.slots_t, :, batch.pos_t] = k
        v_cache[batch.slots_t, :, batch.pos_t] = v
        kc, vc = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # [slots, max_len, kv_heads, d] views
        if decode_attention_ok(q, kc):  # reads the slabs in place: no window gather, no mask
            return decode_attention(q, kc, vc, batch.slots_t, batch.pos_t, batch.kv_len, None, self.scale)
        length = batch.kv_len
        return attend_decode(q, kc[batch.slots_t, :length], vc[batch.slots_t, :length], batch.pos_t, None,
                             self.scale)
