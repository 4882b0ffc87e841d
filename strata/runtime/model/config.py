"""`ModelConfig`: one normalised description of every supported MoE architecture.

Hugging Face configs name the same things differently per architecture and per transformers version
(`num_experts` vs `num_local_experts` vs `n_routed_experts`, `rope_scaling` vs `rope_parameters`).
`ModelConfig.from_hf` reads any of them into one dataclass, so the model code never looks at the raw
dict; each architecture's reading is in strata.runtime.model.hf_config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import CheckpointError, UnsupportedError
from strata.runtime.model import hf_config
from strata.runtime.model.deepseek_v4.config import DeepseekV4Settings
from strata.runtime.model.engram.hashing import EngramConfig
from strata.runtime.model.gpt_oss.config import GptOssSettings
from strata.runtime.model.qwen3_5.config import Qwen35Settings

SUPPORTED_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral",
                           "glm4_moe", "deepseek_v2", "kimi_k2", "kimi_k25", "deepseek_v4", "minimax_m2",
                           "qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@dataclass
class RopeConfig:
    """Rotary embedding parameters (transformers' `rope_parameters`)."""

    rope_type: str = "default"
    theta: float = 10000.0
    dim: int = 0  # rotary dimension: head_dim (GQA) or qk_rope_head_dim (MLA), times partial_rotary_factor
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedError(
                f"RoPE type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.dim <= 0 or self.dim % 2:
            raise CheckpointError(f"config.json: rotary dimension {self.dim} must be a positive even number")


@dataclass
class ModelConfig:
    """Everything the runtime needs to build and run a model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    # attention
    attention: str  # "gqa" | "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim; for MLA the q/k head dim (nope + rope)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False  # MiniMax-M2: one RMSNorm over all heads' q [heads * d] (and k), not one per head
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer, None = full attention
    # MLA (deepseek_v3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    attention_scale: float = 0.0  # softmax scale (set in __post_init__ when 0)
    # MLP / MoE
    intermediate_size: int = 0  # dense MLP width
    moe_intermediate_size: int = 0  # routed expert width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_layers: list[bool] = field(default_factory=list)
    router: str = "softmax"  # "softmax" | "sigmoid_group" (DeepSeek-V3, GLM-4.5) | "softmax_group" (DeepSeek-V2)
    #                           | "sigmoid_topk" (MiniMax-M2)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # qwen2_moe: sigmoid(gate(x)) * shared(x)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    engram: EngramConfig | None = None  # Engram layers (config.json's `engram` section); None: none
    # config.json's quantization_config: "fp8" (block-scaled e4m3, `weight` + `weight_scale_inv`), "mxfp4" (`*_blocks`
    # + `*_scales`), "" (none); weight_block: fp8's weight_block_size (rows, cols) per scale
    quant_method: str = ""
    weight_block: tuple[int, int] | None = None
    deepseek_v4: DeepseekV4Settings | None = None  # what only DeepSeek-V4 has (strata.runtime.model.deepseek_v4)
    gpt_oss: GptOssSettings | None = None  # what only gpt-oss has (strata.runtime.model.gpt_oss)
    qwen3_5: Qwen35Settings | None = None  # Qwen3.5-MoE's linear-attention layers (strata.runtime.model.qwen3_5)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "num_experts",
                    "num_experts_per_tok")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise CheckpointError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise CheckpointError(
                f"config.json: num_experts_per_tok {self.num_experts_per_tok} exceeds the {self.num_experts} experts"
            )
        if self.router in ("sigmoid_group", "softmax_group") and (
            self.num_experts % self.n_group or self.topk_group > self.n_group
        ):
            raise CheckpointError(
                f"config.json: {self.num_experts} experts cannot be split into n_group={self.n_group} "
                f"with topk_group={self.topk_group}"
            )
        if len(self.moe_layers) != self.num_layers or len(self.sliding_windows) != self.num_layers:
            raise CheckpointError("config.json: per-layer lists do not match num_hidden_layers")
        if not self.attention_scale:
            self.attention_scale = self.head_dim**-0.5

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def fp32_router(self) -> bool:
        """Whether the router's weights stay in fp32 whatever the model dtype (DeepSeek's and GLM's routers: their
        `_keep_in_fp32_modules` in transformers); DeepSeek-V4 keeps only the correction bias in fp32, MiniMax-M2
        nothing."""
        return self.router in ("sigmoid_group", "softmax_group") and self.deepseek_v4 is None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Normalise a Hugging Face `config.json` dict; unknown architectures raise `UnsupportedError`."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedError(
                f"{source}: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type == "kimi_k25":  # a multimodal release: the language model's config is its text_config
            cfg = hf_config.kimi_k25_text(cfg, source)
        method, block = hf_config.quantization(cfg.get("quantization_config"), source)
        try:
            fields = hf_config.PARSERS[model_type](cfg, source)
            parsed = cls(**{**fields, "rope": RopeConfig(**fields["rope"])})
            parsed.engram = EngramConfig.from_hf(cfg.get("engram"), parsed.num_layers, source)
            parsed.quant_method, parsed.weight_block = method, block
            return parsed
        except KeyError as e:
            raise CheckpointError(f"{source}: required key {e.args[0]!r} is missing for {model_type}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed value ({e})") from None
