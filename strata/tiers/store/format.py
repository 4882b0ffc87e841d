"""The tiered expert store's on-disk format: layout, index (store.msgpack) and source fingerprint.

A store is a directory that packs a checkpoint so that moving one expert is one aligned read:

    store.msgpack            the index below (written last: a directory without it is not a store)
    dense.safetensors        every non-expert tensor, real safetensors, names as in the checkpoint
    experts/layer-LLL.bin    one file per MoE layer: expert e's blob at offset e * slot_bytes
    tables/NAME.bin          row-addressable tables (Engram hashed n-gram tables), one per file
    config.json, tokenizer.json, ...   copies, so the directory is self-contained

A blob is one expert's payload, gate_up [2I, H] (gate rows, then up rows: transformers' fused
`gate_up_proj[e]`) and down [H, I] in the index's `expert_format`, laid out by
`strata.kernels.quant.ExpertLayout`: plain formats (the checkpoint's bf16/f16/f32) back to back, block-scaled
FP8 and MXFP4 as four 256-byte-aligned sections (values and scales of each matrix). The payload is
zero-padded to `slot_bytes` (a multiple of ALIGN), so every blob starts 4 KiB aligned (O_DIRECT, GPUDirect
Storage) and tiers can use fixed-size slots. Checksums are xxh3_64 of the payload (blobs), of each chunk of
rows (tables), of each tensor and the header (dense.safetensors) and of each copied file.

Index versions: 2 records the experts' format; 1 (plain formats only, no `expert_format` key) is still read.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch
import xxhash

from strata.errors import CheckpointError
from strata.kernels.quant import ExpertFormat, ExpertLayout

ALIGN = 4096
STORE_VERSION = 2  # written; READABLE_VERSIONS are read
READABLE_VERSIONS = (1, 2)
INDEX_NAME = "store.msgpack"
DENSE_NAME = "dense.safetensors"
EXPERTS_DIR = "experts"
TABLES_DIR = "tables"
CHECKSUM = "xxh3_64"
ROWS_PER_CHUNK = 4096
# the files copied verbatim from the checkpoint (whichever exist), so a store is self-contained
COPIED_FILES: tuple[str, ...] = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "special_tokens_map.json",
    "tiktoken.model", "tokenization_kimi.py",  # Kimi's tiktoken tokenizer: read as data (generation.tiktoken_vocab)
)  # fmt: skip
ExpertKey = tuple[int, int]  # (layer, expert)

# dtype strings (safetensors spelling) of expert blobs and tables -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}  # fmt: skip
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
EXPERT_DTYPES = ("BF16", "F16", "F32")
_TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def align_up(n: int, align: int = ALIGN) -> int:
    """The smallest multiple of `align` >= n."""
    return -(-n // align) * align


def checksum(data) -> int:
    """xxh3_64 of a buffer (bytes, memoryview, numpy array), as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(data)


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


def layer_file(layer: int) -> str:
    """The relative path of a MoE layer's blob file."""
    return f"{EXPERTS_DIR}/layer-{layer:03d}.bin"


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _is_int(x: object) -> bool:
    return type(x) is int


@dataclass
class BlobEntry:
    """Where one expert's blob lives: `length` payload bytes at an ALIGN-aligned `offset` of `file`."""

    layer: int
    expert: int
    file: str  # relative to the store directory
    offset: int
    length: int  # payload bytes (the slot on disk is the index's slot_bytes)
    checksum: int  # xxh3_64 of the payload

    def __post_init__(self) -> None:
        _check(all(_is_int(x) for x in (self.layer, self.expert, self.offset, self.length, self.checksum)),
               f"blob {self} has a non-integer field")
        _check(self.layer >= 0 and self.expert >= 0, f"blob ({self.layer}, {self.expert}) has a negative id")
        _check(self.offset >= 0 and self.offset % ALIGN == 0, f"blob ({self.layer}, {self.expert}) is not aligned")
        _check(self.length > 0 and 0 <= self.checksum < 1 << 64, f"blob ({self.layer}, {self.expert}) is malformed")
        _check(isinstance(self.file, str) and _safe_relpath(self.file), f"blob file {self.file!r} is not relative")

    @property
    def key(self) -> ExpertKey:
        return (self.layer, self.expert)


