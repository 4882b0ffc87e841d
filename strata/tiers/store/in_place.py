"""Experts served from a checkpoint's own files: the in-place index and the store that reads through it.

An in-place store is a directory in the cache that holds no weights:

    in-place.msgpack           the index below (written last, atomically)
    in-place-verified.msgpack  the parts' checksums, per source file (strata.tiers.store.part_record)

The index records every routed expert as its parts, `Part(file, offset, length, at)`: `length` bytes at `offset`
of a source file (relative to the checkpoint directory) that belong at byte `at` of the expert's blob in the
layout the compute expects (`strata.kernels.quant.ExpertLayout`: gate rows, up rows, down; FP8 values and
scales in their sections). A per-expert checkpoint gives gate, up and down (and their `_scale_inv`); a fused one
gives slices of `experts.gate_up_proj` and `experts.down_proj`. Dense tensors are recorded as parts too
(`at` 0). Part records are general (a tensor's bytes in a file), so any container with known offsets can be
indexed the same way. The index also keeps each source file's identity (size, mtime, inode) when it was built:
a file whose identity moved is refused (or re-verified on request) before anything is read from it.

Reading an expert is one read per run of parts that are contiguous in both the file and the blob; the bytes
between sections stay zero. A tier reads with `DiskReader.read_parts` (O_DIRECT through aligned windows).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import torch
from tqdm.auto import tqdm

from strata.errors import CheckpointError
from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.tiers.store.files import fsync_dir
from strata.tiers.store.format import (
    ExpertKey,
    align_up,
    byte_view,
    checksum,
    expert_dtype,
    pread_into,
)
from strata.tiers.store.part_record import PartRecord, low_priority
from strata.tiers.store.store import ExpertStore, format_problem

IN_PLACE_INDEX = "in-place.msgpack"
IN_PLACE_VERSION = 1
Extent = tuple[Path, int, int, int]  # (absolute file, offset in it, bytes, offset in the blob)


@dataclass(frozen=True)
class Part:
    """`length` bytes at `offset` of `file` (relative to the checkpoint) that belong at byte `at` of a blob."""

    file: str
    offset: int
    length: int
    at: int
    tensor: str  # the checkpoint tensor (or slice of one) the bytes are, for errors

    def label(self) -> str:
        return f"{self.file} bytes {self.offset}..{self.offset + self.length} ({self.tensor})"


@dataclass(frozen=True)
class SourceFile:
    """A source file's identity when the index was built."""

    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> SourceFile:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class InPlaceIndex:
    """What an in-place store serves and where each part of it is in the checkpoint's files."""

    source_dir: str  # the checkpoint directory (absolute)
    source_fingerprint: str  # names this store (tmpfs mirrors, logs): a hash of the files' names and identities
    model_type: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    hidden: int
    moe_intermediate: int
    expert_format: ExpertFormat
    files: dict[str, SourceFile]
    experts: dict[ExpertKey, tuple[Part, ...]]
    dense_parts: dict[str, Part] = field(default_factory=dict)
    tables: dict = field(default_factory=dict)  # (Engram tables are served from packed stores only)
    dense = None  # (no dense.safetensors: dense tensors are read from the checkpoint)
    version: int = IN_PLACE_VERSION

    def __post_init__(self) -> None:
        self.layout = ExpertLayout.build(self.expert_format, self.hidden, self.moe_intermediate)
        want = {(layer, e) for layer in self.moe_layers for e in range(self.num_experts)}
        if set(self.experts) != want:
            raise ValueError(f"the in-place index lists {len(self.experts)} experts, expected {len(want)}")
        for key, parts in self.experts.items():
            for p in parts:
                if p.file not in self.files or p.at + p.length > self.payload_bytes or p.offset + p.length > self.files[p.file].size:
                    raise ValueError(f"expert {key}: part {p.label()} lies outside its file or blob")

    # the attributes tiers and the planner read from a packed store's index
    @property
    def blobs(self) -> dict[ExpertKey, tuple[Part, ...]]:
        return self.experts

    @property
    def payload_bytes(self) -> int:
        return self.layout.payload_bytes

    @property
    def slot_bytes(self) -> int:
        return align_up(self.payload_bytes)

    @property
    def gate_up_bytes(self) -> int:
        return self.layout.gate_up_bytes

    @property
    def dtype(self) -> str:
        return expert_dtype(self.expert_format)

    def file_sizes(self) -> dict[str, int]:
        return {}  # no data files of its own

    def all_parts(self) -> list[Part]:
        """Every part (experts' and dense tensors'), in file order: what the verification pass reads."""
        parts = {(p.file, p.offset, p.length): p for ps in self.experts.values() for p in ps}
        parts.update({(p.file, p.offset, p.length): p for p in self.dense_parts.values()})
        return [parts[k] for k in sorted(parts)]

    def to_bytes(self) -> bytes:
        def part(p: Part) -> list:
            return [p.file, p.offset, p.length, p.at, p.tensor]

        d = {
            "format": "strata-in-place", "version": IN_PLACE_VERSION, "source_dir": self.source_dir,
            "source_fingerprint": self.source_fingerprint, "model_type": self.model_type,
            "num_layers": self.num_layers, "moe_layers": list(self.moe_layers), "num_experts": self.num_experts,
            "hidden": self.hidden, "moe_intermediate": self.moe_intermediate,
            "expert_format": self.expert_format.to_dict(),
            "files": {n: [f.size, f.mtime_ns, f.ino] for n, f in sorted(self.files.items())},
            "experts": [[k[0], k[1], [part(p) for p in self.experts[k]]] for k in sorted(self.experts)],
            "dense": {n: part(p) for n, p in sorted(self.dense_parts.items())},
        }  # fmt: skip
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes, source: str) -> InPlaceIndex:
        """Parse and validate an in-place index; `CheckpointError` naming `source` when it is not one."""
        try:
            d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            if not isinstance(d, dict) or d.get("format") != "strata-in-place" or d.get("version") != IN_PLACE_VERSION:
                raise ValueError("not a strata in-place index of this version")
            return cls(
                source_dir=d["source_dir"], source_fingerprint=d["source_fingerprint"], model_type=d["model_type"],
                num_layers=d["num_layers"], moe_layers=d["moe_layers"], num_experts=d["num_experts"],
                hidden=d["hidden"], moe_intermediate=d["moe_intermediate"],
                expert_format=ExpertFormat.from_dict(d["expert_format"]),
                files={n: SourceFile(*f) for n, f in d["files"].items()},
                experts={(k0, k1): tuple(Part(*p) for p in ps) for k0, k1, ps in d["experts"]},
                dense_parts={n: Part(*p) for n, p in d["dense"].items()},
            )  # fmt: skip
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{source}: not a valid in-place index ({msg}); delete it, strata rebuilds it") from None


