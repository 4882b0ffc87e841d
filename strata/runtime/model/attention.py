"""Attention: grouped-query attention (Qwen, Mixtral) and multi-head latent attention (DeepSeek-V3).

Both take the flat token batch of a `StepBatch` (x [N, hidden]), write the new keys into the
preallocated cache, and attend each sequence over its cached prefix with a causal (optionally
sliding-window) mask. Parameter names mirror transformers' so checkpoints load by name.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from strata.kernels.cpu import dense, rows
from strata.kernels.gpu import fused
from strata.kernels.gpu.decode_attention import decode_attention, decode_attention_ok
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.hugepages import copy_to_huge_pages
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.layers import RMSNorm, linear, project
from strata.runtime.model.rope import apply_rope

# A prompt's causal attention on CUDA (no window: the cases flash attention takes, GQA included) runs without SDPA's
# cuDNN backend: cuDNN's costs the host ~5 ms a call (an H100 host, torch 2.11), which a prefill's layers wait through
# one by one. On the 12-layer bench model that was 60-70 ms of every prefill, from 128 tokens at a 25% budget to 8K
# tokens, against 6-9 ms without it (bench/probes/prefill_phases.py --no-cudnn-attention; docs/benchmarks.md, "A
# prompt's attention without cuDNN"). A sliding window's boolean mask keeps SDPA's own choice. `sdpa_kernel` sets
# torch's process-wide backend flags and puts back what it found: the lock keeps two threads (pipeline stages, engines
# of one process) from interleaving those, which could leave the flags as neither found them.
PROMPT_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_SDPA_FLAGS = threading.Lock()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None, scale: float) -> torch.Tensor:
    """Causal attention of L new queries over S = start + L cached keys.

    q [heads, L, d], k [kv_heads, S, d], v [kv_heads, S, dv] -> [heads, L, dv]. Query i sits at
    position start + i; key j at position j; with a window, keys older than `window` are masked.
    """
    if q.is_cuda and window is None:
        with _SDPA_FLAGS, sdpa_kernel(PROMPT_SDPA_BACKENDS):
            return _attend(q, k, v, start, window, scale)
    return _attend(q, k, v, start, window, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None, scale: float) -> torch.Tensor:
    L, S = q.shape[1], k.shape[1]
    gqa = q.shape[0] != k.shape[0]
    if L == 1 and window is None and q.device.type == "cpu":
        return attend_one(q, k, v, scale)
    if window is None and start == 0:
        mask, causal = None, True
    elif window is None and L == 1:
        mask, causal = None, False
    elif window is None and S == start + L:
        # A later prefill chunk: causal aligned to the bottom right. As a CausalBias (not a boolean mask)
        # SDPA keeps its flash kernel; a [L, S] mask would force the math path, which materialises
        # [heads, L, S] scores (2.6 GB and ~1 s per 512-token chunk at 40K context on an H200).
        if gqa:  # the flash dispatch of a CausalBias takes equal head counts: repeat the KV heads
            rep = q.shape[0] // k.shape[0]
            k = k[:, None].expand(-1, rep, -1, -1).reshape(q.shape[0], S, k.shape[-1])
            v = v[:, None].expand(-1, rep, -1, -1).reshape(q.shape[0], S, v.shape[-1])
        from torch.nn.attention.bias import causal_lower_right  # here: importing it loads torch._dynamo (~1 s)

        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal_lower_right(L, S), scale=scale)
        return out[0]
    else:
        qpos = torch.arange(start, start + L, device=q.device)[:, None]
        kpos = torch.arange(S, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        causal = False
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    return out[0]


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head over every cached key (a CPU decode row): q [heads, 1, d], k [kv_heads, S, d], v [kv_heads,
    S, dv] -> [heads, 1, dv] in q's dtype. Two batched matmuls with each KV head's query heads as rows, in fp32 (as
    SDPA's CPU kernels accumulate): torch's SDPA spends ~0.6 ms a call on this (one thread, bf16, 100 keys), about
    what the layer's projections take to stream from RAM."""
    heads, kv_heads, d = q.shape[0], k.shape[0], q.shape[-1]
    qg = q.reshape(kv_heads, heads // kv_heads, d).float()  # query head h reads KV head h // (heads / kv_heads)
    scores = torch.bmm(qg, k.float().transpose(1, 2)).mul_(scale)  # [kv_heads, group, S]
    out = torch.bmm(scores.softmax(-1), v.float())  # [kv_heads, group, dv]
    return out.reshape(heads, 1, v.shape[-1]).to(q.dtype)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int | None,
                  scale: float) -> torch.Tensor:
    """One new query per sequence over a fixed-length cache window, masked by position.

    q [B, heads, d], k [B, L, kv_heads, d], v [B, L, kv_heads, dv], pos [B] -> [B, heads, dv].
    Keys at positions > pos (not written yet, or another step's) and, with a window, older than
    `window` are masked, so the shapes depend only on B and L (CUDA-graph friendly).
    """
    kpos = torch.arange(k.shape[1], device=q.device)[None, :]
    mask = kpos <= pos[:, None]  # [B, L]
    if window is not None:
        mask &= kpos > pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
    return out[:, :, 0]