@dataclass
class TableEntry:
    """A row-addressable table: `num_rows` rows of `row_bytes` at an ALIGN-aligned `offset` of `file`.

    Row r lives at `offset + r * row_bytes`; rows [k * rows_per_chunk, (k + 1) * rows_per_chunk) form
    chunk k, whose bytes hash to `chunk_checksums[k]`, so a few rows are verified without the table.
    """

    name: str
    file: str
    offset: int
    num_rows: int
    row_bytes: int
    dtype: str  # element dtype (safetensors spelling); a row is `row_shape` elements of it
    row_shape: tuple[int, ...]
    rows_per_chunk: int
    chunk_checksums: list[int]

    def __post_init__(self) -> None:
        self.row_shape = tuple(self.row_shape)
        self.chunk_checksums = list(self.chunk_checksums)
        _check(isinstance(self.name, str) and bool(_TABLE_NAME.fullmatch(self.name)), f"bad table name {self.name!r}")
        _check(isinstance(self.file, str) and _safe_relpath(self.file), f"table file {self.file!r} is not relative")
        _check(self.dtype in TORCH_DTYPES, f"table {self.name!r} has unknown dtype {self.dtype!r}")
        ints = (self.offset, self.num_rows, self.row_bytes, self.rows_per_chunk, *self.row_shape)
        _check(all(_is_int(x) and x >= 0 for x in ints), f"table {self.name!r} has a malformed size")
        _check(self.offset % ALIGN == 0, f"table {self.name!r} is not aligned")
        _check(self.rows_per_chunk > 0 and self.row_bytes > 0, f"table {self.name!r} has empty rows or chunks")
        _check(self.row_bytes == math.prod(self.row_shape) * itemsize(self.dtype),
               f"table {self.name!r}: row_bytes {self.row_bytes} disagrees with {self.dtype} {list(self.row_shape)}")
        _check(len(self.chunk_checksums) == self.num_chunks and all(_is_int(c) for c in self.chunk_checksums),
               f"table {self.name!r} has {len(self.chunk_checksums)} chunk checksums, expected {self.num_chunks}")

    @property
    def num_chunks(self) -> int:
        return -(-self.num_rows // self.rows_per_chunk)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def chunk_rows(self, k: int) -> tuple[int, int]:
        """Rows [start, stop) of chunk k."""
        start = k * self.rows_per_chunk
        return start, min(start + self.rows_per_chunk, self.num_rows)


@dataclass
class DenseEntry:
    """dense.safetensors: its size, the checksum of its header and of each tensor's bytes."""

    file: str
    size: int
    data_start: int  # 8 + header length: tensor bytes begin here (ALIGN-aligned)
    header_checksum: int  # of bytes [0, data_start)
    tensor_checksums: dict[str, int]  # tensor name -> xxh3_64 of its bytes

    def __post_init__(self) -> None:
        _check(_is_int(self.size) and _is_int(self.data_start) and 8 <= self.data_start <= self.size,
               "dense file has a malformed size")
        _check(isinstance(self.tensor_checksums, dict), "dense tensor checksums are not a map")


@dataclass
class StoreIndex:
    """The contents of store.msgpack: what the store holds and where, with checksums."""

    source_fingerprint: str
    model_type: str
    num_layers: int
    moe_layers: list[int]  # layer ids with routed experts, ascending
    num_experts: int
    hidden: int
    moe_intermediate: int
    dtype: str  # plain formats: the experts' dtype ("BF16" | "F16" | "F32"); quantized formats: "U8" (raw blob bytes)
    payload_bytes: int  # the blob's bytes: ExpertLayout.build(expert_format, H, I).payload_bytes
    slot_bytes: int  # payload_bytes rounded up to ALIGN: every blob's size on disk
    blobs: dict[ExpertKey, BlobEntry] = field(default_factory=dict)
    tables: dict[str, TableEntry] = field(default_factory=dict)
    dense: DenseEntry | None = None
    copied_files: dict[str, int] = field(default_factory=dict)  # name -> xxh3_64 of its bytes
    version: int = STORE_VERSION
    expert_format: ExpertFormat | None = None  # None: plain in `dtype` (a version 1 index)
    _layout: ExpertLayout | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(self.version in READABLE_VERSIONS, f"store version {self.version!r}, this strata reads {READABLE_VERSIONS}")
        if self.expert_format is None:
            _check(self.dtype in EXPERT_DTYPES, f"expert dtype {self.dtype!r} is not one of {EXPERT_DTYPES}")
            self.expert_format = ExpertFormat("plain", self.dtype)
        fmt = self.expert_format
        _check(isinstance(fmt, ExpertFormat), f"expert format {fmt!r} is malformed")
        _check(self.dtype == expert_dtype(fmt), f"expert dtype {self.dtype!r} disagrees with the format {fmt.name}")
        dims = (self.num_layers, self.num_experts, self.hidden, self.moe_intermediate)
        _check(all(_is_int(x) and x > 0 for x in dims), "model dimensions must be positive integers")
        _check(list(self.moe_layers) == sorted(set(self.moe_layers))
               and all(_is_int(x) and 0 <= x < self.num_layers for x in self.moe_layers), "moe layer list is malformed")
        h, i = self.hidden, self.moe_intermediate
        self._layout = ExpertLayout.build(fmt, h, i)  # ValueError when the format cannot take these shapes
        _check(self.payload_bytes == self._layout.payload_bytes,
               f"payload_bytes {self.payload_bytes} is wrong for {fmt.name} experts of {h} x {i}")
        _check(self.slot_bytes == align_up(self.payload_bytes), f"slot_bytes {self.slot_bytes} is wrong")
        for key, blob in self.blobs.items():
            _check(key == blob.key and blob.length == self.payload_bytes, f"blob {key} has the wrong key or length")
        want = {(layer, e) for layer in self.moe_layers for e in range(self.num_experts)}
        _check(set(self.blobs) == want, f"the index lists {len(self.blobs)} blobs, expected {len(want)}")

    @property
    def layout(self) -> ExpertLayout:
        """Where an expert's tensors sit in its blob."""
        return self._layout

    @property
    def gate_up_bytes(self) -> int:
        """Bytes from a blob's start to the end of gate_up's sections (plain formats: gate_up itself)."""
        return self.layout.gate_up_bytes

    def file_sizes(self) -> dict[str, int]:
        """Every data file the index refers to -> the exact size its entries imply."""
        sizes: dict[str, int] = {}
        for b in self.blobs.values():
            sizes[b.file] = max(sizes.get(b.file, 0), b.offset + self.slot_bytes)
        for t in self.tables.values():
            sizes[t.file] = max(sizes.get(t.file, 0), t.offset + align_up(t.nbytes))
        if self.dense is not None:
            sizes[self.dense.file] = self.dense.size
        return sizes

    def to_bytes(self) -> bytes:
        """msgpack bytes; deterministic (same store -> same bytes: no paths, no times)."""
        d = {
            "format": "strata-store", "version": STORE_VERSION, "checksum": CHECKSUM,
            "source_fingerprint": self.source_fingerprint, "model_type": self.model_type,
            "num_layers": self.num_layers, "moe_layers": list(self.moe_layers), "num_experts": self.num_experts,
            "hidden": self.hidden, "moe_intermediate": self.moe_intermediate, "dtype": self.dtype,
            "expert_format": self.expert_format.to_dict(),
            "payload_bytes": self.payload_bytes, "slot_bytes": self.slot_bytes,
            "blobs": [vars(self.blobs[k]) for k in sorted(self.blobs)],
            "tables": [{**vars(t), "row_shape": list(t.row_shape)} for _, t in sorted(self.tables.items())],
            "dense": None if self.dense is None
            else {**vars(self.dense), "tensor_checksums": dict(sorted(self.dense.tensor_checksums.items()))},
            "copied_files": dict(sorted(self.copied_files.items())),
        }  # fmt: skip
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes, source: str = INDEX_NAME) -> StoreIndex:
        """Parse and validate store.msgpack; `CheckpointError` naming `source` when it is not a valid index."""
        fix = "re-run `strata convert` (or delete the store)"
        try:
            d = msgpack.unpackb(raw, raw=False)
            if not isinstance(d, dict) or d.get("format") != "strata-store":
                raise ValueError("not a strata store index")
            if d.get("version") not in READABLE_VERSIONS:
                raise CheckpointError(
                    f"{source}: store format version {d.get('version')!r}, this strata reads versions "
                    f"{' and '.join(map(str, READABLE_VERSIONS))}; {fix}"
                )
            if d.get("checksum") != CHECKSUM:
                raise ValueError(f"unknown checksum {d.get('checksum')!r}")
            blobs = [BlobEntry(**b) for b in d["blobs"]]
            tables = [TableEntry(**t) for t in d["tables"]]
            return cls(
                source_fingerprint=d["source_fingerprint"], model_type=d["model_type"],
                num_layers=d["num_layers"], moe_layers=d["moe_layers"], num_experts=d["num_experts"],
                hidden=d["hidden"], moe_intermediate=d["moe_intermediate"], dtype=d["dtype"],
                payload_bytes=d["payload_bytes"], slot_bytes=d["slot_bytes"],
                blobs={b.key: b for b in blobs}, tables={t.name: t for t in tables},
                dense=None if d["dense"] is None else DenseEntry(**d["dense"]),
                copied_files=d["copied_files"], version=d["version"],
                expert_format=ExpertFormat.from_dict(d["expert_format"]) if d["version"] >= 2 else None,
            )  # fmt: skip
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{source}: not a valid strata store index ({msg}); {fix}") from None


