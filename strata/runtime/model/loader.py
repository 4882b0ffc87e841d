"""Build a `MoETransformer` from a checkpoint, reading each tensor by offset straight into place.

The model is constructed on the meta device (no memory), then every parameter is read from the
checkpoint in the target dtype on the target device, one tensor at a time, so peak host memory is
the model plus one tensor, never a whole shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.model import DeepseekV4Transformer
from strata.runtime.model.gpt_oss.model import GptOssTransformer
from strata.runtime.model.qwen3_5.model import Qwen35Transformer
from strata.runtime.model.rope import RotaryEmbedding
from strata.runtime.model.transformer import MoETransformer

# Parameters kept in fp32 whatever the model dtype (transformers' _keep_in_fp32_modules for DeepSeek and GLM)
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def checkpoint_name(param: str) -> str:
    """Model parameter name -> transformers checkpoint name (everything but lm_head sits under `model.`)."""
    return param if param.startswith("lm_head.") else f"model.{param}"


def build_transformer(cfg: ModelConfig) -> MoETransformer | DeepseekV4Transformer | GptOssTransformer | Qwen35Transformer:
    """The model class of `cfg`'s architecture, built with its parameters uninitialised (on the current device)."""
    if cfg.gpt_oss is not None:
        return GptOssTransformer(cfg)
    if cfg.qwen3_5 is not None:
        return Qwen35Transformer(cfg)
    return DeepseekV4Transformer(cfg) if cfg.deepseek_v4 is not None else MoETransformer(cfg)


def load_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device | str, progress: bool = False,
               prepare: Callable[[MoETransformer], None] | None = None) -> MoETransformer:
    """Instantiate the checkpoint's model with its weights, in `dtype` on `device`.

    `prepare` may swap modules before weights are read (tiered experts have no parameters to load).
    """
    cfg = ckpt.config
    with torch.device("meta"):
        model = build_transformer(cfg)
    if prepare is not None:
        prepare(model)
    state: dict[str, torch.Tensor] = {}
    fp32_router = cfg.fp32_router
    entries = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not n.startswith("rotary.")]
    bar = tqdm(total=len(entries), desc="loading weights", unit="tensor", disable=not progress, leave=False)
    experts_done: set[int] = set()
    name_of = getattr(model, "checkpoint_name", checkpoint_name)  # (gpt-oss: its dense expert biases' names)
    for name, meta in entries:
        bar.update(1)
        want = torch.float32 if fp32_router and name.endswith(FP32_SUFFIXES) else dtype
        if getattr(model, "keeps_fp32", None) is not None and model.keeps_fp32(name):
            want = torch.float32  # (DeepSeek-V4: hyper-connections, norms, sinks, compressor biases)
        if not meta.dtype.is_floating_point:
            want = meta.dtype  # integer buffers (Engram's token_map) keep their dtype
        if ".mlp.experts." in name:
            layer = int(name.split(".")[1])
            if layer not in experts_done:  # gate_up and down load together
                gate_up, down = ckpt.load_experts(layer, dtype, device)
                state[f"layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
                state[f"layers.{layer}.mlp.experts.down_proj"] = down
                experts_done.add(layer)
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings and not ckpt.has("lm_head.weight"):
            continue  # tied below
        state[name] = ckpt.tensor(name_of(name), tuple(meta.shape), want, device)
    bar.close()
    ckpt.finish_loading()  # a store's dense tensors: all checked once, then recorded as verified
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(cfg.rope).to(device)  # a non-persistent buffer: computed, not loaded
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def count_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.parameters())