def attend_latent(q_lat: torch.Tensor, q_rot: torch.Tensor, lat: torch.Tensor, rot: torch.Tensor, pos: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """MLA's absorbed decode attention: every head over the one shared latent key and value, masked by position.

    q_lat [B, heads, kv_lora], q_rot [B, heads, rope], lat [B, S, kv_lora], rot [B, S, rope], pos [B]
    -> [B, heads, kv_lora]. Key = lat ++ rot, value = lat. Two batched matmuls with the heads as rows read the
    window once each; SDPA would not: no fused kernel takes a 576-wide head, and its math fallback repeats the
    one KV head for all 128 query heads (DeepSeek-V3 at 4K context: 2.6 ms a layer against ~0.8 ms expanded).
    Logits in fp32 (the two halves added before rounding), probabilities rounded to the cache's dtype for the
    value product, as transformers' eager attention does."""
    scores = torch.bmm(q_lat, lat.transpose(1, 2)).float() + torch.bmm(q_rot, rot.transpose(1, 2)).float()
    kpos = torch.arange(lat.shape[1], device=lat.device)
    scores = scores.mul_(scale).masked_fill_((kpos[None, :] > pos[:, None])[:, None, :], float("-inf"))  # [B, heads, S]
    return torch.bmm(scores.softmax(-1).to(lat.dtype), lat)


class GQAAttention(nn.Module):
    """Grouped-query attention with optional q/k RMSNorm (per head: Qwen3; over all heads: MiniMax-M2) and q/k/v
    biases (Qwen2)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.window, self.scale = cfg.sliding_windows[layer], cfg.attention_scale
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        # per head [d] (Qwen3, folded into the rotary's launch), or over the whole projection (MiniMax-M2)
        self.qk_norm_whole = cfg.qk_norm_whole
        self.q_norm = RMSNorm(cfg.num_heads * d if self.qk_norm_whole else d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.num_kv_heads * d if self.qk_norm_whole else d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # q/k/v weights (biases) stacked, see _project

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, heads * d], k, v [N, kv_heads * d]. With the folds (on CUDA, decode-sized N), one GEMM over the three weights
        stacked [(heads + 2 kv_heads) * d, H]: two launches fewer per decode layer, where each costs more than
        reading its 2 MB of weights. The three parameters become views of the stacked tensor, so it costs no
        memory and the checkpoint names stay; it is rebuilt if they were moved or replaced since."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        qkv = self._project_stacked(x)
        if qkv is None:
            return tuple(project(p, x) for p in projs)
        return self._split(qkv)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked projection [N, (heads + 2 kv_heads) * d] -> views q, k, v."""
        return qkv.split([p.out_features for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)

    def _project_stacked(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [N, H] -> [N, (heads + 2 kv_heads) * d], q's, k's and v's columns in that order, through the stacked
        weights (`_project`); None where the folds do not apply."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not fused.fold_ok(x) and not dense.applies(x, self.q_proj.weight):  # (CPU decode rows: one pool call)
            return None
        stacked = self._qkv
        if stacked is None or not _views_of(stacked[0], [p.weight for p in projs]):
            if x.is_cuda and torch.cuda.is_current_stream_capturing():  # never allocate the weights in a graph's pool
                return None
            stacked = self._qkv = (_stack_into_views([p.weight for p in projs]),
                                   _stack_into_views([p.bias for p in projs]) if projs[0].bias is not None else None)
        return linear(x, *stacked)

    @staticmethod
    def _norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """Optional per-head RMSNorm, then rotary: x [N, heads, d]. One kernel on CUDA instead of ~10-15, one
        compiled call for CPU decode rows."""
        weight = norm.weight if norm is not None else None
        if x.device.type == "cpu":
            y = rows.norm_rope(x, cos, sin, weight, norm.eps if norm is not None else 0.0)
            if y is not None:
                return y
        if fused.norm_rope_ok(x, cos, weight):
            return fused.norm_rope(x, cos, sin, weight, norm.eps if norm is not None else 0.0)
        return apply_rope(norm(x) if norm is not None else x, cos, sin)

    def forward(self, x, cos, sin, batch: StepBatch, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        qkv = None
        if x.device.type == "cpu" and (seqs := self._decode_rows(x, batch)) is not None:
            # a CPU decode step: the stacked projection, then everything up to the output projection in one compiled
            # call (the path below where it does not take these caches or norms)
            qkv = self._project_stacked(x)
            norms = [(m.weight, m.eps) if m is not None else None for m in (self.q_norm, self.k_norm)]
            out = None if qkv is None else rows.decode_attention(
                qkv, self.num_heads, self.num_kv_heads, cos, sin, *norms, *cache, [s for s, _ in seqs],
                [start for _, start in seqs], self.scale)
            if out is not None:
                return project(self.o_proj, out.reshape(n, -1))
        q, k, v = self._split(qkv) if qkv is not None else self._project(x)
        q_norm, k_norm = self.q_norm, self.k_norm  # the per-head norms, applied with the rotary below
        if self.qk_norm_whole:  # q [N, heads * d], k [N, kv_heads * d] normed as one vector a token
            q, k, q_norm, k_norm = q_norm(q), k_norm(k), None, None
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = cache
        k_weight = k_norm.weight if k_norm is not None else None
        if isinstance(batch, DecodeBatch) and fused.cache_write_ok(k, v, cos, k_weight, k_cache, v_cache):
            # the keys' norm and rotary land straight in the cache, with the values, and the queries' norm and
            # rotary run in the same launch: one kernel where torch takes ~20
            eps = k_norm.eps if k_norm is not None else 0.0
            q_weight = q_norm.weight if q_norm is not None else None
            fold_q = fused.QK_FOLD and fused.norm_rope_ok(q, cos, q_weight)
            folded = fused.norm_rope_into_cache(k, v, cos, sin, k_weight, eps, k_cache, v_cache, batch.slots_t,
                                                batch.pos_t, q=q if fold_q else None, q_weight=q_weight,
                                                q_eps=q_norm.eps if q_norm is not None else 0.0)
            q = folded if fold_q else self._norm_rope(q, cos, sin, q_norm)
        else:
            q = self._norm_rope(q, cos, sin, q_norm)
            k = self._norm_rope(k, cos, sin, k_norm)
            if isinstance(batch, DecodeBatch):
                k_cache[batch.slots_t, batch.pos_t] = k
                v_cache[batch.slots_t, batch.pos_t] = v
        if isinstance(batch, DecodeBatch):
            return project(self.o_proj, self.attend_decode_batch(q, k_cache, v_cache, batch).reshape(n, -1))
        if x.device.type == "cpu" and (out := self._attend_rows(q, k, v, batch, k_cache, v_cache)) is not None:
            return project(self.o_proj, out.reshape(n, -1))
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for slot, start, off, length in batch.sequences():
            end = start + length
            k_cache[slot, start:end] = k[off : off + length]
            v_cache[slot, start:end] = v[off : off + length]
            o = attend(
                q[off : off + length].transpose(0, 1),  # [heads, L, d]
                k_cache[slot, :end].transpose(0, 1),  # [kv_heads, S, d]
                v_cache[slot, :end].transpose(0, 1),
                start, self.window, self.scale,
            )
            out[off : off + length] = o.transpose(0, 1)
        return project(self.o_proj, out.reshape(n, -1))

    def _decode_rows(self, x: torch.Tensor, batch: StepBatch) -> list[tuple[int, int]] | None:
        """(slot, position) of each row of a CPU decode step that `strata.kernels.cpu.rows.decode_attention` can take
        whole (one new token per sequence, in row order; no window; per-head norms or none; bf16), else None."""
        if (self.window is not None or self.qk_norm_whole or x.shape[0] > rows.MAX_ROWS or x.dtype != torch.bfloat16
                or not rows.attends(self.head_dim, self.head_dim) or isinstance(batch, DecodeBatch)):
            return None
        seqs = list(batch.sequences())
        if any(length != 1 or off != i for i, (_, _, off, length) in enumerate(seqs)):
            return None
        return [(slot, start) for slot, start, _, _ in seqs]

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> torch.Tensor | None:
        """A CPU decode step (one new token per sequence, no window): the new keys and values written to the cache,
        then every sequence's attention in one compiled call (strata.kernels.cpu.rows.attend) -> [N, heads, d];
        None where that call does not apply (the caller's loop then runs, rewriting the same cache rows)."""
        if (self.window is not None or q.shape[0] > rows.MAX_ROWS or q.dtype != torch.bfloat16
                or not rows.attends(q.shape[-1], v.shape[-1])):
            return None
        seqs = list(batch.sequences())
        if any(length != 1 for _, _, _, length in seqs):
            return None
        for slot, start, off, _ in seqs:
            k_cache[slot, start] = k[off]
            v_cache[slot, start] = v[off]
        keys = [k_cache[slot, : start + 1] for slot, start, _, _ in seqs]  # row i of q is sequence i (offsets 0..N-1)
        values = [v_cache[slot, : start + 1] for slot, start, _, _ in seqs]
        return rows.attend(q, keys, values, self.scale)

    def attend_decode_batch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            batch: DecodeBatch) -> torch.Tensor:
        """A decode step's attention, its new keys and values already in the cache: q [B, heads, d] over the caches
        [slots, max_len, kv_heads, d], positions < `batch.kv_len` masked by each sequence's position (and window)
        -> [B, heads, d]. gpt-oss's attention adds its sinks here."""
        length = batch.kv_len
        if decode_attention_ok(q, k_cache):  # reads the cache in place: no window gather, no mask
            return decode_attention(q, k_cache, v_cache, batch.slots_t, batch.pos_t, length, self.window, self.scale)
        return attend_decode(q, k_cache[batch.slots_t, :length], v_cache[batch.slots_t, :length], batch.pos_t,
                             self.window, self.scale)


def _stack_into_views(params: list[nn.Parameter]) -> torch.Tensor:
    """Concatenate `params` along dim 0 into one tensor and make each parameter a view of its rows."""
    stacked = torch.cat([p.data for p in params])
    if stacked.device.type == "cpu":  # the weights a CPU decode streams: in 2 MiB pages, as the model loaded them
        stacked = copy_to_huge_pages(stacked)
    for p, part in zip(params, stacked.split([p.shape[0] for p in params]), strict=True):
        p.data = part
    return stacked


def _views_of(stacked: torch.Tensor, params: list[nn.Parameter]) -> bool:
    """Whether `params` are still consecutive row views of `stacked` (not moved or replaced since)."""
    offset, row = stacked.data_ptr(), stacked.stride(0) * stacked.element_size()
    for p in params:
        if p.data_ptr() != offset or p.device != stacked.device:
            return False
        offset += p.shape[0] * row
    return True


class MLAAttention(nn.Module):
    """DeepSeek multi-head latent attention: low-rank q, compressed KV latent plus a shared rope key.

    The cache holds the normalised latent c_kv [S, kv_lora_rank] and the rotated k_rot [S, rope_dim];
    keys and values are expanded through kv_b_proj when attending.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.scale, self.interleave = nh, cfg.attention_scale, cfg.rope_interleave
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=cfg.o_bias)

    def forward(self, x, cos, sin, batch: StepBatch, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n, nh = x.shape[0], self.num_heads
        proj = project  # decode rows through the fast paths (the Triton GEMV on CUDA, the CPU kernel's pool)
        if self.q_lora_rank is None:
            q = proj(self.q_proj, x)
        else:
            q = proj(self.q_b_proj, self.q_a_layernorm(proj(self.q_a_proj, x)))
        q = q.view(n, nh, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = proj(self.kv_a_proj_with_mqa, x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = apply_rope(q_rot, cos, sin, self.interleave)
        k_rot = apply_rope(k_rot[:, None, :], cos, sin, self.interleave)[:, 0]
        lat_cache, rot_cache = cache
        if isinstance(batch, DecodeBatch):
            lat_cache[batch.slots_t, batch.pos_t] = latent
            rot_cache[batch.slots_t, batch.pos_t] = k_rot
            length = batch.kv_len
            lat, rot = lat_cache[batch.slots_t, :length], rot_cache[batch.slots_t, :length]
            o = self.attend_absorbed(q_nope, q_rot, lat, rot, batch.pos_t)
            return proj(self.o_proj, o.reshape(n, -1))
        q = torch.cat((q_nope, q_rot), dim=-1)  # [N, heads, qk]
        out = torch.empty(n, nh, self.v_dim, dtype=x.dtype, device=x.device)
        for slot, start, off, length in batch.sequences():
            end = start + length
            lat_cache[slot, start:end] = latent[off : off + length]
            rot_cache[slot, start:end] = k_rot[off : off + length]
            kv = self.kv_b_proj(lat_cache[slot, :end]).view(end, nh, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat((k_nope, rot_cache[slot, :end, None, :].expand(end, nh, self.rope_dim)), dim=-1)
            o = attend(
                q[off : off + length].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), start, None, self.scale
            )
            out[off : off + length] = o.transpose(0, 1)
        return project(self.o_proj, out.reshape(n, -1))

    def attend_absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, lat: torch.Tensor, rot: torch.Tensor,
                        pos: torch.Tensor) -> torch.Tensor:
        """Decode attention in the latent space (kv_b_proj absorbed into the query and the output, as DeepSeek
        serves MLA): q_nope [B, heads, nope], q_rot [B, heads, rope], the cache window lat [B, S, kv_lora] and
        rot [B, S, rope], pos [B] -> [B, heads, v_dim].

        Expanding the window through kv_b_proj costs S x kv_lora x heads x (nope + v_dim) multiply-adds a step
        (DeepSeek-V3 at 4K context: 69 G a layer); here a step costs heads x kv_lora x (nope + v_dim) for the
        two absorbed products plus one MQA pass of heads x S x (2 kv_lora + rope), ~100x less at 4K. Every head
        attends to the same key (latent ++ rotated key) and value (latent): one KV head."""
        nh, lora = self.num_heads, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(nh, self.nope + self.v_dim, lora)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [heads, nope, kv_lora], [heads, v_dim, kv_lora]
        # per head: [B, nope] @ [nope, kv_lora] -> q_lat [B, heads, kv_lora]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        o_lat = attend_latent(q_lat, q_rot, lat, rot, pos, self.scale)  # [B, heads, kv_lora]
        # per head: o_lat [B, kv_lora] @ [kv_lora, v_dim] -> [B, heads, v_dim]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def attend_expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, lat: torch.Tensor, rot: torch.Tensor,
                        pos: torch.Tensor) -> torch.Tensor:
        """`attend_absorbed`'s arguments and result, the window's keys and values expanded through kv_b_proj
        (transformers' order of operations): the reference its test and bench/probes/mla_decode_probe.py compare to."""
        b, length, nh = lat.shape[0], lat.shape[1], self.num_heads
        kv = self.kv_b_proj(lat).view(b, length, nh, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, rot[:, :, None, :].expand(b, length, nh, self.rope_dim)), dim=-1)
        return attend_decode(torch.cat((q_nope, q_rot), dim=-1), k, v, pos, None, self.scale)
