"""Moves into a slotted tier: starting (or joining) the one transfer of an object, reads from tmpfs or disk into
pinned slots, kvikio reads straight into GPU slots, and pinned -> GPU copies on the copy stream.

Concurrent requests for one object share one transfer: `ensure` returns its Future. A GPU copy from a
pinned-resident source can be issued by the caller after it lets go of the lock (`deferred_copies`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future

import torch

from strata.tiers.copies import GpuCopies
from strata.tiers.eviction import Evictor
from strata.tiers.integrity import Integrity
from strata.tiers.jobs import JobQueue
from strata.tiers.slot_maps import SlotMaps, SlotTier
from strata.tiers.slots import Key, TierFullError
from strata.tiers.stats import PrefetchLedger, TierStats
from strata.tiers.storage.diskio import DiskReader
from strata.tiers.storage.gds import GpuDirectReader
from strata.tiers.storage.gpu_slots import GpuSlots
from strata.tiers.storage.pinned import PinnedPool
from strata.tiers.storage.tmpfs import TmpfsMirror
from strata.tiers.store.store import ExpertStore

log = logging.getLogger("strata.tiers")


class Transfers:
    """Brings objects into the GPU and pinned tiers of `maps`, on `jobs`' workers and the GPU slots' copy stream."""

    def __init__(self, store: ExpertStore, maps: SlotMaps, evictor: Evictor, jobs: JobQueue, copies: GpuCopies,
                 integrity: Integrity, ledger: PrefetchLedger, stats: TierStats, pool: PinnedPool,
                 slots: GpuSlots | None, reader: DiskReader, gds: GpuDirectReader | None, tmpfs: TmpfsMirror | None):
        self._store, self._lock, self._gpu, self._pinned = store, maps.lock, maps.gpu, maps.pinned
        self._evictor, self._jobs, self._copies, self._integrity = evictor, jobs, copies, integrity
        self._ledger, self._stats, self._pool, self._slots = ledger, stats, pool, slots
        self._reader, self._gds, self._tmpfs = reader, gds, tmpfs
        self._tls = threading.local()  # `copies`: GPU copies `ensure` left to its caller (`deferred_copies`)

    def source_of(self, key: Key, tier: SlotTier) -> str:
        """The tier a transfer of `key` into `tier` reads from ("pinned", "tmpfs" or "disk"; lock held)."""
        if tier is self._gpu and self._pinned.usable(key):
            return "pinned"
        return "tmpfs" if self._tmpfs is not None and self._tmpfs.has(key[0]) else "disk"

    def prefetch(self, tier: SlotTier, keys: list[Key], priority: int, warm: bool) -> None:
        """Start bringing `keys` to `tier`, stopping at the first one there is no room for (a prefetch never evicts
        what is in use). `warm`: initial placement or a promotion, not counted as a prediction."""
        with self.deferred_copies():
            with self._lock:
                for key in keys:
                    if key in tier.slot_of or key in tier.inflight:
                        continue
                    try:
                        self.ensure(tier, key, 2 if warm else priority)
                    except TierFullError:
                        return
                    if not warm:
                        self._ledger.issued(tier.name, key)

    @contextlib.contextmanager
    def deferred_copies(self):
        """GPU copies from pinned-resident sources that `ensure` queues in this block are issued at its end,
        after the caller has released the lock: issuing one (copy stream, events) takes about half a
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

    def ensure(self, tier: SlotTier, key: Key, priority: int) -> Future:
        """Future resolved when `key` is resident in `tier`; starts (or joins) the transfer (lock held)."""
        if key in tier.inflight:
            return tier.inflight[key]
        if key in tier.slot_of:
            done: Future = Future()
            done.set_result(None)
            return done
        pinned = self._pinned
        direct = (tier is self._gpu and self._gds is not None and self._store.contiguous and self._integrity.verified(key)
                  and key not in pinned.slot_of and not (self._tmpfs is not None and self._tmpfs.has(key[0])))
        if direct:  # disk -> GPU slot with kvikio; verified objects only (checksums are checked on the host)
            slot = self._evictor.take_slot(tier, key)
            fut = Future()
            tier.inflight[key], tier.slot_of[key] = fut, slot
            self._jobs.submit(priority, self._load_gpu_direct, key, slot, fut)
            return fut
        if tier is self._gpu:  # stage through pinned RAM first (its slot is held while the copy reads it)
            src = self.ensure(pinned, key, priority)
            pinned.ref(key)
            try:
                slot = self._evictor.take_slot(tier, key)
            except TierFullError:
                pinned.unref(key)
                raise
        else:
            slot = self._evictor.take_slot(tier, key)
        fut: Future = Future()
        tier.inflight[key] = fut
        tier.slot_of[key] = slot
        if tier is pinned:
            self._jobs.submit(priority, self._load_pinned, key, slot, fut)
        else:
            deferred = getattr(self._tls, "copies", None)
            if deferred is not None and src.done():  # issued by the caller once it has let go of the lock
                deferred.append((key, slot, fut, src))
            else:
                src.add_done_callback(lambda f: self._copy_to_gpu(key, slot, fut, f))
        return fut

    def fetch_rows(self, table: str, rows, device: str, priority: int) -> Future:
        """Rows of a table object (e.g. an Engram table) as uint8 [n, row_bytes], read on a worker; each chunk of
        rows is checksum-verified on its first read. `device="gpu"` lands them on the GPU through the copy
        stream. Returns a Future of the tensor."""
        fut: Future = Future()
        slots = self._slots

        def job() -> None:
            t0 = time.perf_counter()
            try:
                out = self._store.read_rows(table, rows)
                if device == "gpu" and slots is not None and slots.slab.is_cuda:
                    with torch.cuda.stream(slots.copy_stream):
                        out = out.pin_memory().to(slots.slab.device, non_blocking=True)
                    slots.copy_stream.synchronize()
            except BaseException as e:
                fut.set_exception(e)
                return
            with self._lock:
                self._stats.paths[f"rows:{table}"].add(out.numel(), time.perf_counter() - t0)
            fut.set_result(out)

        with self._lock:
            self._jobs.submit(priority, job)
        return fut

    # ---- the transfers themselves, on workers (reads) or the caller (copies) --------------------------------
    def _abandon(self, tier: SlotTier, key: Key, slot: int, fut: Future, error: BaseException) -> None:
        """A transfer into `tier`'s `slot` failed: free the slot, forget the object, fail its future."""
        with self._lock:
            tier.inflight.pop(key, None)
            tier.slot_of.pop(key, None)
            tier.free.append(slot)
        fut.set_exception(error)

    def _load_pinned(self, key: Key, slot: int, fut: Future) -> None:
        """Read one blob from tmpfs or disk into a pinned slot; verify its checksum on first read."""
        t0 = time.perf_counter()
        try:
            source = "tmpfs" if self._tmpfs is not None and self._tmpfs.has(key[0]) else "disk"
            buf, length = self._pool.slot(slot), self._store.slot_bytes
            if source == "tmpfs":
                path, offset, length = self._tmpfs.location(key)
                self._reader.read(path, offset, length, buf).result()
            else:  # a packed blob's slot, or an in-place expert's parts
                self._reader.read_parts(self._store.extents(key), buf).result()
            self._integrity.check_once(key, buf)
        except BaseException as e:
            self._abandon(self._pinned, key, slot, fut, e)
            return
        with self._lock:
            self._stats.paths[f"{source}->pinned"].add(length, time.perf_counter() - t0)
            del self._pinned.inflight[key]
            self._pinned.policy.insert(key)
        fut.set_result(None)

    def _load_gpu_direct(self, key: Key, slot: int, fut: Future) -> None:
        """kvikio read straight into the GPU slot (GPUDirect Storage, or kvikio's compat mode)."""
        t0, gpu = time.perf_counter(), self._gpu
        try:
            with self._lock:
                prior = gpu.events.get(slot)
            if prior is not None:
                prior.synchronize()  # kvikio's write is not stream-ordered: the slot's last reader must be done
            path, offset, length = self._store.location(key)
            self._gds.read(path, offset, length, self._slots.view(slot)).result()
        except BaseException as e:
            self._abandon(gpu, key, slot, fut, e)
            return
        with self._lock:
            self._stats.paths["disk->gpu"].add(length, time.perf_counter() - t0)
            gpu.events.pop(slot, None)
            self._slots.assign(key, slot)
            del gpu.inflight[key]
            gpu.policy.insert(key)
        fut.set_result(None)

    def _copy_to_gpu(self, key: Key, slot: int, fut: Future, src: Future) -> None:
        """Pinned -> GPU slot on the copy stream; the slot's event is what compute waits on."""
        gpu, slots = self._gpu, self._slots
        with self._lock:
            if src.exception() is not None:
                self._pinned.unref(key)
                self._abandon(gpu, key, slot, fut, src.exception())
                return
            pinned_buf = self._pool.slot(self._pinned.slot_of[key])
            prior = gpu.events.get(slot)
        t0, start = time.perf_counter(), None
        if slots.slab.is_cuda:
            if prior is not None:
                slots.copy_stream.wait_event(prior)  # the slot's last reader must finish first
            start = torch.cuda.Event(enable_timing=True)  # recorded after the waits: copy-engine time only
        event = slots.copy_in(slot, pinned_buf, started=start)
        with self._lock:
            self._copies.add(start, event, [key])
            if event is None:  # CPU-simulated GPU tier: the copy is already done
                self._stats.paths["pinned->gpu"].add(self._store.slot_bytes, time.perf_counter() - t0)
            gpu.events[slot] = event
            slots.assign(key, slot)
            del gpu.inflight[key]
            gpu.policy.insert(key)
        fut.set_result(None)
