"""Writing a store's files: expert layer files slot by slot, dense tensors, row-addressable tables and the
index (written last, atomically). `strata convert` (strata.runtime.plan.checkpoints.convert) drives it for a whole
checkpoint; `add_table` adds one table to an existing store."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import xxhash
from tqdm.auto import tqdm

from strata.errors import CheckpointError, ConfigError
from strata.tiers.store.files import fsync_dir, pwrite_all
from strata.tiers.store.format import (
    ALIGN,
    COPIED_FILES,
    DENSE_NAME,
    DTYPE_NAMES,
    INDEX_NAME,
    ROWS_PER_CHUNK,
    TABLES_DIR,
    BlobEntry,
    DenseEntry,
    StoreIndex,
    TableEntry,
    align_up,
    byte_view,
    checksum,
    layer_file,
    pread_into,
    read_index,
)
from strata.tiers.store.safetensors_header import DTYPE_BITS, TensorInfo, encode_header

_COPY_CHUNK = 16 << 20  # dense tensors are copied through a buffer of this many bytes

Piece = tuple[Path, int, int, int]  # (source file, absolute offset, bytes, offset in the blob): part of one payload
Fill = Callable[[torch.Tensor], None]  # writes one expert's whole payload into a uint8 buffer of payload_bytes

def _holds(path: Path, data: bytes) -> bool:
    """Whether `path` is a file with exactly `data`."""
    try:
        return path.stat().st_size == len(data) and path.read_bytes() == data
    except OSError:
        return False


class StoreWriter:
    """Writes a store's files into `directory`: the temp dir of a convert, or an existing store (tables)."""

    def __init__(self, directory: Path, bar: tqdm | None = None):
        self.directory = Path(directory)
        self.bar = bar
        self._src: dict[Path, int] = {}  # source fds, opened once

    def close(self) -> None:
        for fd in self._src.values():
            os.close(fd)
        self._src.clear()

    def _read(self, path: Path, offset: int, view: memoryview) -> None:
        """Fill `view` from a source file; every failure is a one-line CheckpointError naming the file."""
        try:
            if path not in self._src:
                self._src[path] = os.open(path, os.O_RDONLY)
            got = pread_into(self._src[path], view, offset)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read: {e.strerror or e}; check the file and its permissions") from e
        if got != len(view):
            raise CheckpointError(f"{path}: unexpected end of file at byte {offset + got}; the file is truncated")

    def _create(self, rel: str) -> int:
        path = self.directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def _tick(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def copy_files(self, src_dir: Path) -> dict[str, int]:
        """Copy config/tokenizer files that exist; returns name -> checksum."""
        out = {}
        for name in COPIED_FILES:
            if (src_dir / name).is_file():
                try:
                    data = (src_dir / name).read_bytes()
                except OSError as e:
                    raise CheckpointError(f"{src_dir / name}: cannot read: {e.strerror or e}") from e
                (self.directory / name).write_bytes(data)
                out[name] = checksum(data)
        return out

    def refresh_copies(self, src_dir: Path, index: StoreIndex) -> list[str]:
        """Make the store's copies of `COPIED_FILES` follow `src_dir`: a file added there or changed is
        copied in, one removed there is removed here, and `index` (rewritten when anything changed) records
        their checksums. Cheap: the files are small and read once; an unchanged file is not written.
        Returns the names that changed."""
        changed = []
        for name in COPIED_FILES:
            src, dst = src_dir / name, self.directory / name
            try:
                data = src.read_bytes() if src.is_file() else None
                if data is None:
                    if name not in index.copied_files and not dst.exists():
                        continue
                    dst.unlink(missing_ok=True)
                    index.copied_files.pop(name, None)
                else:
                    digest = checksum(data)
                    if index.copied_files.get(name) == digest and _holds(dst, data):
                        continue
                    tmp = dst.with_name(f".{name}.tmp-{os.getpid()}")
                    tmp.write_bytes(data)
                    os.replace(tmp, dst)  # a server reading the store sees the old file or the new one
                    index.copied_files[name] = digest
            except OSError as e:
                raise CheckpointError(f"{e.filename or dst}: cannot bring the store's copy of {name} up to date with "
                                      f"{src_dir} ({e.strerror or e}); make {self.directory} writable") from e
            changed.append(name)
        if changed:
            self.write_index(index)
        return changed

    def write_dense(self, tensors: list[TensorInfo]) -> DenseEntry:
        """Write `tensors` (raw bytes, any dtype) into dense.safetensors, a real safetensors file.

        Widest dtypes first so every tensor stays aligned to its element size; the header is padded
        with spaces (allowed by the format) so the data starts ALIGN-aligned.
        """
        tensors = sorted(tensors, key=lambda t: (-DTYPE_BITS[t.dtype], t.name))
        head = encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], align=ALIGN)
        sums: dict[str, int] = {}
        buf = memoryview(bytearray(min(_COPY_CHUNK, max((t.nbytes for t in tensors), default=1))))
        fd = self._create(DENSE_NAME)
        try:
            pwrite_all(fd, head, 0)
            pos = len(head)
            for t in tensors:  # streamed through `buf`: an embedding may be GBs
                h = xxhash.xxh3_64()
                for start in range(0, t.nbytes, len(buf)):
                    part = buf[: min(len(buf), t.nbytes - start)]
                    self._read(t.file, t.offset + start, part)
                    h.update(part)
                    pwrite_all(fd, part, pos + start)
                    self._tick(len(part))
                sums[t.name] = h.intdigest()
                pos += t.nbytes
            os.fsync(fd)
        finally:
            os.close(fd)
        return DenseEntry(DENSE_NAME, pos, len(head), checksum(head), sums)

    def write_layer(self, layer: int, experts: list[list[Piece] | Fill], payload_bytes: int) -> list[BlobEntry]:
        """Write one MoE layer file: expert e's payload at e * slot_bytes, zero-padded. An expert is given as its
        pieces (byte copies from the checkpoint to their offsets in the blob; the bytes between them stay zero) or
        as a function that writes the whole payload (an expert quantized while it is packed)."""
        slot = torch.zeros(align_up(payload_bytes), dtype=torch.uint8)  # padding stays zero: deterministic files
        view = byte_view(slot)
        rel = layer_file(layer)
        blobs = []
        fd = self._create(rel)
        try:
            for e, expert in enumerate(experts):
                if callable(expert):
                    expert(slot[:payload_bytes])
                else:
                    for path, offset, nbytes, at in expert:
                        assert at + nbytes <= payload_bytes, (layer, e, at, nbytes, payload_bytes)
                        self._read(path, offset, view[at : at + nbytes])
                pwrite_all(fd, view, e * len(view))
                self._tick(payload_bytes)
                blobs.append(BlobEntry(layer, e, rel, e * len(view), payload_bytes, checksum(view[:payload_bytes])))
            os.fsync(fd)
        finally:
            os.close(fd)
        return blobs

    def add_table(
        self, name: str, data: torch.Tensor | Iterable[torch.Tensor], *, rows_per_chunk: int = ROWS_PER_CHUNK
    ) -> TableEntry:
        """Write a table into tables/NAME.bin at offset 0: `data` is a tensor [num_rows, *row_shape] or an
        iterable of such tensors (consecutive rows, streamed). Returns its index entry."""
        rel = f"{TABLES_DIR}/{name}.bin"
        TableEntry(name, rel, 0, 0, 1, "U8", (1,), rows_per_chunk, [])  # validate name/rows_per_chunk first
        pieces = [data] if isinstance(data, torch.Tensor) else data
        dtype, row_shape, row_bytes = None, (), 0
        h, in_chunk, sums, num_rows, pos = xxhash.xxh3_64(), 0, [], 0, 0
        fd = self._create(rel)
        try:
            for piece in pieces:
                piece = piece.detach().to("cpu").contiguous()
                if dtype is None:
                    if piece.dim() < 1 or piece.dtype not in DTYPE_NAMES:
                        raise ValueError(f"table {name!r}: rows must be a [num_rows, ...] tensor of {list(DTYPE_NAMES)}")
                    dtype, row_shape = piece.dtype, tuple(piece.shape[1:])
                    row_bytes = torch.Size(row_shape).numel() * piece.element_size()
                elif piece.dtype != dtype or tuple(piece.shape[1:]) != row_shape:
                    raise ValueError(f"table {name!r}: every piece must be {dtype} rows of shape {list(row_shape)}")
                view = byte_view(piece) if piece.numel() else memoryview(b"")
                pwrite_all(fd, view, pos)
                pos += len(view)
                self._tick(len(view))
                r, n = 0, piece.shape[0]
                while r < n:  # chunk checksums are over rows_per_chunk rows, whatever the piece sizes
                    take = min(rows_per_chunk - in_chunk, n - r)
                    h.update(view[r * row_bytes : (r + take) * row_bytes])
                    in_chunk, r = in_chunk + take, r + take
                    if in_chunk == rows_per_chunk:
                        sums.append(h.intdigest())
                        h.reset()
                        in_chunk = 0
                num_rows += n
            if dtype is None:
                raise ValueError(f"table {name!r}: no rows given")
            if in_chunk:
                sums.append(h.intdigest())
            pwrite_all(fd, bytes(align_up(pos) - pos), pos)  # pad: the file size is what the index implies
            os.fsync(fd)
        finally:
            os.close(fd)
        return TableEntry(name, rel, 0, num_rows, row_bytes, DTYPE_NAMES[dtype], row_shape, rows_per_chunk, sums)

    def write_index(self, index: StoreIndex) -> None:
        """Write store.msgpack atomically (temp file, fsync, rename, fsync the directory)."""
        tmp = self.directory / f".{INDEX_NAME}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(index.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / INDEX_NAME)
        fsync_dir(self.directory)


def add_table(
    store_dir: str | os.PathLike, name: str, data: torch.Tensor | Iterable[torch.Tensor],
    *, rows_per_chunk: int = ROWS_PER_CHUNK,
) -> TableEntry:  # fmt: skip
    """Add a row-addressable table to an existing store (the index is rewritten atomically, last)."""
    directory = Path(store_dir)
    index = read_index(directory)
    if name in index.tables:
        raise ConfigError(f"{directory}: the store already has a table {name!r}; choose another name")
    entry = StoreWriter(directory).add_table(name, data, rows_per_chunk=rows_per_chunk)
    index.tables[name] = entry
    StoreWriter(directory).write_index(index)
    return entry
