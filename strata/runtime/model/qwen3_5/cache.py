"""Qwen3.5-MoE's per-sequence cache: a fixed-size state for each linear-attention layer, keys and values for each
full-attention layer.

Per sequence slot:

    linear layer   conv       [conv_dim, K-1]        the short convolution's last K-1 inputs (model dtype)
                   recurrent  [Hv, dk, dv]           the gated delta rule's state per value head (fp32)
    full layer     keys, values [kv_heads, max_len, head_dim] each (model dtype)

The linear layers' state has the same size at any context: a decode step reads and writes it whole, whatever the
sequence's length. Only the full-attention layers grow with the context. `kv_growth` gives the planner the two parts
(fixed bytes, bytes per token), `kv_bytes` the total `Qwen35Cache` allocates for one slot.

The state describes a sequence at its current position only, not position by position: a slot's rows cannot serve
another prompt's prefix (the prefix cache is off for this architecture: `reuses_prefixes`), and a sequence's first
pass starts from zeros whatever the slot held (strata.runtime.model.qwen3_5.linear_attention).
"""

from __future__ import annotations

import torch

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.qwen3_5.linear_attention import LinearState


def _item(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_growth(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(fixed bytes, bytes per token of context) of one sequence slot: the linear layers' states, and the
    full-attention layers' keys and values."""
    s = cfg.qwen3_5
    k = s.linear_conv_kernel_dim
    state = s.conv_dim * (k - 1) * _item(dtype) + s.linear_num_value_heads * s.linear_key_head_dim \
        * s.linear_value_head_dim * _item(torch.float32)
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * _item(dtype)
    return state * len(s.linear_layers), per_token * len(s.full_layers)


def kv_bytes(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Cache bytes of one sequence slot of `max_len` positions: what `Qwen35Cache` allocates."""
    fixed, per_token = kv_growth(cfg, dtype)
    return fixed + per_token * max_len


def reuses_prefixes(cfg: ModelConfig) -> bool:
    """Whether a slot's cache can serve another prompt's prefix: not with linear-attention layers (their state is
    the sequence's at its last position, not a row per position)."""
    return cfg.qwen3_5 is None


class Qwen35Cache:
    """Per-layer caches for `num_slots` sequences of up to `max_len` tokens (the `KVCache` interface the scheduler
    uses: `layers`, `num_slots`, `max_len`, `nbytes`, `engram`): a `LinearState` for a linear-attention layer, a
    (keys, values) pair for a full-attention one."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        s = cfg.qwen3_5
        self.num_slots, self.max_len = num_slots, max_len
        self.engram = None  # no per-position snapshots: the prefix cache is off for this cache
        self.layers: list[LinearState | tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            if s.is_linear(i):
                conv = torch.zeros(num_slots, s.conv_dim, s.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                rec = torch.zeros(num_slots, s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim,
                                  dtype=torch.float32, device=device)
                self.layers.append(LinearState(conv, rec))
            else:
                shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
                self.layers.append((torch.zeros(shape, dtype=dtype, device=device),
                                    torch.zeros(shape, dtype=dtype, device=device)))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache."""
        return [t for layer in self.layers for t in (layer.tensors() if isinstance(layer, LinearState) else layer)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Refused: the linear layers' state at `length` is not kept, so no prefix can be copied (the scheduler
        keeps the prefix cache off for this model, `reuses_prefixes`)."""
        if src != dst and length > 0:
            raise RuntimeError("Qwen3.5-MoE's cache holds a recurrent state, not rows per position; it has no prefix "
                               "to copy (the prefix cache must be off for this model)")
