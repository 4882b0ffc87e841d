"""One tier manager per card of a staged model, seen by the engine, the dashboard and /metrics as one.

Each card's `TierManager` serves only its stage's MoE layers: it is given a `StoreView` of the shared
store, so its GPU slots, pinned pool, tmpfs mirror, policies and statistics cover those layers alone
(nothing in the tier manager changes). `DeviceTiers` routes every call by layer and merges statistics:
`stats()` is the usual snapshot over all cards plus `"devices": {"cuda:N": snapshot of that card}` and
`"stage_hops"` (activation copies between cards).
"""

from __future__ import annotations

import time
from collections import defaultdict

from strata.tiers.manager import TierManager
from strata.tiers.stats import PathCounters, TierStats
from strata.tiers.store.store import ExpertStore

Key = tuple[int, int]


class StoreView:
    """`store` restricted to the MoE layers in `layers`: `keys()` lists only theirs; everything else is
    the store's own (files, offsets, checksums, tables). Closing a view leaves the store open."""

    def __init__(self, store: ExpertStore, layers: set[int]):
        self._store, self.layers = store, frozenset(layers)
        self._keys = [k for k in store.keys() if k[0] in self.layers]

    def keys(self) -> list[Key]:
        """This view's (layer, expert) keys, sorted (a shared list: do not modify it)."""
        return self._keys

    def close(self) -> None:
        pass  # the store belongs to the checkpoint

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class _MergedTmpfs:
    def __init__(self, owners: dict[int, TierManager]):
        self._owners = owners

    def has(self, layer: int) -> bool:
        m = self._owners.get(layer)
        return m is not None and m.tmpfs is not None and m.tmpfs.has(layer)


class DeviceTiers:
    """The tier managers of a staged model (one per card, each for its own layers) behind one interface."""

    def __init__(self, store: ExpertStore, managers: list[TierManager], devices: list[str],
                 layers: list[tuple[int, int]], hops=None):
        # one key per card in stats()["devices"]; stages sharing a device (CPU tests) are told apart by index
        names = [d if devices.count(d) == 1 else f"{d}/{s}" for s, d in enumerate(devices)]
        self.store, self.managers, self.devices, self.layer_ranges = store, managers, names, layers
        self._owner: dict[int, TierManager] = {}
        for m, (start, end) in zip(managers, layers, strict=True):
            self._owner.update(dict.fromkeys(range(start, end), m))
        self._hops = hops  # () -> dict of stage-hop statistics, or None

    def manager_for(self, layer: int) -> TierManager:
        """The tier manager of the card that runs `layer`."""
        return self._owner[layer]

    # ---- the TierManager calls, routed by layer -----------------------------------------------------
    def prefetch(self, keys: list[Key], device: str = "gpu", priority: int = 1, warm: bool = False) -> None:
        for m, part in self._by_manager(keys):
            m.prefetch(part, device, priority, warm)

    def acquire(self, keys: list[Key], device: str = "gpu") -> list:
        handles = []
        try:
            for m, part in self._by_manager(keys):
                handles += m.acquire(part, device)
        except BaseException:
            self.release(handles)
            raise
        order = {k: i for i, k in enumerate(keys)}
        return sorted(handles, key=lambda h: order[h.key])

    def release(self, handles: list) -> None:
        for h in handles:
            self._owner[h.key[0]].release([h])

    def residency(self, key: Key) -> list[str]:
        return self._owner[key[0]].residency(key)

    def resident_experts(self, layer: int, device: str = "gpu") -> set[int]:
        return self._owner[layer].resident_experts(layer, device)

    def pending_work(self) -> int:
        return sum(m.pending_work() for m in self.managers)

    def wait_settled(self, timeout: float = 600.0) -> bool:
        deadline = time.monotonic() + timeout
        return all(m.wait_settled(max(0.0, deadline - time.monotonic())) for m in self.managers)

    def scrub(self) -> None:
        for m in self.managers:
            m.scrub()

    def close(self) -> None:
        for m in self.managers:
            m.close()

    def _by_manager(self, keys: list[Key]):
        groups: dict[int, list[Key]] = defaultdict(list)
        for k in keys:
            groups[id(self._owner[k[0]])].append(k)
        by_id = {id(m): m for m in self.managers}
        return [(by_id[i], part) for i, part in groups.items()]

    # ---- statistics ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The merged snapshot, with each card's own under "devices" and the stage hops under "stage_hops"."""
        per = [m.stats() for m in self.managers]  # also drains each card's device-side lookup counts
        residency: dict[str, int] = defaultdict(int)
        capacity: dict[str, int] = defaultdict(int)
        for snap in per:
            for tier, row in snap["tiers"].items():
                residency[tier] += row["resident"]
                capacity[tier] += row["capacity"]
        behind = sum(snap["promotions"]["clears_behind_copy"] for snap in per)
        merged = self.stats_.snapshot(dict(residency), dict(capacity), behind)
        merged["pending_work"] = sum(snap["pending_work"] for snap in per)
        merged["devices"] = {}
        for dev, (start, end), snap in zip(self.devices, self.layer_ranges, per, strict=True):
            gpu = snap["hit_rate"].get("gpu", 0.0)
            pcie = sum(p["bytes"] for name, p in snap["paths"].items() if name.endswith("->gpu"))
            merged["devices"][dev] = {**snap, "stage_layers": [start, end], "gpu_hit_rate": gpu, "pcie_bytes": pcie}
        if self._hops is not None:
            merged["stage_hops"] = self._hops()
        return merged

    @property
    def stats_(self) -> TierStats:
        """Every card's counters added up (a fresh copy; layers are disjoint between cards)."""
        out = TierStats()
        for m in self.managers:
            with m.lock:
                s = m.stats_
                out.started = min(out.started, s.started)
                out.layers.update(s.layers)
                for name, c in s.paths.items():
                    p = out.paths.setdefault(name, PathCounters())
                    p.bytes, p.objects, p.seconds = p.bytes + c.bytes, p.objects + c.objects, p.seconds + c.seconds
                for name in ("prefetch_issued", "prefetch_used", "prefetch_late", "prefetch_unused", "checksum_failures",
                             "promotions", "promotion_host_seconds"):
                    setattr(out, name, getattr(out, name) + getattr(s, name))
                for tier, n in s.evictions.items():
                    out.evictions[tier] += n
                out.damaged.extend(s.damaged)
                out.expert_lookups.update(getattr(s, "expert_lookups", {}))
        return out

    # ---- where experts are, for the dashboard's residency grid ------------------------------------------
    def usable_keys(self) -> dict[str, set[Key]]:
        """`TierManager.usable_keys` over every card (a tier is listed where any card has it)."""
        out: dict[str, set[Key]] = {}
        for m in self.managers:
            for tier, keys in m.usable_keys().items():
                out.setdefault(tier, set()).update(keys)
        return out

    def lookup_counts(self) -> tuple[dict[Key, int], dict[int, int]]:
        """`TierManager.lookup_counts` over every card (their layers are disjoint)."""
        experts: dict[Key, int] = {}
        layers: dict[int, int] = {}
        for m in self.managers:
            e, ly = m.lookup_counts()
            experts.update(e)
            layers.update(ly)
        return experts, layers

    @property
    def tmpfs(self) -> _MergedTmpfs | None:
        return _MergedTmpfs(self._owner) if any(m.tmpfs is not None for m in self.managers) else None
