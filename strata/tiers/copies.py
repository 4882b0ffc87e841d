"""Pinned -> GPU copy batches enqueued on the copy stream and not known to have finished.

A batch holds a reference on each pinned source it reads (the source's slot cannot be evicted and refilled
under the copy); `reap` drops those references once the batch's end event has been reached and books the
copy-engine time of the batch. Every method runs under the slot maps' lock.
"""

from __future__ import annotations

import itertools

from strata.tiers.slot_maps import SlotTier
from strata.tiers.slots import Key
from strata.tiers.stats import TierStats
from strata.tiers.storage.gpu_slots import GpuSlots


class GpuCopies:
    """Copy batches in flight, oldest first, each `(start, end, keys)`: timing events (None on a CPU-simulated GPU
    tier, where a copy is done on return) and the pinned-resident keys it reads."""

    def __init__(self, pinned: SlotTier, slots: GpuSlots | None, stats: TierStats, slot_bytes: int):
        self._pinned, self._slots, self._stats, self._slot_bytes = pinned, slots, stats, slot_bytes
        self._batches: dict[int, tuple] = {}
        self._seq = itertools.count()

    def add(self, start, end, keys: list[Key]) -> None:
        """A batch just enqueued, reading the pinned slots of `keys` (the caller took a pinned reference on each)."""
        self._batches[next(self._seq)] = (start, end, keys)

    def reap(self) -> None:
        """Drop the pinned references of the batches that have finished reading their sources."""
        for token, (start, end, keys) in list(self._batches.items()):
            if end is None or end.query():
                del self._batches[token]
                for key in keys:
                    self._pinned.unref(key)
                if end is not None:  # copy-engine (or in-place kernel) time, not enqueue time
                    counters, nbytes = self._stats.paths["pinned->gpu"], self._slot_bytes * len(keys)
                    seconds = start.elapsed_time(end) / 1000
                    if (t0 := self._slots.since_epoch(start)) is None:
                        counters.add(nbytes, seconds, objects=len(keys))
                    else:
                        counters.add_interval(nbytes, t0, t0 + seconds, objects=len(keys))

    def in_flight(self) -> int:
        """Experts whose copy is enqueued and not known to have finished."""
        return sum(len(batch[2]) for batch in self._batches.values())

    def oldest_end(self):
        """The end event of the oldest batch still held (what a full tier can wait for), or None."""
        oldest = next(iter(self._batches.values()), None)
        return oldest[1] if oldest is not None else None

    @property
    def busy(self) -> bool:
        """Some batch is still held (not reaped)."""
        return bool(self._batches)
