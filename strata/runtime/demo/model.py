"""`strata demo-model`: demo MoE checkpoints in real Hugging Face format, one trained and three random.

Each directory holds config.json, generation_config.json, model.safetensors (or HF-named shards and
model.safetensors.index.json), tokenizer.json, tokenizer_config.json and chat_template.jinja, laid
out exactly as real DeepSeek-V3 / Qwen3-MoE checkpoints ship them (one tensor per expert projection),
so transformers and strata load the very same files. Sizes:

- `demo`: the default model (`strata generate` with no MODEL). A 6-layer deepseek_v3 with 32 routed experts
  per MoE layer (5 MoE layers) and Engram layers, ~8.7M parameters, ~18 MB, *trained* on the King James
  Bible and fortune cookies (strata.runtime.demo.train, which documents the corpus and how to rerun it), so
  it writes KJV-style English and its routers have a trained router's skew and temporal locality. Shipped
  in the package (`TRAINED_DIR`); `ensure_default_model` returns it and `strata demo-model DIR` copies it.
- `tiny`: a 3-layer deepseek_v3 of ~1 MB with random weights, for tests.
- `small`: an 8-layer deepseek_v3 with 64 routed experts per MoE layer, ~390 MB of random weights.
- `bench`: Qwen3-30B-A3B's exact configuration (qwen3_moe, 48 layers x 128 experts), ~61 GB of random weights.

The random sizes are written on demand: weights are N(0, initializer_range) in bf16 (norms are 1.0), each
tensor drawn from its own generator whose seed depends only on (seed, tensor name), so the bytes do not
depend on write order or threading. Writing streams: each shard's header is written first (every shape is
known), then worker threads generate tensors and `pwrite` them at their offsets, so memory stays at a few
tensors. Every size is written into a hidden sibling directory that is renamed into place at the end: a
crash never leaves a directory that looks like a model. The sizes' configurations (`demo_config`, `DemoSpec`)
live in strata.runtime.demo.configs and are importable from here too.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

from strata.errors import ConfigError
from strata.runtime.demo.configs import (
    DEFAULT_SHARD_BYTES,
    DEMO_SIZES,
    TOKENIZER_VOCAB,
    TRAINED_SIZE,
    DemoSpec,
    demo_config,
    demo_generation_config,
    expected_bytes,
)
from strata.runtime.demo.quantized import WeightJob, weight_jobs
from strata.runtime.demo.skew import RouteSkew, check_locality, check_skew
from strata.runtime.demo.tokenizer import tokenizer_size, write_tokenizer_files
from strata.runtime.demo.weights import TensorSpec, make_tensor, tensor_specs, write_safetensors_header
from strata.tiers.store.files import pwrite_all, remove_stale_tmp_dirs, temp_sibling
from strata.tiers.store.safetensors_header import DTYPE_BITS

TRAINED_DIR = Path(__file__).parent / "data" / TRAINED_SIZE
MARKER = "strata_demo.json"  # written last; identifies a complete demo model and its parameters


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedily cut `specs` (in order) into shards of at most `max_shard_bytes` (one big tensor may exceed it).

    Within a shard the widest dtypes go first (F32, then BF16, then FP8 and U8 bytes), so the F32 tensors sit
    8-byte aligned right after the (8-byte padded) header and every tensor after them stays aligned to its width.
    """
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return [sorted(s, key=lambda t: -DTYPE_BITS[t.dtype]) for s in shards]  # stable sort


def ensure_default_model(progress: bool = True) -> Path:
    """The default model (no MODEL argument): the trained `demo` model's directory in the package, `TRAINED_DIR`.

    Nothing is written here (`progress` is accepted for the callers that show one); the tiered runtime
    builds its store from it in the cache on first use (strata.runtime.plan.build.ensure_store)."""
    if not (TRAINED_DIR / MARKER).is_file():
        raise ConfigError(f"the trained demo model is missing from {TRAINED_DIR}; reinstall strata "
                          "(its package data holds the model)")
    return TRAINED_DIR


