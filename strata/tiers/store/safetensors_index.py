"""Safetensors headers parsed by hand: every tensor known by file, absolute offset, dtype and shape.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the data. A
tensor's absolute offset is `8 + N + data_offsets[0]`. Indexing a 100+ GB checkpoint reads only the
JSON headers (KiBs to a few MiB in all), so `TensorIndex.from_dir` takes well under a second; weights
are read later by offset (`os.preadv`) straight into the destination tensor, one tensor at a time:
never a whole shard, and never through mmap, whose page faults and resident-memory accounting are
unpredictable for files far larger than RAM.
"""

from __future__ import annotations

import gc
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.errors import CheckpointError, UnsupportedError

# safetensors dtype string -> (torch dtype, bytes per element): the dtypes strata loads
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
}
# bits per element of every dtype the safetensors format defines, so headers of checkpoints we cannot
# load yet (FP8, MXFP4, int buffers) can still be validated and summarised
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
# dtypes that are valid safetensors but not weights strata computes with yet
KNOWN_UNSUPPORTED = set(DTYPE_BITS) - set(DTYPES)
# dtypes read as raw bytes for quantized weights: block-scaled FP8 values (their `*_scale_inv` beside them) and
# MXFP4's packed e2m1 blocks and e8m0 scales (`*_blocks`, `*_scales`); strata.kernels.quant dequantizes them
RAW_DTYPES: dict[str, torch.dtype] = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8,
                                      "F8_E8M0": torch.float8_e8m0fnu}  # (e8m0 FP8 block scales: DeepSeek-V4's)
# integer tensors read as they are: lookup tables such as DeepSeek-V4's hash routes (`mlp.gate.tid2eid`)
INT_DTYPES: dict[str, torch.dtype] = {"I64": torch.int64, "I32": torch.int32}
FP8_SCALE = "_scale_inv"  # FP8 weight `x.weight` has its block scales in `x.weight_scale_inv`
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"  # MXFP4 tensor `x` is `x_blocks` [N, K/32, 16] + `x_scales` [N, K/32]
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit
INDEX_NAME = "model.safetensors.index.json"
_CORRUPT = "the file is corrupt: re-download or re-save it"
# bytes per preadv call: Linux returns at most ~2 GiB per call anyway; smaller chunks keep every
# platform's read() limits happy. A module constant so tests can shrink it to exercise the loop.
_READ_CHUNK = 1 << 30


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk."""

    name: str
    file: Path
    offset: int  # absolute byte offset in `file`
    nbytes: int
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def supported(self) -> bool:
        """Whether strata can load this tensor's dtype."""
        return self.dtype in DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype to load as; `UnsupportedError` for FP8 and other dtypes strata cannot load as they are."""
        if self.dtype not in DTYPES:
            raise _unsupported_dtype(self)
        return DTYPES[self.dtype][0]

    @property
    def raw_dtype(self) -> torch.dtype:
        """The torch dtype its bytes are read as: a loadable dtype, or a quantized weight's (`RAW_DTYPES`)."""
        if self.dtype in DTYPES:
            return DTYPES[self.dtype][0]
        if self.dtype in RAW_DTYPES:
            return RAW_DTYPES[self.dtype]
        if self.dtype in INT_DTYPES:
            return INT_DTYPES[self.dtype]
        raise _unsupported_dtype(self)


def _unsupported_dtype(info: TensorInfo, count: int = 1) -> UnsupportedError:
    others = f" (and {count - 1} more tensors)" if count > 1 else ""
    if info.dtype == "F8_E4M3":
        why = ("FP8 weights are read with their block scales (`weight` + `weight_scale_inv`), not as they are; load the "
               "checkpoint with strata (Checkpoint.open)")
    elif info.dtype.startswith("F8"):
        why = "strata reads FP8 weights in e4m3 with float block scales only; use a BF16 checkpoint of the model"
    elif info.dtype in ("F4", "F6_E2M3", "F6_E3M2"):
        why = "4/6-bit float (MXFP4/NVFP4) checkpoints are not yet supported; use a BF16 checkpoint of the model"
    else:
        why = "strata loads only BF16, F16 and F32 weights; use a BF16 checkpoint of the model"
    return UnsupportedError(f"{info.file}: tensor {info.name!r}{others} has dtype {info.dtype}: {why}")


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a tensor named twice would silently shadow the first, so reject it."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _parse_entry(path: Path, name: str, meta: object, data_start: int, size: int) -> TensorInfo:
    """Validate one header entry and turn it into a TensorInfo.

    Written for speed (checkpoints have up to ~100k tensors and `strata inspect` must stay well under
    a second): exact type checks, a plain loop, and error text built only when there is an error.
    """
    if type(meta) is not dict:
        raise _malformed(path, name, "not a JSON object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if type(dtype) is not str:
        raise _malformed(path, name, "no dtype" if dtype is None else f"dtype {dtype!r}")
    if type(shape) is not list:
        raise _malformed(path, name, "no shape" if shape is None else f"shape {shape!r}")
    numel = 1
    for d in shape:
        if type(d) is not int or d < 0:  # `type(...) is int` also rejects JSON true/false
            raise _malformed(path, name, f"shape {shape!r}")
        numel *= d
    if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
        raise _malformed(path, name, "no data_offsets" if offsets is None else f"data_offsets {offsets!r}")
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}; the file is corrupt or too new")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise _malformed(path, name, f"data_offsets [{begin}, {end}] are reversed or negative")
    need = (numel * bits + 7) // 8
    if end - begin != need:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but shape {shape} of {dtype} needs {need}; {_CORRUPT}"
        )
    if data_start + end > size:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at byte {data_start + end}, past the end of the file ({size} bytes); "
            "the file is truncated: re-download or re-save it"
        )
    return TensorInfo(name, path, data_start + begin, need, dtype, tuple(shape))


