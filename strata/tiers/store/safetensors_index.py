"""A checkpoint's tensors: the safetensors shards of a directory indexed by tensor name (through
`model.safetensors.index.json` when there is one), each tensor read by its offset.

Indexing a 100+ GB checkpoint reads only the JSON headers (KiBs to a few MiB in all;
strata.tiers.store.safetensors_header), so `TensorIndex.from_dir` takes well under a second; weights are read later by
offset (`os.preadv`) straight into the destination tensor, one tensor at a time: never a whole shard, and never
through mmap, whose page faults and resident-memory accounting are unpredictable for files far larger than RAM.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from strata.errors import CheckpointError
from strata.tiers.store.safetensors_header import (  # noqa: F401 - DTYPE_BITS, MAX_HEADER_BYTES: tests read them here
    DTYPE_BITS,
    FP8_SCALE,
    INT_DTYPES,
    MAX_HEADER_BYTES,
    MX_BLOCKS,
    MX_SCALES,
    TensorInfo,
    read_header,
    unsupported_dtype,
)

INDEX_NAME = "model.safetensors.index.json"
# bytes per preadv call: Linux returns at most ~2 GiB per call anyway; smaller chunks keep every
# platform's read() limits happy. A module constant so tests can shrink it to exercise the loop.
_READ_CHUNK = 1 << 30


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
            raise unsupported_dtype(bad[0], len(bad))

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
