"""`strata convert` and `strata verify`: pack a checkpoint into a tiered expert store; check a store.

Conversion streams: one expert's slot buffer at a time is read by offset from the checkpoint (either
expert layout), hashed and pwritten at its slot, so memory stays at one slot (plus 16 MiB for dense
tensors) whatever the model's size. The store keeps the experts in the checkpoint's format (bf16, block-scaled
FP8, MXFP4: a byte copy into the blob's sections), or quantizes a plain checkpoint's routed experts while it
packs them (`experts="fp8"` or `"mxfp4"`, `[store] experts`, `strata convert --experts`). Everything goes into
a hidden sibling directory, the index last, fsynced, then renamed into place: an interrupted convert never
leaves a directory that looks like a store.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
from pathlib import Path

from tqdm.auto import tqdm

from strata.config import load_config
from strata.errors import CheckpointError, ConfigError, StrataError
from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.deepseek_v4.tables import is_hash_table, write_hash_tables
from strata.runtime.model.engram.store import is_table_tensor, write_tables
from strata.runtime.plan.checkpoints.expert_sources import ExpertSource, layer_sources, store_format
from strata.tiers.store.files import fsync_dir, remove_stale_tmp_dirs, temp_sibling
from strata.tiers.store.format import (
    COPIED_FILES,
    DENSE_NAME,
    EXPERTS_DIR,
    INDEX_NAME,
    TABLES_DIR,
    StoreIndex,
    align_up,
    checkpoint_fingerprint,
    earlier_fingerprint,
    expert_dtype,
    is_store,
    lacks_index,
    read_index,
)
from strata.tiers.store.safetensors_header import TensorInfo
from strata.tiers.store.store import ExpertStore, StaleStoreError
from strata.tiers.store.verify_record import RECORD_NAME
from strata.tiers.store.writer import Fill, Piece, StoreWriter

# routed-expert tensors (per-expert or fused); shared experts (`mlp.shared_experts.`) and gpt-oss's expert biases
# (`mlp.experts.gate_up_proj_bias`, kept dense per layer) are dense
_ROUTED = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.(?!\w+_bias$)")
# what a store directory holds (a directory of only these, without its index, is replaced by a convert)
_STORE_NAMES = {INDEX_NAME, DENSE_NAME, EXPERTS_DIR, TABLES_DIR, RECORD_NAME, *COPIED_FILES}


# --- convert --------------------------------------------------------------------------------------


def convert_checkpoint(checkpoint_dir: str | os.PathLike, store_dir: str | os.PathLike, *, progress: bool = True,
                       fingerprint: str | None = None, experts: str = "checkpoint") -> Path:
    """Convert a checkpoint into a store at `store_dir` (atomically) and return the store directory.

    If `store_dir` already holds the store of these very weights (in the same expert format) it is kept, its
    copies of config.json, the tokenizer and the other small files brought up to date with the checkpoint; a
    store left without its index is replaced; any other non-empty directory is refused. `fingerprint`: the
    weights' fingerprint the caller keyed `store_dir` by; the checkpoint must still have it. `experts`: one of
    `STORE_EXPERTS` (`target_format`).
    """
    return _convert(checkpoint_dir, store_dir, progress, fingerprint, experts)[0]


def target_format(ckpt: Checkpoint, experts: str) -> ExpertFormat:
    """The format a store of `ckpt` keeps its routed experts in (`store_format`)."""
    cfg = ckpt.config
    return store_format(ckpt.expert_format, experts, cfg.hidden_size, cfg.moe_intermediate_size, str(ckpt.directory))


def _convert(checkpoint_dir: str | os.PathLike, store_dir: str | os.PathLike, progress: bool,
             expected: str | None = None, experts: str = "checkpoint") -> tuple[Path, bool]:
    """convert_checkpoint; also says whether anything was written."""
    src = Path(checkpoint_dir).expanduser()
    if is_store(src):
        raise ConfigError(f"{src} is already a strata store; convert the original Hugging Face checkpoint")
    ckpt = Checkpoint.open(src)
    fmt = target_format(ckpt, experts)
    fingerprint = checkpoint_fingerprint(src)
    if expected is not None and fingerprint != expected:
        raise _changed(src)
    out = Path(store_dir).expanduser().absolute()
    state = _existing_store(out, src, fingerprint, fmt)
    if state == "same":
        return out, False
    meta, dense, layers = _plan(ckpt, fingerprint, fmt)  # every shape/dtype checked before anything is written
    num_blobs = len(meta["moe_layers"]) * meta["num_experts"]
    table_bytes = sum(t.nbytes for t in ckpt.index if is_table_tensor(t.name) or is_hash_table(t.name))
    total = sum(t.nbytes for t in dense) + num_blobs * meta["payload_bytes"] + table_bytes
    need = sum(t.nbytes for t in dense) + num_blobs * meta["slot_bytes"] + table_bytes
    tmp = temp_sibling(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp_dirs(out)
        free = shutil.disk_usage(out.parent).free
        if need > free:
            raise StrataError(f"{out.parent}: the store needs {need / 1e9:.2f} GB but only {free / 1e9:.2f} GB "
                              "is free; free space or choose another directory")
        tmp.mkdir()
    except OSError as e:
        raise StrataError(f"{e.filename or out.parent}: cannot create the store: {e.strerror or e}") from e
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress)
    writer = StoreWriter(tmp, bar)
    try:
        try:
            copied = writer.copy_files(src)
            dense_entry = writer.write_dense(dense)
            blobs = {}
            for layer, experts in layers:
                for blob in writer.write_layer(layer, experts, meta["payload_bytes"]):
                    blobs[blob.key] = blob
            # Engram tables and DeepSeek-V4's hash-routing tables as row-addressable objects
            tables = {**write_tables(writer, ckpt), **write_hash_tables(writer, ckpt)}
            if checkpoint_fingerprint(src) != fingerprint:  # its weights were replaced while they were read
                raise _changed(src)
            index = StoreIndex(**meta, blobs=blobs, tables=tables, dense=dense_entry, copied_files=copied)
            writer.write_index(index)  # last: only now is tmp a store
            if not _move_into_place(tmp, out, fingerprint, replace=state == "replace"):
                return out, False  # a concurrent convert finished the same store first
            fsync_dir(out.parent)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StrataError(f"{out}: no space left on the device while writing the store; "
                                  "free space or choose another directory") from e
            raise StrataError(f"{e.filename or out}: cannot write the store: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        writer.close()
        bar.close()
    return out, True


def _changed(src: Path) -> CheckpointError:
    return CheckpointError(f"{src}: the checkpoint's safetensors files changed while they were read; wait until "
                           "they are complete, then load or convert it again")


def _move_into_place(tmp: Path, out: Path, fingerprint: str, replace: bool) -> bool:
    """Rename the finished store `tmp` to `out` (atomic; a directory that `lacks_index` is moved aside
    first and deleted after). False when a concurrent convert put the same store there first."""
    aside = None
    if replace and not is_store(out):  # (a concurrent convert may have put a finished store there meanwhile)
        aside = temp_sibling(out)  # our pid in its name: removed as stale should we die before the rmtree
        try:
            os.rename(out, aside)
        except FileNotFoundError:
            aside = None
    try:
        os.rename(tmp, out)  # atomic; also replaces an empty directory
    except OSError:
        if is_store(out) and read_index(out).source_fingerprint == fingerprint:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    return True


def _plan(ckpt: Checkpoint, fingerprint: str, fmt: ExpertFormat
          ) -> tuple[dict, list[TensorInfo], list[tuple[int, list[list[Piece] | Fill]]]]:
    """The store index's model fields, the dense tensors and, per MoE layer, every expert's payload: byte copies
    when the store keeps the checkpoint's format, else a function quantizing it into `fmt`."""
    cfg = ckpt.config
    e_num, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    moe = [layer for layer, is_moe in enumerate(cfg.moe_layers) if is_moe]
    if not moe:
        raise CheckpointError(f"{ckpt.directory}: config.json has no MoE layers; there are no experts to store")
    layout = ExpertLayout.build(fmt, h, i)
    layers = [(layer, [_payload(source, layout) for source in layer_sources(ckpt, layer)]) for layer in moe]
    # routed experts of layers outside config's MoE layers (DeepSeek's MTP layer) are never run: skipped
    dense = [t for t in ckpt.index if not _ROUTED.search(t.name)
             and not (is_table_tensor(t.name) or is_hash_table(t.name))]  # Engram's and tid2eid: tables
    meta = dict(
        source_fingerprint=fingerprint, model_type=cfg.model_type, num_layers=cfg.num_layers, moe_layers=moe,
        num_experts=e_num, hidden=h, moe_intermediate=i, dtype=expert_dtype(fmt), payload_bytes=layout.payload_bytes,
        slot_bytes=align_up(layout.payload_bytes), expert_format=fmt,
    )  # fmt: skip
    return meta, dense, layers


