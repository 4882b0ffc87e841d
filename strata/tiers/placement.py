"""Background moves into a tier outside the decode step: initial placement (`place`) and promotions of
popular experts into the GPU tier (`promote`), both on threads of the tier manager's, never the caller's."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait

import torch

from strata.tiers.jobs import JobQueue
from strata.tiers.slot_maps import SlotMaps, SlotTier
from strata.tiers.slots import FULL_WAIT_S, Key, TierFullError
from strata.tiers.stats import TierStats
from strata.tiers.storage.gpu_slots import GpuSlots
from strata.tiers.transfers import Transfers

log = logging.getLogger("strata.tiers")


class Placer:
    """Fills the tiers at start-up and promotes experts into the GPU tier, through `transfers`."""

    def __init__(self, maps: SlotMaps, transfers: Transfers, jobs: JobQueue, stats: TierStats,
                 slots: GpuSlots | None):
        self._lock, self._released, self._gpu = maps.lock, maps.released, maps.gpu
        self._transfers, self._jobs, self._stats, self._slots = transfers, jobs, stats, slots
        self._placing = 0  # placement threads running

    @property
    def placing(self) -> int:
        """Initial placement threads still running (lock held)."""
        return self._placing

    def place(self, tier: SlotTier, keys: list[Key]) -> None:
        """Initial placement: bring every one of `keys` to `tier`, in order, in the background.

        Unlike `prefetch`, which stops at the first key there is no room for, placement waits for room and
        goes on: a GPU tier is filled through the pinned staging slots, of which there may be far fewer than
        experts (16 when every expert fits in VRAM), so a budget that holds every expert ends up holding them
        all. Keys beyond the tier's capacity would evict earlier ones: pass at most `capacity` of them."""
        with self._lock:
            self._placing += 1
        threading.Thread(target=self._place, args=(tier, list(keys)), name="strata-placement", daemon=True).start()

    def wait_stopped(self, timeout: float = 30.0) -> bool:
        """After the jobs were closed: wait until every placement thread has returned (each does at its next key or
        wait, within ~0.05 s, or once its copy in flight is issued), at most `timeout` seconds; False (and a line in
        the log) if one has not. The caller frees the memory they copy from only after True: a thread still inside a
        copy would read freed memory, and one still running at interpreter exit would abort the process."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._placing:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%d tier placement thread(s) still running %.0f s after the tiers were closed",
                                self._placing, timeout)
                    return False
                self._released.wait(left)
        return True

    def _place(self, tier: SlotTier, keys: list[Key]) -> None:
        pending: list[Future] = []
        try:
            for key in keys:
                stuck_since = time.monotonic()
                while True:
                    with self._transfers.deferred_copies(), self._lock:  # the copy is issued after the lock is let go
                        if self._jobs.closed:
                            return
                        if key in tier.slot_of and key not in tier.inflight:
                            break
                        try:
                            pending.append(self._transfers.ensure(tier, key, 2))
                            break
                        except TierFullError:  # every staging (or tier) slot is busy: wait for some to land
                            pass
                    if time.monotonic() - stuck_since > FULL_WAIT_S:
                        log.warning("initial placement into the %s tier stopped at %s: no slot came free in %.0f s",
                                    tier.name, key, FULL_WAIT_S)
                        return
                    if pending:
                        futures_wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
                        pending = [f for f in pending if not f.done()]
                    else:
                        with self._lock:
                            self._released.wait(0.05)
        finally:
            with self._lock:
                self._placing -= 1
                self._released.notify_all()

    def promote(self, key: Key, now: bool = False) -> None:
        """Bring `key` into the GPU tier in the background (at initial placement's priority).

        Unlike `prefetch`, which issues a pinned-resident object's copy on the calling thread (slot eviction,
        copy stream, events, map update: a few hundred microseconds of host time), the whole move runs on a
        transfer worker, so a decode step that promotes an expert (`ExpertCompute.promote_one`) only queues it.
        `now=True` issues it on the calling thread instead (the copy itself still runs in the background): for a
        caller whose GPU is busy anyway, as one-graph decode's books are, run by the decoding thread while its step
        runs (on a worker, the issue's Python competed for the GIL with that thread and made its next launch late).
        The victim's map entry is cleared on the caller's current stream, as when the caller evicts: kernels
        queued there before the clear are done before the copy overwrites the slot."""
        if self._gpu is None:
            return
        if self._slots.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # a graph being captured must not see another thread's work
        if now:
            self._promote_on(None, key)  # on this thread's current stream
            return
        stream = torch.cuda.current_stream(self._slots.device) if self._slots.is_cuda else None
        with self._lock:
            self._jobs.submit(2, self._promote_on, stream, key)

    def _promote_on(self, stream, key: Key) -> None:
        t0 = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._transfers.prefetch(self._gpu, [key], 1, warm=True)
        with self._lock:  # the host time (on a worker, Python competing for the GIL with the decoding thread)
            self._stats.promotions += 1
            self._stats.promotion_host_seconds += time.perf_counter() - t0
