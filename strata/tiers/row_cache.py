"""The Engram hot-row cache: `capacity` rows of the global row space in one slab on the compute device."""

from __future__ import annotations

import torch


class RowCache:
    """`capacity` rows of the global row space in one slab, with decayed-LFU eviction.

    Bookkeeping lives on the CPU (slot_of: int32 [total_rows], -1 = absent), the slab on `device`.
    Evictions are batched: when free slots run out, the lowest-scored 1/16 of the slots go at once."""

    def __init__(self, total_rows: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device,
                 half_life: float = 4096.0, slab: torch.Tensor | None = None):
        self.capacity = capacity
        self.slot_of = torch.full((total_rows,), -1, dtype=torch.int32)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64)
        self.score = torch.zeros(capacity, dtype=torch.float64)
        # [capacity, dim]: on `device`, or a given one (pinned host RAM the GPU reads in place)
        self.slab = slab if slab is not None else torch.empty(capacity, dim, dtype=dtype, device=device)
        self._free = torch.arange(capacity, dtype=torch.int64)  # a stack of free slots: the first n_free
        self._n_free = capacity
        self.evictions = 0
        self._inc, self._growth = 1.0, 2.0 ** (1.0 / half_life)  # newer uses weigh more: exponential decay

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Slots of distinct global `rows` (int64 [m]), -1 where absent; hits count as uses."""
        slots = self.slot_of[rows].to(torch.int64)
        hit = slots[slots >= 0]
        if hit.numel():
            self.score[hit] += self._inc
            self._inc *= self._growth
            if self._inc > 1e100:  # renormalise before float64 overflows
                self.score /= self._inc
                self._inc = 1.0
        return slots

    def place(self, rows: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
        """Slots for distinct global `rows` [m]: the current one of a row already admitted (by a ticket
        meanwhile), a newly assigned one otherwise (the caller writes the data there), -1 where the cache
        has no room; never evicts the slots in `protect`. int64 [m]."""
        slots = self.slot_of[rows].to(torch.int64)
        absent = (slots < 0).nonzero().view(-1)
        m = min(absent.numel(), self.capacity - protect.numel())
        if m <= 0:
            return slots
        if self._n_free < m:
            self._evict(max(m - self._n_free, self.capacity // 16), protect)
        m = min(m, self._n_free)
        self._n_free -= m
        new = self._free[self._n_free : self._n_free + m].clone()
        chosen = rows[absent[:m]]
        slots[absent[:m]] = new
        self.row_of[new] = chosen
        self.slot_of[chosen] = new.to(torch.int32)
        self.score[new] = self._inc
        return slots

    def _evict(self, n: int, protect: torch.Tensor) -> None:
        score = self.score.clone()
        score[protect] = float("inf")
        score[self.row_of < 0] = float("inf")  # free slots are not victims
        n = min(n, int((score < float("inf")).sum()))
        if n <= 0:
            return
        victims = torch.topk(score, n, largest=False).indices
        self.slot_of[self.row_of[victims]] = -1
        self.row_of[victims] = -1
        self.score[victims] = 0.0
        self._free[self._n_free : self._n_free + n] = victims
        self._n_free += n
        self.evictions += n

    @property
    def resident(self) -> int:
        return self.capacity - self._n_free
