"""A store's dense tensors (dense.safetensors: attention, norms, embeddings, lm_head, ...) checked against the
index's checksums: in full by `strata verify`, and as a model loads them (`DenseCheck`).

At load, the file's header is checked once and each tensor as it is read, before it is used; one that does
not match stops the load with an error naming it. Once every tensor has passed (those the model does not
load are read once at the end), the verification record (strata.tiers.store.verify_record) keeps the file's
identity, and a later start that finds the file unchanged loads the tensors without hashing them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch
import xxhash

from strata.errors import CheckpointError
from strata.tiers.store.format import DenseEntry, StoreIndex, byte_view, checksum, pread_into
from strata.tiers.store.safetensors_header import TensorInfo, read_header
from strata.tiers.store.verify_record import FileIdentity, VerifyRecord

DENSE_RECORD = "file:dense.safetensors"  # its key in the verification record (no table name has a ':')
_BUF_BYTES = 16 << 20
log = logging.getLogger(__name__)


def dense_fingerprint(source_fingerprint: str, dense: DenseEntry) -> str:
    """A hash of the index's dense entry, every tensor checksum included (another store, another hash)."""
    entry = [source_fingerprint, dense.file, dense.size, dense.data_start, dense.header_checksum,
             sorted(dense.tensor_checksums.items())]
    return xxhash.xxh3_128_hexdigest(msgpack.packb(entry, use_bin_type=True))


def tensor_checksum(fd: int, info: TensorInfo, buf: memoryview,
                    progress: Callable[[int], None] = lambda n: None) -> tuple[int, int]:
    """(xxh3_64, bytes read) of a tensor's bytes read from `fd` through `buf`; short only at end of file."""
    h, done = xxhash.xxh3_64(), 0
    while done < info.nbytes:
        part = buf[: min(len(buf), info.nbytes - done)]
        got = pread_into(fd, part, info.offset + done)
        h.update(part[:got])
        progress(got)
        done += got
        if got < len(part):
            break
    return h.intdigest(), done


def verify_dense(directory: Path, dense: DenseEntry, progress: Callable[[int], None] = lambda n: None,
                 names: list[str] | None = None) -> list[str]:
    """The damaged parts of dense.safetensors ([] when sound): its header, then each tensor of `names`
    (default: all). `progress` is told every byte of the file once, read or skipped, header included."""
    path = directory / dense.file
    damaged, tensors = [], None
    with open(path, "rb") as f:
        head = f.read(dense.data_start)
        progress(dense.data_start)
        if checksum(head) != dense.header_checksum:
            damaged.append(f"{dense.file}: header")
        else:
            try:
                tensors = read_header(path)
            except CheckpointError as e:
                damaged.append(f"{dense.file}: unreadable ({e})")
        if tensors is None:  # tensor offsets come from the header: nothing more to check
            progress(dense.size - dense.data_start)
            return damaged
        buf, counted = memoryview(bytearray(_BUF_BYTES)), 0
        for name in dense.tensor_checksums if names is None else names:
            info = tensors.get(name)
            if info is None:
                damaged.append(f"{dense.file}: tensor {name!r} missing")
                continue
            digest, got = tensor_checksum(f.fileno(), info, buf, progress)
            if digest != dense.tensor_checksums[name]:
                damaged.append(f"{dense.file}: tensor {name!r}")
            progress(info.nbytes - got)  # past the end of a short file: nothing to read, counted as checked
            counted += info.nbytes
        progress(dense.size - dense.data_start - counted)  # alignment padding, tensors not asked for
    return damaged


class DenseCheck:
    """Checks the dense tensors a model loads from a store (`check` each as it is read, `finish` at the end)."""

    def __init__(self, directory: Path, index: StoreIndex):
        if index.dense is None:
            raise CheckpointError(f"{directory}: the store index lists no dense tensors; re-run `strata convert`")
        self.directory, self.dense = directory, index.dense
        self.path = directory / self.dense.file
        self.record = VerifyRecord(directory)
        self.fingerprint = dense_fingerprint(index.source_fingerprint, self.dense)
        self.ident = FileIdentity.of(self.path)
        self.trusted = self.record.matches(DENSE_RECORD, self.fingerprint, self.ident)  # unchanged since verified
        self.checked: set[str] = set()
        self.hashed = 0  # tensors hashed by this check (0 when the record vouched for the file)
        if not self.trusted:
            with open(self.path, "rb") as f:
                if checksum(f.read(self.dense.data_start)) != self.dense.header_checksum:
                    raise CheckpointError(f"{self.path}: its header is damaged (checksum mismatch); {self._fix}")

    @property
    def _fix(self) -> str:
        return f"run `strata verify {self.directory}`, then delete the store and re-run `strata convert`"

    def check(self, name: str, raw: torch.Tensor) -> None:
        """Check tensor `name` as read from the file (`raw`: its stored dtype and bytes, on the CPU)."""
        if self.trusted:
            return
        want = self.dense.tensor_checksums.get(name)
        self.hashed += 1
        if want is None or checksum(byte_view(raw.contiguous()) if raw.numel() else b"") != want:
            raise CheckpointError(f"{self.path}: tensor {name!r} is damaged (checksum mismatch); {self._fix}")
        self.checked.add(name)

    def finish(self) -> None:
        """After a load: check the tensors it did not read (once, so a later start trusts the whole file), then
        record the file as verified if it was not written to meanwhile. A damaged tensor the model does not use
        is logged, not raised, and leaves the file unrecorded (every start checks the tensors it loads)."""
        if self.trusted:
            return
        rest = [n for n in self.dense.tensor_checksums if n not in self.checked]
        damaged = verify_dense(self.directory, self.dense, names=rest) if rest else []
        self.hashed += len(rest)
        if damaged:
            log.warning("%s: damaged, though not used by the model: %s; %s", self.path, ", ".join(damaged), self._fix)
            return
        try:
            unchanged = FileIdentity.of(self.path) == self.ident
        except OSError:
            unchanged = False
        if unchanged:
            self.record.put(DENSE_RECORD, self.fingerprint, self.ident)
        self.trusted = True

