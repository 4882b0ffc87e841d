"""The decoder-only MoE transformer shared by every supported architecture.

One `nn.Module`, configured by `ModelConfig`: embeddings, N decoder layers (GQA or MLA attention;
dense MLP or sparse MoE), final norm, LM head. It runs the flat token batch of a `StepBatch`
against a `KVCache`, so prefill chunks and decode steps of several sequences share one code path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.runtime.attention import GQAAttention, MLAAttention
from strata.runtime.kv_cache import KVCache, StepBatch
from strata.runtime.layers import MLP, RMSNorm
from strata.runtime.model_config import ModelConfig
from strata.runtime.moe import MoEBlock
from strata.runtime.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer) if cfg.attention == "mla" else GQAAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg) if cfg.moe_layers[layer] else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, batch: StepBatch, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETransformer(nn.Module):
    """`forward(input_ids [N], batch, cache) -> hidden [N, H]`; `logits(hidden) -> [n, vocab]` fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.after_layer: Callable[[int, torch.Tensor], None] | None = None  # e.g. the expert prefetcher

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(batch.positions(input_ids.device), x.dtype)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
            x = layer(x, cos, sin, batch, layer_cache)
            if self.after_layer is not None:
                self.after_layer(i, x)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
