"""`strata convert` and `strata verify`: pack a checkpoint into a tiered expert store; check a store.

Conversion streams: one expert's slot buffer at a time is read by offset from the checkpoint (either
expert layout), hashed and pwritten at its slot, so memory stays at one slot (plus 16 MiB for dense
tensors) whatever the model's size. Everything goes into a hidden sibling directory, the index
last, fsynced, then renamed into place: an interrupted convert never leaves a directory that looks
like a store.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import xxhash
from tqdm.auto import tqdm

from strata.errors import CheckpointError, ConfigError, StrataError
from strata.fsutil import fsync_dir, pwrite_all, remove_stale_tmp_dirs, temp_sibling
from strata.runtime.checkpoint import Checkpoint
from strata.runtime.engram_store import is_table_tensor, write_tables
from strata.safetensors_index import DTYPE_BITS, DTYPES, TensorInfo, encode_header
from strata.tiers.store import ExpertStore, StaleStoreError
from strata.tiers.store_format import (
    ALIGN,
    COPIED_FILES,
    DENSE_NAME,
    DTYPE_NAMES,
    EXPERT_DTYPES,
    INDEX_NAME,
    ROWS_PER_CHUNK,
    TABLES_DIR,
    BlobEntry,
    DenseEntry,
    StoreIndex,
    TableEntry,
    align_up,
    byte_view,
    checkpoint_fingerprint,
    checksum,
    is_store,
    layer_file,
    pread_into,
    read_index,
)

# routed-expert tensors (per-expert or fused); shared experts (`mlp.shared_experts.`) are dense
_ROUTED = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.")
_COPY_CHUNK = 16 << 20  # dense tensors are copied through a buffer of this many bytes

Piece = tuple[Path, int, int]  # (source file, absolute offset, bytes): part of one expert's payload


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

    def write_layer(self, layer: int, experts: list[list[Piece]], payload_bytes: int) -> list[BlobEntry]:
        """Write one MoE layer file: expert e's payload (its pieces, in order) at e * slot_bytes, zero-padded."""
        slot = torch.zeros(align_up(payload_bytes), dtype=torch.uint8)  # padding stays zero: deterministic files
        view = byte_view(slot)
        rel = layer_file(layer)
        blobs = []
        fd = self._create(rel)
        try:
            for e, pieces in enumerate(experts):
                pos = 0
                for path, offset, nbytes in pieces:
                    self._read(path, offset, view[pos : pos + nbytes])
                    pos += nbytes
                assert pos == payload_bytes, (layer, e, pos, payload_bytes)
                pwrite_all(fd, view, e * len(view))
                blobs.append(BlobEntry(layer, e, rel, e * len(view), payload_bytes, checksum(view[:payload_bytes])))
                self._tick(payload_bytes)
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


# --- convert --------------------------------------------------------------------------------------


def convert_checkpoint(checkpoint_dir: str | os.PathLike, store_dir: str | os.PathLike, *, progress: bool = True) -> Path:
    """Convert a checkpoint into a store at `store_dir` (atomically) and return the store directory.

    If `store_dir` already holds the store of this very checkpoint it is returned untouched; a
    non-empty directory that is anything else is refused.
    """
    return _convert(checkpoint_dir, store_dir, progress)[0]


