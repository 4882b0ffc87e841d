"""A Hugging Face checkpoint directory: config, tensor index, expert layout, generation defaults.

Opening a checkpoint reads `config.json`, `generation_config.json` and the safetensors headers only;
weights stay on disk until the loader (or the tier store) reads them by offset. Block-scaled FP8 and MXFP4
weights (strata.runtime.model.quantized) are checked against their scales' shapes at open and dequantized as
they load, except the routed experts a store keeps in their format (`expert_format`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from strata.errors import CheckpointError
from strata.kernels.quant import ExpertFormat
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.names import renamed_index
from strata.runtime.model.gpt_oss.layout import experts_transposed, transposed_shapes
from strata.runtime.model.quantized import check_quantized, plain_dtype, read_weight, stored_shape
from strata.tiers.store.dense_check import DenseCheck
from strata.tiers.store.format import EXPERT_DTYPES, is_store, lacks_index, no_index_error
from strata.tiers.store.safetensors_header import DTYPES, MX_BLOCKS, TensorInfo
from strata.tiers.store.safetensors_index import TensorIndex, read_tensor
from strata.tiers.store.store import ExpertStore

TEXT_MODEL_PREFIX = "language_model."  # where a multimodal release (Kimi K2.5) keeps its language model's tensors
NESTED_TEXT_PREFIX = "model.language_model."  # ... and where Qwen3.5's keeps its decoder (its lm_head at the top)
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
    expert_format: ExpertFormat = field(default_factory=ExpertFormat)  # how the routed experts are stored
    experts_transposed: bool = False  # fused experts as transformers' gpt-oss holds them: [E, H, 2I], [E, I, H]

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
        index = _language_model(TensorIndex.from_dir(directory))
        if config.deepseek_v4 is not None:  # the original release's names -> transformers'
            index = renamed_index(index)
        index.check_dtypes()  # fail before anything is allocated, e.g. on FP8 weights without their scales
        check_quantized(index, config, directory / "config.json")
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
            return cls(directory, hf_config, config, index, "store", eos, store, expert_format=store.expert_format)
        layout = _detect_layout(index, config)
        fmt = _expert_format(index, config, layout)
        return cls(directory, hf_config, config, index, layout, eos, expert_format=fmt,
                   experts_transposed=experts_transposed(config, layout, fmt))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype most weights are stored in, among those computed with as they are (FP8 and MXFP4 weights and
        their scales are not counted: they load dequantized)."""
        counts: dict[str, int] = {}
        if self.store is not None and not self.store.expert_format.quantized:
            counts[self.store.index.dtype] = len(self.store.index.blobs) * self.store.payload_bytes
        for info in self.index.tensors.values():
            if plain_dtype(info):
                counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
        return DTYPES[max(counts, key=counts.get)][0] if counts else torch.bfloat16

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Read one tensor by its transformers name in `dtype` on `device`, checking its shape (and, from a store, its
        checksum: a damaged tensor is a `CheckpointError` naming it). FP8 and MXFP4 weights are dequantized."""
        resolved = self._resolve(name)
        have = stored_shape(self.index, resolved)
        if have != tuple(shape):
            info = self.index[resolved] if resolved in self.index else self.index[resolved + MX_BLOCKS]
            raise CheckpointError(
                f"{info.file}: tensor {resolved!r} has shape {list(have)}, expected {list(shape)} "
                "from config.json; the checkpoint and its config disagree"
            )
        return read_weight(self.index, resolved, dtype, self.config.weight_block, self._read_raw).to(device)

    def _read_raw(self, info: TensorInfo) -> torch.Tensor:
        """A tensor's stored bytes; from a store, checked before they are converted or moved."""
        raw = read_tensor(info, raw=True)
        if self.store is not None:
            if self.dense_check is None:
                self.dense_check = DenseCheck(self.store.directory, self.store.index)
            self.dense_check.check(info.name, raw)
        return raw

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
            if stored_shape(self.index, name) is None and alt not in self.index:  # (MXFP4: `name` + _blocks)
                raise CheckpointError(
                    f"{self.directory}: tensor {name!r} is missing from the checkpoint; the checkpoint is "
                    "incomplete or does not match its config.json"
                )
            out[proj] = name if stored_shape(self.index, name) is not None else alt
        return out

    def load_experts(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """All routed experts of a layer stacked: (gate_up [E, 2I, H], down [E, H, I])."""
        cfg = self.config
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if self.store is not None:
            return self.store.load_layer_experts(layer, dtype, device)
        if self.experts_transposed:  # (gpt-oss in bf16: strata.runtime.model.gpt_oss.layout)
            gu_shape, down_shape = transposed_shapes(cfg)
            gate_up = self.tensor(f"model.layers.{layer}.mlp.experts.gate_up_proj", gu_shape, dtype, "cpu")
            down = self.tensor(f"model.layers.{layer}.mlp.experts.down_proj", down_shape, dtype, "cpu")
            return gate_up.transpose(1, 2).contiguous().to(device), down.transpose(1, 2).contiguous().to(device)
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
        """Map a transformers name to the checkpoint's (Mixtral's original files say block_sparse_moe, MiniMax-M2's
        keep the router's correction bias beside the router, `block_sparse_moe.e_score_correction_bias`; an MXFP4
        weight is its `_blocks` + `_scales` pair, found by the weight's own name)."""
        if stored_shape(self.index, name) is not None:
            return name
        mixtral = name.replace(".mlp.", ".block_sparse_moe.")
        beside = ".gate.e_score_correction_bias", ".e_score_correction_bias"
        for alt in (mixtral, name.replace(*beside), mixtral.replace(*beside)):
            if stored_shape(self.index, alt) is not None:
                return alt
        if missing_ok:
            return None
        raise CheckpointError(
            f"{self.directory}: tensor {name!r} is missing from the checkpoint; the checkpoint is incomplete "
            "or does not match its config.json"
        )


def _language_model(index: TensorIndex) -> TensorIndex:
    """`index` as a causal LM's tensors: a multimodal release whose language model sits under `language_model.`
    (Kimi K2.5, beside its vision_tower and mm_projector) gives that model's tensors under transformers' names
    (`language_model.model.layers...` -> `model.layers...`, `language_model.lm_head` -> `lm_head`), or under
    `model.language_model.` (Qwen3.5: `model.language_model.layers...` -> `model.layers...`), leaving the other towers
    and the MTP layers out; any other index is returned as it is."""
    if "model.embed_tokens.weight" not in index and NESTED_TEXT_PREFIX + "embed_tokens.weight" in index:
        nested = {"model." + name.removeprefix(NESTED_TEXT_PREFIX): info for name, info in index.tensors.items()
                  if name.startswith(NESTED_TEXT_PREFIX)}  # (Qwen3.5: beside model.visual and mtp)
        nested |= {name: info for name, info in index.tensors.items() if name.startswith("lm_head.")}
        return TensorIndex({name: replace(info, name=name) for name, info in nested.items()})
    if "model.embed_tokens.weight" in index or TEXT_MODEL_PREFIX + "model.embed_tokens.weight" not in index:
        return index
    return TensorIndex({name.removeprefix(TEXT_MODEL_PREFIX): replace(info, name=name.removeprefix(TEXT_MODEL_PREFIX))
                        for name, info in index.tensors.items() if name.startswith(TEXT_MODEL_PREFIX)})


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
    if stored_shape(index, f"model.layers.{first}.mlp.experts.gate_up_proj") is not None:
        return "fused"
    pattern = re.compile(rf"model\.layers\.{first}\.(mlp|block_sparse_moe)\.experts\.\d+\.")
    if any(pattern.match(n) for n in index.names()):
        return "per-expert"
    raise CheckpointError(
        f"no expert tensors found for MoE layer {first} (looked for mlp.experts.gate_up_proj and "
        "mlp.experts.E.gate_proj.weight); the checkpoint does not match its config.json"
    )



def _expert_format(index: TensorIndex, cfg: ModelConfig, layout: str) -> ExpertFormat:
    """How the checkpoint's routed experts are stored, from the first MoE layer's first expert: their plain dtype,
    block-scaled FP8 (config.json's weight_block_size) or MXFP4 (`*_blocks` + `*_scales`)."""
    first = next((i for i, moe in enumerate(cfg.moe_layers) if moe), None)
    if first is None:
        return ExpertFormat()
    if layout == "fused":
        name = f"model.layers.{first}.mlp.experts.gate_up_proj"
        if name + MX_BLOCKS in index:
            return ExpertFormat("mxfp4")
    else:
        candidates = (f"model.layers.{first}.mlp.experts.0.gate_proj.weight",
                      f"model.layers.{first}.block_sparse_moe.experts.0.w1.weight")
        name = next((n for n in candidates if n in index), None)
        if name is None and candidates[0] + MX_BLOCKS in index:  # (DeepSeek-V4's FP4 experts, one tensor each)
            return ExpertFormat("mxfp4")
        if name is None:  # named by `expert_names` when the experts are read
            return ExpertFormat()
    info = index[name]
    if info.dtype == "F8_E4M3":
        return ExpertFormat("fp8", block=cfg.weight_block)
    if info.dtype not in EXPERT_DTYPES:
        raise CheckpointError(f"{info.file}: expert tensor {info.name!r} is {info.dtype}; strata reads experts in "
                              f"{', '.join(EXPERT_DTYPES)}, block-scaled FP8 or MXFP4")
    return ExpertFormat("plain", info.dtype)
