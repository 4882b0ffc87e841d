"""gpt-oss's config.json: the fields of `ModelConfig` and the settings only gpt-oss has (`GptOssSettings`).

`ModelConfig.from_hf` (strata.runtime.model.config) builds its `ModelConfig` from `gpt_oss_fields` and reads the
rotary from `gpt_oss_rope_source` as every architecture's; this module imports nothing of the model, so the config
module can import it. Defaults are transformers 5.25's `GptOssConfig`'s (gpt-oss-120b's shape): a missing
`layer_types` alternates sliding-window and full attention starting with a sliding layer, a missing rotary is YaRN
x32 over 4,096 positions with theta 150,000, the clamped SwiGLU has alpha 1.702 and limit 7.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.errors import CheckpointError

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass
class GptOssSettings:
    """What gpt-oss adds to `ModelConfig` (names as transformers' `GptOssConfig`)."""

    layer_types: list[str]  # per layer: sliding_attention | full_attention
    swiglu_alpha: float = 1.702  # the experts' gate: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # gate clamped above at it, up to [-limit, limit]


def gpt_oss_fields(cfg: dict, source: str) -> dict[str, Any]:
    """config.json of a `gpt_oss` checkpoint -> `ModelConfig`'s fields but `rope` (read from `gpt_oss_rope_source`).
    A malformed schedule or window is a one-line `CheckpointError` naming the key."""
    n = int(cfg.get("num_hidden_layers", 36))
    heads = int(cfg.get("num_attention_heads", 64))
    hidden = int(cfg.get("hidden_size", 2880))
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise CheckpointError(f"{source}: layer_types must list {n} entries of {SLIDING!r} or {FULL!r}, got "
                              f"{types!r}; fix config.json")
    window = cfg.get("sliding_window", 128)
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(f"{source}: sliding_window {window!r} is not a positive integer, but layer_types has "
                              "sliding_attention layers; fix config.json")
    eos = cfg.get("eos_token_id")
    bias = bool(cfg.get("attention_bias", True))
    return dict(
        model_type="gpt_oss",
        vocab_size=int(cfg.get("vocab_size", 201088)),
        hidden_size=hidden,
        num_layers=n,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention="gqa",
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", 8) or heads),
        head_dim=int(cfg.get("head_dim", 64) or hidden // heads),  # (an explicit null: hidden / heads)
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=[window if t == SLIDING else None for t in types],
        moe_intermediate_size=int(cfg.get("intermediate_size", 2880)),
        num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 128),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4),
        moe_layers=[True] * n,
        router="softmax",  # the top k of the biased logits, softmax over them: GptOssRouter computes it
        norm_topk_prob=True,
        eos_token_ids=[] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
        bos_token_id=cfg.get("bos_token_id"),
        gpt_oss=GptOssSettings(types, float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
    )


def gpt_oss_rope_source(cfg: dict) -> dict:
    """`cfg` as the shared rotary reader takes it, with gpt-oss's defaults: theta 150,000 and, when config.json has
    neither `rope_parameters` nor `rope_scaling`, YaRN x32 (transformers' GptOssConfig)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or DEFAULT_ROPE
    return {**cfg, "rope_theta": cfg.get("rope_theta", DEFAULT_THETA), "rope_parameters": params}
