"""Handles on resident copies: `acquire` pins objects in a tier (waiting only for what is not there yet),
`release` unpins them, and `hold_resident` / `drop_held` pin pinned-RAM slots by address for the CPU kernel.

An object in use (or being copied) is never evicted. A GPU handle carries a CUDA event; the compute stream
waits on it, the host does not. A full tier makes `acquire` wait for transfers in flight, for copies still
reading their staging slots, or for another thread's handles; what this thread holds itself never comes back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from concurrent.futures import Future

import torch

from strata.tiers.copies import GpuCopies
from strata.tiers.lookups import LookupBooks
from strata.tiers.slot_maps import SlotMaps, SlotTier
from strata.tiers.slots import FULL_WAIT_S, ExpertHandle, Key, TierFullError
from strata.tiers.stats import PrefetchLedger, TierStats
from strata.tiers.storage.gpu_slots import GpuSlots
from strata.tiers.storage.pinned import PinnedPool
from strata.tiers.store.store import ExpertStore
from strata.tiers.transfers import Transfers


class Handles:
    """Pins and unpins objects in the slotted tiers of `maps` for callers reading them."""

    def __init__(self, store: ExpertStore, maps: SlotMaps, transfers: Transfers, copies: GpuCopies,
                 books: LookupBooks, ledger: PrefetchLedger, stats: TierStats, pool: PinnedPool,
                 slots: GpuSlots | None):
        self._store, self._maps, self._lock, self._released = store, maps, maps.lock, maps.released
        self._gpu, self._pinned, self._holders = maps.gpu, maps.pinned, maps.holders
        self._transfers, self._copies, self._books = transfers, copies, books
        self._ledger, self._stats, self._pool, self._slots = ledger, stats, pool, slots
        self._cuda = slots is not None and slots.slab.is_cuda

    def acquire(self, tier: SlotTier, keys: list[Key]) -> list[ExpertHandle]:
        """Handles to resident copies of `keys` in `tier`, pinned until `release`."""
        lock = self._lock
        waits: list[tuple[Key, Future | None, str, float]] = []
        for key in keys:
            deadline = None
            while True:
                with lock:
                    try:
                        waits.append(self._lookup(tier, key))
                        break
                    except TierFullError:
                        pending, copy = self._pressure_waitables()
                        if not pending and copy is None:
                            # slots held by another thread (the CPU expert worker, a second request) free up
                            # when it releases them; only what this call holds itself can never come back
                            deadline = deadline or time.monotonic() + FULL_WAIT_S
                            if self._maps.held_by_others() and time.monotonic() < deadline:
                                self._released.wait(timeout=deadline - time.monotonic())
                                continue
                            for k, *_ in waits:
                                self._unpin(tier, k)
                            raise
                # slots held by transfers still in flight free up when they land: wait for one, retry
                if pending:
                    concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                else:
                    copy.synchronize()
        handles: list[ExpertHandle] = []
        for i, (key, fut, source, t0) in enumerate(waits):
            stall = 0.0
            if fut is not None:
                try:
                    fut.result()
                except BaseException:
                    self.release(handles)
                    with lock:
                        for k, *_ in waits[i:]:
                            self._unpin(tier, k)
                    raise
                stall = time.perf_counter() - t0
            with lock:
                self._stats.lookup(key[0], source, fut is not None, stall, expert=key[1])
                handles.append(self._handle(tier, key))
        return handles

    def release(self, handles: list[ExpertHandle]) -> None:
        """Unpin handles. On CUDA, later copies into a released GPU slot wait for the work queued on it."""
        with self._lock:
            self._released.notify_all()
            for h in handles:
                tier = self._gpu if h.tier == "gpu" else self._pinned
                if h.tier == "gpu" and self._cuda:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self._slots.slab.device))
                    tier.events[h.slot] = ev
                tier.unref(h.key)
                self._holders[h.owner] -= 1

    def hold_resident(self, keys: list[Key]) -> list[int] | None:
        """Pin `keys` in their pinned-RAM slots and return the slots, if every one is resident there now;
        else None and nothing changes (the caller takes `acquire`). Counted as pinned-tier hits; undo with
        `drop_held`. For the CPU expert kernel, which reads the slots by address."""
        tier = self._pinned
        with self._lock:
            if not all(k in tier.slot_of and k not in tier.inflight for k in keys):
                return None
            self._books.count_pinned_reads(keys)
            for key in keys:
                tier.refs[key] = tier.refs.get(key, 0) + 1
            self._holders[threading.get_ident()] += len(keys)
            return [tier.slot_of[k] for k in keys]

    def drop_held(self, keys: list[Key]) -> None:
        """Undo `hold_resident` (same thread)."""
        with self._lock:
            for key in keys:
                self._pinned.unref(key)
            self._holders[threading.get_ident()] -= len(keys)
            self._released.notify_all()

    def unheld_slot_reads(self) -> contextlib.AbstractContextManager:
        """Hold while this thread reads GPU slots it has no handle on (decode's pass over the resident pairs). On
        a CPU-simulated GPU tier, evictions wait for it: a transfer worker (`promote`) clears its victim's map
        entry under the lock and then overwrites the slot, and no stream orders that after these reads (a pass
        that has already looked the slot up would read the new expert's bytes). On CUDA the caller's stream
        does (the clear is queued behind its kernels): nothing is held."""
        if self._slots is None or self._slots.is_cuda:
            return contextlib.nullcontext()
        return self._lock

    def _lookup(self, tier: SlotTier, key: Key) -> tuple[Key, Future | None, str, float]:
        """Pin `key` in `tier`, starting its transfer if needed (lock held)."""
        self._ledger.used(tier, key)
        if key in tier.slot_of and key not in tier.inflight:
            tier.policy.touch(key)
            tier.refs[key] = tier.refs.get(key, 0) + 1
            self._holders[threading.get_ident()] += 1
            return key, None, tier.name, 0.0
        source = self._transfers.source_of(key, tier)
        fut = self._transfers.ensure(tier, key, priority=0)
        tier.policy.touch(key)
        tier.refs[key] = tier.refs.get(key, 0) + 1
        self._holders[threading.get_ident()] += 1
        return key, fut, source, time.perf_counter()

    def _unpin(self, tier: SlotTier, key: Key) -> None:
        """Undo a `_lookup` of this thread that will not become a handle."""
        tier.unref(key)
        self._holders[threading.get_ident()] -= 1

    def _pressure_waitables(self) -> tuple[list[Future], object]:
        """What a full tier can wait for: transfers in flight, else the oldest GPU copy holding a staging slot."""
        pending = self._maps.in_flight()
        self._copies.reap()
        return pending, self._copies.oldest_end()

    def _handle(self, tier: SlotTier, key: Key) -> ExpertHandle:
        slot = tier.slot_of[key]
        buf = self._slots.view(slot) if tier is self._gpu else self._pool.slot(slot)
        event = tier.events.get(slot) if tier is self._gpu else None
        return ExpertHandle(key, tier.name, slot, self._store.expert_matrices(buf), event, threading.get_ident())
