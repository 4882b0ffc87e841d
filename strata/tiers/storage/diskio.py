"""Reading store files fast (`DiskReader`): O_DIRECT reads on a thread pool into 4096-aligned buffers, table-row
gathers (the blocks they read: strata.tiers.storage.row_gather; disk straight into GPU memory with kvikio:
strata.tiers.storage.gds).

Store objects are fixed-size blobs at 4096-aligned offsets, so they can be read with O_DIRECT: no
page-cache copy and no page cache filled (then evicted) by a store far larger than RAM. One read in
flight does not saturate a disk (the H200 machine's virtio disk: 1.07 GB/s with 1 thread, 1.18 GB/s with 8), so
big reads are cut into `chunk_bytes` pieces and many pieces run at once on a thread pool (`os.preadv` releases
the GIL). Files on tmpfs are memory already: they are read buffered, and row gathers on them index a
mapping of the file instead of issuing one syscall per row.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from strata.errors import CheckpointError
from strata.tiers.storage import native_io
from strata.tiers.storage.aligned_io import ALIGN, MEMORY_FS, PathLike, aligned_empty, as_bytes, fs_type, pread
from strata.tiers.storage.row_gather import block_runs, gather_rows


@dataclass
class OpenFile:
    """One open store file: the fd reads use and what the filesystem allows."""

    path: str
    fd: int  # O_DIRECT when `direct`, else buffered
    direct: bool
    size: int
    memory: bool  # on tmpfs/ramfs: row gathers index `table`, a mapping of the file
    buffered_fd: int = -1  # opened on first use, for requests O_DIRECT cannot serve (unaligned)
    mm: mmap.mmap | None = None
    table: torch.Tensor | None = None  # uint8 [size] over `mm`


def _fan_in(futs: list[Future], finish: Callable[[], Any]) -> Future:
    """A future that completes with `finish()` once every future in `futs` is done (first error wins)."""
    result: Future = Future()
    result.set_running_or_notify_cancel()
    left, lock = [len(futs)], threading.Lock()

    def on_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [e for e in (f.exception() for f in futs) if e is not None]
        try:
            if errors:
                raise errors[0]
            result.set_result(finish())
        except Exception as e:  # every failure goes to the waiter
            result.set_exception(e)
        except BaseException as e:  # an interrupt on this thread: the waiter is told, and the interrupt goes on
            result.set_exception(e)
            raise

    for f in futs:
        f.add_done_callback(on_done)
    return result


def _failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


class DiskReader:
    """Reads byte ranges and table rows of store files into CPU uint8 tensors, many reads in flight.

    O_DIRECT is used where the filesystem supports it (tried once per file); tmpfs files and requests
    that are not 4096-aligned (offset, length and buffer) are read buffered. Results are futures."""

    def __init__(self, num_threads: int = 8, direct: bool = True, chunk_bytes: int = 16 << 20, native: bool | None = None):
        if num_threads < 1 or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"need num_threads >= 1 and chunk_bytes a positive multiple of {ALIGN}")
        self.num_threads, self.direct, self.chunk_bytes = num_threads, direct, chunk_bytes
        self.native = native  # row gathers' runs read in one C loop per thread (None: where it can be built)
        self.aio = True  # native row gathers on O_DIRECT files: every run submitted at once (Linux AIO)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="strata-disk")
        self._files: dict[str, OpenFile] = {}
        self._lock = threading.Lock()
        self._scratch: list[torch.Tensor] = []  # reusable aligned buffers for row gathers

    # -- files -------------------------------------------------------------------------------------
    def file(self, path: PathLike) -> OpenFile:
        """`path` opened for reads (once; later calls return the same `OpenFile`): its fd, size and filesystem."""
        key = os.fspath(path)
        f = self._files.get(key)
        if f is None:
            with self._lock:
                f = self._files.get(key) or self._open(key)
                self._files[key] = f
        return f

    def _open(self, path: str) -> OpenFile:
        memory = fs_type(path) in MEMORY_FS
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            size = os.stat(path).st_size
            if self.direct and not memory and hasattr(os, "O_DIRECT"):
                fd = self._try_direct(path, flags, size)
                if fd >= 0:
                    return OpenFile(path, fd, True, size, memory)
            return OpenFile(path, os.open(path, flags), False, size, memory)
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror}") from e

    @staticmethod
    def _try_direct(path: str, flags: int, size: int) -> int:
        """An O_DIRECT fd if opening and reading one block that way works, else -1."""
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return -1
            raise
        if size:
            probe = mmap.mmap(-1, ALIGN)  # page-aligned
            try:
                os.preadv(fd, [probe], 0)
            except OSError:
                os.close(fd)
                return -1
            finally:
                probe.close()
        return fd

    def _buffered_fd(self, f: OpenFile) -> int:
        if not f.direct:
            return f.fd
        with self._lock:
            if f.buffered_fd < 0:
                f.buffered_fd = os.open(f.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return f.buffered_fd

    def _mapped(self, f: OpenFile) -> torch.Tensor:
        with self._lock:
            if f.table is None:
                # ACCESS_COPY (private, writable) so torch.frombuffer does not warn; pages are never written
                f.mm = mmap.mmap(f.fd, f.size, access=mmap.ACCESS_COPY)
                f.table = torch.frombuffer(f.mm, dtype=torch.uint8)
        return f.table

    def uses_direct(self, path: PathLike) -> bool:
        """Whether reads of `path` go through O_DIRECT (opens the file if needed)."""
        return self.file(path).direct

    # -- reads -------------------------------------------------------------------------------------
    def read(self, path: PathLike, offset: int, length: int, out: torch.Tensor) -> Future:
        """Read `length` bytes at `offset` of `path` into `out[:length]` (a contiguous CPU uint8 tensor).

        Returns a future of `out`; a missing or too-short file fails it with CheckpointError naming the file."""
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        buf = as_bytes(out, length)
        try:
            f = self.file(path)
        except CheckpointError as e:
            return _failed(e)
        if offset + length > f.size:
            return _failed(CheckpointError(
                f"{f.path} is truncated: bytes {offset}..{offset + length} requested but the file has {f.size}"))
        fd = f.fd
        if f.direct and (offset % ALIGN or length % ALIGN or out.data_ptr() % ALIGN):
            fd = self._buffered_fd(f)
        if length <= self.chunk_bytes:
            return self._pool.submit(lambda: (pread(f.path, fd, buf[:length], offset, length), out)[1])
        futs = [self._pool.submit(pread, f.path, fd, buf[s : min(s + self.chunk_bytes, length)], offset + s,
                                  min(self.chunk_bytes, length - s))
                for s in range(0, length, self.chunk_bytes)]
        return _fan_in(futs, lambda: out)

    def read_parts(self, extents: Sequence[tuple[PathLike, int, int, int]], out: torch.Tensor) -> Future:
        """Fill `out` (a contiguous CPU uint8 tensor: a blob slot) from `extents`, each (path, offset, bytes, offset in
        `out`): one read per extent. On an O_DIRECT file an extent that is not 4096-aligned (in the file, in its
        length or in `out`) is read as the aligned window around it into a scratch buffer and copied out, so every
        read still bypasses the page cache; on a buffered file it is read straight into place. Bytes of `out` that
        no extent covers are left as they are. Returns a future of `out`."""
        if len(extents) == 1 and extents[0][3] == 0:
            path, offset, length, _ = extents[0]
            f = self.file(path)
            if not f.direct or (offset % ALIGN == 0 and length % ALIGN == 0):
                return self.read(path, offset, length, out)
        flat = as_bytes(out, out.numel())
        futs: list[Future] = []
        for path, offset, length, at in extents:
            if at < 0 or at + length > flat.size:
                raise ValueError(f"extent at {at} of {length} bytes runs past the {flat.size}-byte buffer")
            try:
                f = self.file(path)
            except CheckpointError as e:
                return _failed(e)
            if offset + length > f.size:
                return _failed(CheckpointError(
                    f"{f.path} is truncated: bytes {offset}..{offset + length} requested but the file has {f.size}"))
            aligned = offset % ALIGN == 0 and length % ALIGN == 0 and (out.data_ptr() + at) % ALIGN == 0
            for s in range(0, length, self.chunk_bytes):  # big extents in chunk_bytes pieces, read in parallel
                n = min(self.chunk_bytes, length - s)
                if not f.direct or aligned:
                    futs.append(self._pool.submit(pread, f.path, f.fd, flat[at + s : at + s + n], offset + s, n))
                else:
                    futs.append(self._pool.submit(self._read_window, f, offset + s, n, flat[at + s : at + s + n]))
        return _fan_in(futs, lambda: out)

    def _read_window(self, f: OpenFile, offset: int, length: int, dst: np.ndarray) -> None:
        """O_DIRECT read of the 4096-aligned window around [offset, offset + length), copied into `dst`."""
        start = offset - offset % ALIGN
        end = min(-(-(offset + length) // ALIGN) * ALIGN, -(-f.size // ALIGN) * ALIGN)
        scratch = self._take_scratch(end - start)
        try:
            buf = scratch.numpy()[: end - start]
            pread(f.path, f.fd, buf, start, offset + length - start)
            dst[:] = buf[offset - start : offset - start + length]
        finally:
            self._give_scratch(scratch)

    def read_many(self, requests: Sequence[tuple[PathLike, int, int, torch.Tensor]]) -> list[Future]:
        """`read` for each (path, offset, length, out); all are queued before any completes."""
        return [self.read(*r) for r in requests]

    def read_rows(self, path: PathLike, base_offset: int, row_bytes: int, rows: Sequence[int] | np.ndarray | torch.Tensor,
                  out: torch.Tensor) -> Future:
        """Gather rows of a table (row r at `base_offset + r * row_bytes`) into `out` viewed as [n, row_bytes].

        On a disk, the 4 KiB blocks the rows touch are deduplicated, coalesced into runs of consecutive
        blocks, read with O_DIRECT in parallel into an aligned scratch buffer, then scattered with one
        index_select. Duplicates and rows straddling blocks are fine. Returns a future of `out`."""
        if base_offset < 0 or row_bytes <= 0:
            raise ValueError(f"need base_offset >= 0 and row_bytes > 0, got {base_offset}, {row_bytes}")
        idx = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = idx.size
        dst = as_bytes(out, n * row_bytes, keep_tensor=True).view(n, row_bytes)
        if n and int(idx.min()) < 0:
            raise ValueError(f"row indices must be >= 0, got {int(idx.min())}")
        try:
            f = self.file(path)
        except CheckpointError as e:
            return _failed(e)
        if n == 0:
            return self._pool.submit(lambda: out)
        starts = base_offset + idx * row_bytes  # [n] byte offsets in the file
        if int(starts.max()) + row_bytes > f.size:
            last = int(idx[np.argmax(starts)])
            return _failed(CheckpointError(f"{f.path} is truncated: row {last} of {row_bytes} bytes at offset "
                                           f"{base_offset} lies past its end ({f.size} bytes)"))
        if f.memory:  # tmpfs: index the mapping, no syscalls; a memcpy this small costs less than a thread hop
            done: Future = Future()
            try:
                gather_rows(self._mapped(f), starts, row_bytes, dst)
            except Exception as e:  # reported through the future, like the threaded reads
                done.set_exception(e)
            else:
                done.set_result(out)
            return done

        ub, pos, run_a, run_b = block_runs(starts, row_bytes, self.chunk_bytes // ALIGN)
        scratch = self._take_scratch(ub.size * ALIGN)
        sbuf = scratch.numpy()
        # direct files always qualify for O_DIRECT here: block offsets, lengths and the scratch are aligned
        fd = f.fd

        def finish() -> torch.Tensor:
            try:
                gather_rows(scratch, pos, row_bytes, dst)
            finally:
                self._give_scratch(scratch)
            return out

        if native_io.available() if self.native is None else self.native:
            def read_all() -> torch.Tensor:  # every run in one C call on its own threads, then the gather
                off = ub[run_a] * ALIGN
                length = (run_b - run_a) * ALIGN
                try:
                    native_io.read_runs(fd, off, length, np.minimum(length, f.size - off), sbuf, run_a * ALIGN,
                                        threads=self.num_threads, aio=f.direct and self.aio)
                except EOFError as e:
                    self._give_scratch(scratch)
                    raise CheckpointError(f"{f.path} ended early: the read at offset {int(off[e.args[0]])} came "
                                          "up short; the store file is truncated") from None
                except OSError as e:
                    self._give_scratch(scratch)
                    raise CheckpointError(f"cannot read {f.path}: {e.strerror}") from e
                return finish()

            return self._pool.submit(read_all)  # one task: no per-read Python, no fan-in

        runs, blk = list(zip(run_a.tolist(), run_b.tolist(), strict=True)), ub.tolist()

        def read_runs(part: list[tuple[int, int]]) -> None:
            for a, b in part:
                off = blk[a] * ALIGN
                pread(f.path, fd, sbuf[a * ALIGN : b * ALIGN], off, min((b - a) * ALIGN, f.size - off))

        groups = min(self.num_threads, len(runs))
        futs = [self._pool.submit(read_runs, runs[k::groups]) for k in range(groups)]
        return _fan_in(futs, finish)

    def _take_scratch(self, nbytes: int) -> torch.Tensor:
        """An aligned buffer of at least `nbytes` (whole MiBs, so buffers get reused across batches)."""
        with self._lock:
            fits = [i for i, t in enumerate(self._scratch) if t.numel() >= nbytes]
            if fits:  # the smallest that fits (list.remove would compare tensors with ==)
                return self._scratch.pop(min(fits, key=lambda i: self._scratch[i].numel()))
        return aligned_empty(-(-nbytes // (1 << 20)) * (1 << 20))

    def _give_scratch(self, t: torch.Tensor) -> None:
        with self._lock:
            self._scratch.append(t)
            if len(self._scratch) > 4:  # keep the 4 largest
                self._scratch.pop(min(range(len(self._scratch)), key=lambda i: self._scratch[i].numel()))

    def close(self) -> None:
        """Wait for queued reads, then close every file."""
        self._pool.shutdown(wait=True)
        with self._lock:
            for f in self._files.values():
                f.table = None
                if f.mm is not None:
                    try:
                        f.mm.close()
                    except BufferError:  # a caller still holds a view of the mapping: the GC unmaps it later
                        pass
                for fd in {f.fd, f.buffered_fd} - {-1}:
                    os.close(fd)
            self._files.clear()
            self._scratch.clear()

    def __enter__(self) -> DiskReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
