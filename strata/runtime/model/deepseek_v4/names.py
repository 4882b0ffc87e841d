"""DeepSeek-V4's tensor names: the original release's (`layers.0.attn.wq_a.weight`, `embed.weight`, `head.weight`,
also written by transformers' `save_pretrained`, under `model.`) -> transformers' (`model.layers.0.self_attn.q_a_proj
.weight`), the names strata's model and loader use. The renames are transformers 5.25's conversion mapping for
`deepseek_v4`, applied in its order, plus the per-expert `w1` / `w3` / `w2` -> `gate_proj` / `up_proj` / `down_proj`
that transformers merges into its fused tensors. A name already in transformers' spelling maps to itself.

The multi-token-prediction layers (`mtp.*`) are left out: strata reads past them and never runs them.
"""

from __future__ import annotations

import re
from dataclasses import replace

from strata.runtime.model.deepseek_v4.release_quant import release_quantized
from strata.tiers.store.safetensors_index import TensorIndex

_RENAMES: list[tuple[re.Pattern, str]] = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
)]
_MTP = re.compile(r"^(model\.)?mtp\.")


def transformers_name(name: str) -> str | None:
    """A checkpoint tensor's name in transformers' spelling (None: an MTP tensor, which strata skips)."""
    if _MTP.match(name):
        return None
    bare = name.removeprefix("model.")
    for pattern, target in _RENAMES:
        bare = pattern.sub(target, bare)
    return bare if bare.startswith("lm_head.") else f"model.{bare}"


def renamed_index(index: TensorIndex) -> TensorIndex:
    """`index` keyed (and its entries named) by transformers' names, MTP tensors left out. A checkpoint whose names
    collide once renamed (both spellings of one tensor) is refused by `TensorIndex`'s own duplicate check. A quantized
    release's FP8 and FP4 pairs take strata's spellings (strata.runtime.model.deepseek_v4.release_quant)."""
    out, stored = {}, {}
    for name, info in index.tensors.items():
        new = transformers_name(name)
        if new is None:
            continue
        if new in out:
            from strata.errors import CheckpointError

            raise CheckpointError(f"{info.file}: tensors {out[new].name!r} and {name!r} are both {new!r} in "
                                  "transformers' names; keep one spelling of each DeepSeek-V4 tensor")
        out[new] = info if new == name else replace(info, name=new)
        if new != name:
            stored[new] = name
    return release_quantized(TensorIndex(out), stored)