def _payload(source: ExpertSource, layout: ExpertLayout) -> list[Piece] | Fill:
    """One expert's payload for `StoreWriter.write_layer`: its pieces, or a function packing it into `layout`."""
    pieces = source.pieces(layout)
    if pieces is not None:
        return pieces
    if source.fmt == layout.fmt and not source.transposed:  # the checkpoint's format, FP8 scales in another dtype:
        # converted, not requantized
        return lambda out: layout.pack_quantized(*source.as_stored(), out=out)
    return lambda out: layout.pack(*source.weights(), out=out)  # quantized (round to nearest) while it is packed


def _existing_store(out: Path, src: Path, fingerprint: str, fmt: ExpertFormat) -> str:
    """What `out` holds: "absent" (or empty), "same" (this checkpoint's store; its small files are brought up
    to date), or "replace" (a store's files without the index: an interrupted or damaged store); otherwise
    an error."""
    if not out.exists():
        return "absent"
    if not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; choose another store directory")
    if not any(out.iterdir()):
        return "absent"
    if lacks_index(out) and all(p.name in _STORE_NAMES or p.name.startswith(".") for p in out.iterdir()):
        return "replace"
    if not is_store(out):
        raise ConfigError(f"{out} is not empty and is not a strata store; choose an empty or new directory")
    index, rekeyed = read_index(out), False
    if index.source_fingerprint != fingerprint:
        if index.source_fingerprint != earlier_fingerprint(src):
            raise StaleStoreError(
                f"{out} holds a store of a different checkpoint (or of an older {src}); delete it and re-run "
                f"`strata convert {src} {out}`"
            )
        index.source_fingerprint, rekeyed = fingerprint, True  # converted by an earlier strata: same weights
    if index.expert_format != fmt:
        raise ConfigError(f"{out} holds the store of {src} with {index.expert_format.name} experts, not {fmt.name}; "
                          "delete it or choose another directory")
    ExpertStore.open(out).close()  # the same store: check its files are all there (sizes only, cheap)
    if not StoreWriter(out).refresh_copies(src, index) and rekeyed:
        StoreWriter(out).write_index(index)
    return "same"


