"""The tier manager's slot bookkeeping: taking a slot (evicting the policy's victim among objects not in
use), per-layer quotas, references, prefetch accounting and the reload costs the `cost` policy weighs.
All of it runs under the manager's lock."""

from __future__ import annotations

import contextlib

from strata.tiers.slots import Key, TierFullError, _SlotTier


class EvictionMixin:
    """Mixed into TierManager: uses its tiers, slots, budgets, statistics, tmpfs mirror and `_reap_copies`."""

    def _take_slot(self, tier: _SlotTier, key: Key, clears: list[Key] | None = None, reap: bool = True) -> int:
        """A free slot, or one freed by evicting the policy's victim among objects not in use (a GPU
        victim's map entry is cleared now, or appended to `clears` for the caller to clear in a batch).
        `reap=False`: the caller has just reaped finished copies (a batch reaps once, not per object)."""
        if tier.free and (not self.budgets.per_layer or self._layer_count(tier, key[0]) < self._quota(tier)):
            return tier.free.pop()
        if reap:
            self._reap_copies()
        if self.budgets.per_layer:
            victim = tier.policy.victim(lambda k: k[0] == key[0] and k in tier.slot_of and not tier.busy(k))
        else:
            victim = tier.policy.victim(lambda k: k in tier.slot_of and not tier.busy(k))
        if victim is None:
            if tier.free:
                return tier.free.pop()
            raise TierFullError(
                f"all {tier.capacity} {tier.name} slots are in use; raise tiers.{tier.name}.budget "
                "(a step needs at least top_k experts of one layer resident)"
            )
        slot = tier.slot_of.pop(victim)
        tier.policy.remove(victim)
        self.stats_.evictions[tier.name] += 1
        if victim in self._prefetched[tier.name]:
            self._prefetched[tier.name].discard(victim)
            self.stats_.prefetch_unused += 1
        if tier is self.gpu:
            if clears is None:
                self.slots.clear(victim)
            else:
                clears.append(victim)
        return slot

    def unheld_slot_reads(self) -> contextlib.AbstractContextManager:
        """Hold while this thread reads GPU slots it has no handle on (decode's pass over the resident pairs). On
        a CPU-simulated GPU tier, evictions wait for it: a transfer worker (`promote`) clears its victim's map
        entry under the manager's lock and then overwrites the slot, and no stream orders that after these reads
        (a pass that has already looked the slot up would read the new expert's bytes). On CUDA the caller's
        stream does (the clear is queued behind its kernels): nothing is held."""
        if self.slots is None or self.slots.is_cuda:
            return contextlib.nullcontext()
        return self._lock

    def _layer_count(self, tier: _SlotTier, layer: int) -> int:
        return sum(1 for k in tier.slot_of if k[0] == layer)

    def _quota(self, tier: _SlotTier) -> int:
        return max(1, tier.capacity // max(1, len(self._layers)))

    def _unref(self, tier: _SlotTier, key: Key) -> None:
        n = tier.refs.get(key, 0) - 1
        if n > 0:
            tier.refs[key] = n
        else:
            tier.refs.pop(key, None)

    def _note_prefetch_uses(self, tier: _SlotTier, keys: list[Key]) -> None:
        """`_note_prefetch_use` for each of `keys` (usually none was prefetched: one set test for the lot)."""
        if self._prefetched[tier.name]:
            for key in keys:
                self._note_prefetch_use(tier, key)

    def _note_prefetch_use(self, tier: _SlotTier, key: Key) -> None:
        if key in self._prefetched[tier.name]:
            self._prefetched[tier.name].discard(key)
            self.stats_.prefetch_used += 1
            if key in tier.inflight:
                self.stats_.prefetch_late += 1

    def _reload_cost_pinned(self, key: Key) -> float:
        return 1 / 3.0e9 if self.tmpfs is not None and self.tmpfs.has(key[0]) else 1 / 1.0e9

    def _reload_cost_gpu(self, key: Key) -> float:
        return 1 / 50e9 if key in self.pinned.slot_of else self._reload_cost_pinned(key)