def _malformed(path: Path, name: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({what}); {_CORRUPT}")


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building ~100k small dicts: they hold no cycles, and the collections
    they would trigger otherwise double the time to index a large checkpoint."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _parse_json(path: Path, raw: bytes) -> dict:
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        # a tensor named twice would silently shadow the first; every entry has exactly one
        # "data_offsets" key, so more occurrences than entries means a duplicate (or a stray metadata
        # string): only then pay for the slow hook-based parse that names the culprit
        if raw.count(b'"data_offsets"') > len(header) - ("__metadata__" in header):
            json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise CheckpointError(f"{path}: safetensors header lists {e.args[0]!r} twice; {_CORRUPT}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({msg}); {_CORRUPT}") from e
    return header


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header; check every tensor lies inside the file and none overlap.

    Reads only the 8-byte length and the JSON header, never the data.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file ({size} bytes, too short for a header); re-download it"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: header length {n} is over the format's {MAX_HEADER_BYTES}-byte limit; "
                    "this is not a safetensors file or it is corrupt"
                )
            if 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} runs past the end of the file ({size} bytes); "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from e
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    with _gc_paused():
        header = _parse_json(path, raw)
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = _parse_entry(path, name, meta, data_start, size)
    # tensors must not share bytes; zero-size tensors own no bytes, so they cannot overlap anything
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out.values() if t.nbytes)
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:], strict=False):
        if begin < prev_end:
            raise CheckpointError(f"{path}: tensors {prev!r} and {name!r} overlap (data_offsets collide); {_CORRUPT}")
    return out


class TensorIndex:
    """All tensors of a checkpoint directory, from one or many safetensors shards."""

    def __init__(self, tensors: dict[str, TensorInfo]):
        self.tensors = tensors

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> TensorIndex:
        """Index `model.safetensors.index.json` (when present) or every `*.safetensors` in `directory`.

        `directory` may also be a single `.safetensors` file.
        """
        directory = Path(directory)
        if directory.is_file():
            return cls(read_header(directory))
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        index_file = directory / INDEX_NAME
        if index_file.exists():
            return cls(_from_index(directory, index_file))
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files; point strata at a Hugging Face checkpoint")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_header(f).items():
                if name in tensors:
                    # without an index we cannot tell which copy is meant: refuse rather than guess
                    raise CheckpointError(
                        f"{f}: tensor {name!r} is also in {tensors[name].file.name}; remove the stray file "
                        f"or add a {INDEX_NAME}"
                    )
                tensors[name] = info
        return cls(tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"checkpoint has no tensor {name!r}; is the checkpoint complete?") from None

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def names(self) -> list[str]:
        """Every tensor name, in index/header order."""
        return list(self.tensors)

    def files(self) -> list[Path]:
        """The shard files that hold at least one indexed tensor, sorted."""
        return sorted({t.file for t in self.tensors.values()})

    def total_bytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes of tensor data of `names` (default: every tensor); headers not counted."""
        if names is None:
            return sum(t.nbytes for t in self.tensors.values())
        return sum(self[n].nbytes for n in names)

    def check_dtypes(self, names: Iterable[str] | None = None) -> None:
        """Raise now if any of `names` (default: all) has a dtype strata cannot load: `UnsupportedError`, or a
        `CheckpointError` naming an FP8 weight without its `*_scale_inv` or an MXFP4 half without its other half.

        Lets a loader fail before it allocates or reads anything. Block-scaled FP8 (`x.weight` F8_E4M3 beside
        `x.weight_scale_inv`) and MXFP4 (`x_blocks` + `x_scales`, U8) pass: they are read through their scales.
        """
        infos = list(self.tensors.values() if names is None else (self[n] for n in names))
        for t in infos:
            if t.dtype == "F8_E4M3" and t.name + FP8_SCALE not in self.tensors:
                raise CheckpointError(f"{t.file}: FP8 tensor {t.name!r} has no {t.name + FP8_SCALE!r} (its block "
                                      "scales); the checkpoint is incomplete: re-download it")
            if t.dtype == "U8" and t.name.endswith((MX_BLOCKS, MX_SCALES)):
                stem = t.name.removesuffix(MX_BLOCKS).removesuffix(MX_SCALES)
                other = stem + (MX_SCALES if t.name.endswith(MX_BLOCKS) else MX_BLOCKS)
                if other not in self.tensors:
                    raise CheckpointError(f"{t.file}: MXFP4 tensor {t.name!r} has no {other!r}; the checkpoint is "
                                          "incomplete: re-download it")
        bad = [t for t in infos if not t.supported and not _quantized_part(t) and t.dtype not in INT_DTYPES]
        if bad:
            # name the weight-like offender first: FP8 weights, not their F32 scales
            bad.sort(key=lambda t: (not t.dtype.startswith("F8"), t.name))
            raise _unsupported_dtype(bad[0], len(bad))

    def load(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read one tensor by offset (pread) and return it, converted to `dtype` on `device`."""
        t = read_tensor(self[name])
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device)


