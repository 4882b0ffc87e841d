"""Serving a checkpoint from its own files: whether to (`store_mode`), and the in-place index built on first use.

`store_mode` decides between the in-place store (`strata.tiers.store.in_place`: an index in the cache, the
weights read from the checkpoint's safetensors files) and the packed store (`strata convert`, built in the cache
on first use). "auto" takes in place whenever it can: the checkpoint's files are safetensors on a local
filesystem, its experts are kept in their own format (`[store] experts = "checkpoint"`), their bytes are what the
blob holds (FP8 scales in float32) and it has no Engram tables (served by the packed store's row tables).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from strata.config import StrataConfig, load_config
from strata.errors import ConfigError
from strata.kernels.quant import ExpertLayout
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.engram.store import is_table_tensor
from strata.runtime.plan.checkpoints.convert import report_verify
from strata.runtime.plan.checkpoints.expert_sources import layer_sources
from strata.runtime.plan.checkpoints.store_cache import store_root
from strata.tiers.storage.aligned_io import fs_type
from strata.tiers.store.format import is_store
from strata.tiers.store.in_place import (
    InPlaceIndex,
    InPlaceStore,
    Part,
    SourceFile,
    changed_error,
    changed_files,
    read_in_place_index,
    write_in_place_index,
)
from strata.tiers.store.part_record import PartRecord

# filesystems whose reads go over a network or through userspace: a packed store on a local disk reads faster
_REMOTE_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "afs", "lustre", "sshfs"}
# routed experts (shared experts and gpt-oss's expert biases are dense)
_ROUTED = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.(?!\w+_bias$)")


def store_mode(path: str | os.PathLike, cfg: StrataConfig, ckpt: Checkpoint | None = None) -> tuple[str, str]:
    """("in_place" | "packed", why) for serving `path` under `cfg`'s `[store] mode`. `ConfigError` when
    `mode = "in_place"` is asked of a checkpoint that cannot be read in place."""
    path = Path(path).expanduser()
    if is_store(path):
        return "packed", "the path is a packed store"
    if path.suffix == ".gguf" and path.is_file():
        return "packed", "a GGUF file is converted into a packed store (its experts kept in their ggml blocks)"
    if cfg.store.mode == "packed":
        return "packed", '[store] mode = "packed"'
    if len(cfg.runtime.devices) > 1:
        return "packed", "a model split over several cards is read from a packed store"
    problem = _in_place_problem(path, cfg, ckpt)
    if problem is None:
        return "in_place", ('[store] mode = "in_place"' if cfg.store.mode == "in_place"
                            else "the checkpoint's safetensors are on a local disk: no second copy")
    if cfg.store.mode == "in_place":
        raise ConfigError(f'{path}: cannot be served in place: {problem}; set [store] mode = "packed" or "auto"')
    return "packed", problem


def _in_place_problem(path: Path, cfg: StrataConfig, ckpt: Checkpoint | None) -> str | None:
    if cfg.store.experts != "checkpoint":
        return f"its experts are quantized to {cfg.store.experts} while they are packed ([store] experts)"
    fs = fs_type(str(path))
    if fs.split(".")[-1] in _REMOTE_FS:
        return f"its files are on a network filesystem ({fs}): a packed store on a local disk reads faster"
    ckpt = ckpt or Checkpoint.open(path)
    if any(is_table_tensor(t.name) for t in ckpt.index):
        return "it has Engram tables, which a packed store serves as row tables"
    for t in ckpt.index:
        if _ROUTED.search(t.name) and t.name.endswith("_scale_inv") and t.dtype != "F32":
            return f"its FP8 expert scales are {t.dtype} ({t.name}), converted to float32 when packed"
    if getattr(ckpt.config, "deepseek_v4", None) is not None:
        return "DeepSeek-V4 checkpoints are packed (their tensors are renamed and converted as they load)"
    if ckpt.experts_transposed:
        return "its experts are transformers' gpt-oss tensors, transposed ([E, H, 2I]): packed in strata's orientation"
    return None


def in_place_dir_for(path: str | os.PathLike, cfg: StrataConfig) -> Path:
    """Where the in-place index of checkpoint `path` lives: keyed by its absolute path (its files' identities
    are checked against the index, so a changed file is found rather than given a fresh index)."""
    real = Path(path).expanduser().resolve()
    return store_root(cfg).parent / "in-place" / f"{real.name}-{hashlib.sha256(str(real).encode()).hexdigest()[:12]}"


def open_in_place(path: str | os.PathLike, cfg: StrataConfig, ckpt: Checkpoint | None = None) -> InPlaceStore:
    """The in-place store of checkpoint `path`, its index built on first use (headers only). A source file changed
    since the index was built is refused with a one-line error naming it, or, with `[store] reverify`, its
    checksums are dropped and the index rebuilt, so every part of it is verified again."""
    path = Path(path).expanduser().resolve()
    directory = in_place_dir_for(path, cfg)
    index = read_in_place_index(directory)
    if index is not None and index.source_dir != str(path):
        index = None  # (a hash collision of two paths: rebuild)
    if index is not None:
        changed = changed_files(index)
        if changed and not cfg.store.reverify:
            raise changed_error(index, changed[0])
        if changed:
            record = PartRecord(directory, index.files)
            for name in changed:
                record.forget(name)
            record.save()
            index = None
    if index is None or set(index.files) != _safetensors(path):
        index = build_in_place_index(ckpt or Checkpoint.open(path))
        write_in_place_index(directory, index)
    return InPlaceStore.open(directory)


def _safetensors(path: Path) -> set[str]:
    return {p.name for p in path.glob("*.safetensors")}


def build_in_place_index(ckpt: Checkpoint) -> InPlaceIndex:
    """Every routed expert's parts and every dense tensor of `ckpt`, from its headers; the files' identities now."""
    cfg, source = ckpt.config, ckpt.directory.resolve()
    fmt = ckpt.expert_format
    layout = ExpertLayout.build(fmt, cfg.hidden_size, cfg.moe_intermediate_size)
    moe = [layer for layer, is_moe in enumerate(cfg.moe_layers) if is_moe]

    def rel(file: str | os.PathLike) -> str:
        return os.path.relpath(Path(file).resolve(), source)

    experts = {}
    for layer in moe:
        for e, src in enumerate(layer_sources(ckpt, layer)):
            pieces = src.pieces(layout)
            if pieces is None:
                raise ConfigError(f"{ckpt.directory}: expert ({layer}, {e}) cannot be read in place; "
                                  'set [store] mode = "packed"')
            names = [t.name for part in (*src.gate_up, src.down) for t in part if t is not None]  # pieces' order
            experts[(layer, e)] = tuple(Part(rel(f), off, n, at, names[i]) for i, (f, off, n, at) in enumerate(pieces))
    dense = {t.name: Part(rel(t.file), t.offset, t.nbytes, 0, t.name) for t in ckpt.index if not _ROUTED.search(t.name)}
    files = {name: SourceFile.of(source / name) for name in sorted({p.file for ps in experts.values() for p in ps}
                                                                    | {p.file for p in dense.values()})}
    h = hashlib.sha256(b"strata-in-place-1\0")
    for name, f in files.items():
        h.update(f"{name}\0{f.size}\0{f.mtime_ns}\0{f.ino}\0".encode())
    return InPlaceIndex(
        source_dir=str(source), source_fingerprint=h.hexdigest(), model_type=cfg.model_type, num_layers=cfg.num_layers,
        moe_layers=moe, num_experts=cfg.num_experts, hidden=cfg.hidden_size,
        moe_intermediate=cfg.moe_intermediate_size, expert_format=fmt, files=files, experts=experts, dense_parts=dense,
    )  # fmt: skip


def is_served_in_place(path: str | os.PathLike) -> bool:
    """Whether `strata verify PATH` checks a checkpoint served in place (a directory of safetensors, no store)."""
    path = Path(path).expanduser()
    return path.is_dir() and not is_store(path) and any(path.glob("*.safetensors"))


def verify_in_place(checkpoint: str | os.PathLike, config: str | None) -> int:
    """`strata verify CHECKPOINT_DIR`: every part of a checkpoint served in place re-read and checked against the
    checksums its in-place index recorded (recording those not yet checksummed); 0 when sound, else 2."""
    checkpoint = Path(checkpoint).expanduser()
    with open_in_place(checkpoint, load_config(config)) as store:
        damaged = store.verify(progress=True)
        experts, parts = len(store.index.experts), len(store.index.all_parts())
    return report_verify(damaged, f"{checkpoint}: sound (read in place: {experts} experts, {parts} parts checked)",
                         f"{checkpoint}: {len(damaged)} damaged part(s) in the checkpoint's own files; re-download the "
                         "files named")
