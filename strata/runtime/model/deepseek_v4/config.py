"""DeepSeek-V4's config.json: the fields of `ModelConfig` and the settings only V4 has (`DeepseekV4Settings`).

`ModelConfig.from_hf` (strata.runtime.model.config) builds its `ModelConfig` from `deepseek_v4_fields`; this
module imports nothing of the model, so the config module can import it.

The defaults and the legacy spellings follow transformers 5.25's `DeepseekV4Config.__post_init__`:
`compress_ratios` (per-layer 0/4/128) or `layer_types`, `compress_rate_csa` / `compress_rate_hca` folded into
`compress_rates`, `num_hash_layers` or `mlp_layer_types`, `qk_rope_head_dim` or `partial_rotary_factor`, and a flat
`rope_scaling` / `rope_parameters` (YaRN for the compressed branches only) or the nested {"main", "compress"} one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import CheckpointError, UnsupportedError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
DEFAULT_RATES = {CSA: 4, HCA: 128}
SCORING = ("sqrtsoftplus", "sigmoid")  # transformers 5.25 computes these (its ACT2FN has no softmax)


@dataclass
class DeepseekV4Settings:
    """What DeepSeek-V4 adds to `ModelConfig` (names as transformers' `DeepseekV4Config`)."""

    layer_types: list[str]  # per layer: sliding_attention | compressed_sparse_attention | heavily_compressed_attention
    compress_rates: dict[str, int]  # layer type -> source tokens per compressed entry (CSA 4, HCA 128)
    mlp_layer_types: list[str]  # per layer: hash_moe (tid2eid[token] picks the experts) | moe (top-k)
    compress_rope: dict  # RopeConfig fields of the CSA/HCA layers' and compressors' rotary (ModelConfig.rope: "main")
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    scoring_func: str = "sqrtsoftplus"
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint: read past, never run
    hash_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hash_layers = [i for i, t in enumerate(self.mlp_layer_types) if t == "hash_moe"]

    def rate(self, layer: int) -> int:
        """Source tokens per compressed entry of `layer` (0: a sliding-window layer, nothing compressed)."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else int(self.compress_rates[t])


def deepseek_v4_fields(cfg: dict, source: str) -> dict[str, Any]:
    """config.json of a `deepseek_v4` checkpoint -> `ModelConfig`'s fields: `rope` as RopeConfig's fields, and
    `deepseek_v4` holding the V4 settings."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedError(f"{source}: hidden_act {act!r} is not supported; only SwiGLU (silu) experts are")
    n = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim", 512))
    rates = dict(cfg.get("compress_rates") or DEFAULT_RATES)
    if cfg.get("compress_rate_csa") is not None:
        rates[CSA] = int(cfg["compress_rate_csa"])
    if cfg.get("compress_rate_hca") is not None:
        rates[HCA] = int(cfg["compress_rate_hca"])
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        try:
            types = [_RATIO_TO_TYPE[int(r)] for r in cfg["compress_ratios"]]
        except KeyError as e:
            raise CheckpointError(f"{source}: compress_ratios entry {e.args[0]} is not one of 0, 4, 128") from None
    if types is None:  # V4-Pro's default: two HCA layers, then CSA / HCA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types[:n])
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        n_hash = cfg.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlp = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    mlp = list(mlp[:n])
    for name, got, allowed in (("layer_types", types, LAYER_TYPES), ("mlp_layer_types", mlp, MLP_TYPES)):
        if len(got) != n:
            raise CheckpointError(f"{source}: {name} has {len(got)} entries for {n} layers; fix config.json")
        bad = sorted({t for t in got if t not in allowed})
        if bad:
            raise CheckpointError(f"{source}: {name} entries {bad} are not among {', '.join(allowed)}; fix config.json")
    for t in set(types) - {SLIDING}:
        if int(rates.get(t, 0)) <= 0:
            raise CheckpointError(f"{source}: compress_rates has no positive rate for {t}; fix config.json")
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise UnsupportedError(f"{source}: scoring_func {scoring!r} is not supported; DeepSeek-V4 routers score with "
                               f"{', '.join(SCORING)}")
    partial = cfg.get("partial_rotary_factor")
    if partial is None:
        partial = int(cfg["qk_rope_head_dim"]) / head_dim if cfg.get("qk_rope_head_dim") else 64 / 512
    rope_dim = int(head_dim * float(partial))
    main, compress = _ropes(cfg, rope_dim)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    width = int(cfg["moe_intermediate_size"])
    settings = DeepseekV4Settings(
        layer_types=types, compress_rates={k: int(v) for k, v in rates.items()}, mlp_layer_types=mlp,
        compress_rope=compress, sliding_window=int(cfg.get("sliding_window", 128)),
        hc_mult=int(cfg.get("hc_mult", 4)), hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)), swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        o_groups=int(cfg.get("o_groups", 8)), o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
        index_n_heads=int(cfg.get("index_n_heads", 64)), index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)), scoring_func=scoring,
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )
    heads = int(cfg["num_attention_heads"])
    if settings.sliding_window <= 0 or settings.hc_mult <= 0 or settings.hc_sinkhorn_iters <= 0:
        raise CheckpointError(f"{source}: sliding_window, hc_mult and hc_sinkhorn_iters must be positive")
    if (heads * head_dim) % settings.o_groups:
        raise CheckpointError(f"{source}: num_attention_heads x head_dim ({heads * head_dim}) is not a multiple of "
                              f"o_groups ({settings.o_groups}); fix config.json")
    if rope_dim > min(head_dim, settings.index_head_dim):
        raise CheckpointError(f"{source}: the rotary dimension {rope_dim} exceeds head_dim or index_head_dim")
    eos = cfg.get("eos_token_id")
    return dict(
        model_type="deepseek_v4",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=n,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=main,
        attention="deepseek_v4",
        num_heads=heads,
        num_kv_heads=1,  # one shared key = value head
        head_dim=head_dim,
        sliding_windows=[settings.sliding_window] * n,
        q_lora_rank=int(cfg["q_lora_rank"]),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=head_dim - rope_dim,
        v_head_dim=head_dim,
        rope_interleave=True,
        attention_scale=head_dim**-0.5,
        moe_intermediate_size=width,
        num_experts=experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_layers=[True] * n,
        router=scoring,
        norm_topk_prob=True,  # V4's routers always renormalise the picked scores
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
        shared_expert_intermediate_size=width if int(cfg.get("n_shared_experts", 1) or 0) else 0,
        eos_token_ids=[] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])],
        bos_token_id=cfg.get("bos_token_id"),
        deepseek_v4=settings,
    )


def _ropes(cfg: dict, dim: int) -> tuple[dict, dict]:
    """(main, compress) rotary settings: sliding-window layers use plain RoPE at rope_theta; CSA/HCA layers and their
    compressors use compress_rope_theta with the checkpoint's scaling (YaRN's attention factor forced to 1)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    max_pos = int(cfg.get("max_position_embeddings", 1048576))
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_p, comp_p = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main_p = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        comp_p = {**flat, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
        comp_p["rope_type"] = comp_p.get("rope_type", comp_p.get("type", "default"))
        if comp_p["rope_type"] == "yarn":
            comp_p.setdefault("attention_factor", 1.0)

    def one(p: dict) -> dict:
        rope_type = p.get("rope_type", p.get("type", "default"))
        orig = p.get("original_max_position_embeddings") or max_pos
        factor = p.get("factor")
        if factor is None:
            factor = max_pos / orig if rope_type == "yarn" else 1.0
        return dict(rope_type=rope_type, theta=float(p.get("rope_theta", 10000.0)), dim=dim, factor=float(factor),
                    original_max_position_embeddings=int(orig), attention_factor=p.get("attention_factor"),
                    beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                    mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"), truncate=True)

    return one(main_p), one(comp_p)