def write_in_place_index(directory: Path, index: InPlaceIndex) -> None:
    """Write `directory`/in-place.msgpack atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{IN_PLACE_INDEX}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(index.to_bytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / IN_PLACE_INDEX)
    fsync_dir(directory)


def read_in_place_index(directory: Path) -> InPlaceIndex | None:
    """The index in `directory`, or None when there is none."""
    path = directory / IN_PLACE_INDEX
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from e
    return InPlaceIndex.from_bytes(raw, str(path))


def changed_files(index: InPlaceIndex) -> list[str]:
    """The source files whose identity (size, mtime, inode) is not what the index recorded (missing ones too)."""
    out = []
    for name, want in sorted(index.files.items()):
        try:
            have = SourceFile.of(Path(index.source_dir) / name)
        except OSError:
            have = None
        if have != want:
            out.append(name)
    return out


def changed_error(index: InPlaceIndex, name: str) -> CheckpointError:
    """The one-line refusal of a source file that changed since it was indexed and verified."""
    return CheckpointError(f"{Path(index.source_dir) / name}: changed since strata indexed it (size, mtime or inode "
                           "differ); restore the file, or set [store] reverify = true to verify it again")


class InPlaceStore(ExpertStore):
    """An expert store whose experts are read from the checkpoint's own files, through an `InPlaceIndex`."""

    contiguous = False  # an expert is several parts, not one slot of a file: no kvikio reads, no tmpfs mirror
    open_fix = "restore the checkpoint's file (or re-download it)"

    @property
    def files_root(self) -> Path:
        """The checkpoint's folder: its own files hold the experts."""
        return self.source

    def __init__(self, directory: str | os.PathLike, index: InPlaceIndex):
        super().__init__(directory, index)  # type: ignore[arg-type]  (the index has a packed index's attributes)
        self.source = Path(index.source_dir)
        self.record = PartRecord(self.directory, index.files)
        self._extents: dict[ExpertKey, list[Extent]] = {}
        self._verifier: threading.Thread | None = None
        self._stop_verifying = threading.Event()
        self._progress = [0, 0]  # bytes of parts verified, of all parts
        self.pass_damaged: list[str] = []

    @classmethod
    def open(cls, directory: str | os.PathLike, checkpoint_dir: str | os.PathLike | None = None) -> InPlaceStore:
        """Open the in-place store in `directory`: its index, and every source file unchanged since it was built
        (a changed one is refused with `changed_error`)."""
        directory = Path(directory)
        index = read_in_place_index(directory)
        if index is None:
            raise CheckpointError(f"{directory}: no in-place index ({IN_PLACE_INDEX}); load the checkpoint to build it")
        changed = changed_files(index)
        if changed:
            raise changed_error(index, changed[0])
        return cls(directory, index)

    # --- reads ----------------------------------------------------------------------------------------

    def extents(self, key: ExpertKey) -> list[Extent]:
        """The reads that fill `key`'s blob: its parts, those contiguous in both the file and the blob merged."""
        out = self._extents.get(key)
        if out is None:
            out = []
            for p in sorted(self._blob(key), key=lambda p: p.at):
                path = self.source / p.file
                if out and out[-1][0] == path and out[-1][1] + out[-1][2] == p.offset and out[-1][3] + out[-1][2] == p.at:
                    out[-1] = (path, out[-1][1], out[-1][2] + p.length, out[-1][3])
                else:
                    out.append((path, p.offset, p.length, p.at))
            self._extents[key] = out
        return out

    def location(self, key: ExpertKey) -> tuple[Path, int, int]:
        raise TypeError(f"{self.source}: an expert read in place is several parts; read it with `extents`")

    def read_expert(self, key: ExpertKey, out: torch.Tensor | None = None, verify: bool = True) -> torch.Tensor:
        """Read one expert's parts into `out` (a contiguous CPU uint8 tensor of slot_bytes) or a new one, the bytes
        between sections zero; checked against the parts' checksums unless `verify=False`."""
        if out is None:
            out = torch.zeros(self.slot_bytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() != self.slot_bytes:
            raise ValueError(f"out must be a contiguous CPU uint8 tensor of {self.slot_bytes} bytes")
        else:
            zero_gaps(out, self.extents(key))
        view = byte_view(out)
        for path, offset, length, at in self.extents(key):
            try:
                got = pread_into(self._fd(str(path.relative_to(self.source))), view[at : at + length], offset)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot read (layer {key[0]}, expert {key[1]}): {e.strerror or e}") from e
            if got != length:
                raise CheckpointError(f"{path}: ends before (layer {key[0]}, expert {key[1]}); the file is truncated")
        if verify:
            self.verify_blob(key, out)
        return out

    def verify_blob(self, key: ExpertKey, buf: torch.Tensor) -> None:
        """Check every part of `key` in `buf` against its recorded checksum; a part never checksummed before gets its
        checksum recorded now (and, FP8 or MXFP4, the blob's scales checked). `CheckpointError` naming the file, the
        byte range, the tensor and (layer, expert) on a mismatch."""
        data = buf.numpy()
        fresh = False
        for p in self._blob(key):
            got = checksum(data[p.at : p.at + p.length])
            want = self.record.get(p)
            if want is None:
                self.record.put(p, got)
                fresh = True
            elif want != got:
                raise CheckpointError(
                    f"{self.source / p.file}: checksum mismatch in bytes {p.offset}..{p.offset + p.length} "
                    f"({p.tensor}, layer {key[0]}, expert {key[1]}); the file is damaged: restore it (re-download)")
        if fresh and (problem := format_problem(self.layout, buf[: self.payload_bytes])) is not None:
            raise CheckpointError(f"{self.source}: (layer {key[0]}, expert {key[1]}): {problem}; the file is damaged")
        self.record.save(force=False)

    # --- the verification pass -------------------------------------------------------------------------

    def verify(self, progress: bool = False) -> list[str]:
        """Read every part (experts' and dense tensors') and check it against its recorded checksum, recording those
        never checksummed; returns the damaged ones ([] when sound)."""
        return self._pass(self.index.all_parts(), recheck=True, progress=progress)

    def start_verification(self) -> threading.Thread:
        """The full verification pass in a background thread at the lowest CPU and I/O priority, resumable: parts
        whose checksum is recorded (by an earlier pass, or a first read) are skipped. `verification_progress` says
        how far it is; damaged parts land in `pass_damaged`."""
        if self._verifier is None:
            parts = self.index.all_parts()
            self._verifier = threading.Thread(target=self._background, args=(parts,), name="strata-verify", daemon=True)
            self._verifier.start()
        return self._verifier

    def stop_verification(self) -> None:
        """Stop the background pass (`start_verification`) after its current part, the checksums recorded so far kept
        (a later pass resumes there); the tiers that started it are closing."""
        self._stop_verifying.set()
        if self._verifier is not None:
            self._verifier.join(timeout=30)

    def verification_progress(self) -> tuple[int, int]:
        """(bytes of parts with a recorded checksum, bytes of all parts)."""
        parts = self.index.all_parts()
        return sum(p.length for p in parts if self.record.get(p) is not None), sum(p.length for p in parts)

    def _background(self, parts: list) -> None:
        low_priority()
        self.pass_damaged.extend(self._pass(parts, recheck=False, stop=self._stop_verifying))

    def _pass(self, parts: list[Part], recheck: bool, progress: bool = False,
              stop: threading.Event | None = None) -> list[str]:
        damaged, buf = [], np.empty(0, dtype=np.uint8)
        bar = tqdm(total=sum(p.length for p in parts), unit="B", unit_scale=True, desc="verify", disable=not progress)
        for p in parts:
            if stop is not None and stop.is_set():
                break
            bar.update(p.length)
            if not recheck and self.record.get(p) is not None:
                continue
            if buf.size < p.length:
                buf = np.empty(p.length, dtype=np.uint8)
            view = buf[: p.length]
            fd = self._fd(p.file)
            if pread_into(fd, memoryview(view), p.offset) != p.length:
                damaged.append(f"{p.label()}: past the end of the file")
                continue
            if hasattr(os, "posix_fadvise"):  # the pass reads each byte once: keep it out of the page cache
                os.posix_fadvise(fd, p.offset, p.length, os.POSIX_FADV_DONTNEED)
            got, want = checksum(view), self.record.get(p)
            if want is None:
                self.record.put(p, got)
            elif want != got:
                damaged.append(f"{p.label()}: checksum mismatch")
            self.record.save(force=False)
        bar.close()
        self.record.save(force=True)
        return damaged

    def close(self) -> None:
        """Save the checksums recorded so far, then close the files."""
        self.record.save(force=True)
        super().close()

    def __repr__(self) -> str:
        i = self.index
        return f"InPlaceStore({str(self.source)!r}, {i.model_type}, {len(i.experts)} experts of {self.slot_bytes} B)"


def zero_gaps(out: torch.Tensor, extents: list[Extent]) -> None:
    """Zero the bytes of `out` (a blob slot) that no extent fills: between sections and past the payload."""
    pos = 0
    for _, _, length, at in sorted(extents, key=lambda e: e[3]):
        if at > pos:
            out[pos:at].zero_()
        pos = max(pos, at + length)
    if pos < out.numel():
        out[pos:].zero_()


__all__ = ["IN_PLACE_INDEX", "InPlaceIndex", "InPlaceStore", "Part", "SourceFile", "changed_error",
           "changed_files", "read_in_place_index", "write_in_place_index", "zero_gaps"]
