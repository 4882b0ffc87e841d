"""The KV cache's size: what the planner counts for a context and the scheduler allocates.

Most architectures cache a fixed number of bytes per token of context (`KVCache.bytes_per_token`). DeepSeek-V4's
cache is a sliding window (fixed once the context passes it) plus compressed entries, one per 4 (CSA) or 128 (HCA)
tokens: a fixed part plus a much smaller rate (strata.runtime.model.deepseek_v4.cache). Qwen3.5-MoE's is a fixed
state per linear-attention layer plus keys and values for its full-attention layers (strata.runtime.model.qwen3_5.cache).
"""

from __future__ import annotations

import math

import torch

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.cache import kv_bytes, kv_growth
from strata.runtime.model.kv_cache import KVCache
from strata.runtime.model.qwen3_5 import cache as qwen3_5_cache


def kv_growth_of(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, float]:
    """(fixed bytes, bytes per token of context) of one sequence's cache."""
    if cfg.deepseek_v4 is not None:
        return kv_growth(cfg, dtype)
    if cfg.qwen3_5 is not None:
        fixed, per_token = qwen3_5_cache.kv_growth(cfg, dtype)
        return fixed, float(per_token)
    return 0, float(KVCache.bytes_per_token(cfg, dtype))


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one more token of context adds to one sequence's cache, rounded up."""
    return math.ceil(kv_growth_of(cfg, dtype)[1])


def kv_cache_bytes(cfg: ModelConfig, dtype: torch.dtype, context: int) -> int:
    """One sequence slot's cache for `context` tokens, as allocated."""
    if cfg.deepseek_v4 is not None:
        return kv_bytes(cfg, context, dtype)
    if cfg.qwen3_5 is not None:
        return qwen3_5_cache.kv_bytes(cfg, context, dtype)
    return KVCache.bytes_per_token(cfg, dtype) * context
