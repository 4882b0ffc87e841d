"""A Hugging Face checkpoint directory: config, tensor index, expert layout, generation defaults.

Opening a checkpoint reads `config.json`, `generation_config.json` and the safetensors headers only;
weights stay on disk until the loader (or the tier store) reads them by offset.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata.errors import CheckpointError
from strata.runtime.model.config import ModelConfig
from strata.tiers.store.dense_check import DenseCheck
from strata.tiers.store.format import is_store, lacks_index, no_index_error
from strata.tiers.store.safetensors_index import DTYPES, TensorIndex, read_tensor
from strata.tiers.store.store import ExpertStore

# Mixtral's original names for gate / up / down
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def read_json(path: Path) -> dict:
    """Read a JSON object, turning every failure into a one-line `CheckpointError`."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


@dataclass
class Checkpoint:
    """An opened checkpoint: what is in it and where, nothing loaded."""

    directory: Path
    hf_config: dict
    config: ModelConfig
    index: TensorIndex
    expert_layout: str  # "per-expert" | "fused" | "store"
    eos_token_ids: list[int]
    store: ExpertStore | None = None  # set when the directory is a strata expert store
    dense_check: DenseCheck | None = field(default=None, repr=False)  # a store's dense tensors, checked as read

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        """Open a checkpoint directory; raises `CheckpointError` / `UnsupportedError` naming the problem."""
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such checkpoint directory")
        if lacks_index(directory):  # a store's files without its index: not a checkpoint either
            raise no_index_error(directory)
        if not (directory / "config.json").exists():
            raise CheckpointError(
                f"{directory}: no config.json; point strata at a Hugging Face checkpoint directory"
            )
        hf_config = read_json(directory / "config.json")
        config = ModelConfig.from_hf(hf_config, str(directory / "config.json"))
        index = TensorIndex.from_dir(directory)
        index.check_dtypes()  # fail before anything is allocated, e.g. on an FP8 checkpoint
        eos = list(config.eos_token_ids)
        gen_path = directory / "generation_config.json"
        if gen_path.exists():
            gen_eos = read_json(gen_path).get("eos_token_id")
            for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
                if e is not None and int(e) not in eos:
                    eos.append(int(e))
        if is_store(directory):  # dense tensors in dense.safetensors, experts in aligned blobs
            store = ExpertStore.open(directory)
            _check_store_layout(directory, store, config)
            return cls(directory, hf_config, config, index, "store", eos, store)
        layout = _detect_layout(index, config)
        return cls(directory, hf_config, config, index, layout, eos)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype most weights are stored in."""
        if self.store is not None:
            return self.store.dtype
        counts: dict[str, int] = {}
        for info in self.index.tensors.values():
            counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
        return DTYPES[max(counts, key=counts.get)][0]

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Read one non-expert tensor by its transformers name, checking its shape (and, from a store, its
        checksum: a damaged tensor is a `CheckpointError` naming it)."""
        info = self.index[self._resolve(name)]
        if info.shape != tuple(shape):
            raise CheckpointError(
                f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, expected {list(shape)} "
                "from config.json; the checkpoint and its config disagree"
            )
        if self.store is None:
            return self.index.load(info.name, dtype, device)
        if self.dense_check is None:
            self.dense_check = DenseCheck(self.store.directory, self.store.index)
        raw = read_tensor(info)  # as stored: checked before it is converted or moved
        self.dense_check.check(info.name, raw)
        return raw.to(dtype).to(device)

    def finish_loading(self) -> None:
        """Called once a model's dense tensors are loaded: from a store, checks those it did not load (once)
        and records the file as verified, so a restart that finds it unchanged skips the checksums."""
        if self.dense_check is not None:
            self.dense_check.finish()

    def has(self, name: str) -> bool:
        return self._resolve(name, missing_ok=True) is not None

    def expert_names(self, layer: int, expert: int) -> dict[str, str]:
        """Per-expert layout: checkpoint names of one expert's gate / up / down weights."""
        out = {}
        for proj, mixtral in _MIXTRAL_PROJ.items():
            name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
            alt = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{mixtral}.weight"
            if name not in self.index and alt not in self.index:
                raise CheckpointError(
                    f"{self.directory}: tensor {name!r} is missing from the checkpoint; the checkpoint is "
                    "incomplete or does not match its config.json"
                )
            out[proj] = name if name in self.index else alt
        return out

    def load_experts(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """All routed experts of a layer stacked: (gate_up [E, 2I, H], down [E, H, I])."""
        cfg = self.config
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if self.store is not None:
            return self.store.load_layer_experts(layer, dtype, device)
        if self.expert_layout == "fused":
            gate_up = self.tensor(f"model.layers.{layer}.mlp.experts.gate_up_proj", (e, 2 * i, h), dtype, device)
            down = self.tensor(f"model.layers.{layer}.mlp.experts.down_proj", (e, h, i), dtype, device)
            return gate_up, down
        gate_up = torch.empty(e, 2 * i, h, dtype=dtype, device=device)
        down = torch.empty(e, h, i, dtype=dtype, device=device)
        for x in range(e):
            names = self.expert_names(layer, x)
            gate_up[x, :i] = self.tensor(names["gate_proj"], (i, h), dtype, device)
            gate_up[x, i:] = self.tensor(names["up_proj"], (i, h), dtype, device)
            down[x] = self.tensor(names["down_proj"], (h, i), dtype, device)
        return gate_up, down

    def _resolve(self, name: str, missing_ok: bool = False) -> str | None:
        """Map a transformers name to the checkpoint's (Mixtral's original files say block_sparse_moe)."""
        if name in self.index:
            return name
        alt = name.replace(".mlp.", ".block_sparse_moe.")
        if alt in self.index:
            return alt
        if missing_ok:
            return None
        raise CheckpointError(
            f"{self.directory}: tensor {name!r} is missing from the checkpoint; the checkpoint is incomplete "
            "or does not match its config.json"
        )


def _check_store_layout(directory: Path, store: ExpertStore, cfg: ModelConfig) -> None:
    """The store's experts are laid out as its config.json says (the copy follows the checkpoint's)."""
    idx = store.index
    moe = [layer for layer, is_moe in enumerate(cfg.moe_layers) if is_moe]
    have = (idx.moe_layers, idx.num_experts, idx.hidden, idx.moe_intermediate)
    if have != (moe, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size):
        raise CheckpointError(
            f"{directory / 'config.json'}: MoE layers {moe}, {cfg.num_experts} experts of hidden {cfg.hidden_size} x "
            f"{cfg.moe_intermediate_size}, but the store holds MoE layers {idx.moe_layers}, {idx.num_experts} "
            f"experts of {idx.hidden} x {idx.moe_intermediate}; config.json does not describe these weights: "
            "restore it, or convert the checkpoint it belongs to")


def _detect_layout(index: TensorIndex, cfg: ModelConfig) -> str:
    """Per-expert (`experts.E.gate_proj`, Mixtral `experts.E.w1`) or fused 3-D (`experts.gate_up_proj`)."""
    first = next((i for i, moe in enumerate(cfg.moe_layers) if moe), None)
    if first is None:
        return "per-expert"
    if f"model.layers.{first}.mlp.experts.gate_up_proj" in index:
        return "fused"
    pattern = re.compile(rf"model\.layers\.{first}\.(mlp|block_sparse_moe)\.experts\.\d+\.")
    if any(pattern.match(n) for n in index.names()):
        return "per-expert"
    raise CheckpointError(
        f"no expert tensors found for MoE layer {first} (looked for mlp.experts.gate_up_proj and "
        "mlp.experts.E.gate_proj.weight); the checkpoint does not match its config.json"
    )

