"""Where a checkpoint's store lives, and the store built there on first use.

A checkpoint loaded by path gets its store in the cache, `store_root(cfg)/NAME-FINGERPRINT`, keyed by its
weights' fingerprint (safetensors names, sizes and headers): a copy of the weights, or a checkpoint whose
config.json or tokenizer changed, finds the same store, and the store's copies of those small files are
brought up to date at every load. With `[store] experts = "fp8"` or `"mxfp4"` the store's name ends in that
format (`NAME-FINGERPRINT-fp8`): one checkpoint may have a store of each. `store_dir_for` is the one place that names it: loading, `strata plan`
and `strata serve`'s preflight plan all measure the disk where the store is, or will be, written.
"""

from __future__ import annotations

import os
from pathlib import Path

from strata.config import StrataConfig
from strata.config_sections import DiskTierConfig
from strata.errors import CheckpointError
from strata.tiers.store.format import checkpoint_fingerprint, is_store, lacks_index, no_index_error


def model_path(path: str | os.PathLike) -> Path:
    """`path` as a model strata loads (a checkpoint or store directory, or a .gguf file: its store), else a
    CheckpointError naming it."""
    path = Path(path).expanduser()
    if not path.is_dir() and not (path.suffix == ".gguf" and path.is_file()):
        raise CheckpointError(f"{path}: no such checkpoint, store directory or GGUF file")
    return path


def store_root(cfg: StrataConfig) -> Path:
    """Where stores built on first use live: `tiers.disk.path`/stores ($STRATA_CACHE replaces the default path)."""
    path = cfg.tiers.disk.path
    if path == DiskTierConfig().path and os.environ.get("STRATA_CACHE"):
        path = os.environ["STRATA_CACHE"]
    return Path(os.path.expandvars(os.path.expanduser(path))).absolute() / "stores"


def store_dir_for(path: str | os.PathLike, cfg: StrataConfig, fingerprint: str | None = None) -> Path:
    """The store of `path`: `path` itself when it is a store, else its directory in the cache (which may
    not exist yet). `fingerprint`: `checkpoint_fingerprint(path)` when the caller has it."""
    path = Path(path).expanduser()
    if is_store(path):
        return path
    if path.suffix == ".gguf" and path.is_file():
        from strata.runtime.plan.checkpoints.gguf_convert import gguf_fingerprint

        return store_root(cfg) / f"{path.stem}-{gguf_fingerprint(path)[5:17]}"
    if lacks_index(path):
        raise no_index_error(path)
    suffix = "" if cfg.store.experts == "checkpoint" else f"-{cfg.store.experts}"
    return store_root(cfg) / f"{path.name}-{(fingerprint or checkpoint_fingerprint(path))[:12]}{suffix}"


def ensure_store(path: Path, cfg: StrataConfig, progress: bool) -> Path:
    """The store for `path`: `path` itself when it is a store, else its store in the cache, built on first
    use (a store left there without its index is rebuilt) and its copies of config.json, the tokenizer and
    the other small files brought up to date with `path`."""
    from strata.runtime.plan.checkpoints.convert import adopt_earlier_store, convert_checkpoint

    path = Path(path).expanduser()
    if is_store(path):
        return path
    fingerprint = checkpoint_fingerprint(path)
    store_dir = store_dir_for(path, cfg, fingerprint)
    if cfg.store.experts == "checkpoint":  # (earlier strata built stores in the checkpoint's format only)
        adopt_earlier_store(path, store_dir, store_dir.parent)
    return convert_checkpoint(path, store_dir, progress=progress, fingerprint=fingerprint, experts=cfg.store.experts)


def gguf_store(path: Path, cfg: StrataConfig, progress: bool = False) -> Path:
    """The store of GGUF file `path` in the cache (`store_root(cfg)/NAME-FINGERPRINT`), converted on first use."""
    from strata.runtime.plan.checkpoints.gguf_convert import convert_gguf

    path = Path(path).expanduser()
    return convert_gguf(path, store_dir_for(path, cfg), progress=progress)
