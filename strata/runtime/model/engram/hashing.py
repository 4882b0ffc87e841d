"""Engram's configuration and its hashed n-gram addressing (DeepSeek, arXiv 2601.07372).

An Engram layer looks up, for every position t, one row per (n-gram order n, hash head k) of a
huge table. The address depends on token ids only:

    c = token_map[ids]                                     # compressed (normalised) vocabulary
    mix_n(t) = XOR_{j<n} c[t-j] * m_j                      # m_j: odd multipliers seeded per layer
    row_{n,k}(t) = mix_n(t) mod M_{n,k} + offset_{n,k}      # M_{n,k}: distinct primes

positions before the sequence start read `pad_id` (mapped through token_map). Each layer's heads
share one table of sum(M) rows (head (n, k) owns rows [offset_{n,k}, offset_{n,k} + M_{n,k})), so
a layer's lookups are `heads = (max_ngram_size - 1) * n_head_per_ngram` row ids per token.

Multipliers and primes follow the reference demo: multipliers from numpy's PCG64 seeded with
`seed + 10007 * layer`, primes found upward from each order's base size, distinct across every
head of every layer. Everything here is pure integer math on CPU tensors (no model, no device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strata.errors import CheckpointError

_LAYER_PRIME = 10007  # seed stride between layers (the reference's PRIME_1)


@dataclass
class EngramConfig:
    """The `engram` section of config.json (key names as in DeepSeek's reference demo)."""

    layer_ids: list[int]  # decoder layers that add an Engram output before their attention
    engram_vocab_size: list[int]  # base table size per n-gram order 2..max_ngram_size (primes are found above it)
    compressed_vocab_size: int  # distinct ids of the normalised vocabulary (token_map's range)
    pad_id: int = 0  # raw token id read before the sequence start
    max_ngram_size: int = 3  # orders 2..max_ngram_size
    n_head_per_ngram: int = 8  # hash heads per order
    n_embed_per_ngram: int = 512  # row width per order; one head's row is n_embed_per_ngram / n_head_per_ngram
    seed: int = 0
    kernel_size: int = 4  # short causal depthwise convolution (dilation max_ngram_size)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        self.layer_ids = [int(x) for x in self.layer_ids]
        self.engram_vocab_size = [int(x) for x in self.engram_vocab_size]
        if not self.layer_ids or sorted(set(self.layer_ids)) != self.layer_ids or min(self.layer_ids) < 0:
            raise CheckpointError("config.json: engram.layer_ids must be a non-empty ascending list of layer ids")
        if self.max_ngram_size < 2 or len(self.engram_vocab_size) != self.max_ngram_size - 1:
            raise CheckpointError(
                f"config.json: engram.engram_vocab_size needs one size per n-gram order 2..{self.max_ngram_size} "
                f"({self.max_ngram_size - 1} values), got {self.engram_vocab_size}"
            )
        if min(self.engram_vocab_size) < 2 or self.compressed_vocab_size < 1 or self.kernel_size < 1:
            raise CheckpointError("config.json: engram table sizes, compressed_vocab_size and kernel_size must be positive")
        if self.n_head_per_ngram < 1 or self.n_embed_per_ngram % self.n_head_per_ngram:
            raise CheckpointError(
                f"config.json: engram.n_embed_per_ngram {self.n_embed_per_ngram} must be a positive multiple of "
                f"n_head_per_ngram {self.n_head_per_ngram}"
            )

    @property
    def head_dim(self) -> int:
        """Elements in one table row."""
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def num_heads(self) -> int:
        """Rows looked up per token per layer."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def embed_dim(self) -> int:
        """Width of the concatenated rows of one token: num_heads * head_dim."""
        return (self.max_ngram_size - 1) * self.n_embed_per_ngram

    @property
    def conv_window(self) -> int:
        """Past positions the short convolution reads: (kernel_size - 1) * dilation."""
        return (self.kernel_size - 1) * self.max_ngram_size

    def multipliers(self, layer: int) -> torch.Tensor:
        """The layer's odd multipliers m_0..m_{max_ngram_size-1}, int64 [max_ngram_size].

        Bounded so that c * m never overflows int64 (c < compressed_vocab_size)."""
        return _multipliers(self.seed, layer, self.max_ngram_size, self.compressed_vocab_size)

    def table_sizes(self, layer: int) -> list[int]:
        """M_{n,k} of `layer` in head order (order 2's heads first), each a distinct prime."""
        return _primes(tuple(self.layer_ids), tuple(self.engram_vocab_size), self.n_head_per_ngram)[layer]

    def table_rows(self, layer: int) -> int:
        """Rows of the layer's table (all heads): sum of its M_{n,k}."""
        return sum(self.table_sizes(layer))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_hf(cls, d: dict | None, num_layers: int, source: str = "config.json") -> EngramConfig | None:
        """Parse config.json's `engram` dict (None: the model has no Engram layers)."""
        if not d:
            return None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise CheckpointError(f"{source}: unknown engram key(s) {unknown}; known: {sorted(known)}")
        try:
            cfg = cls(**d)
        except TypeError as e:
            raise CheckpointError(f"{source}: engram section is incomplete or malformed ({e})") from None
        if max(cfg.layer_ids) >= num_layers:
            raise CheckpointError(f"{source}: engram.layer_ids {cfg.layer_ids} name layers past num_hidden_layers {num_layers}")
        return cfg


@functools.cache
def _multipliers(seed: int, layer: int, max_n: int, cvocab: int) -> torch.Tensor:
    half_bound = max(1, (np.iinfo(np.int64).max // cvocab) // 2)
    r = np.random.default_rng(int(seed + _LAYER_PRIME * layer)).integers(0, half_bound, size=(max_n,), dtype=np.int64)
    return torch.from_numpy(r * 2 + 1)


@functools.cache
def _primes(layer_ids: tuple[int, ...], base: tuple[int, ...], heads: int) -> dict[int, list[int]]:
    from sympy import nextprime  # here: sympy takes ~0.5 s to import, and only Engram models need it

    seen: set[int] = set()
    out: dict[int, list[int]] = {}
    for layer in layer_ids:
        sizes = []
        for size in base:
            p = size - 1
            for _ in range(heads):
                p = nextprime(p)
                while p in seen:
                    p = nextprime(p)
                seen.add(p)
                sizes.append(int(p))
        out[layer] = sizes
    return out


@dataclass
class NgramHasher:
    """Row ids of every Engram layer for a flat batch of tokens: `cfg` plus the normalisation table."""

    cfg: EngramConfig
    token_map: torch.Tensor  # int64 [vocab]: raw id -> compressed id
    _layers: dict = field(default_factory=dict, repr=False)
    _on_device: dict = field(default_factory=dict, repr=False)  # (layer, device) -> the constants there

    def __post_init__(self) -> None:
        self.token_map = self.token_map.to("cpu", torch.int64)
        if self.token_map.numel() and (int(self.token_map.min()) < 0 or int(self.token_map.max()) >= self.cfg.compressed_vocab_size):
            raise CheckpointError(
                f"engram token_map values must lie in [0, compressed_vocab_size={self.cfg.compressed_vocab_size})"
            )
        for layer in self.cfg.layer_ids:
            sizes = torch.tensor(self.cfg.table_sizes(layer), dtype=torch.int64)
            offsets = torch.cumsum(sizes, 0) - sizes
            self._layers[layer] = (self.cfg.multipliers(layer), sizes, offsets)

    def _constants(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device.type == "cpu":
            return self._layers[layer]
        key = (layer, device)
        if key not in self._on_device:
            self._on_device[key] = tuple(t.to(device) for t in self._layers[layer])
        return self._on_device[key]

    @property
    def pad(self) -> int:
        return int(self.token_map[self.cfg.pad_id])

    def grams(self, ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Compressed ids of each token and its predecessors: int64 [T, max_ngram_size], column j = c[t-j].

        `ids` [T] raw new tokens; `history` [<= max_ngram_size-1] raw tokens right before them (fewer
        at the sequence start: the rest is padding)."""
        n = self.cfg.max_ngram_size
        ctx = torch.full((n - 1,), self.pad, dtype=torch.int64)
        h = history[-(n - 1):] if n > 1 else history[:0]
        if h.numel():
            ctx[n - 1 - h.numel():] = self.token_map[h.to(torch.int64)]
        seq = torch.cat([ctx, self.token_map[ids.to("cpu", torch.int64)]])
        t = ids.numel()
        return torch.stack([seq[n - 1 - j : n - 1 - j + t] for j in range(n)], dim=1)

    def rows(self, layer: int, grams: torch.Tensor) -> torch.Tensor:
        """Row ids into the layer's table, int64 [T, num_heads], from `grams` [T, max_ngram_size] on any
        device (the constants follow it; copied once per device, outside any CUDA-graph capture's steps)."""
        mult, sizes, offsets = self._constants(layer, grams.device)
        prod = grams * mult  # never overflows: c < compressed_vocab_size, m < int64.max / compressed_vocab_size
        per_order = []
        mix = prod[:, 0]
        for n in range(2, self.cfg.max_ngram_size + 1):
            mix = torch.bitwise_xor(mix, prod[:, n - 1])
            per_order.append(mix)
        heads = self.cfg.n_head_per_ngram
        mixed = torch.stack(per_order, dim=1).repeat_interleave(heads, dim=1)  # [T, num_heads]
        return torch.remainder(mixed, sizes) + offsets


def build_token_map(tokenizer, vocab_size: int) -> torch.Tensor:
    """The normalisation table of the reference demo for a `tokenizers.Tokenizer`: ids whose decoded
    text is equal after NFKC, accent stripping, lower-casing and whitespace folding share one
    compressed id. Ids past the tokenizer's size each keep their own id. int64 [vocab_size]."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])  # fmt: skip
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    key_to_new: dict[str, int] = {}
    out = np.empty(vocab_size, dtype=np.int64)
    for tid in range(vocab_size):
        if tid < size:
            text = tokenizer.decode([tid], skip_special_tokens=False)
            key = tokenizer.id_to_token(tid) if "\ufffd" in text else (norm.normalize_str(text) or text)
        else:
            key = f"\0unused-{tid}"
        out[tid] = key_to_new.setdefault(key, len(key_to_new))
    return torch.from_numpy(out)
