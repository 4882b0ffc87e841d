"""Lookups the MoE executor makes without `acquire`: experts read straight from GPU slots.

On the decode fast path the GPU finds resident experts through the device map `slot_of` with no
host round trip, so the tier manager does not see those lookups happen. The executor reports them
afterwards: `note_hits` when it has the step's expert ids on the host anyway (policy recency and
frequency stay exact), or counts accumulated on the device and drained when statistics are read
(`add_lookup_source`, for steps captured in CUDA graphs, where every expert is resident).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from strata.kernels.gpu.grouped import SlotWeights

LookupSource = Callable[[], Iterable[tuple[int, int, int]]]  # -> (layer, expert, lookups) since last drain


class LookupsMixin:
    """Mixed into TierManager (uses its lock, tiers and statistics)."""

    def note_hits(self, layer: int, experts: Iterable[int], device: str = "gpu") -> None:
        """Count one lookup per expert of `layer` answered by `device`'s tier (resident, no wait). In bulk: one-graph
        decode books every layer of every step this way (~100 lookups a step, Python on the decoding thread)."""
        tier = self._tier(device)
        keys = [(layer, int(e)) for e in experts]
        with self._lock:
            self._note_prefetch_uses(tier, keys)
            tier.policy.touch_many([k for k in keys if k in tier.slot_of])
            self.stats_.lookup_many(layer, tier.name, [k[1] for k in keys])

    def note_gpu_misses(self, layer: int, experts: Iterable[int]) -> None:
        """Count lookups of `layer` that the GPU tier missed and no copy brought in (computed on the CPU) in
        its policy's history, so the frequency that decides admission sees every lookup (statistics count
        them where they were served)."""
        if self.gpu is None:
            return
        with self._lock:
            self.gpu.policy.touch_many([(layer, int(e)) for e in experts])

    def note_pinned_reads(self, layer: int, experts: Iterable[int]) -> None:
        """Lookups of `layer` the GPU tier missed that a native CPU worker served in place from pinned RAM
        (strata.runtime.offload.mailbox): counted as pinned-tier hits and seen by both tiers' policies, as
        `note_gpu_misses` and `hold_resident` count the host step's CPU share."""
        keys = [(layer, int(e)) for e in experts]
        with self._lock:
            self._count_pinned_reads(keys)
            if self.gpu is not None:
                self.gpu.policy.touch_many(keys)

    def _count_pinned_reads(self, keys: list[tuple[int, int]]) -> None:
        """One lookup of each of `keys`, served in place from its pinned-RAM slot (lock held)."""
        tier = self.pinned
        self._note_prefetch_uses(tier, keys)
        if not self._pinned_holds_all:
            tier.policy.touch_many(keys)
        for layer in sorted({k[0] for k in keys}):  # usually one layer
            self.stats_.lookup_many(layer, tier.name, [e for kl, e in keys if kl == layer])

    def note_uses(self, layer: int, uses: dict[int, int]) -> None:
        """A prefill chunk routed `uses[e]` tokens to expert e of `layer`: the GPU tier's frequency history
        counts every one (staging an expert for the chunk counts it once), so what a prompt uses most
        outranks what it touched once when later staging and promotions pick victims."""
        if self.gpu is None:
            return
        with self._lock:
            for e, n in uses.items():
                if n > 1:
                    # the stage's own touch is the last one; the prompt's uses do not move the decay clock
                    self.gpu.policy.touch((layer, int(e)), float(n - 1), advance=False)

    def gpu_scores(self, layer: int, experts: Iterable[int]) -> dict[int, float]:
        """expert -> the GPU tier policy's use score (decayed frequency; 0 for policies without one)."""
        score = getattr(self.gpu.policy, "score", None) if self.gpu is not None else None
        with self._lock:
            return {int(e): score((layer, int(e))) if score is not None else 0.0 for e in experts}

    def worth_caching(self, layer: int, experts: list[int], margin: float = 2.0) -> list[int]:
        """Those of `experts` (cold, about to be copied for a step) that the GPU tier should keep: while it
        has free slots, all; with a frequency policy, those used `margin` times more than what they would
        evict (so uniform traffic does not churn the tier, and a popular expert still gets in); with a
        recency policy, none (a copy for one step says nothing about the next)."""
        tier = self.gpu
        if tier is None or not experts:
            return []
        score = getattr(tier.policy, "score", None)
        with self._lock:
            if tier.free:
                return list(experts)[: len(tier.free)]
            if score is None:
                return []
            victim = tier.policy.victim(lambda k: (k[0] == layer or not self.budgets.per_layer)
                                        and k in tier.slot_of and not tier.busy(k))
            if victim is None:
                return []
            bar = margin * score(victim)
            return [e for e in experts if score((layer, int(e))) > bar]

    def hold_resident(self, keys: list[tuple[int, int]]) -> list[int] | None:
        """Pin `keys` in their pinned-RAM slots and return the slots, if every one is resident there now;
        else None and nothing changes (the caller takes `acquire`). Counted as pinned-tier hits; undo with
        `drop_held`. For the CPU expert kernel, which reads the slots by address."""
        tier = self.pinned
        with self._lock:
            if not self._all_in_tier(tier, keys):
                return None
            me = threading.get_ident()
            self._count_pinned_reads(keys)
            for key in keys:
                tier.refs[key] = tier.refs.get(key, 0) + 1
            self._thread_refs[me] += len(keys)
            return [tier.slot_of[k] for k in keys]

    @staticmethod
    def _all_in_tier(tier, keys: list[tuple[int, int]]) -> bool:
        """Every key resident in `tier` now (mapped, no transfer in flight)."""
        return all(k in tier.slot_of and k not in tier.inflight for k in keys)

    def drop_held(self, keys: list[tuple[int, int]]) -> None:
        """Undo `hold_resident` (same thread)."""
        with self._lock:
            for key in keys:
                self._unref(self.pinned, key)
            self._thread_refs[threading.get_ident()] -= len(keys)
            self._released.notify_all()

    def add_lookup_source(self, source: LookupSource) -> None:
        """Register a drain of device-side lookup counts; `stats()` calls it before every snapshot."""
        self._lookup_sources.append(source)

    def remove_lookup_source(self, source: LookupSource) -> None:
        """Undo `add_lookup_source`."""
        if source in self._lookup_sources:
            self._lookup_sources.remove(source)

    def _drain_lookup_sources(self) -> None:
        for source in self._lookup_sources:
            for layer, expert, n in source():
                self.stats_.lookup(layer, "gpu", False, 0.0, expert=expert, count=n)

    def gpu_transfers_in_flight(self) -> int:
        """Copies to GPU slots asked for and not landed yet (the copy stream's backlog)."""
        if self.gpu is None:
            return 0
        with self._lock:
            self._reap_copies()
            return len(self.gpu.inflight) + self._copies_in_flight()

    def all_resident(self) -> bool:
        """Every expert of the store sits in a GPU slot, its copy and device map entry have landed, and no
        eviction can ever happen (budget >= experts). "Landed" matters: a copy leaves `inflight` once it is
        enqueued, and its map entry is written on the copy stream after it, so a decode kernel launched
        before that reads -1 for the expert; a step that then skipped its cold path lost the expert's
        contribution (seen once on the H200 as a bf16 error 20x transformers' while placement finished)."""
        if self.gpu is None or self.gpu.capacity < len(self.store.keys()):
            return False
        with self._lock:
            if len(self.gpu.slot_of) != len(self.store.keys()) or self.gpu.inflight:
                return False
            self._reap_copies()
            return not self._copying

    def all_pinned(self) -> bool:
        """Every expert of the store sits in pinned RAM and none can ever be evicted from it (its budget holds
        them all): from then on, nothing needs fetching into RAM again."""
        if not self._pinned_holds_all:
            return False
        with self._lock:
            return len(self.pinned.slot_of) == len(self.store.keys()) and not self.pinned.inflight

    def slot_weights(self) -> SlotWeights:
        """Typed views of every GPU slot: gate_up [S, 2I, H], down [S, H, I]."""
        (gu, dn), store = self.store.expert_shapes, self.store
        return SlotWeights.from_slab(self.slots.slab, store.dtype, gu, dn, store.index.gate_up_bytes)
