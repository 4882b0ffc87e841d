"""Checksums of the experts the tier manager reads: each verified on its first read, the rest by a background
scrub at the lowest priority. A damaged object is counted in the statistics and its read fails."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from strata.errors import StrataError
from strata.tiers.jobs import JobQueue
from strata.tiers.slots import Key
from strata.tiers.stats import TierStats
from strata.tiers.store.store import ExpertStore


class Integrity:
    """Which experts of `store` have passed their checksum in this process."""

    def __init__(self, store: ExpertStore, jobs: JobQueue, lock: threading.RLock, stats: TierStats):
        self._store, self._jobs, self._lock, self._stats = store, jobs, lock, stats
        self._verified: set[Key] = set()

    def verified(self, key: Key) -> bool:
        """`key` passed its checksum (so it may be read straight into a GPU slot, where it cannot be checked)."""
        return key in self._verified

    def check_once(self, key: Key, blob: torch.Tensor) -> None:
        """Verify `blob` (the bytes of `key` just read) unless `key` passed before; raises StrataError, and counts
        the damage, on a mismatch."""
        if key in self._verified:
            return
        try:
            self._store.verify_blob(key, blob)
        except StrataError:
            with self._lock:
                self._stats.record_damage(key)
            raise
        self._verified.add(key)

    def scrub(self) -> Future:
        """Verify every expert not yet verified, at the lowest priority; the Future gives the damaged keys."""
        done: Future = Future()
        if not self._store.contiguous:  # in place: the store's own pass, at the OS's lowest CPU and I/O priority
            thread = self._store.start_verification()
            threading.Thread(target=lambda: (thread.join(), done.set_result(self._store.pass_damaged)),
                             name="strata-verify-wait", daemon=True).start()
            return done
        keys = [k for k in self._store.keys() if k not in self._verified]
        damaged: list[Key] = []
        remaining = [len(keys)]

        def check(key: Key) -> None:
            try:
                self._store.read_expert(key, verify=True)
                self._verified.add(key)
            except StrataError:
                with self._lock:
                    self._stats.record_damage(key)
                damaged.append(key)
            with self._lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set_result(sorted(damaged))

        with self._lock:
            if not keys:
                done.set_result([])
            for key in keys:
                self._jobs.submit(3, check, key)
        return done
