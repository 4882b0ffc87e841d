"""A Hugging Face `config.json`, architecture by architecture, read into the fields of `ModelConfig`
(strata.runtime.model.config).

Each parser takes the dict and its path (for errors) and returns the fields as a dict, `rope` a dict of
`RopeConfig`'s; `ModelConfig.from_hf` builds and checks the dataclasses. The semantics follow transformers' modeling
files (qwen3_moe, qwen2_moe, deepseek_v3, mixtral, glm4_moe, deepseek_v2, minimax_m2); Kimi K2 / K2.5 (`kimi_k2`,
`kimi_k25`) are DeepSeek-V3 under their own names; DeepSeek-V4, Qwen3.5-MoE and gpt-oss read their own settings
(strata.runtime.model.deepseek_v4.config, strata.runtime.model.qwen3_5.config, strata.runtime.model.gpt_oss.config).
"""

from __future__ import annotations

from typing import Any

from strata.errors import CheckpointError, UnsupportedError
from strata.runtime.model.deepseek_v4.config import deepseek_v4_fields
from strata.runtime.model.gpt_oss.config import gpt_oss_fields, gpt_oss_rope_source
from strata.runtime.model.qwen3_5.config import qwen3_5_fields

QUANT_METHODS = ("fp8", "mxfp4")  # config.json's quantization_config.quant_method values strata loads


def quantization(q: Any, source: str) -> tuple[str, tuple[int, int] | None]:
    """(quant_method, fp8 weight block) of config.json's `quantization_config` (absent: ("", None)); strata loads
    block-scaled FP8 in e4m3 (DeepSeek-V3's `weight_block_size`) and MXFP4, and refuses every other scheme."""
    if q is None:
        return "", None
    if not isinstance(q, dict):
        raise CheckpointError(f"{source}: quantization_config is not a JSON object; re-download config.json")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise UnsupportedError(f"{source}: quantization_config.quant_method {method!r} is not supported; strata loads "
                               "block-scaled fp8 and mxfp4 checkpoints, or unquantized ones (bf16, f16, f32)")
    if method == "mxfp4":
        return method, None
    if q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # (MiniMax-M2 names the dtype)
        raise UnsupportedError(f"{source}: quantization_config.fmt {q.get('fmt')!r} is not supported; strata loads "
                               "fp8 in e4m3 (float8_e4m3fn)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedError(f"{source}: quantization_config.weight_block_size {block!r} is not two positive "
                               "integers; strata loads block-scaled fp8 (one scale per block, as DeepSeek-V3 ships)")
    return method, (block[0], block[1])


