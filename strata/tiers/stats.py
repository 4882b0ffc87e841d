"""Tier statistics: every lookup counted, every byte moved, every wait timed.

Counters are plain integers and floats updated under the tier manager's lock; `snapshot()` copies
them into a JSON-ready dict, cheap enough to call every second from a dashboard.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class PathCounters:
    """One movement path (e.g. disk->pinned): bytes, objects and busy time, for achieved bandwidth."""

    bytes: int = 0
    objects: int = 0
    seconds: float = 0.0
    busy_until: float = field(default=float("-inf"), repr=False)  # end of the latest interval (`add_interval`)

    def add(self, nbytes: int, seconds: float, objects: int = 1) -> None:
        self.bytes += nbytes
        self.objects += objects
        self.seconds += seconds

    def add_interval(self, nbytes: int, start: float, end: float, objects: int = 1) -> None:
        """A transfer that ran from `start` to `end` (seconds on one clock, e.g. a device's events). Busy time
        counts each instant once: batches that several threads enqueued on one stream at once have nested or
        overlapping spans (one's start event before the other's copies), and summing those would charge the
        link for the same time twice or more (measured: 19-21 GB/s for a 55 GB/s link, which made the split's
        cost model never copy). Intervals should come in about the order they ran."""
        self.bytes += nbytes
        self.objects += objects
        self.seconds += max(0.0, end - max(start, self.busy_until))
        self.busy_until = max(self.busy_until, end)

    def as_dict(self) -> dict:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds else 0.0
        return {"bytes": self.bytes, "objects": self.objects, "seconds": round(self.seconds, 6), "GB_per_s": round(gbps, 3)}


@dataclass
class LayerCounters:
    lookups: int = 0
    hits: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # tier that answered -> count
    misses: int = 0  # lookups that had to wait for a transfer
    stall_seconds: float = 0.0


@dataclass
class TierStats:
    """All counters of one tier manager."""

    started: float = field(default_factory=time.monotonic)
    layers: dict[int, LayerCounters] = field(default_factory=lambda: defaultdict(LayerCounters))
    paths: dict[str, PathCounters] = field(default_factory=lambda: defaultdict(PathCounters))
    prefetch_issued: int = 0
    prefetch_used: int = 0  # a prefetched object was looked up while resident or in flight
    prefetch_late: int = 0  # ... and the lookup still had to wait for it
    prefetch_unused: int = 0  # evicted before any lookup used it
    evictions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    promotions: int = 0  # `promote` requests handled, inline or on a worker (a full tier or a resident key: no move)
    promotion_host_seconds: float = 0.0  # the host time issuing them (on a worker: Python competing for the GIL)
    checksum_failures: int = 0  # failed checksums, every read counted (a damaged object may be asked for again)
    damaged: list = field(default_factory=list)  # objects whose checksum failed (layer, expert), each listed once
    expert_lookups: dict = field(default_factory=lambda: defaultdict(int))  # (layer, expert) -> lookups (heatmap)

    def record_damage(self, key: tuple[int, int]) -> None:
        """A read of `key` failed its checksum: counted in `checksum_failures`, listed in `damaged` once."""
        self.checksum_failures += 1
        if tuple(key) not in self.damaged:
            self.damaged.append(tuple(key))

    def lookup_many(self, layer: int, tier: str, experts: list[int]) -> None:
        """One lookup of each of `experts` of `layer`, answered from `tier` with no wait."""
        if not experts:
            return
        per_expert = self.expert_lookups
        for e in experts:
            per_expert[(layer, e)] += 1
        c = self.layers[layer]
        c.lookups += len(experts)
        c.hits[tier] += len(experts)

    def lookup(self, layer: int, tier: str, missed: bool, stall: float, expert: int | None = None,
               count: int = 1) -> None:
        """Count `count` lookups answered from `tier`; `missed` when not resident where wanted."""
        if expert is not None:
            self.expert_lookups[(layer, expert)] += count
        c = self.layers[layer]
        c.lookups += count
        c.hits[tier] += count
        c.misses += count * int(missed)
        c.stall_seconds += stall

    def snapshot(self, residency: dict[str, int], capacity: dict[str, int], clears_behind_copy: int = 0) -> dict:
        """A JSON-ready copy: totals, per tier, per layer, per path, prefetch quality, promotions
        (`clears_behind_copy`: GPU map clears queued behind a copy still in flight, `GpuSlots`)."""
        lookups = sum(c.lookups for c in self.layers.values())
        hits: dict[str, int] = defaultdict(int)
        for c in self.layers.values():
            for tier, n in c.hits.items():
                hits[tier] += n
        misses = sum(c.misses for c in self.layers.values())
        issued = self.prefetch_issued
        return {
            "uptime_s": round(time.monotonic() - self.started, 3),
            "lookups": lookups,
            "misses": misses,
            "stall_seconds": round(sum(c.stall_seconds for c in self.layers.values()), 6),
            "hit_rate": {t: (n / lookups if lookups else 0.0) for t, n in hits.items()},
            "tiers": {t: {"resident": residency.get(t, 0), "capacity": capacity.get(t, 0), "hits": hits.get(t, 0),
                          "evictions": self.evictions.get(t, 0)} for t in capacity},
            "paths": {p: c.as_dict() for p, c in self.paths.items()},
            "prefetch": {
                "issued": issued,
                "used": self.prefetch_used,
                "late": self.prefetch_late,
                "unused": self.prefetch_unused,
                "precision": self.prefetch_used / issued if issued else 0.0,
                "recall": self.prefetch_used / (self.prefetch_used + misses) if (self.prefetch_used + misses) else 0.0,
            },
            "promotions": {
                "done": self.promotions,
                "host_ms_each": round(1000 * self.promotion_host_seconds / self.promotions, 3) if self.promotions else 0.0,
                "clears_behind_copy": clears_behind_copy,
            },
            "checksum_failures": self.checksum_failures,
            "damaged": [list(k) for k in self.damaged],
            "layers": {
                layer: {"lookups": c.lookups, "misses": c.misses, "hits": dict(c.hits),
                        "stall_seconds": round(c.stall_seconds, 6)}
                for layer, c in sorted(self.layers.items())
            },
        }


class PrefetchLedger:
    """Prefetched objects not looked up yet, per slotted tier: what makes `TierStats`' prefetch precision, lateness
    and waste. Every method runs under the slot maps' lock."""

    def __init__(self, stats: TierStats):
        self.stats = stats
        self._waiting: dict[str, set] = {"gpu": set(), "pinned": set()}  # tier name -> prefetched, not used yet

    def issued(self, tier_name: str, key: tuple[int, int]) -> None:
        """A prefetch of `key` into the tier was started (not initial placement)."""
        self.stats.prefetch_issued += 1
        self._waiting[tier_name].add(key)

    def used(self, tier, key: tuple[int, int]) -> None:
        """A lookup of `key` in `tier` (a `SlotTier`): a prefetch of it was used, and late if still in flight."""
        if key in self._waiting[tier.name]:
            self._waiting[tier.name].discard(key)
            self.stats.prefetch_used += 1
            if key in tier.inflight:
                self.stats.prefetch_late += 1

    def used_many(self, tier, keys: list[tuple[int, int]]) -> None:
        """`used` for each of `keys` (usually none was prefetched: one set test for the lot)."""
        if self._waiting[tier.name]:
            for key in keys:
                self.used(tier, key)

    def evicted(self, tier_name: str, key: tuple[int, int]) -> None:
        """`key` left the tier: a prefetch of it that no lookup used was wasted."""
        if key in self._waiting[tier_name]:
            self._waiting[tier_name].discard(key)
            self.stats.prefetch_unused += 1
