"""The Engram hot-row cache: `capacity` rows of the global row space in one slab on the compute device."""

from __future__ import annotations

import numpy as np
import torch


class RowCache:
    """`capacity` rows of the global row space in one slab, with decayed-LFU eviction.

    Bookkeeping lives on the CPU in numpy (slot_of: int32 [total_rows], -1 = absent; row_of, score per slot):
    a decode step makes a few lookups and placements of a few dozen rows each, where an indexing op on a small
    CPU tensor costs ~5 us in torch and under 1 us in numpy (the dev box). The slab is on `device`. Evictions
    are batched: when free slots run out, the lowest-scored 1/16 of the slots go at once."""

    def __init__(self, total_rows: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device,
                 half_life: float = 4096.0, slab: torch.Tensor | None = None):
        self.capacity = capacity
        self.slot_of = np.full(total_rows, -1, dtype=np.int32)
        self.row_of = np.full(capacity, -1, dtype=np.int64)
        self.score = np.zeros(capacity, dtype=np.float64)
        # [capacity, dim]: on `device`, or a given one (pinned host RAM the GPU reads in place)
        self.slab = slab if slab is not None else torch.empty(capacity, dim, dtype=dtype, device=device)
        # a stack of free slots, the first `counts[0]` (native code, strata.tiers.rows.serve, pops and pushes it)
        self.free_stack = np.arange(capacity, dtype=np.int64)
        # counters and the decay in arrays, so native code (strata.tiers.rows.serve) updates them in place:
        # counts [n_free, evictions]; decay [inc, growth]: newer uses weigh more (exponential decay)
        self.counts = np.array([capacity, 0], dtype=np.int64)
        self.decay = np.array([1.0, 2.0 ** (1.0 / half_life)], dtype=np.float64)

    @property
    def _n_free(self) -> int:
        return int(self.counts[0])

    @_n_free.setter
    def _n_free(self, n: int) -> None:
        self.counts[0] = n

    @property
    def evictions(self) -> int:
        return int(self.counts[1])

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Slots of distinct global `rows` (int64 CPU [m]), -1 where absent (int64 [m]); hits count as uses."""
        slots = self.slot_of[rows.numpy()].astype(np.int64)
        hit = slots[slots >= 0]
        if hit.size:
            self.score[hit] += self.decay[0]  # rows are distinct, so their slots are too: no repeated index
            self.decay[0] *= self.decay[1]
            if self.decay[0] > 1e100:  # renormalise before float64 overflows
                self.score /= self.decay[0]
                self.decay[0] = 1.0
        return torch.from_numpy(slots)

    def place(self, rows: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
        """Slots for distinct global `rows` [m]: the current one of a row already admitted (by a ticket
        meanwhile), a newly assigned one otherwise (the caller writes the data there), -1 where the cache
        has no room; never evicts the slots in `protect`. int64 [m]."""
        r = rows.numpy()
        slots = self.slot_of[r].astype(np.int64)
        absent = np.flatnonzero(slots < 0)
        m = min(absent.size, self.capacity - protect.numel())
        if m <= 0:
            return torch.from_numpy(slots)
        if self._n_free < m:
            self._evict(max(m - self._n_free, self.capacity // 16), protect.numpy())
        m = min(m, self._n_free)
        self._n_free -= m
        new = self.free_stack[self._n_free : self._n_free + m].copy()
        chosen = r[absent[:m]]
        slots[absent[:m]] = new
        self.row_of[new] = chosen
        self.slot_of[chosen] = new
        self.score[new] = self.decay[0]
        return torch.from_numpy(slots)

    def _evict(self, n: int, protect: np.ndarray) -> None:
        score = self.score.copy()
        score[protect] = np.inf
        score[self.row_of < 0] = np.inf  # free slots are not victims
        n = min(n, int(np.count_nonzero(score < np.inf)))
        if n <= 0:
            return
        victims = np.argpartition(score, n - 1)[:n]  # the n lowest scores (in no particular order)
        self.slot_of[self.row_of[victims]] = -1
        self.row_of[victims] = -1
        self.score[victims] = 0.0
        self.free_stack[self._n_free : self._n_free + n] = victims
        self._n_free += n
        self.counts[1] += n

    @property
    def resident(self) -> int:
        return self.capacity - self._n_free