def _act(cfg: dict, source: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedError(f"{source}: hidden_act {act!r} is not supported; only SwiGLU (silu) experts are")


def _rope(cfg: dict, dim: int) -> dict[str, Any]:
    """`RopeConfig`'s fields from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older
    checkpoints)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    # transformers gives a top-level original_max_position_embeddings priority (Phi3-style configs)
    orig = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / orig if rope_type == "yarn" else 1.0
    return dict(
        rope_type=rope_type,
        theta=theta,
        dim=int(dim * partial),
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        attention_factor=params.get("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _eos(cfg: dict) -> list[int]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _num_experts(cfg: dict) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            return int(cfg[key])
    raise KeyError("num_experts")


def _common(cfg: dict) -> dict[str, Any]:
    return dict(
        model_type=cfg["model_type"],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        num_experts=_num_experts(cfg),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        eos_token_ids=_eos(cfg),
        bos_token_id=cfg.get("bos_token_id"),
    )


def _gqa(common: dict[str, Any], rope: dict[str, Any], head_dim: int, **fields: Any) -> dict[str, Any]:
    """A grouped-query-attention architecture's fields: `common` (`_common`), its rotary and head size, its own."""
    return dict(common, rope=rope, attention="gqa", head_dim=head_dim, **fields)


def _grouped_moe(cfg: dict, layers: int, width: int, first_dense: int, shared: int) -> dict[str, Any]:
    """DeepSeek-V3's MoE fields (GLM-4.5's too): dense MLPs before layer `first_dense`, then experts `width` wide
    routed by sigmoid scores (with a correction bias) within the best groups, and `shared` shared experts as wide."""
    return dict(moe_intermediate_size=width, moe_layers=[i >= first_dense for i in range(layers)],
                router="sigmoid_group", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                shared_expert_intermediate_size=width * shared)


def _qwen_sparse_layers(cfg: dict, n_layers: int) -> list[bool]:
    """Qwen MoE: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return [(i not in only) and (i + 1) % step == 0 for i in range(n_layers)]


def _parse_qwen3_moe(cfg: dict, source: str) -> dict[str, Any]:
    _act(cfg, source)
    c = _common(cfg)
    head_dim = int(cfg.get("head_dim") or c["hidden_size"] // c["num_heads"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    bias = bool(cfg.get("attention_bias", False))
    return _gqa(
        c, _rope(cfg, head_dim), head_dim,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        sliding_windows=[window] * c["num_layers"],
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        moe_layers=_qwen_sparse_layers(cfg, c["num_layers"]),
        router="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def _parse_qwen2_moe(cfg: dict, source: str) -> dict[str, Any]:
    _act(cfg, source)
    c = _common(cfg)
    head_dim = int(cfg.get("head_dim") or c["hidden_size"] // c["num_heads"])
    n = c["num_layers"]
    if cfg.get("layer_types"):
        types = cfg["layer_types"]
    else:  # transformers' default: odd-numbered layers below max_window_layers slide
        use = bool(cfg.get("use_sliding_window", False))
        types = ["sliding_attention" if use and (i + 1) % 2 and i < cfg.get("max_window_layers", n) else "full"
                 for i in range(n)]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return _gqa(
        c, _rope(cfg, head_dim), head_dim,
        qkv_bias=bool(cfg.get("qkv_bias", True)),
        sliding_windows=[window if t == "sliding_attention" and window else None for t in types],
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        moe_layers=_qwen_sparse_layers(cfg, n),
        router="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
        shared_expert_gated=True,
    )


def _parse_mixtral(cfg: dict, source: str) -> dict[str, Any]:
    _act(cfg, source)
    c = _common(cfg)
    head_dim = int(cfg.get("head_dim") or c["hidden_size"] // c["num_heads"])
    # Mixtral's experts are intermediate_size wide; it has no dense MLP layers.
    return _gqa(
        {**c, "intermediate_size": 0}, _rope(cfg, head_dim), head_dim,
        sliding_windows=[cfg.get("sliding_window")] * c["num_layers"],
        moe_intermediate_size=int(cfg["intermediate_size"]),
        moe_layers=[True] * c["num_layers"],
        router="softmax",
        norm_topk_prob=True,
    )


def _parse_deepseek_v3(cfg: dict, source: str) -> dict[str, Any]:
    _act(cfg, source)
    c = _common(cfg)
    rope_dim, nope_dim = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"])
    rope = _rope(cfg, rope_dim)
    qk_head_dim = rope_dim + nope_dim
    scale = qk_head_dim**-0.5
    if rope["rope_type"] != "default" and rope["mscale_all_dim"]:
        # YaRN also scales the softmax: transformers' yarn_apply_mscale
        m = _yarn_mscale(rope["factor"], float(rope["mscale_all_dim"]))
        scale = scale * m * m
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    q_lora = cfg.get("q_lora_rank")
    return dict(
        **c,
        rope=rope,
        attention="mla",
        head_dim=qk_head_dim,
        o_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        sliding_windows=[None] * c["num_layers"],
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim,
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        attention_scale=scale,
        **_grouped_moe(cfg, c["num_layers"], int(cfg["moe_intermediate_size"]), first_dense,
                       int(cfg.get("n_shared_experts") or 0)),
    )


def _parse_deepseek_v2(cfg: dict, source: str) -> dict[str, Any]:
    """DeepSeek-V2 / V2-Lite: DeepSeek-V3's MLA, dense-then-MoE layers and shared experts, routed by a softmax over
    fp32 logits, top-k over all experts (`greedy`) or within the best `topk_group` of `n_group` groups, each scored
    by its best expert (`group_limited_greedy`), never renormalised (transformers' router has no
    norm_topk_prob), then scaled by routed_scaling_factor."""
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedError(f"{source}: topk_method {method!r} is not supported for deepseek_v2; strata routes "
                               "greedy and group_limited_greedy (transformers' DeepSeek-V2)")
    if cfg.get("scoring_func", "softmax") != "softmax" or cfg.get("mlp_bias"):
        raise UnsupportedError(f"{source}: deepseek_v2 with scoring_func {cfg.get('scoring_func')!r} or mlp_bias is "
                               "not supported; strata runs DeepSeek-V2's softmax router and bias-free MLPs")
    grouped = method == "group_limited_greedy"
    return {**_parse_deepseek_v3(cfg, source), "router": "softmax_group", "norm_topk_prob": False,
            "rope_interleave": True,  # its rotary multiplies adjacent pairs as complex numbers
            "n_group": int(cfg["n_group"]) if grouped else 1, "topk_group": int(cfg["topk_group"]) if grouped else 1}


def _parse_kimi_k2(cfg: dict, source: str) -> dict[str, Any]:
    """Kimi K2 (`kimi_k2`): DeepSeek-V3's architecture in DeepSeek's original config spelling (`rope_scaling`,
    `scoring_func`, `topk_method`)."""
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedError(f"{source}: {cfg['model_type']} with scoring_func {cfg.get('scoring_func')!r} / "
                               f"topk_method {cfg.get('topk_method')!r} is not supported; Kimi K2 routes by sigmoid "
                               "scores (noaux_tc), as DeepSeek-V3")
    return _parse_deepseek_v3(cfg, source)


def kimi_k25_text(cfg: dict, source: str) -> dict:
    """Kimi K2.5's config.json keeps its language model (DeepSeek-V3, `kimi_k2` or `deepseek_v3`) under
    `text_config`, beside the vision tower's: that config, completed by the keys the release keeps at the top."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: kimi_k25 has no text_config object (its language model); re-download "
                              "config.json")
    if text.get("model_type", "deepseek_v3") not in ("kimi_k2", "deepseek_v3"):
        raise UnsupportedError(f"{source}: text_config.model_type {text.get('model_type')!r} is not supported; "
                               "kimi_k25's language model is kimi_k2 (DeepSeek-V3)")
    kept = ("quantization_config", "bos_token_id", "eos_token_id", "tie_word_embeddings")
    top = {k: cfg[k] for k in kept if k in cfg}
    return {**top, **text, "model_type": "kimi_k25"}