def write_demo_model(
    out_dir: str | Path,
    size: str = "small",
    layers: int | None = None,
    *,
    seed: int = 0,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int | None = None,
    engram: bool = True,
    route_skew: float | str = 0.0,
    route_locality: float = 0.0,
    experts: str = "bf16",
    arch: str | None = None,
) -> Path:
    """Write a demo model into `out_dir` (atomically) and return the directory.

    `size` "demo" copies the trained model shipped in the package (the options that shape random weights do
    not apply to it); the other sizes are written with random weights.
    `route_skew` S > 0 (Zipf-like) or "uniform" writes a routing profile into the weights (strata.runtime.demo.skew);
    `route_locality` L > 0 adds temporal locality to it (each router also weighs the recent context, L x the token).
    `experts` "fp8" / "mxfp4" writes the same weights as a quantized release ships them (strata.runtime.demo.quantized).
    `arch` writes the size in another architecture (glm4_moe, deepseek_v2: their tiny and bench sizes; minimax_m2: its
    tiny, small and bench sizes, under its release's names; `ARCH_CONFIGS`; deepseek_v4: its tiny, small and bench
    sizes, strata.runtime.demo.deepseek_v4; qwen3_5_moe: its tiny, small and bench sizes, strata.runtime.demo.qwen3_5).

    If `out_dir` already holds a demo model with the same size, layers and seed it is returned as is;
    any other non-empty directory is refused with a ConfigError.
    """
    if size == TRAINED_SIZE:
        shaped = {"--layers": layers is not None, "--seed": seed != 0, "--no-engram": not engram,
                  "--route-skew": check_skew(route_skew) != 0, "--route-locality": check_locality(route_locality) != 0,
                  "--experts": experts != "bf16", "--arch": arch is not None}
        if any(shaped.values()):
            raise ConfigError(f"{', '.join(k for k, v in shaped.items() if v)}: the demo model is trained, its weights "
                              f"are fixed; these options shape the random sizes ({', '.join(DEMO_SIZES)})")
        marker = json.loads((ensure_default_model() / MARKER).read_text())
        fill = functools.partial(shutil.copytree, TRAINED_DIR, dirs_exist_ok=True)  # fill(tmp) copies into tmp
    elif arch == "gpt_oss":  # its own writer: the release's names, MXFP4 experts (or transformers' bf16 ones)
        from strata.runtime.demo.gpt_oss import oss_demo

        given = {"--route-skew": check_skew(route_skew) != 0, "--route-locality": check_locality(route_locality) != 0}
        if any(given.values()):
            raise ConfigError(f"{', '.join(k for k, v in given.items() if v)}: not written for --arch gpt_oss; "
                              "leave them out")
        marker, write = oss_demo(size, layers, seed, max_shard_bytes, progress, workers, experts)
        fill = functools.partial(_write_arch_into, write=write, marker=marker)
    elif arch == "deepseek_v4":  # its own writer: the release's tensor names, hash tables, hyper-connections
        from strata.runtime.demo.deepseek_v4 import v4_demo

        given = {"--route-skew": check_skew(route_skew) != 0, "--route-locality": check_locality(route_locality) != 0}
        if any(given.values()):
            raise ConfigError(f"{', '.join(k for k, v in given.items() if v)}: not written for --arch deepseek_v4; "
                              "leave them out")
        marker, write = v4_demo(size, layers, seed, max_shard_bytes, progress, workers, experts)
        fill = functools.partial(_write_arch_into, write=write, marker=marker)
    elif arch == "qwen3_5_moe":  # its own writer: the hybrid layers' tensors, fused experts
        from strata.runtime.demo.qwen3_5 import q35_demo

        given = {"--route-skew": check_skew(route_skew) != 0, "--route-locality": check_locality(route_locality) != 0,
                 "--experts": experts != "bf16"}
        if any(given.values()):
            raise ConfigError(f"{', '.join(k for k, v in given.items() if v)}: not written for --arch qwen3_5_moe; "
                              "leave them out")
        marker, write = q35_demo(size, layers, seed, max_shard_bytes, progress, workers)
        fill = functools.partial(_write_arch_into, write=write, marker=marker)
    else:
        spec = DemoSpec(size, layers, seed, max_shard_bytes, engram, route_skew, route_locality, experts, arch)
        marker = spec.marker()
        fill = functools.partial(_write_into, spec=spec, progress=progress, workers=workers)
    out = Path(out_dir).expanduser().absolute()
    if _existing_demo(out, marker):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp_dirs(out)
    tmp = temp_sibling(out)
    tmp.mkdir()
    try:
        fill(tmp)
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty directory
        except OSError:
            if _existing_demo(out, marker):  # another process finished the same model first
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _existing_demo(out: Path, marker: dict) -> bool:
    """True if `out` is a finished demo model with this `MARKER` content; False if absent or empty; else ConfigError."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; choose another output path")
    if not any(out.iterdir()):
        return False
    try:
        found = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"{out} is not empty and is not a strata demo model; choose an empty or new directory"
        ) from None
    if found != marker:
        raise ConfigError(
            f"{out} already holds a different demo model ({found.get('size')}, "
            f"{found.get('num_hidden_layers')} layers, seed {found.get('seed')}); delete it or choose another directory"
        )
    return True


def _write_arch_into(tmp: Path, write, marker: dict) -> None:
    """An architecture with a writer of its own: its files (`write`), then the marker."""
    write(tmp)
    _dump_json(tmp / MARKER, marker)


def _write_into(tmp: Path, spec: DemoSpec, progress: bool, workers: int | None) -> None:
    """Write every file of the model into `tmp`; the marker last."""
    cfg = demo_config(spec.size, spec.layers, spec.engram, spec.experts, spec.arch)
    vocab = TOKENIZER_VOCAB[spec.size]
    if tokenizer_size(vocab) > cfg["vocab_size"]:  # a corpus edit must not outgrow the embedding
        raise AssertionError(f"demo tokenizer has {tokenizer_size(vocab)} ids > vocab_size {cfg['vocab_size']}")
    write_tokenizer_files(tmp, vocab, cfg["max_position_embeddings"])
    _dump_json(tmp / "config.json", cfg)
    _dump_json(tmp / "generation_config.json", demo_generation_config())
    _write_weights(tmp, cfg, spec, progress, workers)
    _dump_json(tmp / MARKER, spec.marker())


def _write_weights(tmp: Path, cfg: dict, spec: DemoSpec, progress: bool, workers: int | None) -> None:
    """Write the safetensors shard(s), plus model.safetensors.index.json when there are several."""
    from tqdm.auto import tqdm

    specs, weight_work = weight_jobs(tensor_specs(cfg), spec.experts, cfg)  # the tensors as written, their jobs
    shards = plan_shards(specs, spec.max_shard_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    std = float(cfg["initializer_range"])
    workers = workers or min(32, os.cpu_count() or 1)
    fds: list[int] = []
    where: dict[str, tuple[int, int]] = {}  # tensor -> (fd, absolute offset)
    try:
        for name, shard in zip(names, shards, strict=True):
            fd = os.open(tmp / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            offsets = write_safetensors_header(fd, shard)
            where.update((t.name, (fd, off)) for off, t in zip(offsets, shard, strict=True))
        # Biggest first so the embedding/lm_head do not straggle at the end; pwrite makes order free.
        jobs = sorted(weight_work, key=lambda j: -j.nbytes)
        bar = tqdm(
            total=sum(t.nbytes for t in specs),
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"demo-{spec.size}",
            disable=not progress,
        )
        pool = ThreadPoolExecutor(workers, thread_name_prefix="strata-demo")
        try:
            skew = (RouteSkew.for_config(cfg, spec.route_skew, spec.seed, spec.route_locality) if spec.route_skew
                    else None)
            futures = [pool.submit(_write_one, job, where, spec.seed, std, skew) for job in jobs]
            for f in as_completed(futures):
                bar.update(f.result())  # re-raises the first worker exception as soon as it happens
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # on error: drop queued jobs, let running ones end
            bar.close()
        for fd in fds:
            os.fsync(fd)  # data on disk before the rename makes the directory visible
    finally:
        for fd in fds:
            os.close(fd)
    if n > 1:
        weight_map = {t.name: names[i] for i, shard in enumerate(shards) for t in shard}
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in specs)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _dump_json(tmp / "model.safetensors.index.json", index)


def _write_one(job: WeightJob, where: dict[str, tuple[int, int]], seed: int, std: float,
               skew: RouteSkew | None = None) -> int:
    """Generate a job's source tensors and pwrite its outputs at their offsets; returns the byte count (for the bar)."""

    def make(spec: TensorSpec) -> torch.Tensor:
        t = make_tensor(spec, seed, std)
        return skew.apply(spec.name, t) if skew is not None else t

    written = 0
    for name, at, data in job.tensors(make):
        fd, offset = where[name]
        # bf16 has no numpy dtype: write the raw bytes through a uint8 view (little-endian, as safetensors).
        pwrite_all(fd, data.numpy(), offset + at)
        written += data.numel()
    return written


def _dump_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


__all__ = [
    "DEMO_SIZES",
    "DemoSpec",
    "TRAINED_DIR",
    "TRAINED_SIZE",
    "demo_config",
    "ensure_default_model",
    "expected_bytes",
    "write_demo_model",
]
