"""Lookups the MoE executor makes without `acquire`, and what the tier policies say about keeping an expert.

On the decode fast path the GPU finds resident experts through the device map `slot_of` with no
host round trip, so the tier manager does not see those lookups happen. The executor reports them
afterwards: `note_hits` when it has the step's expert ids on the host anyway (policy recency and
frequency stay exact), or counts accumulated on the device and drained when statistics are read
(`add_lookup_source`, for steps captured in CUDA graphs, where every expert is resident).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from strata.tiers.eviction import Evictor
from strata.tiers.slot_maps import SlotMaps
from strata.tiers.slots import Key
from strata.tiers.stats import PrefetchLedger, TierStats

LookupSource = Callable[[], Iterable[tuple[int, int, int]]]  # -> (layer, expert, lookups) since last drain


class LookupBooks:
    """Counts lookups made elsewhere in the statistics and the tier policies; scores experts for the GPU tier."""

    def __init__(self, maps: SlotMaps, evictor: Evictor, ledger: PrefetchLedger, stats: TierStats):
        self._maps, self._lock, self._gpu, self._pinned = maps, maps.lock, maps.gpu, maps.pinned
        self._evictor, self._ledger, self._stats = evictor, ledger, stats
        self._sources: list[LookupSource] = []

    def note_hits(self, layer: int, experts: Iterable[int], device: str) -> None:
        """Count one lookup per expert of `layer` answered by `device`'s tier (resident, no wait). In bulk: one-graph
        decode books every layer of every step this way (~100 lookups a step, Python on the decoding thread)."""
        tier = self._maps.tier(device)
        keys = [(layer, int(e)) for e in experts]
        with self._lock:
            self._ledger.used_many(tier, keys)
            tier.policy.touch_many([k for k in keys if k in tier.slot_of])
            self._stats.lookup_many(layer, tier.name, [k[1] for k in keys])

    def note_gpu_misses(self, layer: int, experts: Iterable[int]) -> None:
        """Count lookups of `layer` that the GPU tier missed and no copy brought in (computed on the CPU) in
        its policy's history, so the frequency that decides admission sees every lookup (statistics count
        them where they were served)."""
        if self._gpu is None:
            return
        with self._lock:
            self._gpu.policy.touch_many([(layer, int(e)) for e in experts])

    def note_pinned_reads(self, layer: int, experts: Iterable[int]) -> None:
        """Lookups of `layer` the GPU tier missed that a native CPU worker served in place from pinned RAM
        (strata.runtime.offload.mailbox): counted as pinned-tier hits and seen by both tiers' policies, as
        `note_gpu_misses` and `hold_resident` count the host step's CPU share."""
        keys = [(layer, int(e)) for e in experts]
        with self._lock:
            self.count_pinned_reads(keys)
            if self._gpu is not None:
                self._gpu.policy.touch_many(keys)

    def count_pinned_reads(self, keys: list[Key]) -> None:
        """One lookup of each of `keys`, served in place from its pinned-RAM slot (lock held)."""
        tier = self._pinned
        self._ledger.used_many(tier, keys)
        if not tier.holds_all:
            tier.policy.touch_many(keys)
        for layer in sorted({k[0] for k in keys}):  # usually one layer
            self._stats.lookup_many(layer, tier.name, [e for kl, e in keys if kl == layer])

    def note_uses(self, layer: int, uses: dict[int, int]) -> None:
        """A prefill chunk routed `uses[e]` tokens to expert e of `layer`: the GPU tier's frequency history
        counts every one (staging an expert for the chunk counts it once), so what a prompt uses most
        outranks what it touched once when later staging and promotions pick victims."""
        if self._gpu is None:
            return
        with self._lock:
            for e, n in uses.items():
                if n > 1:
                    # the stage's own touch is the last one; the prompt's uses do not move the decay clock
                    self._gpu.policy.touch((layer, int(e)), float(n - 1), advance=False)

    def gpu_scores(self, layer: int, experts: Iterable[int]) -> dict[int, float]:
        """expert -> the GPU tier policy's use score (decayed frequency; 0 for policies without one)."""
        score = getattr(self._gpu.policy, "score", None) if self._gpu is not None else None
        with self._lock:
            return {int(e): score((layer, int(e))) if score is not None else 0.0 for e in experts}

    def worth_caching(self, layer: int, experts: list[int], margin: float) -> list[int]:
        """Those of `experts` (cold, about to be copied for a step) that the GPU tier should keep: while it
        has free slots, all; with a frequency policy, those used `margin` times more than what they would
        evict (so uniform traffic does not churn the tier, and a popular expert still gets in); with a
        recency policy, none (a copy for one step says nothing about the next)."""
        tier = self._gpu
        if tier is None or not experts:
            return []
        score = getattr(tier.policy, "score", None)
        with self._lock:
            if tier.free:
                return list(experts)[: len(tier.free)]
            if score is None:
                return []
            victim = self._evictor.victim(tier, layer)
            if victim is None:
                return []
            bar = margin * score(victim)
            return [e for e in experts if score((layer, int(e))) > bar]

    def add_source(self, source: LookupSource) -> None:
        """Register a drain of device-side lookup counts; `drain_sources` calls it before every snapshot."""
        self._sources.append(source)

    def remove_source(self, source: LookupSource) -> None:
        """Undo `add_source`."""
        if source in self._sources:
            self._sources.remove(source)

    def drain_sources(self) -> None:
        """Count what every registered source has seen since its last drain as GPU-tier hits (lock held)."""
        for source in self._sources:
            for layer, expert, n in source():
                self._stats.lookup(layer, "gpu", False, 0.0, expert=expert, count=n)
