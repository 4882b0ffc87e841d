"""What the parts of the Engram row store (strata.tiers.rows.store) pass between them: a ticket per `start`
(the rows one layer asked for, their cache slots, the misses and their reads) and the counters of `stats()`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


@dataclass
class RowStats:
    """Counters for `stats()`: row lookups, where they were served, bytes read, stall."""

    lookups: int = 0  # rows asked for (with repeats)
    unique: int = 0  # distinct rows asked for, per step
    hits: dict = field(default_factory=dict)  # tier -> distinct rows served from it
    bytes_read: int = 0  # bytes read from the backing tier
    stall_s: float = 0.0  # seconds a layer waited for rows that had not arrived
    prefetched: int = 0  # rows fetched ahead by `prefetch`

    def served(self, tier: str, n: int) -> None:
        """Count `n` distinct rows served from `tier` ("cache" for the row cache)."""
        self.hits[tier] = self.hits.get(tier, 0) + n


@dataclass(eq=False)  # identity comparison: a ticket is found in the live list by identity
class Ticket:
    """One `start`: the distinct rows asked for, their cache slots, the misses and their reads."""

    layer: int
    uniq: torch.Tensor  # int64 [m] distinct rows of the layer
    inverse: torch.Tensor  # int64 [T * heads] position of each asked-for row in `uniq`
    shape: tuple  # (T, heads)
    slots: torch.Tensor  # int64 [m] cache slot of each distinct row, -1 where absent (empty: no cache)
    miss: torch.Tensor  # int64 [k] rows to read from the tier
    reads: list[Future] | None = None  # None until the reads are queued
    staged: torch.Tensor | None = None  # [k, head_dim] the read rows, on the CPU

    def hit_slots(self) -> torch.Tensor:
        """The cache slots of the ticket's rows found in the cache (int64 [h]): admissions must not evict them."""
        return self.slots[self.slots >= 0]
