"""Native helpers of the disk tier (csrc/pread_runs.cpp, csrc/row_serve.cpp), built on first use.

    read_runs(fd, file_off, length, need, buf, buf_off, threads)   # every run read; raises OSError / EOFError
    wait_word(addr, want, spin_ns, timeout_ns)                      # an int64 another agent writes, awaited
    lib().strata_serve_rows(...)                                    # an Engram layer's rows (strata.tiers.rows.serve)

A reader thread hands a whole list of reads to one C call (ctypes releases the GIL for the call) that reads
them on `threads` threads of its own, so nobody takes the GIL back between reads. The library is compiled with the system's C++ compiler into
strata's cache (`$STRATA_CACHE/ext`, keyed by a hash of the source and the compiler); without a compiler
`available()` is False and the disk reader issues its reads from Python, as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

from strata.tiers.store.files import cache_root

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("pread_runs.cpp", "row_serve.cpp")]
_FLAGS = ["-O2", "-shared", "-fPIC", "-fvisibility=hidden"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES) + repr((cxx, _FLAGS)).encode()).hexdigest()[:16]
    path = cache_root() / "ext" / f"strata_pread_runs_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            subprocess.run([cxx, *_FLAGS, "-o", str(tmp), *map(str, _SOURCES)], check=True, capture_output=True,
                           text=True, timeout=120)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{cxx} failed: {(e.stderr or '').strip().splitlines()[-1:] or e}") from None
        os.replace(tmp, path)  # atomic: a concurrent build of the same source writes the same file
    lib = ctypes.CDLL(str(path))
    p = ctypes.c_void_p
    lib.strata_pread_runs.argtypes = [ctypes.c_int, ctypes.c_int64, p, p, p, p, p, ctypes.c_int]
    lib.strata_pread_runs.restype = ctypes.c_int64
    lib.strata_aio_runs.argtypes = [ctypes.c_int, ctypes.c_int64, p, p, p, p, p]
    lib.strata_aio_runs.restype = ctypes.c_int64
    lib.strata_serve_rows.argtypes = [p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_int64, p, p, p, p, p, p, ctypes.c_int64, p, p, ctypes.c_int64, p,
                                      ctypes.c_int64, p, p]
    lib.strata_serve_rows.restype = ctypes.c_int64
    lib.strata_wait_word.argtypes = [p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.strata_wait_word.restype = ctypes.c_int
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _build()
                except Exception as e:  # noqa: BLE001 - no compiler, read-only cache...: reads stay in Python
                    log.warning("strata: native disk reads unavailable (%s); reading from Python", e)
                _tried = True
    return _lib


def available() -> bool:
    """Whether the native batch of reads can be used here (built; else reads stay in Python)."""
    return _load() is not None


_AIO_UNAVAILABLE = -(2**63)
_aio_ok = True  # False once the kernel refused native AIO: threads from then on


def read_runs(fd: int, file_off: np.ndarray, length: np.ndarray, need: np.ndarray, buf: np.ndarray,
              buf_off: np.ndarray, threads: int = 1, aio: bool = False) -> None:
    """Read run i (`length[i]` bytes at `file_off[i]`, at least `need[i]` of them) into `buf[buf_off[i]:]`
    for every i (int64 arrays of one length; `buf` a uint8 array big enough), on `threads` threads, or with
    `aio` (an O_DIRECT fd) all submitted at once through Linux native AIO from this thread (threads where the
    kernel refuses it). Raises OSError for a failed read, EOFError (with the run's
    index) for a file that ends before a run's `need`."""
    global _aio_ok
    lib = _load()
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (file_off, length, need, buf_off)]
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError("file_off, length, need and buf_off must have one length")
    if arrays[0].size and int((arrays[3] + arrays[1]).max()) > buf.size:
        raise ValueError(f"runs end past the {buf.size}-byte buffer")
    rc = _AIO_UNAVAILABLE
    if aio and _aio_ok and arrays[0].size > 1:
        rc = lib.strata_aio_runs(fd, arrays[0].size, *(a.ctypes.data for a in arrays[:3]), buf.ctypes.data,
                                 arrays[3].ctypes.data)
        if rc == _AIO_UNAVAILABLE:
            log.info("strata: Linux native AIO unavailable here; row reads use threads")
            _aio_ok = False
    if rc == _AIO_UNAVAILABLE:
        rc = lib.strata_pread_runs(fd, arrays[0].size, *(a.ctypes.data for a in arrays[:3]), buf.ctypes.data,
                                   arrays[3].ctypes.data, max(1, threads))
    if rc > 0:
        raise OSError(int(rc), os.strerror(int(rc)))
    if rc < 0:
        raise EOFError(int(-1 - rc))


def wait_word(addr: int, want: int, spin_ns: int, timeout_ns: int) -> bool:
    """Wait, without the GIL, until the int64 at address `addr` (page-locked memory a GPU writes) equals `want`:
    polled without sleeping for `spin_ns`, then every ~20 us; False when `timeout_ns` passed first."""
    return bool(lib().strata_wait_word(addr, want, spin_ns, timeout_ns))


def lib() -> ctypes.CDLL:
    """The loaded library (for callers that pass their own arrays); raises where it cannot be built."""
    loaded = _load()
    if loaded is None:
        raise RuntimeError("the native helpers are unavailable (no C++ compiler, or they failed to build)")
    return loaded
