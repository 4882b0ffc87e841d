"""One Engram layer of a decode step served from the host row cache in one native call (csrc/row_serve.cpp).

What `EngramRowStore.start` + `finish_one` do for a layer of tables on disk, without Python per row: the
distinct ids looked up in the cache (decayed-LFU scores, `RowCache`'s own arrays updated in place), the misses'
4 KiB blocks read with one Linux AIO batch, evictions when free slots run out, the rows copied into their
slots of the page-locked slab, and each id's slot returned. The handshake's host thread calls it with the
store's lock held (strata.tiers.rows.handshake); ctypes gives up the GIL for the call.
"""

from __future__ import annotations

import numpy as np

from strata.errors import CheckpointError
from strata.tiers.rows.cached import CachedRows
from strata.tiers.rows.load import RowTables
from strata.tiers.storage import native_io
from strata.tiers.storage.aligned_io import ALIGN, aligned_empty
from strata.tiers.storage.diskio import DiskReader

NO_ROOM = -(1 << 40)  # csrc/row_serve.cpp's codes, beyond any -1 - i of a short read
PAST_END, SMALL_SCRATCH = NO_ROOM - 1, NO_ROOM - 2


class NoRoom(RuntimeError):
    """The row cache cannot hold a layer's misses next to the protected slots."""


class NativeRowServer:
    """Serves layers of disk-tier `tables` whose row cache `cached` has a host slab (`gather_view`), reading
    through `reader`'s open files."""

    def __init__(self, tables: RowTables, cached: CachedRows | None, reader: DiskReader | None):
        if tables.tier != "disk" or cached is None or cached.gather_view is None or reader is None:
            raise ValueError("native row serving needs tables on disk behind a host row cache")
        cache = cached.cache
        if cache.slab.device.type != "cpu" or not cache.slab.is_contiguous() or \
                cache.slab.shape[1] * cache.slab.element_size() != tables.row_bytes:
            raise ValueError("the row cache's slab must be contiguous host memory of whole rows")
        self.tables, self.cache, self.reader = tables, cache, reader
        self._lib = native_io.lib()
        self._scratch = aligned_empty(0)
        self._info = np.zeros(4, dtype=np.int64)

    def serve(self, layer: int, ids: np.ndarray, protect: np.ndarray, out: np.ndarray) -> tuple[int, int, int, float]:
        """Put layer `layer`'s rows `ids` (int64 [n], layer-local) in the cache without evicting `protect` (int64
        slots) and write each id's slot to `out` (int64 [n]). Returns (distinct rows, cache hits, rows read,
        seconds reading). Raises NoRoom (nothing admitted) or CheckpointError (a read failed)."""
        tables, c = self.tables, self.cache
        f = self.reader.file(tables.paths[layer])
        t = tables.entries[layer]
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        protect = np.ascontiguousarray(protect, dtype=np.int64)
        need = 2 * ids.size * ALIGN  # a row may straddle two blocks
        if self._scratch.numel() < need:
            self._scratch = aligned_empty(need)
        rc = self._lib.strata_serve_rows(
            ids.ctypes.data, ids.size, tables.base[layer], f.fd, t.offset, tables.row_bytes, f.size,
            c.slot_of.ctypes.data, c.row_of.ctypes.data, c.score.ctypes.data, c.free_stack.ctypes.data,
            c.counts.ctypes.data, c.decay.ctypes.data, c.capacity, c.slab.data_ptr(), protect.ctypes.data,
            protect.size, self._scratch.data_ptr(), self._scratch.numel(), out.ctypes.data, self._info.ctypes.data)
        if rc == NO_ROOM:
            raise NoRoom(f"the Engram row cache ({c.capacity} rows) cannot hold one decode step's rows; raise "
                         "engram.row_cache")
        if rc == SMALL_SCRATCH:  # pragma: no cover - the scratch is sized for two blocks a row
            raise RuntimeError("native row serving: scratch too small")
        if rc == PAST_END:
            raise CheckpointError(f"{f.path} is truncated: a row of Engram layer {layer} lies past its end")
        if rc < 0:
            raise CheckpointError(f"{f.path} ended early (read run {-1 - rc}); the store file is truncated")
        if rc > 0:
            raise CheckpointError(f"cannot read {f.path}: errno {rc}")
        m, hits, read, ns = self._info.tolist()
        return m, hits, read, ns / 1e9
