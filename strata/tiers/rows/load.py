"""The Engram tables of a store in their tier: every table checked at start-up, then loaded whole (gpu, pinned),
copied to tmpfs, or verified in place (disk); pinned and tmpfs tables mapped for the device to read in place.

The row store's docstring (strata.tiers.rows.store) describes the checks and the verification record that
lets later starts skip the full pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from strata.tiers.storage.uva import RegisteredFile, device_view, register_file
from strata.tiers.store.format import TORCH_DTYPES, TableEntry
from strata.tiers.store.store import ExpertStore
from strata.tiers.store.verify_record import FileIdentity, VerifyRecord, table_fingerprint, table_identity


class RowTables:
    """Engram tables `entries` (layer -> table of `store`) held by `tier` for reads on `device`.

    full:    gpu / pinned tiers: layer -> the whole table [rows, head_dim] (in VRAM, or in host RAM)
    paths:   tmpfs / disk tiers: layer -> the file to read its rows from
    mapped:  layer -> a device view of the pinned table or the page-locked tmpfs copy (CUDA with `zero_copy`),
             which the gather kernel reads in place; empty where any table cannot be mapped
    base:    layer -> its first row in one global row space over all layers (the row cache's keys)
    """

    def __init__(self, store: ExpertStore, entries: dict[int, TableEntry], tier: str, device: torch.device,
                 tmpfs_dir: str, zero_copy: bool):
        self.store, self.entries, self.tier, self.device = store, entries, tier, device
        first = next(iter(entries.values()))
        self.dtype, self.dim, self.row_bytes = TORCH_DTYPES[first.dtype], first.row_shape[-1], first.row_bytes
        self.base: dict[int, int] = {}
        total = 0
        for layer, t in entries.items():
            self.base[layer], total = total, total + t.num_rows
        self.total_rows = total
        self.full: dict[int, torch.Tensor] = {}
        self.paths: dict[int, str] = {}
        self.verified_from_record: set[str] = set()  # tables whose checksum pass a record made unnecessary
        self.tmpfs_reused: set[str] = set()  # tables whose tmpfs copy from an earlier start was reused
        self.chunks_read = 0  # table chunks read at start-up
        self._load(tmpfs_dir)
        # pinned tables on CUDA: the gather kernel reads rows straight from pinned RAM through its device
        # mapping (a few bytes per row across PCIe, inside the step's graph): no row cache, no host copies
        self.mapped: dict[int, torch.Tensor] = {}
        self._registered: list[RegisteredFile] = []  # tmpfs copies page-locked for zero-copy reads
        if tier in ("pinned", "tmpfs") and device.type == "cuda" and zero_copy:
            self._map_tables()

    @property
    def in_place(self) -> bool:
        """Whether the compute device reads every table in place (VRAM, or mapped host RAM): no row cache."""
        return self.tier == "gpu" or bool(self.mapped)

    def device_table(self, layer: int) -> torch.Tensor | None:
        """The layer's whole table as the compute device reads it in place, or None (rows go through the cache)."""
        if self.tier == "gpu":
            return self.full[layer]
        return self.mapped.get(layer)

    def close(self) -> None:
        """Drop the device mappings and unregister the page-locked tmpfs copies (after the device's kernels)."""
        self.mapped = {}
        if self._registered:
            torch.cuda.synchronize(self.device)  # no kernel may still read a mapping being unregistered
            self._unregister()

    def _load(self, tmpfs_dir: str) -> None:
        """Check every table, filling the full copies (gpu, pinned) or the tmpfs files; each chunk's
        checksum is verified unless the verification record vouches for the table's file."""
        record, sizes = VerifyRecord(self.store.directory), self.store.index.file_sizes()
        for layer, t in self.entries.items():
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
        for layer, t in self.entries.items():
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
        if len(views) == len(self.entries):
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


