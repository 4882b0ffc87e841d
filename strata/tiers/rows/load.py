"""Start-up of the Engram row store: every table checked, then loaded whole (gpu, pinned), copied to
tmpfs, or verified in place (disk); pinned and tmpfs tables mapped for the device to read in place.

Mixed into `EngramRowStore` (strata.tiers.rows.store), whose docstring describes the checks and the
verification record that lets later starts skip the full pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from strata.tiers.storage.uva import device_view, register_file
from strata.tiers.store.format import TORCH_DTYPES, TableEntry
from strata.tiers.store.verify_record import FileIdentity, VerifyRecord, table_fingerprint, table_identity


class TableLoadingMixin:
    """Uses the store's `store`, `tables`, `tier`, `device`, `full`, `paths`, `mapped`, `_registered` and
    the counters `verified_from_record`, `tmpfs_reused`, `chunks_read`."""

    def _load(self, tmpfs_dir: str) -> None:
        """Check every table, filling the full copies (gpu, pinned) or the tmpfs files; each chunk's
        checksum is verified unless the verification record vouches for the table's file."""
        record, sizes = VerifyRecord(self.store.directory), self.store.index.file_sizes()
        for layer, t in self.tables.items():
            src = self.store.directory / t.file
            before = table_identity(src, t, sizes[t.file])  # missing or truncated: an error, record or not
            fp = table_fingerprint(self.store.index.source_fingerprint, t)
            trusted = record.matches(t.name, fp, before)
            if trusted:
                self.verified_from_record.add(t.name)
            if self.tier in ("gpu", "pinned"):
                pin = self.tier == "pinned" and torch.cuda.is_available()
                with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                    # pinned in the context of the card that reads it (its device mapping: strata.tiers.storage.uva)
                    full = torch.empty(t.num_rows, t.row_bytes, dtype=torch.uint8, pin_memory=pin)
                for a, b, chunk in self._chunks(t, check=not trusted):
                    full[a:b] = chunk
                view = full.view(TORCH_DTYPES[t.dtype]).view(t.num_rows, *t.row_shape)
                self.full[layer] = view.to(self.device) if self.tier == "gpu" else view
            elif self.tier == "tmpfs":
                self.paths[layer] = self._tmpfs_copy(t, tmpfs_dir, fp, trusted)
            else:
                if not trusted:
                    for _ in self._chunks(t, check=True):
                        pass
                    _drop_page_cache(src)  # disk means disk: the verification pass must not leave it in RAM
                self.paths[layer] = str(src)
            if not trusted and FileIdentity.of(src) == before:  # not written to while it was verified
                record.put(t.name, fp, before)

    def _map_tables(self) -> None:
        """Device views of every table in pinned RAM or in tmpfs (its copy mapped and page-locked), so
        the gather kernel reads rows in place; where any table cannot be mapped, none is (the row cache
        serves them all)."""
        views = {}
        for layer, t in self.tables.items():
            if self.tier == "pinned":
                host = self.full[layer]
            else:
                reg = register_file(self.paths[layer], t.nbytes)
                if reg is None:
                    break
                self._registered.append(reg)
                host = reg.tensor.view(TORCH_DTYPES[t.dtype]).view(t.num_rows, *t.row_shape)
            view = device_view(host, self.device)
            if view is None:
                break
            views[layer] = view
        if len(views) == len(self.tables):
            self.mapped = views
        else:
            self._unregister()

    def _unregister(self) -> None:
        for reg in self._registered:
            reg.close()
        self._registered = []

    def _tmpfs_copy(self, t: TableEntry, tmpfs_dir: str, fp: str, trusted: bool) -> str:
        """The table's file in tmpfs: an earlier start's copy when the source is trusted and the copy is
        still the one recorded when it was completed, else a fresh copy (a stale or partial one is replaced)."""
        os.makedirs(tmpfs_dir, exist_ok=True)
        name = f"{self.store.index.source_fingerprint[:12]}-{t.name}.bin"
        path, copies = os.path.join(tmpfs_dir, name), VerifyRecord(tmpfs_dir)
        try:
            ident = FileIdentity.of(path)
        except OSError:
            ident = None
        if trusted and ident is not None and ident.size == t.nbytes and copies.matches(name, fp, ident):
            self.tmpfs_reused.add(t.name)
            return path
        copies.drop(name)  # the copy is about to be replaced: never vouch for a half-written one
        try:
            with open(path + ".tmp", "wb") as dst:
                for _, _, chunk in self._chunks(t, check=not trusted):
                    dst.write(chunk.numpy().tobytes())
        except BaseException:
            if os.path.exists(path + ".tmp"):  # the open itself may have failed
                os.unlink(path + ".tmp")
            raise
        os.replace(path + ".tmp", path)
        copies.put(name, fp, FileIdentity.of(path))  # recorded only once complete
        return path

    def _chunks(self, t: TableEntry, check: bool) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first row, end row, uint8 [rows, row_bytes]) of each chunk of `t`, checksum-verified with
        `check`: a CheckpointError naming the damaged table stops start-up (short reads always do)."""
        for k in range(t.num_chunks):
            self.chunks_read += 1
            yield (*t.chunk_rows(k), self.store.read_chunk(t, k, check=check))


def _drop_page_cache(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass


