"""The tier manager's worker threads and their job queue.

Jobs run by priority, first come first served within one: 0 a step waiting for an expert, 1 prefetch,
2 initial placement and promotions, 3 the scrub. The queue shares the slot maps' lock (a job is queued by
code that already holds it), and every finished job notifies `SlotMaps.released`, which is what threads
waiting for room or for the manager to settle wait on.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from strata.tiers.slot_maps import SlotMaps


class JobQueue:
    """`threads` daemon workers running `submit`ted jobs until `close`."""

    def __init__(self, maps: SlotMaps, threads: int):
        self._lock, self._released = maps.lock, maps.released
        self._ready = threading.Condition(self._lock)
        self._jobs: list = []  # heap of (priority, sequence, fn, args)
        self._seq = itertools.count()
        self._running = 0  # jobs a worker has popped and not finished
        self._closed = False
        self._workers = [threading.Thread(target=self._work, name=f"strata-tier-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    def submit(self, priority: int, fn: Callable, *args) -> None:
        """Queue `fn(*args)` at `priority` (lower runs first). The caller holds the slot maps' lock."""
        heapq.heappush(self._jobs, (priority, next(self._seq), fn, args))
        self._ready.notify()

    def queued(self) -> int:
        """Jobs waiting for a worker."""
        return len(self._jobs)

    def pending(self) -> int:
        """Jobs queued or running (lock held)."""
        return len(self._jobs) + self._running

    @property
    def closed(self) -> bool:
        """`close` has been called: long-running jobs (placement) stop at their next check."""
        return self._closed

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the workers once their current jobs end (queued jobs are dropped), waiting at most `timeout` seconds
        for them all; False if one is still inside its job then."""
        with self._lock:
            self._closed = True
            self._ready.notify_all()
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(w.is_alive() for w in self._workers)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._ready.wait()
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
