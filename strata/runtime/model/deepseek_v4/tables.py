"""DeepSeek-V4's hash-routing tables (`model.layers.L.mlp.gate.tid2eid` [vocab, k]: the experts of each token id in
a hash_moe layer) as store tables, like Engram's.

`strata convert` writes each as the row-addressable table `tid2eid.L` (tables/tid2eid.L.bin, chunk checksums in the
index) and leaves it out of dense.safetensors. A model built from the store drops the routers' table buffers before
its weights load (`drop_hash_tables`) and takes them from the store afterwards (`attach_hash_tables`): each table is
checked against its checksums (once per table file, then vouched for by the verification record) and held whole in
its tier, the GPU on CUDA hosts and RAM otherwise, where the router indexes it by token id. A checkpoint loaded in
memory, or a store written before these tables existed, keeps them as dense buffers.
"""

from __future__ import annotations

import re

import torch

from strata.runtime.model.checkpoint import Checkpoint
from strata.tiers.rows.load import RowTables
from strata.tiers.store.format import TableEntry
from strata.tiers.store.safetensors_index import read_tensor
from strata.tiers.store.store import ExpertStore

HASH_TABLE = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.tid2eid")


def table_name(layer: int) -> str:
    """The store's table object holding hash_moe layer `layer`'s tid2eid rows."""
    return f"tid2eid.{layer}"


def is_hash_table(name: str) -> bool:
    """Whether a checkpoint tensor is a hash-routing table (stored as a table object, not a dense tensor)."""
    return HASH_TABLE.fullmatch(name) is not None


def write_hash_tables(writer, ckpt: Checkpoint) -> dict[str, TableEntry]:
    """Write every tid2eid table of `ckpt` through a `StoreWriter` (each a few MB: read whole); entries by name."""
    out = {}
    for info in ckpt.index:
        m = HASH_TABLE.fullmatch(info.name)
        if m:
            name = table_name(int(m[1]))
            out[name] = writer.add_table(name, read_tensor(info, raw=True))
    return out


def _hash_routers(model) -> dict:
    """layer -> the hash router of each hash_moe layer of a `DeepseekV4Transformer` (none for other models)."""
    out = {}
    for i, layer in enumerate(getattr(model, "layers", [])):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "tid2eid"):
            out[i] = gate
    return out


def drop_hash_tables(model, store: ExpertStore | None) -> None:
    """Before weights load: the routers whose table `store` holds get none (the loader then does not read it)."""
    tables = getattr(getattr(store, "index", None), "tables", {})
    for layer, gate in _hash_routers(model).items():
        if table_name(layer) in tables:
            gate.register_buffer("tid2eid", None)


def attach_hash_tables(model, store: ExpertStore, device: torch.device, tmpfs_dir: str) -> RowTables | None:
    """After weights load: the dropped tables from `store`, checked and held whole in their tier (the GPU on CUDA,
    RAM otherwise), set on their routers. Returns the tables (None: the model has none in the store)."""
    routers = {layer: g for layer, g in _hash_routers(model).items() if g.tid2eid is None}
    if not routers:
        return None
    entries = {layer: store.index.tables[table_name(layer)] for layer in routers}
    tier = "gpu" if device.type == "cuda" else "pinned"
    tables = RowTables(store, entries, tier, device, tmpfs_dir, zero_copy=False)
    for layer, gate in routers.items():
        gate.tid2eid = tables.full[layer]
    return tables
