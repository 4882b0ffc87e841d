"""Qwen3.5 / 3.6 MoE's config.json: the fields of `ModelConfig` and the settings only this architecture has
(`Qwen35Settings`).

`ModelConfig.from_hf` (strata.runtime.model.config) builds its `ModelConfig` from `qwen3_5_fields` and reads the
rotary settings from the text config it returns; this module imports nothing of the model, so the config module can
import it. Releases are multimodal (`qwen3_5_moe`: the language model's config under `text_config`, beside the
vision tower's); a text-only checkpoint (`qwen3_5_moe_text`, transformers' Qwen3_5MoeForCausalLM) is flat. The
defaults are transformers 5.25's `Qwen3_5MoeTextConfig`'s (Qwen3.5-35B-A3B's shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.errors import CheckpointError, UnsupportedError

LINEAR, FULL = "linear_attention", "full_attention"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_TOP_KEYS = ("bos_token_id", "eos_token_id", "tie_word_embeddings")  # kept at the top of a multimodal release


@dataclass
class Qwen35Settings:
    """What Qwen3.5-MoE adds to `ModelConfig` (names as transformers' `Qwen3_5MoeTextConfig`): which layers are Gated
    DeltaNet linear attention and the shapes of those layers."""

    layer_types: list[str]  # per layer: linear_attention | full_attention
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    @property
    def key_dim(self) -> int:
        """Width of the linear layers' queries and keys (all heads)."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of the linear layers' values and output gate (all heads)."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: queries, keys and values together."""
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear attention) layer."""
        return self.layer_types[layer] == LINEAR

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]


def text_config(cfg: dict, source: str) -> dict:
    """The language model's config: `text_config` completed by the keys a multimodal release keeps at the top, or
    a text-only checkpoint's config as it is."""
    if cfg.get("model_type") == "qwen3_5_moe_text":
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: qwen3_5_moe has no text_config object (its language model); re-download "
                              "config.json")
    if text.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
        raise UnsupportedError(f"{source}: text_config.model_type {text.get('model_type')!r} is not supported; "
                               "qwen3_5_moe's language model is qwen3_5_moe_text")
    return {**{k: cfg[k] for k in _TOP_KEYS if k in cfg}, **text}


def qwen3_5_fields(cfg: dict, source: str) -> tuple[dict, dict[str, Any]]:
    """config.json of a Qwen3.5-MoE checkpoint -> (its text config, `ModelConfig`'s fields but `rope`)."""
    text = text_config(cfg, source)
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedError(f"{source}: hidden_act {act!r} is not supported; only SwiGLU (silu) experts are")
    n = int(text.get("num_hidden_layers", 40))
    types = text.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer attends in full
        interval = int(text.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise CheckpointError(f"{source}: layer_types has {len(types)} entries for {n} layers; fix config.json")
    bad = sorted({t for t in types if t not in (LINEAR, FULL)})
    if bad:
        raise CheckpointError(f"{source}: layer_types entries {bad} are not among {LINEAR}, {FULL}; fix config.json")
    settings = Qwen35Settings(
        layer_types=types,
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
    )
    s = settings
    if min(s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim,
           s.linear_conv_kernel_dim) <= 0:
        raise CheckpointError(f"{source}: the linear_* head counts, head dims and linear_conv_kernel_dim must be "
                              "positive; fix config.json")
    if s.linear_num_value_heads % s.linear_num_key_heads:
        raise CheckpointError(f"{source}: linear_num_value_heads {s.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {s.linear_num_key_heads}; fix config.json")
    heads = int(text.get("num_attention_heads", 16))
    hidden = int(text.get("hidden_size", 2048))
    head_dim = int(text.get("head_dim") or 256)
    bias = bool(text.get("attention_bias", False))
    eos = text.get("eos_token_id")
    return text, dict(
        model_type=str(cfg["model_type"]),
        vocab_size=int(text.get("vocab_size", 248320)),
        hidden_size=hidden,
        num_layers=n,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        attention="gqa",  # the full-attention layers (with an output gate and zero-centred q/k norms)
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or 2),
        head_dim=head_dim,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        sliding_windows=[None] * n,
        moe_intermediate_size=int(text.get("moe_intermediate_size", 512)),
        num_experts=int(text.get("num_experts", 256)),
        num_experts_per_tok=int(text.get("num_experts_per_tok", 8)),
        moe_layers=[True] * n,  # every layer's MLP is the sparse MoE block
        router="softmax",
        norm_topk_prob=True,  # transformers' Qwen3_5MoeTopKRouter always renormalises the top k
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 512)),
        shared_expert_gated=True,  # sigmoid(shared_expert_gate(x)) * shared_expert(x), as Qwen2-MoE
        eos_token_ids=[] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
        bos_token_id=text.get("bos_token_id"),
        qwen3_5=settings,
    )
