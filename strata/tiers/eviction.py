"""Slots for arriving objects: a free one, or one freed by evicting the policy's victim among objects not in
use; per-layer quotas; and the reload costs the `cost` policy weighs. All of it runs under the slot maps' lock."""

from __future__ import annotations

from collections.abc import Callable

from strata.tiers.copies import GpuCopies
from strata.tiers.slot_maps import SlotTier
from strata.tiers.slots import Key, TierBudgets, TierFullError, static_hot_slots
from strata.tiers.stats import PrefetchLedger, TierStats
from strata.tiers.storage.gpu_slots import GpuSlots
from strata.tiers.storage.tmpfs import TmpfsMirror


def pinned_reload_cost(tmpfs: TmpfsMirror | None) -> Callable[[Key], float]:
    """Seconds per byte to bring an object back into pinned RAM: from the tmpfs mirror, else from disk."""

    def cost(key: Key) -> float:
        return 1 / 3.0e9 if tmpfs is not None and tmpfs.has(key[0]) else 1 / 1.0e9

    return cost


def gpu_reload_cost(pinned: SlotTier, below: Callable[[Key], float]) -> Callable[[Key], float]:
    """Seconds per byte to bring an object back into a GPU slot: from pinned RAM, else as `below` (into pinned)."""

    def cost(key: Key) -> float:
        return 1 / 50e9 if key in pinned.slot_of else below(key)

    return cost


class Evictor:
    """Finds slots in a full tier: what the policy gives up, never an object in use or on its way in."""

    def __init__(self, budgets: TierBudgets, moe_layers: list[int], policy_name: str, stats: TierStats,
                 ledger: PrefetchLedger, copies: GpuCopies, gpu: SlotTier | None, slots: GpuSlots | None):
        self._per_layer, self._layers, self._static = budgets.per_layer, len(moe_layers), policy_name == "static"
        self._stats, self._ledger, self._copies, self._gpu, self._slots = stats, ledger, copies, gpu, slots

    def take_slot(self, tier: SlotTier, key: Key, clears: list[Key] | None = None, reap: bool = True) -> int:
        """A free slot, or one freed by evicting the policy's victim among objects not in use (a GPU
        victim's map entry is cleared now, or appended to `clears` for the caller to clear in a batch).
        `reap=False`: the caller has just reaped finished copies (a batch reaps once, not per object)."""
        if tier.free and (not self._per_layer or tier.layer_count(key[0]) < self.quota(tier)):
            return tier.free.pop()
        if reap:
            self._copies.reap()
        victim = self.victim(tier, key[0])
        if victim is None:
            if tier.free:
                return tier.free.pop()
            raise TierFullError(
                f"all {tier.capacity} {tier.name} slots are in use; raise tiers.{tier.name}.budget "
                "(a step needs at least top_k experts of one layer resident)"
            )
        slot = tier.slot_of.pop(victim)
        tier.policy.remove(victim)
        self._stats.evictions[tier.name] += 1
        self._ledger.evicted(tier.name, victim)
        if tier is self._gpu:
            if clears is None:
                self._slots.clear(victim)
            else:
                clears.append(victim)
        return slot

    def victim(self, tier: SlotTier, layer: int) -> Key | None:
        """The object the policy would evict for an arrival in `layer` (its own layer's with per-layer budgets)."""
        if self._per_layer:
            return tier.policy.victim(lambda k: k[0] == layer and k in tier.slot_of and not tier.busy(k))
        return tier.policy.victim(lambda k: k in tier.slot_of and not tier.busy(k))

    def quota(self, tier: SlotTier) -> int:
        """Slots one layer may hold with per-layer budgets."""
        return max(1, tier.capacity // max(1, self._layers))

    def max_acquire(self, tier: SlotTier) -> int:
        """How many experts of one layer can be held at once in `tier` (the static policy's hot set stays put)."""
        n = self.quota(tier) if self._per_layer else tier.capacity
        return n - static_hot_slots(n) if self._static else n