def _parse_glm4_moe(cfg: dict, source: str) -> dict[str, Any]:
    """GLM-4.5 / 4.6 / 4.7: GQA with q/k/v biases (`attention_bias`; o_proj has none), optional per-head q/k RMSNorm
    (`use_qk_norm`), rotary on the first `partial_rotary_factor` of each head (0.5 unless given), then
    `first_k_dense_replace` dense layers and MoE layers routed as DeepSeek-V3 (sigmoid, correction bias, groups),
    with shared experts. Defaults are transformers' Glm4MoeConfig's."""
    _act(cfg, source)
    c = _common({"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "n_routed_experts": 128, **cfg})
    head_dim = int(cfg.get("head_dim") or c["hidden_size"] // c["num_heads"])
    first_dense = int(cfg.get("first_k_dense_replace", 1) or 0)
    moe_width = int(cfg.get("moe_intermediate_size", 1408))
    return _gqa(
        c, _rope({"partial_rotary_factor": 0.5, **cfg}, head_dim), head_dim,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        sliding_windows=[None] * c["num_layers"],
        **_grouped_moe(cfg, c["num_layers"], moe_width, first_dense, int(cfg.get("n_shared_experts", 1) or 0)),
    )


def _parse_minimax_m2(cfg: dict, source: str) -> dict[str, Any]:
    """MiniMax-M2 / M2.1: GQA whose q and k are RMS-normed over the whole projection (all heads at once), rotary on
    the first `rotary_dim` of each head, and in every layer a MoE of `intermediate_size`-wide experts routed by
    sigmoid scores (top k of score + e_score_correction_bias, renormalised), no shared expert, no sliding window.
    Defaults are transformers' MiniMaxM2Config's; the release's MTP modules (`num_mtp_modules`, layers past
    num_hidden_layers) are read past."""
    _act(cfg, source)
    cfg = {"head_dim": 128, "rope_theta": 5000000.0, "max_position_embeddings": 196608, "num_local_experts": 256,
           "num_experts_per_tok": 8, "intermediate_size": 1536, **cfg}
    c = _common(cfg)
    head_dim = int(cfg["head_dim"])
    if cfg.get("rotary_dim"):  # the release's spelling of partial_rotary_factor (an explicit factor wins)
        cfg = {"partial_rotary_factor": int(cfg["rotary_dim"]) / head_dim, **cfg}
    return _gqa(
        {**c, "intermediate_size": 0}, _rope(cfg, head_dim), head_dim,
        qk_norm=True,
        qk_norm_whole=True,
        sliding_windows=[None] * c["num_layers"],
        moe_intermediate_size=int(cfg["intermediate_size"]),
        moe_layers=[True] * c["num_layers"],
        router="sigmoid_topk",
        norm_topk_prob=True,
    )


def _parse_qwen3_5_moe(cfg: dict, source: str) -> dict[str, Any]:
    """Qwen3.5 / 3.6 MoE: Gated DeltaNet and gated full-attention layers (strata.runtime.model.qwen3_5), rotary on
    the first `partial_rotary_factor` of each full-attention head (0.25 unless given)."""
    text, fields = qwen3_5_fields(cfg, source)
    return {**fields, "rope": _rope({"partial_rotary_factor": 0.25, **text}, fields["head_dim"])}


def _parse_gpt_oss(cfg: dict, source: str) -> dict[str, Any]:
    """gpt-oss (20b, 120b): its fields from strata.runtime.model.gpt_oss.config, its rotary (YaRN) read as every
    architecture's."""
    fields = gpt_oss_fields(cfg, source)
    return {**fields, "rope": _rope(gpt_oss_rope_source(cfg), fields["head_dim"])}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


PARSERS = {  # model_type -> (config.json dict, its path for errors) -> ModelConfig's fields
    "qwen3_moe": _parse_qwen3_moe,
    "qwen2_moe": _parse_qwen2_moe,
    "mixtral": _parse_mixtral,
    "deepseek_v3": _parse_deepseek_v3,
    "glm4_moe": _parse_glm4_moe,
    "deepseek_v2": _parse_deepseek_v2,
    "kimi_k2": _parse_kimi_k2,
    "kimi_k25": _parse_kimi_k2,
    "minimax_m2": _parse_minimax_m2,
    "deepseek_v4": deepseek_v4_fields,
    "qwen3_5_moe": _parse_qwen3_5_moe,
    "qwen3_5_moe_text": _parse_qwen3_5_moe,
    "gpt_oss": _parse_gpt_oss,
}