def _convert(checkpoint_dir: str | os.PathLike, store_dir: str | os.PathLike, progress: bool) -> tuple[Path, bool]:
    """convert_checkpoint; also says whether anything was written."""
    src = Path(checkpoint_dir).expanduser()
    if is_store(src):
        raise ConfigError(f"{src} is already a strata store; convert the original Hugging Face checkpoint")
    ckpt = Checkpoint.open(src)
    fingerprint = checkpoint_fingerprint(src)
    out = Path(store_dir).expanduser().absolute()
    if _existing_store(out, src, fingerprint):
        return out, False
    meta, dense, layers = _plan(ckpt, fingerprint)  # every shape/dtype checked before anything is written
    num_blobs = len(meta["moe_layers"]) * meta["num_experts"]
    total = sum(t.nbytes for t in dense) + num_blobs * meta["payload_bytes"]
    need = sum(t.nbytes for t in dense) + num_blobs * meta["slot_bytes"]
    tmp = temp_sibling(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp_dirs(out)
        free = shutil.disk_usage(out.parent).free
        if need > free:
            raise StrataError(f"{out.parent}: the store needs {need / 1e9:.2f} GB but only {free / 1e9:.2f} GB "
                              "is free; free space or choose another directory")
        tmp.mkdir()
    except OSError as e:
        raise StrataError(f"{e.filename or out.parent}: cannot create the store: {e.strerror or e}") from e
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress)
    writer = StoreWriter(tmp, bar)
    try:
        try:
            copied = writer.copy_files(src)
            dense_entry = writer.write_dense(dense)
            blobs = {}
            for layer, experts in layers:
                for blob in writer.write_layer(layer, experts, meta["payload_bytes"]):
                    blobs[blob.key] = blob
            tables = write_tables(writer, ckpt)  # Engram tables as row-addressable objects
            index = StoreIndex(**meta, blobs=blobs, tables=tables, dense=dense_entry, copied_files=copied)
            writer.write_index(index)  # last: only now is tmp a store
            try:
                os.rename(tmp, out)  # atomic; also replaces an empty directory
            except OSError:
                if is_store(out) and read_index(out).source_fingerprint == fingerprint:
                    shutil.rmtree(tmp, ignore_errors=True)  # a concurrent convert finished the same store first
                    return out, False
                raise
            fsync_dir(out.parent)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StrataError(f"{out}: no space left on the device while writing the store; "
                                  "free space or choose another directory") from e
            raise StrataError(f"{e.filename or out}: cannot write the store: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        writer.close()
        bar.close()
    return out, True


def _plan(ckpt: Checkpoint, fingerprint: str) -> tuple[dict, list[TensorInfo], list[tuple[int, list[list[Piece]]]]]:
    """The store index's model fields, the dense tensors and every expert's payload pieces."""
    cfg = ckpt.config
    e_num, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    moe = [layer for layer, is_moe in enumerate(cfg.moe_layers) if is_moe]
    if not moe:
        raise CheckpointError(f"{ckpt.directory}: config.json has no MoE layers; there are no experts to store")
    names = _expert_tensor_names(ckpt, moe[0], 0)
    dtype = ckpt.index[names[0]].dtype
    if dtype not in EXPERT_DTYPES:
        raise CheckpointError(f"{ckpt.index[names[0]].file}: expert dtype {dtype}; strata stores {EXPERT_DTYPES}")
    es = DTYPES[dtype][1]
    layers = [(layer, _layer_pieces(ckpt, layer, dtype, e_num, i, h)) for layer in moe]
    # routed experts of layers outside config's MoE layers (DeepSeek's MTP layer) are never run: skipped
    dense = [t for t in ckpt.index if not _ROUTED.search(t.name) and not is_table_tensor(t.name)]  # Engram: tables
    payload = 3 * i * h * es
    meta = dict(
        source_fingerprint=fingerprint, model_type=cfg.model_type, num_layers=cfg.num_layers, moe_layers=moe,
        num_experts=e_num, hidden=h, moe_intermediate=i, dtype=dtype, payload_bytes=payload,
        slot_bytes=align_up(payload),
    )  # fmt: skip
    return meta, dense, layers


def _expert_tensor_names(ckpt: Checkpoint, layer: int, expert: int) -> list[str]:
    if ckpt.expert_layout == "fused":
        return [_resolve(ckpt, f"model.layers.{layer}.mlp.experts.{p}") for p in ("gate_up_proj", "down_proj")]
    names = ckpt.expert_names(layer, expert)
    return [names["gate_proj"], names["up_proj"], names["down_proj"]]


def _resolve(ckpt: Checkpoint, name: str) -> str:
    alt = name.replace(".mlp.", ".block_sparse_moe.")
    return alt if name not in ckpt.index and alt in ckpt.index else name


def _layer_pieces(ckpt: Checkpoint, layer: int, dtype: str, e_num: int, i: int, h: int) -> list[list[Piece]]:
    """Per expert, where its payload's bytes are: gate [I, H], up [I, H], down [H, I] (per-expert
    layout), or its slices of the fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    if ckpt.expert_layout == "fused":  # expert e's rows are contiguous slices of the stacked tensors
        gu, dn = _checked_infos(ckpt, layer, 0, dtype, [(e_num, 2 * i, h), (e_num, h, i)])
        gub, dnb = gu.nbytes // e_num, dn.nbytes // e_num
        return [[(gu.file, gu.offset + e * gub, gub), (dn.file, dn.offset + e * dnb, dnb)] for e in range(e_num)]
    shapes = [(i, h), (i, h), (h, i)]
    return [[(t.file, t.offset, t.nbytes) for t in _checked_infos(ckpt, layer, e, dtype, shapes)] for e in range(e_num)]


def _checked_infos(ckpt: Checkpoint, layer: int, e: int, dtype: str, shapes: list[tuple]) -> list[TensorInfo]:
    """The expert tensors of (layer, e) (all experts when fused), checked against config.json's shapes."""
    infos = [ckpt.index[n] for n in _expert_tensor_names(ckpt, layer, e)]
    for info, shape in zip(infos, shapes, strict=True):
        if info.shape != shape or info.dtype != dtype:
            raise CheckpointError(
                f"{info.file}: tensor {info.name!r} is {info.dtype} {list(info.shape)}, expected {dtype} "
                f"{list(shape)} from config.json; the checkpoint and its config disagree"
            )
    return infos


def _existing_store(out: Path, src: Path, fingerprint: str) -> bool:
    """True if `out` is this checkpoint's store; False if absent or empty; otherwise an error."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; choose another store directory")
    if not any(out.iterdir()):
        return False
    if not is_store(out):
        raise ConfigError(f"{out} is not empty and is not a strata store; choose an empty or new directory")
    if read_index(out).source_fingerprint != fingerprint:
        raise StaleStoreError(
            f"{out} holds a store of a different checkpoint (or of an older {src}); delete it and re-run "
            f"`strata convert {src} {out}`"
        )
    ExpertStore.open(out).close()  # the same store: check its files are all there (sizes only, cheap)
    return True


# --- CLI bodies -----------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    """`strata convert MODEL STORE_DIR`."""
    out, wrote = _convert(args.model, args.store, progress=True)
    idx = read_index(out)
    what = f"{len(idx.blobs)} experts in {len(idx.moe_layers)} layers, {idx.slot_bytes} bytes a slot"
    print(f"wrote the store {out} ({what})" if wrote else f"{out} is already the store of {args.model} ({what})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """`strata verify STORE_DIR`: 0 when every object's checksum holds, else 2 naming every damaged one."""
    directory = Path(args.store).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such store directory")
    with ExpertStore(directory, read_index(directory)) as store:  # not open(): verify reports bad files itself
        damaged = store.verify(progress=True)
        idx = store.index
    if not damaged:
        chunks = sum(t.num_chunks for t in idx.tables.values())
        print(f"{directory}: sound ({len(idx.blobs)} experts, {len(idx.tables)} tables / {chunks} chunks, "
              f"{len(idx.dense.tensor_checksums) if idx.dense else 0} dense tensors)")
        return 0
    for name in damaged:
        print(f"damaged: {name}")
    print(f"strata: error: {directory}: {len(damaged)} damaged object(s); delete the store and re-run "
          "`strata convert`", file=sys.stderr)
    return 2
