"""DeepSeek-V4's KV cache: per layer and sequence slot, the sliding window and the compressed entries.

Every layer keeps its one shared key = value head for the last `sliding_window` positions, in a ring indexed by
position % window. A layer that compresses (CSA: every 4 source tokens, HCA: every 128) also keeps

    entries     [slots, ceil(max_len / m), head_dim]   entry w pools positions [w*m, (w+1)*m) (CSA: and window
                                                       w-1's other half); written once, when its window completes
    source      [slots, R, width] x 2 (kv, gate)       the compressor's projections of the last R positions, a ring
                                                       by position % R (R = 2m for CSA's overlapping windows, m for
                                                       HCA's): the partial window and, for CSA, the one before it

and a CSA layer the same pair again at the indexer's `index_head_dim` (its own compressed keys). Nothing else is
per-sequence state: a slot's entry count is its position // m, so a sequence at position p is fully described by
its rings (the last positions before p) and its entries below p // m. That makes the state cheap to snapshot
(`engram_rings`: the rings only) for the prefix cache, which then reuses a prefix only where a snapshot was taken.

Sizes are fixed at construction: `layer_bytes` gives them, the planner's KV figure (`kv_bytes`) is their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.config import CSA, DeepseekV4Settings


@dataclass
class CompressedState:
    """One compressor's per-slot tensors: entries [slots, E, dim] and the source rings [slots, R, width]."""

    entries: torch.Tensor
    src_kv: torch.Tensor
    src_gate: torch.Tensor
    rate: int

    @property
    def ring(self) -> int:
        return self.src_kv.shape[1]


@dataclass
class LayerCache:
    """One layer's cache: the window ring [slots, W, head_dim], its compressor's state and (CSA) the indexer's."""

    window: torch.Tensor
    compressor: CompressedState | None = None
    indexer: CompressedState | None = None

    def tensors(self) -> list[torch.Tensor]:
        out = [self.window]
        for c in (self.compressor, self.indexer):
            if c is not None:
                out += [c.entries, c.src_kv, c.src_gate]
        return out

    def rings(self) -> list[torch.Tensor]:
        """The tensors holding state about the last positions only (everything but the entries)."""
        out = [self.window]
        for c in (self.compressor, self.indexer):
            if c is not None:
                out += [c.src_kv, c.src_gate]
        return out


def _shapes(cfg: ModelConfig, s: DeepseekV4Settings, layer: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """Per-slot shapes of one layer's tensors (name -> shape without the slot dimension)."""
    d = cfg.head_dim
    out = {"window": (min(s.sliding_window, max_len), d)}
    m = s.rate(layer)
    if m:
        csa = s.layer_types[layer] == CSA
        n = -(-max_len // m)
        ring, width = (2 * m, 2 * d) if csa else (m, d)
        out |= {"entries": (n, d), "src_kv": (ring, width), "src_gate": (ring, width)}
        if csa:
            di = s.index_head_dim
            out |= {"idx_entries": (n, di), "idx_kv": (2 * m, 2 * di), "idx_gate": (2 * m, 2 * di)}
    return out


def layer_bytes(cfg: ModelConfig, layer: int, max_len: int, dtype: torch.dtype) -> int:
    """Cache bytes of one layer for one sequence slot of `max_len` positions."""
    s = cfg.deepseek_v4
    n = sum(torch.Size(shape).numel() for shape in _shapes(cfg, s, layer, max_len).values())
    return n * torch.empty((), dtype=dtype).element_size()


def kv_bytes(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Cache bytes of one sequence slot of `max_len` positions, all layers: what `DeepseekV4Cache` allocates."""
    return sum(layer_bytes(cfg, i, max_len, dtype) for i in range(cfg.num_layers))


def kv_growth(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, float]:
    """(fixed bytes, bytes per token) of one sequence slot: the windows and source rings, which stop growing at the
    sliding window, and the compressed entries (and CSA's indexer keys), one per rate tokens of context.
    kv_bytes(cfg, n) = fixed + n * per_token for n >= the window and a multiple of every rate."""
    s, item = cfg.deepseek_v4, torch.empty((), dtype=dtype).element_size()
    per_token = sum((cfg.head_dim + (s.index_head_dim if s.layer_types[i] == CSA else 0)) / s.rate(i)
                    for i in range(cfg.num_layers) if s.rate(i)) * item
    rates = [s.rate(i) for i in range(cfg.num_layers) if s.rate(i)]
    step = math.lcm(*rates) if rates else 1
    n = -(-max([s.sliding_window] + [2 * m for m in rates]) // step) * step  # rings full, every rate divides it
    return kv_bytes(cfg, n, dtype) - round(per_token * n), per_token


class DeepseekV4Cache:
    """Per-layer caches (`LayerCache`) for `num_slots` sequences of up to `max_len` tokens (the `KVCache`
    interface: `layers`, `nbytes`, `copy_prefix`, and the per-position snapshot the prefix cache keeps)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        s = cfg.deepseek_v4
        self.num_slots, self.max_len = num_slots, max_len
        self.layers: list[LayerCache] = []

        def new(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros((num_slots, *shape), dtype=dtype, device=device)

        for i in range(cfg.num_layers):
            sh = _shapes(cfg, s, i, max_len)
            layer = LayerCache(new(sh["window"]))
            if "entries" in sh:
                layer.compressor = CompressedState(new(sh["entries"]), new(sh["src_kv"]), new(sh["src_gate"]),
                                                   s.rate(i))
            if "idx_entries" in sh:
                layer.indexer = CompressedState(new(sh["idx_entries"]), new(sh["idx_kv"]), new(sh["idx_gate"]),
                                                s.rate(i))
            self.layers.append(layer)

    @property
    def engram(self) -> DeepseekV4Cache:
        """The per-position state the prefix cache snapshots (`engram_rings`), as for Engram layers' rings."""
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot `dst` hold slot `src`'s first `length` positions: the compressed entries below length // m
        (the rings, the state at `length`, come with `restore_engram_rings` from a snapshot taken there)."""
        if src == dst or length <= 0:
            return
        for layer in self.layers:
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    n = length // c.rate
                    c.entries[dst, :n] = c.entries[src, :n]

    def engram_rings(self, slot: int) -> list[torch.Tensor]:
        """A copy of `slot`'s rings (window and compressor sources): with the entries, its state at its position."""
        return [t[slot].clone() for layer in self.layers for t in layer.rings()]

    def restore_engram_rings(self, slot: int, rings: list[torch.Tensor]) -> None:
        """Put rings taken by `engram_rings` (of this slot or another) back into `slot`."""
        tensors = [t for layer in self.layers for t in layer.rings()]
        for t, saved in zip(tensors, rings, strict=True):
            t[slot].copy_(saved)
