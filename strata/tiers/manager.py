"""The tier manager: where every expert lives, and moving experts between tiers without blocking compute.

Tiers, fastest first: `gpu` (fixed slots in one VRAM slab), `pinned` (fixed slots of page-locked host
RAM; plain RAM on CPU-only hosts), `tmpfs` (whole layer files of the store copied to /dev/shm) and
`disk` (the store itself, which always holds everything, so dropping a copy never loses the only one).

    prefetch(keys, device)   returns at once; transfers run on worker threads and a CUDA copy stream
    place(keys, device)      initial placement, in the background, waiting for room (strata.tiers.placement)
    promote(key)             a popular expert into the GPU tier, the whole move on a transfer worker
    acquire(keys, device)    handles to resident copies, waiting only for what is not there yet
    release(handles)         unpins; an object in use (or being copied) is never evicted

Concurrent requests for one object share one transfer. A GPU handle carries a CUDA event; the compute
stream waits on it, the host does not. Every lookup, byte and wait is counted in `TierStats`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from strata.errors import StrataError
from strata.tiers.diskio import DiskReader
from strata.tiers.eviction import EvictionMixin
from strata.tiers.gpu_slots import GpuSlots
from strata.tiers.integrity import IntegrityMixin
from strata.tiers.lookups import LookupsMixin
from strata.tiers.pinned import PinnedPool
from strata.tiers.placement import PlacementMixin
from strata.tiers.policy import make_policy
from strata.tiers.slots import (
    MIN_PINNED_SLOTS,
    ExpertHandle,
    Key,
    TierBudgets,
    TierFullError,
    _SlotTier,
    gpu_direct_reader,
    static_hot_slots,
)
from strata.tiers.stats import TierStats
from strata.tiers.step_copies import StepCopiesMixin
from strata.tiers.store.store import ExpertStore
from strata.tiers.tmpfs import TmpfsMirror
from strata.tiers.transfers import TransfersMixin

log = logging.getLogger("strata.tiers")


class TierManager(IntegrityMixin, LookupsMixin, PlacementMixin, StepCopiesMixin, TransfersMixin, EvictionMixin):
    """Places a store's experts across GPU, pinned RAM, tmpfs and disk within budgets."""

    FULL_WAIT_S = 30.0  # how long an acquire waits for other threads to release slots before TierFullError

    def __init__(self, store: ExpertStore, budgets: TierBudgets, *, gpu_device: torch.device | None = None,
                 policy: str = "lfu", half_life: float = 8192.0, hot: list[Key] | None = None,
                 tmpfs_dir: str | Path | None = None, io_threads: int = 8, direct_io: bool = True,
                 disk_reader: str = "auto", stream_slots: int = 0):
        self.store, self.budgets = store, budgets
        self.stats_ = TierStats()
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._jobs: list = []
        self._running = 0  # jobs a worker has popped and not finished
        self._jobs_ready = threading.Condition(self._lock)
        self._released = threading.Condition(self._lock)  # notified whenever handles are released
        self._thread_refs: collections.Counter = collections.Counter()  # thread id -> handles it holds
        self._closed = False
        self._verified: set[Key] = set()
        self._prefetched: dict[str, set[Key]] = {"gpu": set(), "pinned": set()}
        self._lookup_sources: list = []
        self._placing = 0  # initial placement threads running (`place`)
        self._tls = threading.local()  # `copies`: GPU copies `_ensure` left to its caller (`_outside_lock`)
        moe_layers = sorted({k[0] for k in store.keys()})
        self._layers = moe_layers
        hot = list(hot or [])
        self.policy_name = policy
        n_pinned = max(budgets.pinned_slots, MIN_PINNED_SLOTS if budgets.gpu_slots else 4)
        self.pool = PinnedPool(store.slot_bytes, n_pinned, pin=gpu_device is not None and gpu_device.type == "cuda")
        # every expert fits in pinned RAM: nothing is ever evicted from it, so its policy order is moot and a
        # decode layer's pinned lookups skip updating it (tens of microseconds per layer on the hot path)
        self._pinned_holds_all = n_pinned >= len(store.keys())
        self.pinned = _SlotTier("pinned", n_pinned, make_policy(policy, half_life=half_life,
                                                                 hot=hot[: static_hot_slots(n_pinned)],
                                                                 reload_cost=self._reload_cost_pinned))
        self.slots: GpuSlots | None = None
        self.gpu: _SlotTier | None = None
        self.stream_slots: list[int] = []  # GPU slots outside the cached tier, for `stream_gpu`
        self._stream_free: dict[int, object] = {}  # stream slot -> event after its last readers (absent: free now)
        self._stream_out: set[int] = set()  # stream slots of `stream_gpu` batches out and not released
        if budgets.gpu_slots > 0:
            n_layers = max(moe_layers) + 1
            n_experts = max(k[1] for k in store.keys()) + 1
            try:
                self.slots = GpuSlots(store.slot_bytes, budgets.gpu_slots, n_layers, n_experts, gpu_device or "cpu")
            except torch.OutOfMemoryError:
                raise StrataError(
                    f"could not allocate {budgets.gpu_slots} GPU expert slots "
                    f"({budgets.gpu_slots * store.slot_bytes / 2**30:.2f} GiB) on {gpu_device}; "
                    "lower tiers.gpu.budget or free GPU memory"
                ) from None
            if not 0 <= stream_slots < budgets.gpu_slots:
                raise ValueError(f"stream_slots must be in [0, {budgets.gpu_slots}), got {stream_slots}")
            cached = budgets.gpu_slots - stream_slots  # the last `stream_slots` slots take one step's copies
            self.gpu = _SlotTier("gpu", cached, make_policy(policy, half_life=half_life,
                                                            hot=hot[: static_hot_slots(cached)],
                                                            reload_cost=self._reload_cost_gpu))
            self.stream_slots = list(range(cached, budgets.gpu_slots))
        self.reader = DiskReader(num_threads=io_threads, direct=direct_io)
        self.gds = gpu_direct_reader(disk_reader) if self.slots is not None and self.slots.slab.is_cuda else None
        self.tmpfs = TmpfsMirror(store, tmpfs_dir, budgets.tmpfs_bytes, order=hot) if tmpfs_dir and budgets.tmpfs_bytes else None
        self._copying: dict[int, tuple] = {}  # GPU copy batches (start, done, keys) whose pinned sources are held
        self._workers = [threading.Thread(target=self._work, name=f"strata-tier-{i}", daemon=True)
                         for i in range(io_threads)]
        for w in self._workers:
            w.start()

    # ---- public API ---------------------------------------------------------------------------
    def prefetch(self, keys: list[Key], device: str = "gpu", priority: int = 1, warm: bool = False) -> None:
        """Start bringing `keys` to the `device` tier ("gpu" or "cpu"); returns at once.

        `warm=True` is initial placement (lowest priority, not counted as prediction).
        """
        tier = self._tier(device)
        with self._outside_lock():
            with self._lock:
                for key in keys:
                    if key in tier.slot_of or key in tier.inflight:
                        continue
                    try:
                        self._ensure(tier, key, 2 if warm else priority)
                    except TierFullError:
                        return  # prefetch is best effort: never evict what is in use
                    if not warm:
                        self.stats_.prefetch_issued += 1
                        self._prefetched[tier.name].add(key)

    @contextlib.contextmanager
    def _outside_lock(self):
        """GPU copies from pinned-resident sources that `_ensure` queues in this block are issued at its end,
        after the caller has released the manager's lock: issuing one (copy stream, events) takes about half a
        millisecond of host time, which the decode thread would otherwise wait out in its next lookup (a
        promotion on a transfer worker, a prefetch, placement)."""
        outer = getattr(self._tls, "copies", None)
        if outer is not None:  # nested: the outermost block issues them
            yield
            return
        self._tls.copies = copies = []
        try:
            yield
        finally:
            self._tls.copies = None
            for args in copies:
                try:
                    self._copy_to_gpu(*args)
                except Exception:  # as from a future's callback, where the copy ran before: logged, not raised
                    log.exception("strata: the GPU copy of expert %s failed", args[0])

    def acquire(self, keys: list[Key], device: str = "gpu") -> list[ExpertHandle]:
        """Handles to resident copies of `keys` on `device`, pinned until `release`."""
        tier = self._tier(device)
        waits: list[tuple[Key, Future, str | None, float]] = []
        for key in keys:
            deadline = None
            while True:
                with self._lock:
                    try:
                        waits.append(self._lookup(tier, key))
                        break
                    except TierFullError:
                        pending, copy = self._pressure_waitables()
                        if not pending and copy is None:
                            # slots held by another thread (the CPU expert worker, a second request) free up
                            # when it releases them; only what this call holds itself can never come back
                            deadline = deadline or time.monotonic() + self.FULL_WAIT_S
                            if self._held_by_others() and time.monotonic() < deadline:
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
                    with self._lock:
                        for k, *_ in waits[i:]:
                            self._unpin(tier, k)
                    raise
                stall = time.perf_counter() - t0
            with self._lock:
                self.stats_.lookup(key[0], source, fut is not None, stall, expert=key[1])
                handles.append(self._handle(tier, key))
        return handles

    def _lookup(self, tier: _SlotTier, key: Key) -> tuple[Key, Future | None, str, float]:
        """Pin `key` in `tier`, starting its transfer if needed (under the lock)."""
        self._note_prefetch_use(tier, key)
        if key in tier.slot_of and key not in tier.inflight:
            tier.policy.touch(key)
            tier.refs[key] = tier.refs.get(key, 0) + 1
            self._thread_refs[threading.get_ident()] += 1
            return key, None, tier.name, 0.0
        source = self._source_of(key, tier)
        fut = self._ensure(tier, key, priority=0)
        tier.policy.touch(key)
        tier.refs[key] = tier.refs.get(key, 0) + 1
        self._thread_refs[threading.get_ident()] += 1
        return key, fut, source, time.perf_counter()

    def _held_by_others(self) -> bool:
        """Another thread holds handles: it will release them (what this thread holds never comes back
        while it waits here)."""
        me = threading.get_ident()
        return any(n > 0 for tid, n in self._thread_refs.items() if tid != me)

    def _unpin(self, tier: _SlotTier, key: Key) -> None:
        """Undo a `_lookup` of this thread that will not become a handle."""
        self._unref(tier, key)
        self._thread_refs[threading.get_ident()] -= 1

    def _pressure_waitables(self) -> tuple[list[Future], object]:
        """What a full tier can wait for: transfers in flight, else the oldest GPU copy holding a staging slot."""
        pending = [f for t in (self.gpu, self.pinned) if t is not None for f in t.inflight.values()]
        self._reap_copies()
        oldest = next(iter(self._copying.values()), None)
        return pending, (oldest[1] if oldest is not None else None)

    def resident_experts(self, layer: int, device: str = "gpu") -> set[int]:
        """Experts of `layer` with a usable copy on `device` right now (a snapshot)."""
        tier = self._tier(device)
        with self._lock:
            return {k[1] for k in tier.slot_of if k[0] == layer and k not in tier.inflight}

    def observed_rate(self, path: str, default: float) -> float:
        """Achieved bytes/s on a movement path so far (`default` until something has moved)."""
        with self._lock:
            c = self.stats_.paths.get(path)
            return c.bytes / c.seconds if c is not None and c.seconds > 0 and c.objects >= 8 else default

    def max_acquire(self, device: str = "gpu") -> int:
        """How many experts of one layer can be held at once on `device` (callers acquire in chunks)."""
        tier = self._tier(device)
        n = self._quota(tier) if self.budgets.per_layer else tier.capacity
        return n - static_hot_slots(n) if self.policy_name == "static" else n

    async def acquire_async(self, keys: list[Key], device: str = "gpu") -> list[ExpertHandle]:
        """`acquire` for asyncio callers: waits in a thread, never blocks the event loop."""
        return await asyncio.to_thread(self.acquire, keys, device)

    def release(self, handles: list[ExpertHandle]) -> None:
        """Unpin handles. On CUDA, later copies into a released GPU slot wait for the work queued on it."""
        with self._lock:
            self._released.notify_all()
            for h in handles:
                tier = self.gpu if h.tier == "gpu" else self.pinned
                if h.tier == "gpu" and self.slots is not None and self.slots.slab.is_cuda:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.slots.slab.device))
                    tier.events[h.slot] = ev
                self._unref(tier, h.key)
                self._thread_refs[h.owner] -= 1

    def residency(self, key: Key) -> list[str]:
        """Tiers holding a usable copy of `key`, fastest first (disk always)."""
        with self._lock:
            tiers = [t.name for t in (self.gpu, self.pinned) if t is not None and key in t.slot_of and key not in t.inflight]
        if self.tmpfs is not None and self.tmpfs.has(key[0]):
            tiers.append("tmpfs")
        return tiers + ["disk"]

    def pending_work(self) -> int:
        """Reads and copies queued, running or in flight (initial placement, prefetch, scrub); 0 when settled."""
        with self._lock:
            self._reap_copies()
            inflight = sum(len(t.inflight) for t in (self.gpu, self.pinned) if t is not None)
            background = int(self.pool.allocating) + int(self.tmpfs is not None and self.tmpfs.copying)
            return len(self._jobs) + self._running + inflight + self._copies_in_flight() + background + self._placing

    def wait_settled(self, timeout: float = 600.0) -> bool:
        """Block until `pending_work()` is 0 (the background placement is done); False on timeout.

        Benchmarks call it so that a measurement does not include the start-up placement still
        filling the tiers; serving never needs to (requests are served while the tiers fill)."""
        deadline = time.monotonic() + timeout
        while self.pending_work():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._lock:
                self._released.wait(min(left, 0.05))
        return True

    def stats(self) -> dict:
        """A snapshot of tier statistics (JSON-ready)."""
        pending = self.pending_work()
        with self._lock:
            self._reap_copies()
            self._drain_lookup_sources()
            residency = {"pinned": len(self.pinned.slot_of), "disk": len(self.store.keys())}
            capacity = {"pinned": self.pinned.capacity, "disk": len(self.store.keys())}
            if self.gpu is not None:
                residency["gpu"], capacity["gpu"] = len(self.gpu.slot_of), self.gpu.capacity
            if self.tmpfs is not None:
                residency["tmpfs"] = self.tmpfs.resident_objects()
                capacity["tmpfs"] = self.tmpfs.capacity_objects()
            behind = self.slots.clears_behind_copy if self.slots is not None else 0
            return {**self.stats_.snapshot(residency, capacity, behind), "pending_work": pending}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._jobs_ready.notify_all()
        for w in self._workers:
            w.join(timeout=5)
        self.reader.close()
        if self.tmpfs is not None:
            self.tmpfs.close()
        self.pool.close()
        if self.gds is not None:
            self.gds.close()

    # ---- placement (all under self._lock) ---------------------------------------------------------
    def _tier(self, device: str) -> _SlotTier:
        if device == "gpu":
            if self.gpu is None:
                raise StrataError("the GPU tier has no slots (tiers.gpu.budget is 0 or there is no GPU); use device='cpu'")
            return self.gpu
        if device in ("cpu", "pinned"):
            return self.pinned
        raise StrataError(f"unknown tier device {device!r}; use 'gpu' or 'cpu'")

    def _source_of(self, key: Key, tier: _SlotTier) -> str:
        if tier is self.gpu and key in self.pinned.slot_of and key not in self.pinned.inflight:
            return "pinned"
        return "tmpfs" if self.tmpfs is not None and self.tmpfs.has(key[0]) else "disk"

    def _ensure(self, tier: _SlotTier, key: Key, priority: int) -> Future:
        """Future resolved when `key` is resident in `tier`; starts (or joins) the transfer."""
        if key in tier.inflight:
            return tier.inflight[key]
        if key in tier.slot_of:
            done: Future = Future()
            done.set_result(None)
            return done
        direct = (tier is self.gpu and self.gds is not None and key in self._verified
                  and key not in self.pinned.slot_of and not (self.tmpfs is not None and self.tmpfs.has(key[0])))
        if direct:  # disk -> GPU slot with kvikio; verified objects only (checksums are checked on the host)
            slot = self._take_slot(tier, key)
            fut = Future()
            tier.inflight[key], tier.slot_of[key] = fut, slot
            self._submit(priority, self._load_gpu_direct, key, slot, fut)
            return fut
        if tier is self.gpu:  # stage through pinned RAM first (its slot is held while the copy reads it)
            src = self._ensure(self.pinned, key, priority)
            self.pinned.refs[key] = self.pinned.refs.get(key, 0) + 1
            try:
                slot = self._take_slot(tier, key)
            except TierFullError:
                self._unref(self.pinned, key)
                raise
        else:
            slot = self._take_slot(tier, key)
        fut: Future = Future()
        tier.inflight[key] = fut
        tier.slot_of[key] = slot
        if tier is self.pinned:
            self._submit(priority, self._load_pinned, key, slot, fut)
        else:
            deferred = getattr(self._tls, "copies", None)
            if deferred is not None and src.done():  # issued by the caller once it has let go of the lock
                deferred.append((key, slot, fut, src))
            else:
                src.add_done_callback(lambda f: self._copy_to_gpu(key, slot, fut, f))
        return fut

    def _handle(self, tier: _SlotTier, key: Key) -> ExpertHandle:
        slot = tier.slot_of[key]
        buf = self.slots.view(slot) if tier is self.gpu else self.pool.slot(slot)
        gate_up, down = self.store.expert_views(buf)
        event = tier.events.get(slot) if tier is self.gpu else None
        return ExpertHandle(key, tier.name, slot, gate_up, down, event, threading.get_ident())
