"""`ExpertStore`: read experts (one aligned read each) and table rows from a converted store.

Reads go by `pread` into caller buffers (pinned staging buffers, tier slots), so a blob costs one
syscall and no intermediate copy; `expert_matrices` turns a blob buffer, on any device, into the
gate_up [2I, H] / down [H, I] matrices as stored (values and, for FP8 and MXFP4, scales: views, no copy),
and `expert_views` into the typed views plain formats' kernels take. Checksums are verified on read
unless the caller opts out (a tier that re-reads a blob it already verified).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from strata.errors import CheckpointError
from strata.kernels.quant import ExpertFormat, ExpertLayout, QuantMatrix
from strata.tiers.store.dense_check import verify_dense
from strata.tiers.store.format import (
    ALIGN,
    INDEX_NAME,
    TORCH_DTYPES,
    BlobEntry,
    ExpertKey,
    StoreIndex,
    TableEntry,
    byte_view,
    checkpoint_fingerprint,
    checksum,
    pread_into,
    read_index,
)

_FIX = "delete the store and re-run `strata convert`"


class StaleStoreError(CheckpointError):
    """The store was converted from a different checkpoint (or an older version of it)."""


def blob_label(blob: BlobEntry) -> str:
    """How errors and `verify` name a blob: `experts/layer-001.bin (layer 1, expert 5)`."""
    return f"{blob.file} (layer {blob.layer}, expert {blob.expert})"


class ExpertStore:
    """An opened store. `ExpertStore.open` validates it; the constructor trusts `index` (for verify)."""

    contiguous = True  # every blob is one slot of a file (kvikio reads and tmpfs mirrors copy them as they are)
    open_fix = _FIX  # what to do about a file of the store that cannot be opened

    @property
    def files_root(self) -> Path:
        """The folder the experts' files are named relative to (the store's own)."""
        return self.directory

    def __init__(self, directory: str | os.PathLike, index: StoreIndex):
        self.directory = Path(directory)
        self.index = index
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._verified_chunks: dict[str, set[int]] = {}  # table name -> chunk ids whose checksum held
        self._keys: tuple[ExpertKey, ...] | None = None  # `keys()`, sorted once

    @classmethod
    def open(cls, directory: str | os.PathLike, checkpoint_dir: str | os.PathLike | None = None) -> ExpertStore:
        """Open a store: check its index and that every file exists with the size the index implies;
        `StaleStoreError` if `checkpoint_dir` is given and is not the checkpoint the store was made from."""
        directory = Path(directory).expanduser()
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such store directory; create it with `strata convert`")
        index = read_index(directory)
        for rel, size in index.file_sizes().items():
            path = directory / rel
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing from the store; {_FIX}") from None
            if actual != size:
                raise CheckpointError(
                    f"{path}: {actual} bytes but the store index implies {size}; the file is truncated or damaged: {_FIX}"
                )
        if checkpoint_dir is not None and checkpoint_fingerprint(checkpoint_dir) != index.source_fingerprint:
            raise StaleStoreError(
                f"{directory}: stale store: it was converted from a different version of {checkpoint_dir}; re-run "
                f"`strata convert` into a new directory, or delete {directory} and convert again"
            )
        return cls(directory, index)

    # --- what is in it ------------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        return self.index.slot_bytes

    @property
    def payload_bytes(self) -> int:
        return self.index.payload_bytes

    @property
    def dtype(self) -> torch.dtype:
        """The experts' dtype: a plain format's; torch.uint8 (raw blob bytes) for FP8 and MXFP4, which no kernel may
        view as weights of one dtype (`expert_matrices`)."""
        return TORCH_DTYPES[self.index.dtype]

    @property
    def expert_format(self) -> ExpertFormat:
        """How the experts are stored: their checkpoint's dtype, block-scaled FP8 or MXFP4."""
        return self.index.expert_format

    @property
    def layout(self) -> ExpertLayout:
        """Where an expert's values and scales sit in its blob."""
        return self.index.layout

    @property
    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((2I, H), (H, I)): the shapes of gate_up and down."""
        i, h = self.index.moe_intermediate, self.index.hidden
        return (2 * i, h), (h, i)

    def keys(self) -> tuple[ExpertKey, ...]:
        """Every (layer, expert) in the store, sorted (made once: a decode step asks, via `all_resident`, and sorting
        6,144 keys of a 48-layer model each time took ~0.25 ms)."""
        if self._keys is None or len(self._keys) != len(self.index.blobs):
            self._keys = tuple(sorted(self.index.blobs))
        return self._keys

    def location(self, key: ExpertKey) -> tuple[Path, int, int]:
        """(file, offset, padded length) of a blob, for tiers that read by themselves (O_DIRECT, kvikio)."""
        blob = self._blob(key)
        return self.directory / blob.file, blob.offset, self.slot_bytes

    def extents(self, key: ExpertKey) -> list[tuple[Path, int, int, int]]:
        """The reads that fill `key`'s slot: (file, offset, bytes, offset in the slot); a packed blob is one read of
        its whole slot (an in-place store's expert is several, `strata.tiers.store.in_place`)."""
        path, offset, length = self.location(key)
        return [(path, offset, length, 0)]

    # --- experts --------------------------------------------------------------------------------------

    def read_expert(self, key: ExpertKey, out: torch.Tensor | None = None, verify: bool = True) -> torch.Tensor:
        """Read one blob (its whole slot, one aligned pread) into `out` (a contiguous CPU uint8 tensor of
        slot_bytes, e.g. pinned) or a new one; checksum-verified unless `verify=False`."""
        blob = self._blob(key)
        if out is None:
            out = torch.empty(self.slot_bytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() != self.slot_bytes:
            raise ValueError(f"out must be a contiguous CPU uint8 tensor of {self.slot_bytes} bytes")
        view = byte_view(out)
        path = self.directory / blob.file
        try:
            got = pread_into(self._fd(blob.file), view, blob.offset)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {blob_label(blob)}: {e.strerror or e}") from e
        if got != len(view):
            raise CheckpointError(f"{path}: {blob_label(blob)} runs past the end of the file; {_FIX}")
        if verify:
            self.verify_blob(key, out)
        return out

    def verify_blob(self, key: ExpertKey, buf: torch.Tensor) -> None:
        """Check a blob read by someone else (a tier's own O_DIRECT read) into a contiguous CPU uint8 `buf`;
        `CheckpointError` naming the file and (layer, expert) when its checksum does not hold."""
        blob = self._blob(key)
        if buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous() or buf.numel() < blob.length:
            raise ValueError(f"buf must be a contiguous CPU uint8 tensor of at least {blob.length} bytes")
        if checksum(byte_view(buf)[: blob.length]) != blob.checksum:
            raise CheckpointError(
                f"{self.directory / blob.file}: checksum mismatch in {blob_label(blob)}; the store is damaged: run "
                f"`strata verify {self.directory}`, then {_FIX}"
            )

    def expert_views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) typed views of a 1-D uint8 blob buffer on any device; no copy. Plain formats
        only (`TypeError` for FP8 and MXFP4: take `expert_matrices`)."""
        if self.expert_format.quantized:
            raise TypeError(f"{self.directory}: {self.expert_format.name} experts have no typed views; use "
                            "expert_matrices and dequantize")
        gate_up, down = self.layout.matrices(buf)
        return gate_up.values, down.values

    def expert_matrices(self, buf: torch.Tensor) -> tuple[QuantMatrix, QuantMatrix]:
        """(gate_up [2I, H], down [H, I]) of a 1-D uint8 blob buffer on any device as stored, in every format: values
        and (FP8, MXFP4) scales as views, no copy; `QuantMatrix.dequantize(dtype)` gives the weights."""
        return self.layout.matrices(buf)

    def load_layer_experts(
        self, layer: int, dtype: torch.dtype, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts of a MoE layer stacked, verified, in `dtype` on `device` (FP8 and MXFP4 dequantized):
        (gate_up [E, 2I, H], down [E, H, I]). Host memory beyond the result: one slot (and one expert dequantized)."""
        if layer not in self.index.moe_layers:
            raise KeyError(f"layer {layer} is not a MoE layer of the store (MoE layers: {self.index.moe_layers})")
        (a, b), (c, d) = self.expert_shapes
        n = self.index.num_experts
        gate_up = torch.empty(n, a, b, dtype=dtype, device=device)
        down = torch.empty(n, c, d, dtype=dtype, device=device)
        buf = torch.empty(self.slot_bytes, dtype=torch.uint8)
        quantized = self.expert_format.quantized
        for e in range(n):
            gu, dn = self.expert_matrices(self.read_expert((layer, e), out=buf))
            # plain: converts dtype and moves to device in one copy; quantized: dequantized in fp32 first
            gate_up[e].copy_(gu.dequantize(torch.float32) if quantized else gu.values)
            down[e].copy_(dn.dequantize(torch.float32) if quantized else dn.values)
        return gate_up, down

    # --- tables ---------------------------------------------------------------------------------------

    def read_rows(
        self, table: str, rows: Sequence[int] | torch.Tensor | np.ndarray, out: torch.Tensor | None = None,
        verify: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """Rows of a table as uint8 [n, row_bytes] (into `out` when given), reading only those rows.

        With `verify`, the first read of a row reads and checks its whole chunk once; the chunk is then
        remembered as verified and later rows of it are single preads (or one chunk read, when the rows
        asked for cover most of its pages).
        """
        t = self._table(table)
        idx = torch.as_tensor(np.asarray(rows, dtype=np.int64)).reshape(-1)
        n = idx.numel()
        if n and (int(idx.min()) < 0 or int(idx.max()) >= t.num_rows):
            raise IndexError(f"table {table!r}: row ids must be in [0, {t.num_rows})")
        if out is None:
            out = torch.empty(n, t.row_bytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() or out.shape != (n, t.row_bytes):
            raise ValueError(f"out must be a contiguous CPU uint8 tensor of shape [{n}, {t.row_bytes}]")
        fd, ov = self._fd(t.file), byte_view(out)
        verified = self._verified_chunks.setdefault(table, set())
        chunk_of = idx // t.rows_per_chunk
        order = torch.argsort(chunk_of, stable=True)  # group the rows by chunk in one sort
        ks, counts = torch.unique_consecutive(chunk_of[order], return_counts=True)
        for k, pos in zip(ks.tolist(), torch.split(order, counts.tolist()), strict=True):
            # pos: the positions in `out` of the requested rows that live in chunk k
            start, stop = t.chunk_rows(k)
            check = verify and k not in verified
            # one read of the whole chunk beats a pread per row once the rows cover its pages
            if check or len(pos) * max(t.row_bytes, ALIGN) >= (stop - start) * t.row_bytes:
                chunk = self.read_chunk(t, k, check)  # [stop - start, row_bytes]
                out[pos] = chunk[idx[pos] - start]
                if check:
                    verified.add(k)
                continue
            for p, r in zip(pos.tolist(), idx[pos].tolist(), strict=True):
                got = pread_into(fd, ov[p * t.row_bytes : (p + 1) * t.row_bytes], t.offset + r * t.row_bytes)
                if got != t.row_bytes:
                    raise CheckpointError(f"{self.directory / t.file}: table {table!r} row {r} is past the end; {_FIX}")
        return out

    def rows_view(self, table: str, buf: torch.Tensor) -> torch.Tensor:
        """Typed view [n, *row_shape] of a uint8 [n, row_bytes] buffer from `read_rows`; no copy."""
        t = self._table(table)
        return buf.view(TORCH_DTYPES[t.dtype]).view(buf.shape[0], *t.row_shape)

    def read_chunk(self, t: TableEntry, k: int, check: bool = True) -> torch.Tensor:
        """Chunk `k` of table `t` as uint8 [rows in the chunk, row_bytes]; `check`: verify its checksum (a damaged
        or truncated chunk raises CheckpointError)."""
        start, stop = t.chunk_rows(k)
        buf = torch.empty(stop - start, t.row_bytes, dtype=torch.uint8)
        path = self.directory / t.file
        try:
            got = pread_into(self._fd(t.file), byte_view(buf), t.offset + start * t.row_bytes)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read table {t.name!r}: {e.strerror or e}") from e
        if got != buf.numel() or (check and checksum(byte_view(buf)) != t.chunk_checksums[k]):
            raise CheckpointError(f"{path}: {_chunk_label(t, k)} is damaged (truncated or checksum mismatch); {_FIX}")
        return buf

    # --- verify -----------------------------------------------------------------------------------------

    def verify(self, progress: bool = False) -> list[str]:
        """Check every object against its checksum; returns the names of damaged ones ([] when sound):
        missing or mis-sized files, blobs (and, for FP8 and MXFP4, blobs whose scales or values are not valid
        numbers of the recorded format), table chunks, dense.safetensors' header and tensors, copied files.
        The progress bar counts every byte of the index's objects once, read or skipped (a missing file)."""
        idx, damaged, missing = self.index, [], set()
        for rel, size in idx.file_sizes().items():
            path = self.directory / rel
            if not path.is_file():
                damaged.append(f"{rel}: missing")
                missing.add(rel)
            elif path.stat().st_size != size:
                damaged.append(f"{rel}: {path.stat().st_size} bytes, expected {size}")
        total = len(idx.blobs) * idx.payload_bytes + sum(t.nbytes for t in idx.tables.values())
        total += idx.dense.size if idx.dense else 0
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", disable=not progress)
        try:
            if idx.dense is not None and idx.dense.file not in missing:
                damaged += verify_dense(self.directory, idx.dense, bar.update)
            elif idx.dense is not None:
                bar.update(idx.dense.size)
            buf = np.empty(idx.payload_bytes, dtype=np.uint8)
            for key in self.keys():
                blob = idx.blobs[key]
                if blob.file not in missing:
                    got = pread_into(self._fd(blob.file), memoryview(buf), blob.offset)
                    if got != blob.length or checksum(buf) != blob.checksum:
                        damaged.append(blob_label(blob))
                    elif (problem := format_problem(idx.layout, torch.from_numpy(buf))) is not None:
                        damaged.append(f"{blob_label(blob)}: {problem}")
                bar.update(blob.length)
            for t in idx.tables.values():
                for k in range(t.num_chunks):
                    if t.file not in missing:
                        try:
                            self.read_chunk(t, k)
                        except CheckpointError:
                            damaged.append(_chunk_label(t, k))
                    start, stop = t.chunk_rows(k)
                    bar.update((stop - start) * t.row_bytes)
        finally:
            bar.close()
        for name, want in idx.copied_files.items():
            path = self.directory / name
            if not path.is_file():
                damaged.append(f"{name}: missing")
            elif checksum(path.read_bytes()) != want:
                damaged.append(f"{name}: checksum mismatch")
        return damaged

    # --- plumbing -------------------------------------------------------------------------------------

    def _blob(self, key: ExpertKey) -> BlobEntry:
        try:
            return self.index.blobs[tuple(key)]
        except KeyError:
            raise KeyError(f"the store {self.directory} has no expert (layer, expert) = {tuple(key)}") from None

    def _table(self, name: str) -> TableEntry:
        try:
            return self.index.tables[name]
        except KeyError:
            raise KeyError(f"the store {self.directory} has no table {name!r} (tables: {sorted(self.index.tables)})") from None

    def _fd(self, rel: str) -> int:
        """A cached read-only fd per file (`rel` below `files_root`): pread is thread-safe, so tiers share them."""
        fd = self._fds.get(rel)
        if fd is None:
            with self._lock:
                fd = self._fds.get(rel)
                if fd is None:
                    path = self.files_root / rel
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as e:
                        raise CheckpointError(f"{path}: cannot open: {e.strerror or e}; {self.open_fix}") from e
                    self._fds[rel] = fd
        return fd

    def stop_verification(self) -> None:
        """Stop a background verification pass; a packed store runs none (its scrub is the tier manager's jobs)."""

    def close(self) -> None:
        """Close the cached file descriptors (reads reopen them)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fds", None):
            self.close()

    def __repr__(self) -> str:
        i = self.index
        return (f"ExpertStore({str(self.directory)!r}, {i.model_type}, {len(i.blobs)} experts of {i.slot_bytes} B, "
                f"{len(i.tables)} tables; index {INDEX_NAME})")


def format_problem(layout: ExpertLayout, buf: torch.Tensor) -> str | None:
    """Why blob `buf` (1-D uint8) is not an expert in `layout`'s quantized format, or None: FP8 block scales must be
    finite and positive and no FP8 value NaN; an MXFP4 scale of 255 is NaN in e8m0. (A checksum that holds over such
    bytes means the store was written wrong, not damaged since.) A GGUF blob's header must name, for each of gate,
    up and down, a block type the store's format lists for it."""
    fmt = layout.fmt
    if not fmt.quantized:
        return None
    if fmt.kind == "gguf":
        from strata.kernels.gguf_blocks import BY_ID

        ids = buf[:3].tolist()  # the blob's header: gate, up and down's ggml type ids
        for what, type_id, allowed in zip(("gate", "up", "down"), ids, fmt.ggml, strict=True):
            if type_id not in BY_ID or BY_ID[type_id].name not in allowed:
                return f"{what} has ggml type id {type_id}, not one of the store's {'/'.join(allowed)}"
        return None
    for what, m in zip(("gate_up", "down"), layout.matrices(buf), strict=True):
        if fmt.kind == "fp8":
            if not bool((torch.isfinite(m.scales) & (m.scales > 0)).all()):
                return f"{what} has fp8 block scales that are not finite and positive"
            if bool(((m.values & 0x7F) == 0x7F).any()):  # e4m3fn's only NaN codes: 0x7F, 0xFF
                return f"{what} has NaN fp8 values"
        elif bool((m.scales == 255).any()):
            return f"{what} has NaN mxfp4 scales (e8m0 255)"
    return None


def _chunk_label(t: TableEntry, k: int) -> str:
    start, stop = t.chunk_rows(k)
    return f"{t.file} (table {t.name!r}, rows {start}-{stop - 1})"
