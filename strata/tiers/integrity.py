"""Table rows and the background scrub: the tier manager's reads that are not expert transfers."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from strata.errors import StrataError

Key = tuple[int, int]


class IntegrityMixin:
    """Mixed into `TierManager`: uses its store, lock, job queue, statistics and verified set."""

    def fetch_rows(self, table: str, rows, device: str = "cpu", priority: int = 1) -> Future:
        """Rows of a table object (e.g. an Engram table) as uint8 [n, row_bytes], read in the background.

        Only the asked-for rows are read; each chunk of rows is checksum-verified on its first read.
        `device="gpu"` lands them on the GPU through the copy stream. Returns a Future of the tensor.
        """
        fut: Future = Future()

        def job() -> None:
            t0 = time.perf_counter()
            try:
                out = self.store.read_rows(table, rows)
                if device == "gpu" and self.slots is not None and self.slots.slab.is_cuda:
                    with torch.cuda.stream(self.slots.copy_stream):
                        out = out.pin_memory().to(self.slots.slab.device, non_blocking=True)
                    self.slots.copy_stream.synchronize()
            except BaseException as e:
                fut.set_exception(e)
                return
            with self._lock:
                self.stats_.paths[f"rows:{table}"].add(out.numel(), time.perf_counter() - t0)
            fut.set_result(out)

        with self._lock:
            self._submit(priority, job)
        return fut

    def scrub(self) -> Future:
        """Verify every expert not yet verified, at the lowest priority; the Future gives the damaged keys."""
        done: Future = Future()
        keys = [k for k in self.store.keys() if k not in self._verified]
        damaged: list[Key] = []
        remaining = [len(keys)]

        def check(key: Key) -> None:
            try:
                self.store.read_expert(key, verify=True)
                self._verified.add(key)
            except StrataError:
                with self._lock:
                    self.stats_.record_damage(key)
                damaged.append(key)
            with self._lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set_result(sorted(damaged))

        with self._lock:
            if not keys:
                done.set_result([])
            for key in keys:
                self._submit(3, check, key)
        return done

