"""Where every expert sits in the slotted tiers (GPU and pinned RAM), and the one lock that guards it.

Each slotted tier is a `SlotTier`: which object holds which slot, the free slots, how many handles use
each object, the transfers still on their way in, and the last event reading or writing each slot.
`SlotMaps` holds both tiers, the lock every part of the tier manager takes to read or change them,
the condition waited on for slots to come free, and how many handles each thread holds (a thread that
waits for room must know whether anyone else can give some back).

The fields are plain dicts and lists, read and written directly by the tier manager's parts under
`SlotMaps.lock` (the decode step looks experts up every layer: no method call per key there). Callers
outside the tier manager read them through the manager's snapshot methods, which take the lock.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from strata.errors import StrataError
from strata.tiers.slots import Key


@dataclass
class SlotTier:
    """Bookkeeping of one slotted tier; every field is guarded by `SlotMaps.lock`."""

    name: str  # "gpu" | "pinned"
    capacity: int
    policy: object  # strata.tiers.policy: ranks the resident objects for eviction
    holds_all: bool = False  # the tier holds every expert: nothing is ever evicted, its policy order is moot
    slot_of: dict[Key, int] = field(default_factory=dict)  # mapped objects (landed, or with a transfer in flight)
    free: list[int] = field(default_factory=list)  # free slots, popped from the end
    refs: dict[Key, int] = field(default_factory=dict)  # handles (and copies reading it) per object in use
    inflight: dict[Key, Future] = field(default_factory=dict)  # transfers into the tier not landed yet
    events: dict[int, object] = field(default_factory=dict)  # slot -> last event that reads/writes it

    def __post_init__(self) -> None:
        self.free = list(range(self.capacity - 1, -1, -1))

    def usable(self, key: Key) -> bool:
        """`key` has a copy here that can be read now (mapped, no transfer into its slot in flight)."""
        return key in self.slot_of and key not in self.inflight

    def busy(self, key: Key) -> bool:
        """`key` may not be evicted: a handle uses it, or its transfer is still in flight."""
        return self.refs.get(key, 0) > 0 or key in self.inflight

    def ref(self, key: Key) -> None:
        """One more user of `key` (a handle, or a GPU copy reading its pinned slot)."""
        self.refs[key] = self.refs.get(key, 0) + 1

    def unref(self, key: Key) -> None:
        """Undo one `ref`."""
        n = self.refs.get(key, 0) - 1
        if n > 0:
            self.refs[key] = n
        else:
            self.refs.pop(key, None)

    def layer_count(self, layer: int) -> int:
        """Objects of `layer` mapped here (per-layer budgets)."""
        return sum(1 for k in self.slot_of if k[0] == layer)

    def usable_keys(self) -> set[Key]:
        """Every key with a usable copy here."""
        return {k for k in self.slot_of if k not in self.inflight}


class SlotMaps:
    """The GPU tier (None without GPU slots) and the pinned tier, with the lock and condition they share."""

    def __init__(self, pinned: SlotTier, gpu: SlotTier | None):
        self.pinned, self.gpu = pinned, gpu
        self.lock = threading.RLock()  # re-entrant: a lookup source may call back into the manager under it
        self.released = threading.Condition(self.lock)  # notified whenever handles are released or work ends
        self.holders: collections.Counter[int] = collections.Counter()  # thread id -> handles it holds (lock held)

    def tier(self, device: str) -> SlotTier:
        """The slotted tier a device name asks for: "gpu", or "cpu" / "pinned"."""
        if device == "gpu":
            if self.gpu is None:
                raise StrataError("the GPU tier has no slots (tiers.gpu.budget is 0 or there is no GPU); use device='cpu'")
            return self.gpu
        if device in ("cpu", "pinned"):
            return self.pinned
        raise StrataError(f"unknown tier device {device!r}; use 'gpu' or 'cpu'")

    def tiers(self) -> list[SlotTier]:
        """The slotted tiers there are, fastest first."""
        return [self.gpu, self.pinned] if self.gpu is not None else [self.pinned]

    def held_by_others(self) -> bool:
        """Another thread holds handles: it will release them (what this thread holds never comes back while it
        waits for room). Lock held."""
        me = threading.get_ident()
        return any(n > 0 for tid, n in self.holders.items() if tid != me)

    def in_flight(self) -> list[Future]:
        """Transfers into either tier not landed yet (lock held)."""
        return [f for t in self.tiers() for f in t.inflight.values()]

    def holding(self, key: Key) -> list[str]:
        """Names of the slotted tiers holding a usable copy of `key`, fastest first."""
        with self.lock:
            return [t.name for t in self.tiers() if t.usable(key)]

    def usable_keys(self) -> dict[str, set[Key]]:
        """Tier name -> keys with a usable copy there, read in one hold of the lock."""
        with self.lock:
            return {t.name: t.usable_keys() for t in self.tiers()}

    def resident_experts(self, layer: int, device: str) -> set[int]:
        """Experts of `layer` with a usable copy in `device`'s tier right now (a snapshot)."""
        tier = self.tier(device)
        with self.lock:
            return {k[1] for k in tier.slot_of if k[0] == layer and k not in tier.inflight}
