"""Preallocated KV cache: one slab per layer, indexed by sequence slot and position.

GQA layers store keys and values `[slots, max_len, kv_heads, head_dim]`. MLA layers (DeepSeek) store
the compressed latent `[slots, max_len, kv_lora_rank]` and the shared rotated key
`[slots, max_len, qk_rope_head_dim]` (about 1/50 of the expanded K/V), and expand them when attending.
Everything is allocated once, so a long generation never reallocates and memory use is known up front.
A slot's rows outlive its sequence: the prefix cache (strata.runtime.generation.prefix_cache) serves later
prompts from them, in place or copied to another slot (`copy_prefix`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.engram.cache import EngramCache


@dataclass
class StepBatch:
    """The new tokens of one forward pass: several sequences' tokens flattened into one [N] batch.

    Sequence i owns tokens `offsets[i] : offsets[i] + lengths[i]` of the flat batch, lives in cache
    slot `slots[i]`, and has `starts[i]` tokens already cached before this step.
    """

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    engram: object | None = None  # the step's Engram work (EngramStep), set by the model at the start of forward

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.starts) == len(self.lengths)):
            raise ValueError("StepBatch lists must have one entry per sequence")
        self.offsets = [0]
        for n in self.lengths[:-1]:
            self.offsets.append(self.offsets[-1] + n)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """Absolute position of every token, [N] int64."""
        return torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths, strict=True)]).to(device)

    def sequences(self) -> Iterator[tuple[int, int, int, int]]:
        """(slot, start, offset, length) of each sequence."""
        return zip(self.slots, self.starts, self.offsets, self.lengths, strict=True)

    def last_token_rows(self) -> list[int]:
        """Row of each sequence's last new token in the flat batch (where its next-token logits are)."""
        return [o + n - 1 for o, n in zip(self.offsets, self.lengths, strict=True)]


class KVCache:
    """Per-layer cache slabs for `num_slots` sequences of up to `max_len` tokens."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        self.num_slots, self.max_len = num_slots, max_len
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            if cfg.attention == "mla":
                a = torch.zeros(num_slots, max_len, cfg.kv_lora_rank, dtype=dtype, device=device)
                b = torch.zeros(num_slots, max_len, cfg.qk_rope_head_dim, dtype=dtype, device=device)
            else:
                shape = (num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
                a = torch.zeros(shape, dtype=dtype, device=device)
                b = torch.zeros(shape, dtype=dtype, device=device)
            self.layers.append((a, b))
        self.engram = None  # Engram layers' per-slot state: token history and convolution rings
        if cfg.engram is not None:
            self.engram = EngramCache(cfg.engram, cfg.hidden_size, num_slots, max_len, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.layers)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot `dst`'s first `length` positions a copy of slot `src`'s: every layer's rows (GQA keys and
        values, MLA's latent and rotated key) and the Engram token history. A prefix cache hit on another slot's
        prompt: copied on the device, in the stream order of the steps that wrote it."""
        if src == dst or length <= 0:
            return
        for a, b in self.layers:
            a[dst, :length] = a[src, :length]  # [length, kv_heads, d] (GQA) or [length, kv_lora] (MLA)
            b[dst, :length] = b[src, :length]
        if self.engram is not None:
            self.engram.tokens[dst, :length] = self.engram.tokens[src, :length]

    def engram_rings(self, slot: int) -> list[torch.Tensor] | None:
        """A copy of `slot`'s Engram convolution rings (one [window, hidden] per Engram layer), None without
        Engram layers. A ring is indexed by position, so the copy restores the slot at the position it was taken."""
        if self.engram is None:
            return None
        return [ring[slot].clone() for ring in self.engram.conv.values()]

    def restore_engram_rings(self, slot: int, rings: list[torch.Tensor]) -> None:
        """Put rings taken by `engram_rings` (of this slot or another) back into `slot`."""
        for ring, saved in zip(self.engram.conv.values(), rings, strict=True):
            ring[slot].copy_(saved)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Cache bytes one token occupies across all layers."""
        per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) if cfg.attention == "mla" else 2 * cfg.num_kv_heads * cfg.head_dim
        return per_layer * cfg.num_layers * torch.empty((), dtype=dtype).element_size()


@dataclass
class DecodeBatch:
    """B sequences decoding one token each, described by device tensors so shapes never change.

    Attention attends over the first `kv_len` cache positions (a bucket >= every position + 1) with
    a mask, instead of each sequence's exact prefix: one code path with fixed shapes for eager decode
    steps and CUDA-graph replays, so both give bit-identical results.
    """

    slots_t: torch.Tensor  # [B] int64 cache slot of each sequence
    pos_t: torch.Tensor  # [B] int64 position of each new token
    kv_len: int
    engram: object | None = None

    @property
    def num_tokens(self) -> int:
        return self.slots_t.shape[0]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        return self.pos_t

    def last_token_rows(self) -> list[int]:
        return list(range(self.num_tokens))


def kv_bucket(max_position: int, max_len: int, smallest: int = 256) -> int:
    """Cache positions a decode step attends over: the next power of two above `max_position`, capped."""
    n = smallest
    while n <= max_position:
        n *= 2
    return min(n, max_len)
