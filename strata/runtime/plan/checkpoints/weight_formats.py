"""How tensors and routed experts are stored, as `strata inspect` and the planner name them: a safetensors dtype,
block-scaled FP8 values and their scales, or MXFP4 halves (strata.runtime.model.quantized reads them)."""

from __future__ import annotations

from strata.kernels.quant import ExpertFormat
from strata.tiers.store.safetensors_header import FP8_SCALE, MX_BLOCKS, MX_SCALES, TensorInfo

FP8, FP8_SCALES, MXFP4 = "fp8", "fp8 scales", "mxfp4"  # `formats_by_role` keys of quantized tensors; else a dtype


def tensor_format(info: TensorInfo) -> str:
    """How a tensor is stored, for `formats_by_role`: FP8 values ("fp8"), their block scales ("fp8 scales"), an
    MXFP4 half ("mxfp4"), or its safetensors dtype."""
    if info.dtype == "F8_E4M3":
        return FP8
    if info.name.endswith(FP8_SCALE):
        return FP8_SCALES
    if info.dtype == "U8" and info.name.endswith((MX_BLOCKS, MX_SCALES)):
        return MXFP4
    return info.dtype


def fp8_block(cfg: dict) -> tuple[int, int] | None:
    """config.json's quantization_config.weight_block_size, when it is two integers."""
    q = cfg.get("quantization_config")
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    ok = isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    return (block[0], block[1]) if ok else None


def experts_format(formats: dict[str, int], fp8_block: tuple[int, int] | None) -> ExpertFormat | None:
    """The routed experts' format from their tensors' formats (None: no experts, or a dtype strata cannot load)."""
    if MXFP4 in formats:
        return ExpertFormat("mxfp4")
    if FP8 in formats:
        return ExpertFormat("fp8", block=fp8_block or (128, 128))
    plain = {k: n for k, n in formats.items() if k in ("BF16", "F16", "F32")}
    return ExpertFormat("plain", max(plain, key=plain.get)) if plain else None
