"""The tier manager: where every expert lives, and moving experts between tiers without blocking compute.

Tiers, fastest first: `gpu` (fixed slots in one VRAM slab), `pinned` (fixed slots of page-locked host
RAM; plain RAM on CPU-only hosts), `tmpfs` (whole layer files of the store copied to /dev/shm) and
`disk` (the store itself, which always holds everything, so dropping a copy never loses the only one).

    prefetch(keys, device)   returns at once; transfers run on worker threads and a CUDA copy stream
    place(keys, device)      initial placement, in the background, waiting for room
    promote(key)             a popular expert into the GPU tier, the whole move on a transfer worker
    acquire(keys, device)    handles to resident copies, waiting only for what is not there yet
    release(handles)         unpins; an object in use (or being copied) is never evicted

`TierManager` is made of parts, each in its own module, and its methods delegate to them:

    maps        SlotMaps: the GPU and pinned tiers' maps (`gpu`, `pinned`) and the lock they share
    slots       GpuSlots: the GPU tier's VRAM slab and device map (None without a GPU tier)
    pool        PinnedPool: the pinned tier's page-locked RAM
    tmpfs       TmpfsMirror: layer files mirrored in tmpfs (None without a tmpfs budget)
    jobs        JobQueue: the worker threads
    evictor     Evictor: slots for arrivals, per-layer quotas
    copies      GpuCopies: pinned -> GPU copy batches in flight
    integrity   Integrity: checksums on first read, the background scrub
    transfers   Transfers: moves into a tier (reads, kvikio, copies)
    handles     Handles: acquire / release, pinned slots held by address
    books       LookupBooks: lookups made elsewhere, the policies' scores
    placer      Placer: initial placement, promotions
    step        StepCopies: one decode layer's cold experts in one batch
    stats_      TierStats: every lookup, byte and wait counted

Concurrent requests for one object share one transfer. A GPU handle carries a CUDA event; the compute
stream waits on it, the host does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from strata.errors import StrataError
from strata.kernels.gpu.experts.grouped import SlotWeights
from strata.tiers.copies import GpuCopies
from strata.tiers.eviction import Evictor, gpu_reload_cost, pinned_reload_cost
from strata.tiers.handles import Handles
from strata.tiers.integrity import Integrity
from strata.tiers.jobs import JobQueue
from strata.tiers.lookups import LookupBooks, LookupSource
from strata.tiers.placement import Placer
from strata.tiers.policy import make_policy
from strata.tiers.slot_maps import SlotMaps, SlotTier
from strata.tiers.slots import (
    MIN_PINNED_SLOTS,
    ExpertHandle,
    Key,
    TierBudgets,
    TierFullError,
    gpu_direct_reader,
    static_hot_slots,
)
from strata.tiers.stats import PrefetchLedger, TierStats
from strata.tiers.step_copies import StagedExperts, StepCopies, StreamedExperts
from strata.tiers.storage.diskio import DiskReader
from strata.tiers.storage.gpu_slots import GpuSlots
from strata.tiers.storage.pinned import PinnedPool
from strata.tiers.storage.tmpfs import TmpfsMirror
from strata.tiers.store.store import ExpertStore
from strata.tiers.transfers import Transfers

__all__ = ["ExpertHandle", "Key", "TierBudgets", "TierFullError", "TierManager"]

log = logging.getLogger("strata.tiers")


class TierManager:
    """Places a store's experts across GPU, pinned RAM, tmpfs and disk within budgets."""

    def __init__(self, store: ExpertStore, budgets: TierBudgets, *, gpu_device: torch.device | None = None,
                 policy: str = "lfu", half_life: float = 8192.0, hot: list[Key] | None = None,
                 tmpfs_dir: str | Path | None = None, io_threads: int = 8, direct_io: bool = True,
                 disk_reader: str = "auto", stream_slots: int = 0):
        self.store, self.budgets, self.policy_name = store, budgets, policy
        keys = store.keys()
        moe_layers = sorted({k[0] for k in keys})
        hot = list(hot or [])
        self.slots: GpuSlots | None = None
        if budgets.gpu_slots > 0:
            if not 0 <= stream_slots < budgets.gpu_slots:
                raise ValueError(f"stream_slots must be in [0, {budgets.gpu_slots}), got {stream_slots}")
            try:
                self.slots = GpuSlots(store.slot_bytes, budgets.gpu_slots, max(moe_layers) + 1,
                                      max(k[1] for k in keys) + 1, gpu_device or "cpu")
            except torch.OutOfMemoryError:
                raise StrataError(
                    f"could not allocate {budgets.gpu_slots} GPU expert slots "
                    f"({budgets.gpu_slots * store.slot_bytes / 2**30:.2f} GiB) on {gpu_device}; "
                    "lower tiers.gpu.budget or free GPU memory"
                ) from None
        self.tmpfs = TmpfsMirror(store, tmpfs_dir, budgets.tmpfs_bytes, order=hot) if tmpfs_dir and budgets.tmpfs_bytes and store.contiguous else None
        n_pinned = max(budgets.pinned_slots, MIN_PINNED_SLOTS if budgets.gpu_slots else 4)
        self.pool = PinnedPool(store.slot_bytes, n_pinned, pin=gpu_device is not None and gpu_device.type == "cuda")
        # every expert fits in pinned RAM: nothing is ever evicted from it, so its policy order is moot and a
        # decode layer's pinned lookups skip updating it (tens of microseconds per layer on the hot path)
        into_pinned = pinned_reload_cost(self.tmpfs)
        self.pinned = SlotTier("pinned", n_pinned, make_policy(policy, half_life=half_life,
                                                              hot=hot[: static_hot_slots(n_pinned)],
                                                              reload_cost=into_pinned),
                               holds_all=n_pinned >= len(keys))
        self.gpu: SlotTier | None = None
        if self.slots is not None:
            cached = budgets.gpu_slots - stream_slots  # the last `stream_slots` slots take one step's copies
            self.gpu = SlotTier("gpu", cached, make_policy(policy, half_life=half_life,
                                                           hot=hot[: static_hot_slots(cached)],
                                                           reload_cost=gpu_reload_cost(self.pinned, into_pinned)))
        self.maps = SlotMaps(self.pinned, self.gpu)
        self.reader = DiskReader(num_threads=io_threads, direct=direct_io)
        self.gds = gpu_direct_reader(disk_reader) if self.slots is not None and self.slots.slab.is_cuda else None
        self.stats_ = TierStats()
        ledger = PrefetchLedger(self.stats_)
        self.jobs = JobQueue(self.maps, io_threads)
        self.copies = GpuCopies(self.pinned, self.slots, self.stats_, store.slot_bytes)
        self.evictor = Evictor(budgets, moe_layers, policy, self.stats_, ledger, self.copies, self.gpu, self.slots)
        self.integrity = Integrity(store, self.jobs, self.maps.lock, self.stats_)
        self.transfers = Transfers(store, self.maps, self.evictor, self.jobs, self.copies, self.integrity, ledger,
                                   self.stats_, self.pool, self.slots, self.reader, self.gds, self.tmpfs)
        self.books = LookupBooks(self.maps, self.evictor, ledger, self.stats_)
        self.handles = Handles(store, self.maps, self.transfers, self.copies, self.books, ledger, self.stats_,
                               self.pool, self.slots)
        self.placer = Placer(self.maps, self.transfers, self.jobs, self.stats_, self.slots)
        stream = list(range(budgets.gpu_slots - stream_slots, budgets.gpu_slots)) if self.slots is not None else []
        self.step = StepCopies(self.maps, self.handles, self.evictor, self.copies, ledger, self.stats_, self.pool,
                               self.slots, stream, store.slot_bytes)

    @property
    def lock(self) -> threading.RLock:
        """The lock guarding where experts are (re-entrant). A caller with a lock of its own that a lookup source
        also takes (`add_lookup_source`: `stats()` calls sources under this lock) takes this one first."""
        return self.maps.lock

    @property
    def stream_slots(self) -> list[int]:
        """GPU slots outside the cached tier, which `stream_gpu` copies one step's experts into."""
        return self.step.stream_slots

    # ---- moving experts --------------------------------------------------------------------------------
    def prefetch(self, keys: list[Key], device: str = "gpu", priority: int = 1, warm: bool = False) -> None:
        """Start bringing `keys` to the `device` tier ("gpu" or "cpu"); returns at once. Best effort: stops at the
        first key there is no room for. `warm=True` is initial placement (lowest priority, not counted as
        prediction)."""
        self.transfers.prefetch(self.maps.tier(device), keys, priority, warm)

    def place(self, keys: list[Key], device: str = "gpu") -> None:
        """Initial placement of `keys` (at most the tier's capacity) into `device`'s tier, in order, in the
        background, waiting for room (`Placer.place`)."""
        self.placer.place(self.maps.tier(device), keys)

    def promote(self, key: Key, now: bool = False) -> None:
        """Bring `key` into the GPU tier on a transfer worker, or (`now`) issued on this thread (`Placer.promote`)."""
        self.placer.promote(key, now)

    def fetch_rows(self, table: str, rows, device: str = "cpu", priority: int = 1) -> Future:
        """Rows of a table object as uint8 [n, row_bytes], read in the background (`Transfers.fetch_rows`)."""
        return self.transfers.fetch_rows(table, rows, device, priority)

    def scrub(self) -> Future:
        """Verify every expert not yet verified, at the lowest priority; the Future gives the damaged keys."""
        return self.integrity.scrub()

    # ---- handles -----------------------------------------------------------------------------------------
    def acquire(self, keys: list[Key], device: str = "gpu") -> list[ExpertHandle]:
        """Handles to resident copies of `keys` on `device`, pinned until `release` (`Handles.acquire`)."""
        return self.handles.acquire(self.maps.tier(device), keys)

    async def acquire_async(self, keys: list[Key], device: str = "gpu") -> list[ExpertHandle]:
        """`acquire` for asyncio callers: waits in a thread, never blocks the event loop."""
        return await asyncio.to_thread(self.acquire, keys, device)

    def release(self, handles: list[ExpertHandle]) -> None:
        """Unpin handles. On CUDA, later copies into a released GPU slot wait for the work queued on it."""
        self.handles.release(handles)

    def hold_resident(self, keys: list[Key]) -> list[int] | None:
        """Pin `keys` in their pinned-RAM slots and return the slots, if all are resident there now; else None
        (`Handles.hold_resident`). Undo with `drop_held`."""
        return self.handles.hold_resident(keys)

    def drop_held(self, keys: list[Key]) -> None:
        """Undo `hold_resident` (same thread)."""
        self.handles.drop_held(keys)

    def unheld_slot_reads(self) -> contextlib.AbstractContextManager:
        """Hold while this thread reads GPU slots it has no handle on (`Handles.unheld_slot_reads`)."""
        return self.handles.unheld_slot_reads()

    def max_acquire(self, device: str = "gpu") -> int:
        """How many experts of one layer can be held at once on `device` (callers acquire in chunks)."""
        return self.evictor.max_acquire(self.maps.tier(device))

    # ---- one decode layer's copies -------------------------------------------------------------------------
    def stage_gpu(self, layer: int, experts: list[int]) -> StagedExperts:
        """Pin `experts` of `layer` in GPU slots, copying the pinned-resident ones in one batch
        (`StepCopies.stage_gpu`)."""
        return self.step.stage_gpu(layer, experts)

    def stream_gpu(self, layer: int, experts: list[int]) -> StreamedExperts | None:
        """Copy `experts` of `layer` from pinned RAM into the stream slots, for this step only; None when it cannot
        (`StepCopies.stream_gpu`)."""
        return self.step.stream_gpu(layer, experts)

    def release_staged(self, staged: StagedExperts | StreamedExperts) -> None:
        """Unpin a `stage_gpu` or `stream_gpu` batch (`StepCopies.release_staged`)."""
        self.step.release_staged(staged)

    # ---- lookups made elsewhere, and the policies' view ---------------------------------------------------
    def note_hits(self, layer: int, experts, device: str = "gpu") -> None:
        """Count one lookup per expert of `layer` answered by `device`'s tier (`LookupBooks.note_hits`)."""
        self.books.note_hits(layer, experts, device)

    def note_gpu_misses(self, layer: int, experts) -> None:
        """Count lookups the GPU tier missed, computed on the CPU, in its policy (`LookupBooks.note_gpu_misses`)."""
        self.books.note_gpu_misses(layer, experts)

    def note_pinned_reads(self, layer: int, experts) -> None:
        """Count lookups served in place from pinned RAM (`LookupBooks.note_pinned_reads`)."""
        self.books.note_pinned_reads(layer, experts)

    def note_uses(self, layer: int, uses: dict[int, int]) -> None:
        """A prefill chunk's uses of each expert of `layer`, in the GPU policy's history (`LookupBooks.note_uses`)."""
        self.books.note_uses(layer, uses)

    def gpu_scores(self, layer: int, experts) -> dict[int, float]:
        """expert -> the GPU tier policy's use score (decayed frequency; 0 for policies without one)."""
        return self.books.gpu_scores(layer, experts)

    def worth_caching(self, layer: int, experts: list[int], margin: float = 2.0) -> list[int]:
        """Those of `experts` the GPU tier should keep rather than copy for one step (`LookupBooks.worth_caching`)."""
        return self.books.worth_caching(layer, experts, margin)

    def add_lookup_source(self, source: LookupSource) -> None:
        """Register a drain of device-side lookup counts; `stats()` calls it, under `lock`, before every snapshot."""
        self.books.add_source(source)

    def remove_lookup_source(self, source: LookupSource) -> None:
        """Undo `add_lookup_source`."""
        self.books.remove_source(source)

    # ---- where experts are ----------------------------------------------------------------------------------
    def residency(self, key: Key) -> list[str]:
        """Tiers holding a usable copy of `key`, fastest first (disk always)."""
        tiers = self.maps.holding(key)
        if self.tmpfs is not None and self.tmpfs.has(key[0]):
            tiers.append("tmpfs")
        return tiers + ["disk"]

    def resident_experts(self, layer: int, device: str = "gpu") -> set[int]:
        """Experts of `layer` with a usable copy on `device` right now (a snapshot)."""
        return self.maps.resident_experts(layer, device)

    def usable_keys(self) -> dict[str, set[Key]]:
        """Slotted tier name ("gpu" where there is a GPU tier, "pinned") -> the keys with a usable copy there
        (mapped, no transfer in flight), read in one hold of the lock."""
        return self.maps.usable_keys()

    def pinned_addresses(self) -> dict[Key, int]:
        """Key -> host address of its pinned-RAM slot, for every expert mapped there now (a snapshot; a slot stays
        the expert's while nothing can evict it, as once `all_pinned()`)."""
        with self.maps.lock:
            return {key: self.pool.slot_address(slot) for key, slot in self.pinned.slot_of.items()}

    def all_resident(self) -> bool:
        """Every expert of the store sits in a GPU slot, its copy and device map entry have landed, and no
        eviction can ever happen (budget >= experts). "Landed" matters: a copy leaves `inflight` once it is
        enqueued, and its map entry is written on the copy stream after it, so a decode kernel launched
        before that reads -1 for the expert; a step that then skipped its cold path lost the expert's
        contribution (seen once on the H200 as a bf16 error 20x transformers' while placement finished)."""
        gpu, n = self.gpu, len(self.store.keys())
        if gpu is None or gpu.capacity < n:
            return False
        with self.maps.lock:
            if len(gpu.slot_of) != n or gpu.inflight:
                return False
            self.copies.reap()
            return not self.copies.busy

    def all_pinned(self) -> bool:
        """Every expert of the store sits in pinned RAM and none can ever be evicted from it (its budget holds
        them all): from then on, nothing needs fetching into RAM again."""
        if not self.pinned.holds_all:
            return False
        with self.maps.lock:
            return len(self.pinned.slot_of) == len(self.store.keys()) and not self.pinned.inflight

    def slot_weights(self) -> SlotWeights:
        """Typed views of every GPU slot: gate_up [S, 2I, H], down [S, H, I]."""
        (gu, dn), store = self.store.expert_shapes, self.store
        return SlotWeights.from_slab(self.slots.slab, store.dtype, gu, dn, store.index.gate_up_bytes)

    # ---- progress and statistics --------------------------------------------------------------------------
    def gpu_transfers_in_flight(self) -> int:
        """Copies to GPU slots asked for and not landed yet (the copy stream's backlog)."""
        if self.gpu is None:
            return 0
        with self.maps.lock:
            self.copies.reap()
            return len(self.gpu.inflight) + self.copies.in_flight()

    def pending_work(self) -> int:
        """Reads and copies queued, running or in flight (initial placement, prefetch, scrub); 0 when settled."""
        with self.maps.lock:
            self.copies.reap()
            inflight = sum(len(t.inflight) for t in self.maps.tiers())
            background = int(self.pool.allocating) + int(self.tmpfs is not None and self.tmpfs.copying)
            return self.jobs.pending() + inflight + self.copies.in_flight() + background + self.placer.placing

    def wait_settled(self, timeout: float = 600.0) -> bool:
        """Block until `pending_work()` is 0 (the background placement is done); False on timeout.

        Benchmarks call it so that a measurement does not include the start-up placement still
        filling the tiers; serving never needs to (requests are served while the tiers fill)."""
        deadline = time.monotonic() + timeout
        while self.pending_work():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self.maps.lock:
                self.maps.released.wait(min(left, 0.05))
        return True

    def observed_rate(self, path: str, default: float) -> float:
        """Achieved bytes/s on a movement path so far (`default` until something has moved)."""
        with self.maps.lock:
            c = self.stats_.paths.get(path)
            return c.bytes / c.seconds if c is not None and c.seconds > 0 and c.objects >= 8 else default

    def lookup_counts(self) -> tuple[dict[Key, int], dict[int, int]]:
        """Lookups counted so far, per (layer, expert) and per layer (copies; device-side counts join them at the
        next `stats()`)."""
        with self.maps.lock:
            return dict(self.stats_.expert_lookups), {layer: c.lookups for layer, c in self.stats_.layers.items()}

    def stats(self) -> dict:
        """A snapshot of tier statistics (JSON-ready)."""
        pending = self.pending_work()
        with self.maps.lock:
            self.copies.reap()
            self.books.drain_sources()
            residency = {"pinned": len(self.pinned.slot_of), "disk": len(self.store.keys())}
            capacity = {"pinned": self.pinned.capacity, "disk": len(self.store.keys())}
            if self.gpu is not None:
                residency["gpu"], capacity["gpu"] = len(self.gpu.slot_of), self.gpu.capacity
            if self.tmpfs is not None:
                residency["tmpfs"] = self.tmpfs.resident_objects()
                capacity["tmpfs"] = self.tmpfs.capacity_objects()
            behind = self.slots.clears_behind_copy if self.slots is not None else 0
            return {**self.stats_.snapshot(residency, capacity, behind), "pending_work": pending}

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers and free the tiers' memory, readers and mirror threads. A worker or placement thread
        still copying `timeout` seconds after the jobs were closed keeps the pinned pool it reads from allocated
        (until the process exits), rather than have it freed under the copy."""
        deadline = time.monotonic() + timeout
        stopped = self.jobs.close(timeout)
        stopped = self.placer.wait_stopped(max(0.0, deadline - time.monotonic())) and stopped
        self.store.stop_verification()  # an in-place store's background pass (the scrub's)
        self.reader.close()
        if self.tmpfs is not None:
            self.tmpfs.close()
        if stopped:
            self.pool.close()
        else:
            log.warning("the pinned pool (%.2f GiB) stays allocated until the process exits: a tier thread may "
                        "still be copying from it", self.pool.nbytes / 2**30)
        if self.gds is not None:
            self.gds.close()
