"""The demo models' configurations: each random size's config.json (DeepSeek-V3 or Qwen3-MoE, with Engram
layers unless left out; `--arch` writes a size in another architecture: `ARCH_CONFIGS`), generation_config.json,
and `DemoSpec`, the validated parameters of one model to write (strata.runtime.demo.model writes it).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError
from strata.runtime.demo.quantized import DEMO_EXPERTS, quantization_config, weight_jobs
from strata.runtime.demo.skew import check_locality, check_skew
from strata.runtime.demo.tokenizer import ENDOFTEXT, IM_END, SPECIAL_IDS
from strata.runtime.demo.weights import tensor_specs

DEMO_SIZES: tuple[str, ...] = ("tiny", "small", "bench")  # random weights, written on demand
TRAINED_SIZE = "demo"  # trained weights, shipped in the package (strata.runtime.demo.train)
DEFAULT_SHARD_BYTES = 4_000_000_000  # HF's "4GB" shard size (decimal)
TOKENIZER_VOCAB = {"tiny": 512, "small": 8192, "bench": 8192}

DEEPSEEK_COMMON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,  # no multi-token-prediction layer is written
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,  # DeepSeek's layout; real checkpoints omit it (transformers' default is True)
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
    "use_cache": True,
}

BASE_CONFIGS: dict[str, dict] = {
    "tiny": {
        **DEEPSEEK_COMMON,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "max_position_embeddings": 4096,
    },
    "small": {
        **DEEPSEEK_COMMON,
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 8,
        "first_k_dense_replace": 1,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_group": 8,
        "topk_group": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 256,
        "kv_lora_rank": 128,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "max_position_embeddings": 8192,
    },
    "bench": {  # Qwen/Qwen3-30B-A3B's config.json, field for field
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}

# `--arch`: sizes written in another architecture than the size's own (tiny/small: deepseek_v3, bench: qwen3_moe)
GLM4_MOE_COMMON = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "n_group": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,  # no multi-token-prediction layer is written
    "partial_rotary_factor": 0.5,
    "rope_scaling": None,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_cache": True,
}
DEEPSEEK_V2_COMMON = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "moe_layer_freq": 1,
    "n_group": 1,
    "norm_topk_prob": False,
    "rms_norm_eps": 1e-6,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "use_cache": True,
}
MINIMAX_M2_COMMON = {  # the keys of MiniMaxAI/MiniMax-M2's config.json transformers reads (its MTP modules left out)
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
}
ARCH_CONFIGS: dict[str, dict[str, dict]] = {
    "glm4_moe": {
        "tiny": {
            **GLM4_MOE_COMMON, "attention_bias": True, "use_qk_norm": True, "vocab_size": 512, "hidden_size": 64,
            "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        },
        "bench": {  # zai-org/GLM-4.5-Air's config.json (its MTP layer left out)
            **GLM4_MOE_COMMON, "attention_bias": True, "use_qk_norm": False, "vocab_size": 151552,
            "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 96, "num_key_value_heads": 8,
            "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
            "first_k_dense_replace": 1, "n_routed_experts": 128, "num_experts_per_tok": 8,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        },
    },
    "deepseek_v2": {
        "tiny": {
            **DEEPSEEK_V2_COMMON, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 16,
            "n_shared_experts": 2, "num_experts_per_tok": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "max_position_embeddings": 4096, "rope_scaling": None, "rope_theta": 10000.0,
        },
        "bench": {  # deepseek-ai/DeepSeek-V2-Lite's config.json
            **DEEPSEEK_V2_COMMON, "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "num_hidden_layers": 27, "first_k_dense_replace": 1,
            "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "num_attention_heads": 16,
            "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000.0,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
        },
    },
    "minimax_m2": {
        "tiny": {
            **MINIMAX_M2_COMMON, "vocab_size": 512, "hidden_size": 64, "head_dim": 16, "rotary_dim": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32, "num_hidden_layers": 3,
            "num_local_experts": 16, "num_experts_per_tok": 4, "max_position_embeddings": 4096,
        },
        "small": {
            **MINIMAX_M2_COMMON, "vocab_size": 8192, "hidden_size": 512, "head_dim": 64, "rotary_dim": 32,
            "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 256, "num_hidden_layers": 8,
            "num_local_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 8192,
        },
        "bench": {  # MiniMaxAI/MiniMax-M2's config.json
            **MINIMAX_M2_COMMON, "vocab_size": 200064, "hidden_size": 3072, "head_dim": 128, "rotary_dim": 64,
            "num_attention_heads": 48, "num_key_value_heads": 8, "intermediate_size": 1536, "num_hidden_layers": 62,
            "num_local_experts": 256, "num_experts_per_tok": 8, "max_position_embeddings": 196608,
        },
    },
}  # fmt: skip


def base_config(size: str, arch: str | None = None) -> dict:
    """The config.json of random size `size` as written in `arch` (None: the size's own architecture), before the
    layer count, tokens, Engram and quantization are set; `ConfigError` for an architecture or size not written."""
    if arch is None or arch == BASE_CONFIGS.get(size, {}).get("model_type"):
        return BASE_CONFIGS[size]
    if arch not in ARCH_CONFIGS:
        raise ConfigError(f"--arch {arch!r} is not written by demo-model; use one of {', '.join(DEMO_ARCHS)}")
    if size not in ARCH_CONFIGS[arch]:
        raise ConfigError(f"--arch {arch} is written in sizes {', '.join(ARCH_CONFIGS[arch])}, not {size!r}")
    return ARCH_CONFIGS[arch][size]


DEMO_ARCHS: tuple[str, ...] = ("deepseek_v3", "qwen3_moe", *ARCH_CONFIGS)


@dataclass(frozen=True)
class DemoSpec:
    """What to write: a size, an optional layer count, a seed and a shard size; validated."""

    size: str = "small"
    layers: int | None = None
    seed: int = 0
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    engram: bool = True  # Engram layers (hashed n-gram tables); False: `--no-engram`
    route_skew: float | str = 0.0  # routing popularity in the weights: S > 0 or "uniform" (demo_skew); 0: none
    route_locality: float = 0.0  # temporal locality in the weights (demo_skew; needs route_skew): L > 0; 0: none
    experts: str = "bf16"  # "fp8" / "mxfp4": written as quantized releases ship them (strata.runtime.demo.quantized)
    arch: str | None = None  # `--arch`: the size written in another architecture (`ARCH_CONFIGS`); None: its own

    def __post_init__(self) -> None:
        if self.size not in DEMO_SIZES:
            raise ConfigError(f"unknown demo model size {self.size!r}; use one of {', '.join(DEMO_SIZES)}")
        base = base_config(self.size, self.arch)
        if self.layers is not None:
            first_moe = base.get("first_k_dense_replace", 0)
            if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers <= first_moe:
                raise ConfigError(
                    f"--layers {self.layers!r} is invalid for the {self.size} demo model; use an integer "
                    f">= {first_moe + 1} so that at least one layer is a MoE layer"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"demo model seed {self.seed!r} is invalid; use a non-negative integer")
        if not isinstance(self.max_shard_bytes, int) or self.max_shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes {self.max_shard_bytes!r} is invalid; use a positive byte count")
        object.__setattr__(self, "route_skew", check_skew(self.route_skew))
        object.__setattr__(self, "route_locality", check_locality(self.route_locality))
        if self.route_locality and not self.route_skew:
            raise ConfigError("--route-locality needs the skew channel: give --route-skew too (S > 0 or uniform)")
        if self.experts not in DEMO_EXPERTS:
            raise ConfigError(f"--experts {self.experts!r} is invalid; use one of {', '.join(DEMO_EXPERTS)}")
        if base["model_type"] == "minimax_m2" and (self.route_skew or self.experts == "mxfp4"):
            raise ConfigError("--route-skew, --route-locality and --experts mxfp4 are not written for --arch "
                              "minimax_m2 (its release ships bf16 or fp8); leave them out")

    @property
    def num_layers(self) -> int:
        return self.layers if self.layers is not None else base_config(self.size, self.arch)["num_hidden_layers"]

    def marker(self) -> dict:
        """The identity recorded in `MARKER` (shard size is not part of it: the weights are the same)."""
        return {"strata_demo": 1, "size": self.size, "num_hidden_layers": self.num_layers, "seed": self.seed,
                "engram": self.engram, **({"route_skew": self.route_skew} if self.route_skew else {}),
                **({"route_locality": self.route_locality} if self.route_locality else {}),
                **({"experts": self.experts} if self.experts != "bf16" else {}),
                **({"arch": self.arch} if self.arch is not None else {})}


def demo_config(size: str = "small", layers: int | None = None, engram: bool = True, experts: str = "bf16",
                arch: str | None = None) -> dict:
    """The config.json dict of a demo model; `layers` overrides `num_hidden_layers`; `engram` adds Engram layers;
    `experts` "fp8" / "mxfp4" adds the `quantization_config` of such a release; `arch` writes the size in another
    architecture (`ARCH_CONFIGS`)."""
    spec = DemoSpec(size, layers, arch=arch)
    cfg = dict(base_config(size, arch))
    cfg["num_hidden_layers"] = spec.num_layers
    if cfg["model_type"] == "qwen3_moe":
        cfg["max_window_layers"] = spec.num_layers  # Qwen3 sets it to the layer count
    # ChatML: generation ends at <|im_end|>; <|endoftext|> doubles as BOS and pad, as in Qwen.
    cfg["bos_token_id"] = SPECIAL_IDS[ENDOFTEXT]
    cfg["eos_token_id"] = SPECIAL_IDS[IM_END]
    cfg["torch_dtype"] = "bfloat16"  # the key older checkpoints ship ...
    cfg["dtype"] = "bfloat16"  # ... and the one transformers >= 4.56 writes
    if engram:
        from strata.runtime.demo.engram import demo_engram_config

        cfg["engram"] = demo_engram_config(size, spec.num_layers, cfg["vocab_size"], cfg["bos_token_id"])
    if (quantization := quantization_config(experts, cfg)) is not None:
        cfg["quantization_config"] = quantization
    return dict(sorted(cfg.items()))


def demo_generation_config() -> dict:
    """generation_config.json: both stop tokens and Qwen3's recommended sampling defaults."""
    return {
        "bos_token_id": SPECIAL_IDS[ENDOFTEXT],
        "eos_token_id": [SPECIAL_IDS[IM_END], SPECIAL_IDS[ENDOFTEXT]],
        "pad_token_id": SPECIAL_IDS[ENDOFTEXT],
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def expected_bytes(size: str = "small", layers: int | None = None, engram: bool = True, experts: str = "bf16",
                   arch: str | None = None) -> int:
    """Total tensor bytes of a demo model (what the safetensors files hold, headers excluded)."""
    cfg = demo_config(size, layers, engram, experts, arch)
    return sum(t.nbytes for t in weight_jobs(tensor_specs(cfg), experts, cfg)[0])
