"""Writing a demo checkpoint's random weights as safetensors shards, in parallel and straight to their offsets.

The architecture modules describe their tensors (`DemoTensor`s, or anything with `name`, `shape`, `dtype` and `nbytes`)
and how to make one; this writes them (`write_demo_files`: with the tokenizer, config.json and generation_config.json): greedy shards of at most `max_shard_bytes`, each shard's header first, then every tensor (or
every leading slice of it, so a bench layer's 1 GiB fused experts never sit in memory whole) on a thread pool with a
progress bar, and model.safetensors.index.json when there are several shards.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strata.errors import ConfigError
from strata.runtime.demo.configs import TOKENIZER_VOCAB, demo_generation_config
from strata.runtime.demo.tokenizer import write_tokenizer_files
from strata.runtime.demo.weights import write_safetensors_header
from strata.tiers.store.files import pwrite_all

TENSOR_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32, "U8": torch.uint8}


@dataclass(frozen=True)
class DemoTensor:
    """One checkpoint tensor of a demo model: name, shape, safetensors dtype, initialisation (each architecture's
    own kinds: "normal", "ones", ...). Tensors with `per_expert` are written one expert's slice (their first
    dimension) at a time."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "BF16"
    init: str = "normal"
    per_expert: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return TENSOR_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


def demo_layers(default: int, layers: int | None) -> int:
    """The layer count `--layers` asks for (None: the size's `default`); a one-line error unless a positive int."""
    n = default if layers is None else layers
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"--layers {layers!r} is invalid; use a positive integer")
    return n


def write_demo_files(tmp: Path, size: str, cfg: dict, write_weights: Callable[[Path], None]) -> None:
    """A demo checkpoint's files but its marker, into `tmp`: the demo tokenizer (its `size`'s vocabulary),
    config.json (`cfg`), generation_config.json, then the weights (`write_weights(tmp)`)."""
    write_tokenizer_files(tmp, TOKENIZER_VOCAB[size], cfg["max_position_embeddings"])
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    (tmp / "generation_config.json").write_text(json.dumps(demo_generation_config(), indent=2) + "\n",
                                                 encoding="utf-8")
    write_weights(tmp)


def write_shards(tmp: Path, tensors: Sequence[Any], make: Callable[[Any, int, int], torch.Tensor],
                 max_shard_bytes: int, progress: bool, workers: int | None, desc: str,
                 parts: Callable[[Any], int] = lambda t: 1, order_in_shard: Callable[[Any], int] | None = None) -> None:
    """Write `tensors` into `tmp`. `make(t, i, part)` gives part `part` of the `parts(t)` equal leading slices of
    tensor `t` (`i`: its position in `tensors`, which seeds it); `order_in_shard`: a sort key of the tensors within a
    shard (e.g. widest dtype first, so every tensor stays aligned), else their given order."""
    from tqdm.auto import tqdm

    order = {t.name: i for i, t in enumerate(tensors)}
    shards: list[list[Any]] = [[]]
    for t in tensors:  # greedy shards of at most max_shard_bytes
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + t.nbytes > max_shard_bytes:
            shards.append([])
        shards[-1].append(t)
    if order_in_shard is not None:
        shards = [sorted(sh, key=order_in_shard) for sh in shards]
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    fds, where = [], {}
    try:
        for name, shard in zip(names, shards, strict=True):
            fd = os.open(tmp / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            where.update((t.name, (fd, off)) for off, t in zip(write_safetensors_header(fd, shard), shard, strict=True))

        def write(t: Any, part: int) -> int:
            size = t.nbytes // parts(t)
            fd, off = where[t.name]
            data = make(t, order[t.name], part).contiguous()
            pwrite_all(fd, data.view(torch.uint8).reshape(-1).numpy(), off + part * size)
            return size

        jobs = sorted(((t, p) for t in tensors for p in range(parts(t))), key=lambda j: -j[0].nbytes // parts(j[0]))
        bar = tqdm(total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                   disable=not progress)
        with ThreadPoolExecutor(workers or min(32, os.cpu_count() or 1), thread_name_prefix="strata-demo") as pool:
            for fut in as_completed([pool.submit(write, t, p) for t, p in jobs]):
                bar.update(fut.result())
        bar.close()
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    if n > 1:
        weight_map = {t.name: names[i] for i, shard in enumerate(shards) for t in shard}
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