def expert_dtype(fmt: ExpertFormat) -> str:
    """The index's `dtype` for experts stored in `fmt`: a plain format's dtype, "U8" (raw bytes) for quantized ones."""
    return "U8" if fmt.quantized else fmt.dtype


def _safe_relpath(p: str) -> bool:
    return bool(p) and not p.startswith("/") and ".." not in p.split("/")


def checkpoint_fingerprint(checkpoint_dir: str | os.PathLike) -> str:
    """The identity of a checkpoint's weights, which keys its store: sha256 of each safetensors file's
    name, size, raw header and `FINGERPRINT_SAMPLES` 4 KiB windows spread evenly over its tensor data (sorted
    by name). Headers alone would give two checkpoints of one shape (a fine-tune, another seed) one store;
    the samples tell their weights apart while reading ~1 MiB a file. mtimes are ignored, so a copy is the
    same. config.json, the tokenizer and the other `COPIED_FILES` are not part of it: a store's copies of
    them follow the checkpoint (`StoreWriter.refresh_copies`)."""
    return _fingerprint(Path(checkpoint_dir), b"strata-fingerprint-3\0", with_config=False, samples=FINGERPRINT_SAMPLES)


def earlier_fingerprint(checkpoint_dir: str | os.PathLike) -> str:
    """The fingerprint stores converted by earlier strata versions carry: config.json's bytes, then the
    weights' headers. Such a store is taken over (its index rewritten) rather than converted again."""
    return _fingerprint(Path(checkpoint_dir), b"strata-fingerprint-1\0", with_config=True)


