"""Verification records: a file's full checksum pass runs once per file version, not once per start.

After every chunk of a table has passed its checksum, a small JSON record next to the files
(`<store>/engram-verified.json`; for tmpfs copies `<tmpfs dir>/engram-verified.json`) keeps, per
table, the file's identity (size, st_mtime_ns, st_ctime_ns, st_ino) and the table's fingerprint (a
hash of its index entry, chunk checksums included). At the next start a file that still has that
identity is trusted without reading it. dense.safetensors is recorded the same way once every dense
tensor has passed (key "file:dense.safetensors", strata.tiers.store.dense_check).

Why that is enough: any write to the file moves its mtime and ctime (ctime cannot be set back by
`touch`/utime), a replaced or copied file has another inode, a truncated one another size, and a
re-converted store another fingerprint; any of these runs the full pass again. What a record cannot
see is damage that changes none of them (bit rot on the medium, a write through a raw block device):
that is the job of `strata verify`, which reads every table chunk (the background scrub covers experts
only). Rows read while serving are not checksummed, with or without a record (see engram_rows).

A record that cannot be read is treated as empty; one that cannot be written (a read-only store
directory) is skipped with one log line, and every start then verifies in full, as before.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack
import xxhash

from strata.errors import CheckpointError
from strata.tiers.store.format import TableEntry

RECORD_NAME = "engram-verified.json"
RECORD_VERSION = 1
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one version of a file's contents without reading it."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> FileIdentity:
        """The identity of `path` now (OSError when it cannot be stat'ed, e.g. missing)."""
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def table_fingerprint(source_fingerprint: str, t: TableEntry) -> str:
    """A hash of the table's index entry: layout and every chunk checksum (another store, another hash)."""
    entry = [source_fingerprint, t.name, t.file, t.offset, t.num_rows, t.row_bytes, t.dtype, list(t.row_shape),
             t.rows_per_chunk, t.chunk_checksums]
    return xxhash.xxh3_128_hexdigest(msgpack.packb(entry, use_bin_type=True))


def table_identity(path: str | os.PathLike, t: TableEntry, size: int) -> FileIdentity:
    """The identity of table `t`'s file, which must exist with the `size` the store index implies:
    checked at every start, record or not, so a missing or truncated table always stops start-up."""
    fix = "run `strata verify` on the store, or delete it and re-run `strata convert`"
    try:
        ident = FileIdentity.of(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read table {t.name!r} ({e.strerror or e}); {fix}") from None
    if ident.size != size:
        raise CheckpointError(f"{path}: table {t.name!r} has {ident.size} bytes but the store index implies {size}; "
                              f"the file is truncated or damaged: {fix}")
    return ident


class VerifyRecord:
    """The record file `directory`/engram-verified.json: name -> (fingerprint, file identity)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / RECORD_NAME
        self.entries: dict[str, dict] = _load(self.path)
        self.writable = True  # False after a failed save: the directory is read-only, stop trying

    def matches(self, name: str, fingerprint: str, ident: FileIdentity) -> bool:
        """Whether `name` was fully verified as `fingerprint` while its file had identity `ident`."""
        e = self.entries.get(name)
        return e is not None and e == {"fingerprint": fingerprint, **asdict(ident)}

    def put(self, name: str, fingerprint: str, ident: FileIdentity) -> None:
        """Record `name` as verified and save at once (a later table failing keeps this one's record)."""
        self.entries[name] = {"fingerprint": fingerprint, **asdict(ident)}
        self.save()

    def drop(self, name: str) -> None:
        """Forget `name` (its file is being replaced) and save."""
        if self.entries.pop(name, None) is not None:
            self.save()

    def save(self) -> bool:
        """Write the record atomically (temporary sibling, then rename), merged over what another
        process may have written meanwhile; False, with one log line, when the directory is not writable."""
        if not self.writable:
            return False
        merged = {**_load(self.path), **self.entries}
        tmp = self.path.with_name(f".{RECORD_NAME}.tmp-{os.getpid()}")
        data = json.dumps({"version": RECORD_VERSION, "tables": merged}, indent=1, sort_keys=True).encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)  # a few hundred bytes: one write
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as e:
            self.writable = False
            try:
                os.unlink(tmp)
            except OSError:
                pass
            log.warning("%s: cannot write the verification record (%s); tables are verified in full at every start",
                        self.path, e.strerror or e)
            return False
        self.entries = merged
        return True


def _load(path: Path) -> dict[str, dict]:
    """The entries of a record file; {} when it is missing, unreadable, malformed or of another version."""
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(d, dict) or d.get("version") != RECORD_VERSION or not isinstance(d.get("tables"), dict):
        return {}
    keys = {"fingerprint", "size", "mtime_ns", "ctime_ns", "ino"}
    return {name: e for name, e in d["tables"].items()
            if isinstance(e, dict) and set(e) == keys and isinstance(e["fingerprint"], str)
            and all(type(e[k]) is int for k in keys - {"fingerprint"})}
