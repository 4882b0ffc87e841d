"""A GGUF file converted into a strata store: dense tensors as bf16 where the file holds them so, else dequantized
(float32, exact), routed experts kept in the
file's ggml blocks (`ExpertFormat("gguf")`) or, for f16/bf16/f32 files, in their plain dtype.

    convert_gguf("model-Q4_K_M.gguf", "store/")   # then strata runs store/ as any checkpoint
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from strata.errors import CheckpointError
from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.tiers.store.files import fsync_dir
from strata.tiers.store.format import StoreIndex, align_up, expert_dtype, is_store, read_index
from strata.tiers.store.gguf_reader import PLAIN_TYPES, GGUFFile, split_parts
from strata.tiers.store.gguf_tokenizer import write_tokenizer_files
from strata.tiers.store.safetensors_index import TensorIndex
from strata.tiers.store.writer import StoreWriter

_PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (by its suffix; its contents are checked when it is opened)."""
    return str(path).endswith(".gguf") and Path(path).expanduser().is_file()


def gguf_fingerprint(path: Path) -> str:
    """The identity of a GGUF model's weights: sha256 over each part's name, size and first and last MiB."""
    h = hashlib.sha256()
    for part in split_parts(path):
        size = part.stat().st_size
        h.update(f"{part.name}:{size}".encode())
        with open(part, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return "gguf-" + h.hexdigest()


def expert_format(f: GGUFFile) -> ExpertFormat:
    """The store's expert format: every block type each of gate, up and down has in any layer, or a plain dtype."""
    per_layer = [f.expert_types(layer) for layer in f.moe_layers()]
    if not per_layer:
        raise CheckpointError(f"{f.path}: the file has no routed experts (blk.N.ffn_gate_exps); strata runs MoE models")
    plain = {t for types in per_layer for t in types if t in PLAIN_TYPES}
    if plain:
        if len(plain) > 1 or any(t not in PLAIN_TYPES for types in per_layer for t in types):
            raise CheckpointError(f"{f.path}: experts mix plain and quantized types; strata keeps one or the other")
        return ExpertFormat("plain", _PLAIN[plain.pop()])
    return ExpertFormat("gguf", ggml=tuple(tuple(dict.fromkeys(types[j] for types in per_layer)) for j in range(3)))


def convert_gguf(gguf_path: str | os.PathLike, store_dir: str | os.PathLike, *, progress: bool = False) -> Path:
    """Convert a GGUF model into a store at `store_dir` (kept when it already holds this file's store)."""
    src = Path(gguf_path).expanduser()
    out = Path(store_dir).expanduser().absolute()
    f = GGUFFile.open(src)
    fingerprint = gguf_fingerprint(src)
    if is_store(out) and read_index(out).source_fingerprint == fingerprint:
        return out
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} is not empty and not the store of {src}; choose an empty directory")
    cfg = f.hf_config
    fmt = expert_format(f)
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    try:
        layout = ExpertLayout.build(fmt, h, i)
    except ValueError as e:
        raise CheckpointError(f"{src}: {e}") from None
    moe = f.moe_layers()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    staging = tmp / ".staging"
    staging.mkdir(parents=True)
    try:
        _stage(f, staging)
        writer = StoreWriter(tmp)
        try:
            copied = writer.copy_files(staging)
            dense = writer.write_dense(list(TensorIndex.from_dir(staging)))
            blobs = {}
            for layer in moe:
                experts = f.experts(layer)
                fills = [_fill(layout, experts, e) for e in range(experts[0][1].shape[0])]
                for blob in writer.write_layer(layer, fills, layout.payload_bytes):
                    blobs[blob.key] = blob
            index = StoreIndex(
                source_fingerprint=fingerprint, model_type=cfg["model_type"], num_layers=cfg["num_hidden_layers"],
                moe_layers=moe, num_experts=experts[0][1].shape[0], hidden=h, moe_intermediate=i,
                dtype=expert_dtype(fmt), payload_bytes=layout.payload_bytes, slot_bytes=align_up(layout.payload_bytes),
                blobs=blobs, dense=dense, copied_files=copied, expert_format=fmt,
            )  # fmt: skip
            shutil.rmtree(staging)
            writer.write_index(index)
        finally:
            writer.close()
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _fill(layout: ExpertLayout, experts: list, e: int):
    """One expert's payload writer for `StoreWriter.write_layer`."""
    (gt, gate), (ut, up), (dt, down) = experts
    if layout.fmt.kind == "gguf":
        # np.array: a copy of the file's read-only mapping, which torch will not wrap
        return lambda out: layout.pack_gguf((gt, torch.from_numpy(np.array(gate[e]))), (ut, torch.from_numpy(np.array(up[e]))),
                                            (dt, torch.from_numpy(np.array(down[e]))), out=out)
    gate_up = torch.cat([torch.from_numpy(gate[e]), torch.from_numpy(up[e])]).float()
    return lambda out: layout.pack(gate_up, torch.from_numpy(down[e]).float(), out=out)


def _stage(f: GGUFFile, staging: Path) -> None:
    """config.json, generation_config.json, the tokenizer and the dense tensors (model.safetensors) of `f`."""
    from safetensors.torch import save_file

    cfg = f.hf_config
    (staging / "config.json").write_text(json.dumps(cfg, indent=2))
    eos = cfg.get("eos_token_id")
    (staging / "generation_config.json").write_text(json.dumps({"eos_token_id": eos} if eos is not None else {}))
    write_tokenizer_files(f, staging)
    tensors = {}
    for name, w in f.dense_tensors():
        if name in tensors:
            raise CheckpointError(f"{f.path}: two tensors map to {name!r}; the file is malformed")
        tensors[name] = w.contiguous()
    save_file(tensors, str(staging / "model.safetensors"))
