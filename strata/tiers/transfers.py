"""The tier manager's transfers: the worker threads' job queue, disk/tmpfs -> pinned reads, kvikio reads
straight into GPU slots, and pinned -> GPU copies on the copy stream (whose finished copies release
their pinned source in `_reap_copies`)."""

from __future__ import annotations

import heapq
import time
from concurrent.futures import Future

import torch

from strata.errors import StrataError
from strata.tiers.slots import Key


class TransfersMixin:
    """Mixed into `TierManager`: uses its lock, job heap, tiers, pools, reader and statistics."""

    def _reap_copies(self) -> None:
        """Drop the pinned refs held by GPU copy batches that have finished reading their sources."""
        for token, (start, end, keys, *path) in list(self._copying.items()):
            if end is None or end.query():
                del self._copying[token]
                for key in keys:
                    self._unref(self.pinned, key)
                if end is not None:  # copy-engine (or in-place kernel) time, not enqueue time
                    counters, nbytes = self.stats_.paths[path[0] if path else "pinned->gpu"], self.store.slot_bytes * len(keys)
                    seconds = start.elapsed_time(end) / 1000
                    if (t0 := self.slots.since_epoch(start)) is None:
                        counters.add(nbytes, seconds, objects=len(keys))
                    else:
                        counters.add_interval(nbytes, t0, t0 + seconds, objects=len(keys))

    def _copies_in_flight(self) -> int:
        """Experts whose pinned -> GPU copy is enqueued and not known to have finished."""
        return sum(len(entry[2]) for entry in self._copying.values())

    def _submit(self, priority: int, fn, *args) -> None:
        heapq.heappush(self._jobs, (priority, next(self._seq), fn, args))
        self._jobs_ready.notify()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._jobs_ready.wait()
                if self._closed:
                    return
                _, _, fn, args = heapq.heappop(self._jobs)
                self._running += 1
            try:
                fn(*args)
            finally:
                with self._lock:
                    self._running -= 1
                    self._released.notify_all()

    def _abandon(self, tier, key: Key, slot: int, fut: Future, error: BaseException) -> None:
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
            source = "tmpfs" if self.tmpfs is not None and self.tmpfs.has(key[0]) else "disk"
            path, offset, length = self.tmpfs.location(key) if source == "tmpfs" else self.store.location(key)
            buf = self.pool.slot(slot)
            self.reader.read(path, offset, length, buf).result()
            if key not in self._verified:
                try:
                    self.store.verify_blob(key, buf)
                except StrataError:
                    with self._lock:
                        self.stats_.record_damage(key)
                    raise
                self._verified.add(key)
        except BaseException as e:
            self._abandon(self.pinned, key, slot, fut, e)
            return
        with self._lock:
            self.stats_.paths[f"{source}->pinned"].add(length, time.perf_counter() - t0)
            del self.pinned.inflight[key]
            self.pinned.policy.insert(key)
        fut.set_result(None)

    def _load_gpu_direct(self, key: Key, slot: int, fut: Future) -> None:
        """kvikio read straight into the GPU slot (GPUDirect Storage, or kvikio's compat mode)."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                prior = self.gpu.events.get(slot)
            if prior is not None:
                prior.synchronize()  # kvikio's write is not stream-ordered: the slot's last reader must be done
            path, offset, length = self.store.location(key)
            self.gds.read(path, offset, length, self.slots.view(slot)).result()
        except BaseException as e:
            self._abandon(self.gpu, key, slot, fut, e)
            return
        with self._lock:
            self.stats_.paths["disk->gpu"].add(length, time.perf_counter() - t0)
            self.gpu.events.pop(slot, None)
            self.slots.assign(key, slot)
            del self.gpu.inflight[key]
            self.gpu.policy.insert(key)
        fut.set_result(None)

    def _copy_to_gpu(self, key: Key, slot: int, fut: Future, src: Future) -> None:
        """Pinned -> GPU slot on the copy stream; the slot's event is what compute waits on."""
        with self._lock:
            if src.exception() is not None:
                self._unref(self.pinned, key)
                self._abandon(self.gpu, key, slot, fut, src.exception())
                return
            pinned_buf = self.pool.slot(self.pinned.slot_of[key])
            prior = self.gpu.events.get(slot)
        t0, start = time.perf_counter(), None
        if self.slots.slab.is_cuda:
            if prior is not None:
                self.slots.copy_stream.wait_event(prior)  # the slot's last reader must finish first
            start = torch.cuda.Event(enable_timing=True)  # recorded after the waits: copy-engine time only
        event = self.slots.copy_in(slot, pinned_buf, started=start)
        with self._lock:
            self._copying[next(self._seq)] = (start, event, [key])
            if event is None:  # CPU-simulated GPU tier: the copy is already done
                self.stats_.paths["pinned->gpu"].add(self.store.slot_bytes, time.perf_counter() - t0)
            self.gpu.events[slot] = event
            self.slots.assign(key, slot)
            del self.gpu.inflight[key]
            self.gpu.policy.insert(key)
        fut.set_result(None)