def _quantized_part(info: TensorInfo) -> bool:
    """Whether `info` is block-scaled FP8 values, e8m0 FP8 block scales or an MXFP4 half (their partners checked by
    `check_dtypes`)."""
    return (info.dtype == "F8_E4M3" or (info.dtype == "U8" and info.name.endswith((MX_BLOCKS, MX_SCALES)))
            or (info.dtype == "F8_E8M0" and info.name.endswith(FP8_SCALE)))


def _from_index(directory: Path, index_file: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not an object of tensor name -> shard file")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, KeyError):
            msg = f"no {msg} key"
        raise CheckpointError(f"{index_file}: not a valid safetensors index ({msg}); re-download it") from e
    headers: dict[str, dict[str, TensorInfo]] = {}
    for shard in sorted(set(weight_map.values())):
        if not (directory / shard).is_file():
            raise CheckpointError(
                f"{index_file}: names shard {shard!r}, which is missing from {directory}; the download is incomplete"
            )
        headers[shard] = read_header(directory / shard)
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise CheckpointError(
                f"{directory / shard}: tensor {name!r} listed in {index_file.name} is missing from the shard; "
                "re-download the shard"
            )
        tensors[name] = headers[shard][name]
    return tensors


def read_tensor(info: TensorInfo, out: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
    """Read exactly `info.nbytes` at `info.offset` straight into a CPU tensor (one copy: kernel -> tensor).

    `out`, when given, is a contiguous CPU tensor of the tensor's dtype and element count (e.g. a pinned
    staging buffer); it is filled and returned reshaped to `info.shape`. `raw`: quantized weights too, in their
    stored dtype (`RAW_DTYPES`), for the caller to dequantize with their scales.
    """
    dtype = info.raw_dtype if raw else info.torch_dtype  # raises UnsupportedError before any I/O
    if out is None:
        out = torch.empty(info.shape, dtype=dtype)
    elif out.dtype != dtype or out.numel() != math.prod(info.shape) or not out.is_contiguous() or out.is_cuda:
        raise ValueError(f"out must be a contiguous CPU {dtype} tensor of {math.prod(info.shape)} elements")
    if info.nbytes == 0:
        return out.view(info.shape)
    # a writable byte view of the tensor's own storage: preadv fills it with no intermediate buffer
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    try:
        with open(info.file, "rb", buffering=0) as f:
            done = 0
            while done < info.nbytes:
                got = os.preadv(f.fileno(), [view[done : done + _READ_CHUNK]], info.offset + done)
                if got <= 0:
                    raise CheckpointError(
                        f"{info.file}: unexpected end of file reading tensor {info.name!r}; "
                        "the file was truncated after it was indexed"
                    )
                done += got
    except OSError as e:
        raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r}: {e.strerror or e}") from e
    return out.view(info.shape)


def encode_header(tensors: list[tuple[str, str, tuple[int, ...], int]], align: int = 8) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding `tensors` (name, dtype, shape,
    nbytes) back to back in that order, padded with spaces so the data starts `align`-aligned."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    rel = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [rel, rel + nbytes]}
        rel += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return len(raw).to_bytes(8, "little") + raw
