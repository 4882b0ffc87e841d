"""The checksums of an in-place store's parts (`<in-place dir>/in-place-verified.msgpack`).

A checkpoint's safetensors files carry no checksums, so strata makes its own: the full verification pass (a
background thread at the lowest CPU and I/O priority) and every first read of a part not yet passed record
the part's xxh3_64, under its file's identity (size, mtime, inode) when the index was built. Later reads, in
this process or the next, compare against them: damage that leaves the file's identity as it was (bit rot,
a write through the block device) is caught at the first read of the damaged part, and a file whose identity
moved is refused before it is read (`strata.tiers.store.in_place.changed_error`). What no record can catch is a
part that was already wrong when it was first checksummed: that is a damaged download (compare the files'
sha256 with the hub's).

The record is saved atomically at most every `SAVE_EVERY_S` seconds, and at the end of the pass: a pass that
stops (the process ends) resumes from what the record holds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Protocol

import msgpack

log = logging.getLogger(__name__)

RECORD_NAME = "in-place-verified.msgpack"
SAVE_EVERY_S = 2.0


class _Part(Protocol):
    file: str
    offset: int
    length: int


class PartRecord:
    """file -> {"identity": [size, mtime_ns, ino], "sums": {offset: [length, checksum]}}; entries made under
    another identity of the file than `files` gives are dropped when the record is read."""

    def __init__(self, directory: str | os.PathLike, files: dict):
        self.path = Path(directory) / RECORD_NAME
        self._ident = {name: [f.size, f.mtime_ns, f.ino] for name, f in files.items()}
        self._lock = threading.Lock()
        self._dirty, self._saved_at = False, time.monotonic()
        self.writable = True
        loaded = _load(self.path)
        self.sums: dict[str, dict[int, list[int]]] = {
            name: ({int(o): list(v) for o, v in loaded[name]["sums"].items()}
                   if name in loaded and loaded[name].get("identity") == ident else {})
            for name, ident in self._ident.items()}  # fmt: skip

    def get(self, part: _Part) -> int | None:
        """The recorded checksum of `part`, or None."""
        got = self.sums.get(part.file, {}).get(part.offset)
        return got[1] if got is not None and got[0] == part.length else None

    def put(self, part: _Part, value: int) -> None:
        with self._lock:
            self.sums.setdefault(part.file, {})[part.offset] = [part.length, value]
            self._dirty = True

    def forget(self, name: str) -> None:
        """Drop every checksum of file `name` (it is verified again)."""
        with self._lock:
            self.sums[name] = {}
            self._dirty = True

    def save(self, force: bool = True) -> None:
        """Write the record atomically when it changed (unless `force`, at most every SAVE_EVERY_S seconds)."""
        if not self._dirty or not self.writable or (not force and time.monotonic() - self._saved_at < SAVE_EVERY_S):
            return
        with self._lock:
            data = msgpack.packb({"version": 1, "files": {
                name: {"identity": self._ident[name], "sums": dict(self.sums.get(name, {}))} for name in self._ident}},
                use_bin_type=True)  # fmt: skip
            self._dirty, self._saved_at = False, time.monotonic()
        tmp = self.path.with_name(f".{RECORD_NAME}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
        except OSError as e:
            self.writable = False
            log.warning("%s: cannot write the verification record (%s); parts are checksummed again at every start",
                        self.path, e.strerror or e)


def _load(path: Path) -> dict:
    try:
        d = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except (OSError, ValueError, msgpack.UnpackException):
        return {}
    if not isinstance(d, dict) or d.get("version") != 1 or not isinstance(d.get("files"), dict):
        return {}
    return {n: e for n, e in d["files"].items() if isinstance(e, dict) and isinstance(e.get("sums"), dict)}


# ioprio_set(2): IOPRIO_WHO_PROCESS with a thread id sets that thread's I/O class; class 3 is idle
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_IOPRIO_IDLE = 3 << 13


def low_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19) and, on Linux, the idle I/O class: it runs only
    when nothing else wants the CPU or the disk."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)  # Linux: per thread
    except (AttributeError, OSError):
        pass
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is not None:
        try:
            ctypes.CDLL(None, use_errno=True).syscall(nr, 1, tid, _IOPRIO_IDLE)
        except (OSError, AttributeError):
            pass
