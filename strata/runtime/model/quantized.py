"""Quantized weights as checkpoints ship them: block-scaled FP8 and MXFP4 tensors, checked and dequantized.

    fp8    `x.weight` F8_E4M3 [..., N, K] + `x.weight_scale_inv` F32 [..., ceil(N/bn), ceil(K/bk)] (bn x bk:
           config.json's quantization_config.weight_block_size), w = values * scale_inv per block (DeepSeek-V3,
           the FP8 releases of Qwen3-MoE; DeepSeek-V4's scales are F8_E8M0, powers of two); the fused layout's `experts.gate_up_proj` + `gate_up_proj_scale_inv`
           has one such pair per expert ([E, ...]).
    mxfp4  `x_blocks` U8 [..., N, K/32, 16] (two e2m1 codes a byte) + `x_scales` U8 [..., N, K/32] (e8m0), as
           gpt-oss ships its fused experts (`experts.gate_up_proj_blocks`, `experts.down_proj_blocks`).

A tensor of the checkpoint without scales stays in its own dtype (releases mix bf16 norms, embeddings and
routers into FP8 checkpoints). Dense (non-expert) weights are dequantized to the compute dtype when they load;
routed experts keep their format in the store (strata.tiers.store) and are dequantized only by the paths whose
kernels do not read it (strata.kernels.quant.FAST_PATHS). Every check here reads headers only, so a scale
tensor that is missing or has the wrong shape is a one-line `CheckpointError` naming it before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from strata.errors import CheckpointError
from strata.kernels.quant import MX_GROUP, dequantize_fp8, dequantize_mxfp4
from strata.runtime.model.config import ModelConfig
from strata.tiers.store.safetensors_header import DTYPES, FP8_SCALE, MX_BLOCKS, MX_SCALES, TensorInfo
from strata.tiers.store.safetensors_index import TensorIndex

SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # FP8 scale_inv dtypes read (converted to float32 exactly)
RawReader = Callable[[TensorInfo], torch.Tensor]  # a tensor's stored bytes as a CPU tensor of its dtype


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale_inv shape of an FP8 weight of `shape` [..., N, K] in `block` (bn, bk): [..., ceil(N/bn), ceil(K/bk)]."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def check_quantized(index: TensorIndex, cfg: ModelConfig, config_path: Path) -> None:
    """Every FP8 weight of `index` has a scale_inv of its block shape (config.json's weight_block_size), every MXFP4
    `*_blocks` its `*_scales`; the first that does not is a one-line `CheckpointError` naming the tensor."""
    fix = "the checkpoint is damaged or does not match its config.json: re-download it"
    for info in index:
        if info.dtype == "F8_E4M3":
            if cfg.quant_method != "fp8" or cfg.weight_block is None:
                raise CheckpointError(f"{info.file}: tensor {info.name!r} is FP8 but {config_path} has no "
                                      "quantization_config with quant_method \"fp8\" and weight_block_size; " + fix)
            if len(info.shape) < 2:
                raise CheckpointError(f"{info.file}: FP8 tensor {info.name!r} has shape {list(info.shape)}; strata "
                                      "reads FP8 matrices only: " + fix)
            scale = index[info.name + FP8_SCALE]
            want = fp8_scale_shape(info.shape, cfg.weight_block)
            if scale.shape != want or scale.dtype not in SCALE_DTYPES:
                bn, bk = cfg.weight_block
                raise CheckpointError(
                    f"{scale.file}: tensor {scale.name!r} is {scale.dtype} {list(scale.shape)} but {info.name!r} "
                    f"{list(info.shape)} in {bn}x{bk} blocks needs {' or '.join(SCALE_DTYPES)} {list(want)}; {fix}")
        elif info.dtype == "U8" and info.name.endswith(MX_BLOCKS):
            scales = index[info.name.removesuffix(MX_BLOCKS) + MX_SCALES]
            if len(info.shape) < 3 or info.shape[-1] != MX_GROUP // 2:
                raise CheckpointError(f"{info.file}: MXFP4 tensor {info.name!r} has shape {list(info.shape)}, not "
                                      f"[..., N, K/32, 16]; {fix}")
            if scales.shape != info.shape[:-1] or scales.dtype != "U8":
                raise CheckpointError(
                    f"{scales.file}: tensor {scales.name!r} is {scales.dtype} {list(scales.shape)} but {info.name!r} "
                    f"{list(info.shape)} needs U8 {list(info.shape[:-1])} (one e8m0 scale per 32 values); {fix}")


def stored_shape(index: TensorIndex, name: str) -> tuple[int, ...] | None:
    """The shape of the weight `name` as a dense tensor: its own, or an MXFP4 pair's [..., N, K]; None if absent."""
    if name in index:
        return index[name].shape
    if name + MX_BLOCKS in index:
        *lead, n, groups, _ = index[name + MX_BLOCKS].shape
        return (*lead, n, groups * MX_GROUP)
    return None


def read_weight(index: TensorIndex, name: str, dtype: torch.dtype, block: tuple[int, int] | None,
                read: RawReader) -> torch.Tensor:
    """Weight `name` as a CPU tensor of `dtype`: plain tensors converted, FP8 dequantized with `name`_scale_inv in
    `block`, MXFP4 (`name`_blocks + `name`_scales) dequantized. `read` reads a tensor's stored bytes (a store checks
    their checksums there). Leading dimensions (the fused layout's experts) are dequantized one matrix at a time."""
    if name not in index and name + MX_BLOCKS in index:
        blocks = read(index[name + MX_BLOCKS])
        scales = read(index[name + MX_SCALES])
        return _per_matrix(blocks, scales, 3, lambda v, s: dequantize_mxfp4(v, s, dtype), dtype)
    info = index[name]
    raw = read(info)
    if info.dtype != "F8_E4M3":
        return raw.to(dtype)
    scale = read(index[name + FP8_SCALE]).float()
    return _per_matrix(raw, scale, 2, lambda v, s: dequantize_fp8(v, s, block, dtype), dtype)


def _per_matrix(values: torch.Tensor, scales: torch.Tensor, dims: int, dequantize, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize values [..., *matrix] one matrix at a time (fp8 [N, K]: dims 2; mxfp4 blocks [N, K/32, 16]: dims 3)
    with scales [..., *their matrix]; the leading dimensions (experts) are kept."""
    if values.dim() == dims:
        return dequantize(values, scales)
    lead = values.shape[:-dims]
    mats = values.reshape(-1, *values.shape[-dims:])
    sc = scales.reshape(mats.shape[0], *scales.shape[len(lead):])
    first = dequantize(mats[0], sc[0])
    out = torch.empty((mats.shape[0], *first.shape), dtype=dtype)
    out[0] = first
    for i in range(1, mats.shape[0]):
        out[i] = dequantize(mats[i], sc[i])
    return out.reshape(*lead, *first.shape)


def plain_dtype(info: TensorInfo) -> bool:
    """Whether `info` is a weight in a dtype strata computes with as it is (not FP8 values, scales or MXFP4)."""
    return info.dtype in DTYPES and not info.name.endswith((FP8_SCALE, MX_SCALES))
