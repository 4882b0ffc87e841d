"""Where a gpt-oss checkpoint keeps its routed experts.

The release ships them in MXFP4 (`mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32],
`down_proj_blocks` / `_scales` [E, H, I/32, ...]): strata's orientation, a byte copy into the store. A checkpoint
saved by transformers in bf16 (or fp32) holds its `GptOssExperts` parameters as they are: `gate_up_proj` [E, H, 2I]
and `down_proj` [E, I, H], transposed; strata reads them into its orientation (in memory as they load, into a packed
store's records when it is converted; such a checkpoint is not served in place). Either way gate_up's rows (the
transposed tensor's columns) interleave gate and up: gate j at 2j, up j at 2j + 1.
"""

from __future__ import annotations

from strata.kernels.quant import ExpertFormat
from strata.runtime.model.config import ModelConfig


def experts_transposed(cfg: ModelConfig, layout: str, fmt: ExpertFormat) -> bool:
    """Whether a checkpoint of `cfg` with experts in `layout` ("fused", "per-expert", "store") and format `fmt`
    holds them as transformers' gpt-oss parameters: gate_up [E, H, 2I], down [E, I, H]."""
    return cfg.gpt_oss is not None and layout == "fused" and not fmt.quantized


def transposed_shapes(cfg: ModelConfig) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(gate_up, down) shapes of transposed experts: [E, H, 2I], [E, I, H]."""
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return (e, h, 2 * i), (e, i, h)
