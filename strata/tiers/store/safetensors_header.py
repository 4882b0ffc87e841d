"""One safetensors file's header, parsed by hand and checked, and written: every tensor's absolute offset, dtype
and shape (`TensorInfo`), and the dtypes strata reads.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the data. A tensor's absolute
offset is `8 + N + data_offsets[0]`. Parsing reads only the length and the JSON, never the data.
"""

from __future__ import annotations

import gc
import json
import os
import struct
from collections.abc import Iterator
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
_CORRUPT = "the file is corrupt: re-download or re-save it"


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
            raise unsupported_dtype(self)
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
        raise unsupported_dtype(self)


def unsupported_dtype(info: TensorInfo, count: int = 1) -> UnsupportedError:
    """The error for `info`'s dtype, one strata cannot load as it is (`count` tensors have one), saying what to use."""
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