def adopt_earlier_store(src: Path, out: Path, root: Path) -> None:
    """Rename the store an earlier strata built on first use for `src` (keyed then by config.json too) to
    `out`, its name now: the same weights are not converted again. Its index is rewritten when `out` is
    next converted into (`_existing_store`)."""
    if out.exists():
        return
    earlier = root / f"{src.name}-{earlier_fingerprint(src)[:12]}"
    if earlier != out and is_store(earlier) and read_index(earlier).source_fingerprint == earlier_fingerprint(src):
        try:
            os.rename(earlier, out)
        except OSError:
            pass  # another process took it over first (or the rename cannot be done): convert as usual


# --- CLI bodies -----------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    """`strata convert MODEL STORE_DIR [--experts checkpoint|fp8|mxfp4] [--config PATH]`; MODEL may be a .gguf file,
    whose experts keep their ggml blocks (`--experts` other than "checkpoint" is refused for it)."""
    experts = getattr(args, "experts", None) or load_config(getattr(args, "config", None)).store.experts
    if str(args.model).endswith(".gguf"):
        from strata.runtime.plan.checkpoints.gguf_convert import convert_gguf, gguf_fingerprint

        if experts != "checkpoint":
            raise ConfigError(f"{args.model}: a GGUF file's experts keep their ggml blocks; drop --experts {experts} "
                              "(or [store] experts) to convert it")
        store = Path(args.store).expanduser().absolute()
        wrote = not (is_store(store) and read_index(store).source_fingerprint == gguf_fingerprint(Path(args.model)))
        out = convert_gguf(args.model, store, progress=True)
    else:
        out, wrote = _convert(args.model, args.store, progress=True, experts=experts)
    idx = read_index(out)
    what = (f"{len(idx.blobs)} {idx.expert_format.name} experts in {len(idx.moe_layers)} layers, {idx.slot_bytes} "
            "bytes a slot")
    print(f"wrote the store {out} ({what})" if wrote else f"{out} is already the store of {args.model} ({what})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """`strata verify STORE_DIR`: 0 when every object's checksum holds, else 2 naming every damaged one."""
    directory = Path(args.store).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such store directory")
    with ExpertStore(directory, read_index(directory)) as store:  # not open(): verify reports bad files itself
        damaged = store.verify(progress=True)
        idx = store.index
    chunks = sum(t.num_chunks for t in idx.tables.values())
    dense = len(idx.dense.tensor_checksums) if idx.dense else 0
    return report_verify(damaged, f"{directory}: sound ({len(idx.blobs)} {idx.expert_format.name} experts, "
                                  f"{len(idx.tables)} tables / {chunks} chunks, {dense} dense tensors)",
                         f"{directory}: {len(damaged)} damaged object(s); delete the store and re-run `strata convert`")


def report_verify(damaged: list[str], sound: str, failure: str) -> int:
    """`strata verify`'s report and exit status: `sound` and 0 when nothing is `damaged`; else each damaged name,
    then `failure` on stderr, and 2."""
    if not damaged:
        print(sound)
        return 0
    for name in damaged:
        print(f"damaged: {name}")
    print(f"strata: error: {failure}", file=sys.stderr)
    return 2

