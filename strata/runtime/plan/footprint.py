"""What the planner reads from a checkpoint or a store, from headers alone: a model's footprint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from strata.runtime.model.checkpoint import read_json
from strata.runtime.model.config import ModelConfig
from strata.runtime.plan.inspect import summarize_checkpoint
from strata.tiers.store import format as store_format
from strata.tiers.store.safetensors_index import DTYPE_BITS


@dataclass
class ModelFootprint:
    """What the planner needs from a checkpoint or a store; bytes as stored (the checkpoint's dtype)."""

    path: str
    source: str  # "checkpoint" | "store"
    config: ModelConfig
    moe_layers: int
    experts_per_layer: int
    expert_bytes: int  # one routed expert's payload (gate, up, down)
    slot_bytes: int  # its slot in the store and the host tiers: the payload rounded up to 4 KiB
    non_expert_bytes: int  # every tensor the engine loads that is not a routed expert
    itemsize: int  # bytes per element of the stored weights
    store_bytes: int  # the store's size on disk (existing, or to be built)
    engram_table_bytes: int = 0  # Engram lookup tables, as stored (served by the row store, not the dense weights)

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.experts_per_layer


def read_footprint(model_dir: str | Path) -> ModelFootprint:
    """Read a checkpoint directory or a strata store (it has store.msgpack) without reading weights."""
    path = Path(model_dir)
    if store_format.is_store(path):
        return _store_footprint(path)
    s = summarize_checkpoint(path)
    cfg = _model_config(path)
    itemsize = DTYPE_BITS.get(s.dtype, 16) // 8
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * itemsize  # the store's payload_bytes
    # MTP is never loaded; Engram tables live in the tiers as row objects, not with the dense weights
    non_expert = s.total_bytes - s.bytes_by_role["experts"] - s.bytes_by_role["mtp"] - s.bytes_by_role["engram_tables"]
    slot = store_format.align_up(expert)
    return ModelFootprint(
        path=str(path), source="checkpoint", config=cfg, moe_layers=cfg.num_moe_layers,
        experts_per_layer=cfg.num_experts, expert_bytes=expert, slot_bytes=slot, non_expert_bytes=non_expert,
        itemsize=itemsize,
        store_bytes=store_format.align_up(non_expert) + cfg.num_moe_layers * cfg.num_experts * slot
        + store_format.align_up(s.bytes_by_role["engram_tables"]),
        engram_table_bytes=s.bytes_by_role["engram_tables"],
    )  # fmt: skip


def _store_footprint(path: Path) -> ModelFootprint:
    idx = store_format.read_index(path)
    dense = idx.dense.size - idx.dense.data_start if idx.dense is not None else 0
    return ModelFootprint(
        path=str(path), source="store", config=_model_config(path), moe_layers=len(idx.moe_layers),
        experts_per_layer=idx.num_experts, expert_bytes=idx.payload_bytes, slot_bytes=idx.slot_bytes,
        non_expert_bytes=dense, itemsize=store_format.itemsize(idx.dtype),
        store_bytes=sum(idx.file_sizes().values()), engram_table_bytes=sum(t.nbytes for t in idx.tables.values()),
    )  # fmt: skip


def _model_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(read_json(path / "config.json"), str(path / "config.json"))
