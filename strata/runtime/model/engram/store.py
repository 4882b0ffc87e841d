"""Engram tables in a store: written as row-addressable table objects by `strata convert`, served by
the tiered row store (strata.tiers.rows.store) when a model is built.

Checkpoint tensor `model.layers.L.engram.multi_head_embedding.embedding.weight` [rows, head_dim]
becomes the store's table `engram.L` (tables/engram.L.bin, chunk checksums in store.msgpack); it is
left out of dense.safetensors. Start-up checksums each table once per table file; `engram-verified.json`
in the store (strata.tiers.store.verify_record) lets later starts skip that pass while the file is unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import torch

from strata.runtime.model.checkpoint import Checkpoint
from strata.tiers.rows.store import EngramRowStore, resolve_tier, table_name
from strata.tiers.store.format import TableEntry
from strata.tiers.store.safetensors_header import TensorInfo
from strata.tiers.store.safetensors_index import read_tensor

TABLE_TENSOR = re.compile(r"model\.layers\.(\d+)\.engram\.multi_head_embedding\.embedding\.weight")
_PIECE_BYTES = 64 << 20


def is_table_tensor(name: str) -> bool:
    """Whether a checkpoint tensor is an Engram table (stored as a table object, not a dense tensor)."""
    return TABLE_TENSOR.fullmatch(name) is not None


def _pieces(info: TensorInfo) -> Iterator[torch.Tensor]:
    """The tensor's rows in pieces of about 64 MiB, read by offset (a 100 GB table never sits in RAM)."""
    rows, row_bytes = info.shape[0], info.nbytes // max(info.shape[0], 1)
    step = max(1, _PIECE_BYTES // max(row_bytes, 1))
    for a in range(0, rows, step):
        n = min(step, rows - a)  # rows [a, a + n) as a tensor of their own: read_tensor's checks and errors
        piece = replace(info, offset=info.offset + a * row_bytes, nbytes=n * row_bytes, shape=(n, *info.shape[1:]))
        yield read_tensor(piece)


def write_tables(writer, ckpt: Checkpoint) -> dict[str, TableEntry]:
    """Write every Engram table of `ckpt` through a `StoreWriter`; returns the index entries by name."""
    out = {}
    for info in ckpt.index:
        m = TABLE_TENSOR.fullmatch(info.name)
        if m:
            name = table_name(int(m[1]))
            out[name] = writer.add_table(name, _pieces(info))
    return out


def drop_tables(model) -> None:
    """Tiered path: the layers' tables are not loaded into the model (the row store serves them)."""
    for layer in model.layers:
        if getattr(layer, "engram", None) is not None:
            layer.engram.multi_head_embedding = None


def attach_row_store(model, store, cfg, device: torch.device, ram_available: int,
                     layer_devices: dict[int, torch.device] | None = None,
                     tier: str | None = None) -> EngramRowStore | StagedRows:
    """Build the row store from `[engram]` config and make it the model's row source.

    `layer_devices` (a model staged over several cards): one row store per card, for the Engram layers
    that card runs, so each layer's rows land on its own card; the row cache is shared out by layers.
    `tier`: the planner's choice (`plan.engram.tier`); None resolves `engram.tier` here."""
    ecfg = model.cfg.engram
    tables = [store.index.tables.get(table_name(i)) for i in ecfg.layer_ids]
    table_bytes = sum(t.nbytes for t in tables if t is not None)
    tier = tier or resolve_tier(cfg.engram.tier, table_bytes, ram_available, cfg.tiers.tmpfs.budget_bytes)
    row_bytes = max((t.row_bytes for t in tables if t is not None), default=1)
    cache = cfg.engram.row_cache_bytes
    if cache is None:  # auto: 1/8 of the tables, at most 1 GiB, on the compute device
        cache = min(table_bytes // 8, 1 << 30)
    groups: dict[torch.device, list[int]] = {}
    for layer in ecfg.layer_ids:
        groups.setdefault(torch.device((layer_devices or {}).get(layer, device)), []).append(layer)

    def build(dev: torch.device, layers: list[int]) -> EngramRowStore:
        share = cache * len(layers) // len(ecfg.layer_ids)
        return EngramRowStore(store, layers, tier, dev, share // row_bytes, prefetch=cfg.debug.engram_prefetch,
                              read_batch=cfg.debug.engram_read_batch, tmpfs_dir=cfg.tiers.tmpfs.path,
                              zero_copy=cfg.debug.engram_zero_copy)

    stores = {dev: build(dev, layers) for dev, layers in groups.items()}
    rows = next(iter(stores.values())) if len(stores) == 1 else StagedRows(stores)
    model.engram.source = rows
    return rows


class StagedRows:
    """The row source of a model staged over several cards: each Engram layer's rows come from the row
    store of the card that runs it (`strata.runtime.model.engram.layer.RowSource`)."""

    def __init__(self, stores: dict[torch.device, EngramRowStore]):
        self.stores = stores
        self._of = {layer: rs for rs in stores.values() for layer in rs.tables}

    def start(self, layer: int, rows: torch.Tensor):
        return self._of[layer], self._of[layer].start(layer, rows)

    def wait(self, ticket) -> torch.Tensor:
        rs, inner = ticket
        return rs.wait(inner)

    def prefetch(self, layer: int, rows: torch.Tensor) -> None:
        self._of[layer].prefetch(layer, rows)

    def device_table(self, layer: int) -> None:
        return None  # staged models decode eagerly through `begin` (no device-side steps across cards yet)

    def stats(self) -> dict:
        """Every card's statistics under "devices" (the metrics and dashboard add them up)."""
        return {"tier": next(iter(self.stores.values())).tier,
                "devices": {str(dev): rs.stats() for dev, rs in self.stores.items()}}

    def close(self) -> None:
        for rs in self.stores.values():
            rs.close()