FINGERPRINT_SAMPLES = 256  # data windows hashed per safetensors file (4 KiB each)


def _fingerprint(directory: Path, tag: bytes, with_config: bool, samples: int = 0) -> str:
    h = hashlib.sha256(tag)

    def put(b: bytes) -> None:  # length-prefixed, so field boundaries cannot be confused
        h.update(len(b).to_bytes(8, "little") + b)

    try:
        if with_config:
            put((directory / "config.json").read_bytes())
        for path in sorted(directory.glob("*.safetensors")):
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                raw = f.read(min(n, 100 * 1024 * 1024))  # the format's header limit
                windows = _data_windows(f.fileno(), 8 + n, size, samples)
            put(path.name.encode())
            put(size.to_bytes(8, "little"))
            put(head + raw)
            put(windows)
    except OSError as e:
        raise CheckpointError(f"{getattr(e, 'filename', None) or directory}: cannot read: {e.strerror or e}") from e
    return h.hexdigest()


def _data_windows(fd: int, start: int, end: int, count: int, width: int = 4096) -> bytes:
    """`count` windows of `width` bytes at evenly spaced offsets of [start, end) (the last one ends at `end`)."""
    span = end - start
    if count <= 0 or span <= 0:
        return b""
    if span <= count * width:
        return os.pread(fd, span, start)
    step = (span - width) / (count - 1) if count > 1 else 0
    return b"".join(os.pread(fd, width, start + int(i * step)) for i in range(count))


def is_store(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a (finished) strata store: it has store.msgpack."""
    return (Path(directory) / INDEX_NAME).is_file()


def lacks_index(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a store's data (dense.safetensors, experts/) but no store.msgpack: not a
    checkpoint, and not a store either until it is converted again."""
    d = Path(directory)
    return not is_store(d) and ((d / DENSE_NAME).is_file() or (d / EXPERTS_DIR).is_dir())


def no_index_error(directory: str | os.PathLike) -> CheckpointError:
    """The one-line error for a directory that `lacks_index`."""
    return CheckpointError(f"{directory}: this store has no index ({INDEX_NAME}); re-run `strata convert` "
                           "from the checkpoint into it")


def read_index(directory: str | os.PathLike) -> StoreIndex:
    """Read and validate `directory`/store.msgpack (files are not checked: see ExpertStore.open)."""
    path = Path(directory) / INDEX_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if lacks_index(directory):
            raise no_index_error(directory) from None
        raise CheckpointError(f"{directory}: not a strata store (no {INDEX_NAME}); create one with `strata convert`") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from e
    return StoreIndex.from_bytes(raw, str(path))


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """pread until `buf` is full or EOF; returns the bytes read (short only at end of file)."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte memoryview of a contiguous CPU tensor's storage (pinned works too)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
