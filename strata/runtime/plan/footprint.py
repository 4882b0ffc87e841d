"""What the planner reads from a checkpoint or a store, from headers alone: a model's footprint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.runtime.model.checkpoint import read_json
from strata.runtime.model.config import ModelConfig
from strata.runtime.plan.checkpoints.expert_sources import store_format as experts_format
from strata.runtime.plan.checkpoints.inspect import (
    FP8,
    FP8_SCALES,
    RESIDENT_ROLES,
    CheckpointSummary,
    summarize_checkpoint,
)
from strata.tiers.store import format as store_format
from strata.tiers.store.safetensors_header import DTYPE_BITS

PLAIN_DTYPES = ("BF16", "F16", "F32")


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
    expert_format: ExpertFormat = field(default_factory=ExpertFormat)  # the store's (existing, or to be built)
    dense_format: str = ""  # the resident weights' formats, e.g. "bf16 + fp8 128x128"
    dense_fp8_bytes: int = 0  # of non_expert_bytes: FP8 values (one byte an element, dequantized when loaded) ...
    dense_scale_bytes: int = 0  # ... and their block scales (dropped when loaded)
    dtype: str = "BF16"  # the plain dtype ("BF16", "F16", "F32") holding most of the weights' bytes

    @property
    def cpu_dtype(self) -> str:
        """runtime.dtype "auto" on the CPU: a bf16 checkpoint computes in bf16 (accumulating in fp32), as llama.cpp
        computes a bf16 GGUF; float16 and float32 checkpoints in float32 (the CPU has no fast fp16 matmul)."""
        return "bfloat16" if self.dtype == "BF16" else "float32"

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.experts_per_layer

    def non_expert_bytes_in(self, itemsize: int) -> int:
        """The non-expert weights' bytes once loaded in a compute dtype of `itemsize` bytes: plain tensors converted,
        FP8 ones dequantized (their scales dropped)."""
        plain = self.non_expert_bytes - self.dense_fp8_bytes - self.dense_scale_bytes
        return int(plain * itemsize / self.itemsize) + self.dense_fp8_bytes * itemsize

    def gpu_slot_bytes(self, itemsize: int) -> int:
        """One expert's GPU slot in the planner's count: plain experts in a compute dtype of `itemsize` bytes, FP8 and
        MXFP4 ones as stored (their GPU slots hold the blob)."""
        if self.expert_format.quantized:
            return self.slot_bytes
        return self.expert_bytes * itemsize // self.itemsize


def read_footprint(model_dir: str | Path, experts: str = "checkpoint") -> ModelFootprint:
    """Read a checkpoint directory or a strata store (it has store.msgpack) without reading weights. `experts`: the
    `[store] experts` a checkpoint's store is (to be) built with, which fixes the experts' bytes."""
    path = Path(model_dir)
    if store_format.is_store(path):
        return _store_footprint(path)
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_footprint(path)
    s = summarize_checkpoint(path)
    cfg = _model_config(path)
    plain = _plain_dtype(s.bytes_by_dtype)
    itemsize = DTYPE_BITS[plain] // 8
    src = s.expert_format or ExpertFormat("plain", plain)
    fmt = experts_format(src, experts, cfg.hidden_size, cfg.moe_intermediate_size, str(path))
    expert = ExpertLayout.build(fmt, cfg.hidden_size, cfg.moe_intermediate_size).payload_bytes  # the store's payload
    # MTP is never loaded; Engram tables live in the tiers as row objects, not with the dense weights
    non_expert = s.total_bytes - s.bytes_by_role["experts"] - s.bytes_by_role["mtp"] - s.bytes_by_role["engram_tables"]
    slot = store_format.align_up(expert)
    return ModelFootprint(
        path=str(path), source="checkpoint", config=cfg, moe_layers=cfg.num_moe_layers,
        experts_per_layer=cfg.num_experts, expert_bytes=expert, slot_bytes=slot, non_expert_bytes=non_expert,
        itemsize=itemsize,
        store_bytes=store_format.align_up(non_expert) + cfg.num_moe_layers * cfg.num_experts * slot
        + store_format.align_up(s.bytes_by_role["engram_tables"]),
        engram_table_bytes=s.bytes_by_role["engram_tables"], dtype=plain, expert_format=fmt,
        **_dense_formats(s),
    )  # fmt: skip


def _dense_formats(s: CheckpointSummary) -> dict:
    """The footprint's fields on the resident weights' formats, from a summary."""
    fp8 = scales = 0
    for role in RESIDENT_ROLES:
        formats = s.formats_by_role.get(role, {})
        fp8, scales = fp8 + formats.get(FP8, 0), scales + formats.get(FP8_SCALES, 0)
    return dict(dense_format=s.roles_format(RESIDENT_ROLES)[0], dense_fp8_bytes=fp8, dense_scale_bytes=scales)


def _store_footprint(path: Path) -> ModelFootprint:
    idx = store_format.read_index(path)
    dense = idx.dense.size - idx.dense.data_start if idx.dense is not None else 0
    s = summarize_checkpoint(path)  # dense.safetensors' header and the index
    plain = idx.dtype if not idx.expert_format.quantized else _plain_dtype(s.bytes_by_dtype)
    return ModelFootprint(
        path=str(path), source="store", config=_model_config(path), moe_layers=len(idx.moe_layers),
        experts_per_layer=idx.num_experts, expert_bytes=idx.payload_bytes, slot_bytes=idx.slot_bytes,
        non_expert_bytes=dense, itemsize=store_format.itemsize(plain),
        store_bytes=sum(idx.file_sizes().values()), engram_table_bytes=sum(t.nbytes for t in idx.tables.values()),
        dtype=plain, expert_format=idx.expert_format, **_dense_formats(s),
    )  # fmt: skip


def _plain_dtype(bytes_by_dtype: dict[str, int]) -> str:
    """The plain dtype with the most bytes; "BF16" when there is none (quantized weights dequantize to bf16)."""
    plain = {d: n for d, n in bytes_by_dtype.items() if d in PLAIN_DTYPES}
    return max(plain, key=plain.get) if plain else "BF16"


def _model_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(read_json(path / "config.json"), str(path / "config.json"))


def _gguf_footprint(path: Path) -> ModelFootprint:
    """A GGUF file's: its store keeps the experts' ggml blocks (one slot each), BF16 tensors as they are and every
    other tensor in float32."""
    from strata.runtime.plan.checkpoints.gguf_inspect import summarize_gguf
    from strata.tiers.store.gguf_reader import GGUFFile

    f = GGUFFile.open(path)
    s = summarize_gguf(path)
    cfg = ModelConfig.from_hf(f.hf_config, str(path))
    fmt = s.expert_format or ExpertFormat("plain", "F32")
    expert = ExpertLayout.build(fmt, cfg.hidden_size, cfg.moe_intermediate_size).payload_bytes
    dense = [t for name, t in f.tensors.items() if "_exps" not in name]
    bf16 = sum(int(t.n_elements) for t in dense if t.tensor_type.name == "BF16")
    f32 = sum(int(t.n_elements) for t in dense) - bf16
    non_expert = 2 * bf16 + 4 * f32
    plain = "BF16" if 2 * bf16 > 4 * f32 else "F32"  # the dtype holding most of the dense bytes, as the store's
    slot = store_format.align_up(expert)
    return ModelFootprint(
        path=str(path), source="checkpoint", config=cfg, moe_layers=cfg.num_moe_layers,
        experts_per_layer=cfg.num_experts, expert_bytes=expert, slot_bytes=slot, non_expert_bytes=non_expert,
        itemsize=2 if plain == "BF16" else 4,
        store_bytes=store_format.align_up(non_expert) + cfg.num_moe_layers * cfg.num_experts * slot,
        dtype=plain, expert_format=fmt, dense_format="bf16 + f32" if bf16 and f32 else plain.lower(),
    )  # fmt: skip
