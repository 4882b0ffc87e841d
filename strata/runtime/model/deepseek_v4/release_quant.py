"""DeepSeek-V4's quantized tensors as its releases spell them -> strata's spellings (strata.runtime.model.quantized).

The releases (DeepSeek-V4-Flash / -Pro with FP4 experts, DeepSeek-V4-Flash-Base with FP8 ones) ship config.json's
`quantization_config` {quant_method "fp8", fmt "e4m3", weight_block_size [128, 128], activation_scheme "dynamic",
scale_fmt "ue8m0" where the scales are e8m0} and `expert_dtype` "fp4" | "fp8" (at the top, or inside
quantization_config), and, under the release's names (strata.runtime.model.deepseek_v4.names):

    fp8 linears  `x.weight` F8_E4M3 [N, K] + `x.scale` [ceil(N/bn), ceil(K/bk)], F8_E8M0 (ue8m0: 2**(byte - 127))
                 or F32: attention's wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b, the shared experts (and the
                 routed experts of an fp8 release); the compressors' and indexer's other projections, the routers,
                 embeddings and head stay bf16
    fp4 experts  `experts.E.w{1,2,3}.weight` I8 [N, K/2] (two e2m1 codes a byte, element 2j in the low nibble; U8
                 in some re-packs)
                 + `x.scale` F8_E8M0 [N, K/32], one e8m0 scale per 32 values along K

transformers reads the same (its FP8 quantizer renames `x.scale` to `x.weight_scale_inv`; `Fp8Dequantize` unpacks
int8 FP4 with the e2m1 table, low nibble first). Both are strata's own formats under other names, byte for byte:
fp8 is `x.weight` + `x.weight_scale_inv` (an F8_E8M0 scale is read as float32, exactly), and an fp4 expert's bytes
are MXFP4's `x.weight_blocks` [N, K/32, 16] + `x.weight_scales` [N, K/32] (U8 e8m0) as gpt-oss ships them, so the
index is relabelled from headers alone and a store keeps the experts as they are (kind "mxfp4").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from strata.errors import CheckpointError
from strata.kernels.quant import MX_GROUP
from strata.tiers.store.safetensors_header import FP8_SCALE, MX_BLOCKS, MX_SCALES, TensorInfo
from strata.tiers.store.safetensors_index import TensorIndex

RELEASE_SCALE = ".scale"  # the release's name of a quantized weight's scales, beside `.weight`
FP8_SCALE_DTYPES = ("F8_E8M0", "F32")  # ue8m0 (scale_fmt "ue8m0") or float32 block scales
FP4_DTYPES = ("I8", "U8")  # packed e2m1 pairs: I8 as the releases (and transformers) store them, U8 as some re-packs do
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
_FIX = "the checkpoint is damaged or not a DeepSeek-V4 release: re-download it"


def release_quantized(index: TensorIndex, stored_names: dict[str, str] | None = None) -> TensorIndex:
    """`index` (in transformers' names) with the release's quantized pairs in strata's spellings: FP8 `x.scale` ->
    `x.weight_scale_inv`; FP4 experts' `x.weight` I8 + `x.scale` -> MXFP4 `x.weight_blocks` + `x.weight_scales` (U8,
    the same bytes). Headers only; a pair that cannot be read is a one-line `CheckpointError` naming the tensor as
    its file does (`stored_names`: transformers' name -> the file's, where they differ)."""
    def named(name: str) -> str:
        return repr((stored_names or {}).get(name, name))

    def scale_of(weight: str) -> str:  # the missing scales' name, spelled as the weight's file spells it
        return repr((stored_names or {}).get(weight, weight).removesuffix(".weight") + RELEASE_SCALE)

    tensors = dict(index.tensors)
    for name, info in index.tensors.items():
        if info.dtype not in FP4_DTYPES or not name.endswith(".weight"):
            continue
        stem = name.removesuffix(".weight")
        scale = tensors.pop(stem + RELEASE_SCALE, None)
        if scale is None:
            if info.dtype == "U8":
                continue  # an unquantized byte tensor, if any: checked (and refused) with the other dtypes
            raise CheckpointError(f"{info.file}: FP4 tensor {named(name)} (I8, two e2m1 values a byte) has no "
                                  f"{scale_of(name)} (its e8m0 scales); {_FIX}")
        del tensors[name]
        blocks, scales = _fp4_as_mxfp4(info, scale, stem, named)
        tensors[blocks.name], tensors[scales.name] = blocks, scales
    for name, info in index.tensors.items():
        if not name.endswith(RELEASE_SCALE) or name not in tensors:
            continue
        weight = tensors.get(name.removesuffix(RELEASE_SCALE) + ".weight")
        if weight is None or weight.dtype != "F8_E4M3":
            continue  # a parameter named `scale` (the hyper-connections' `attn_hc.scale`)
        if info.dtype not in FP8_SCALE_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {named(name)} is {info.dtype}; the FP8 block scales of "
                                  f"{named(weight.name)} are {' or '.join(FP8_SCALE_DTYPES)} (scale_fmt ue8m0 or float); "
                                  + _FIX)
        del tensors[name]
        tensors[weight.name + FP8_SCALE] = replace(info, name=weight.name + FP8_SCALE)
    for name, info in tensors.items():
        if info.dtype == "F8_E4M3" and name + FP8_SCALE not in tensors:
            raise CheckpointError(f"{info.file}: FP8 tensor {named(name)} has no {scale_of(name)} (its block "
                                  f"scales); {_FIX}")
    return index if tensors.keys() == index.tensors.keys() else TensorIndex(tensors)


def _fp4_as_mxfp4(values: TensorInfo, scale: TensorInfo, stem: str, named: Callable[[str], str]
                  ) -> tuple[TensorInfo, TensorInfo]:
    """An FP4 expert matrix [N, K] (values I8 [N, K/2], scales F8_E8M0 [N, K/32]) as MXFP4's blocks and scales."""
    if not _ROUTED_EXPERT.search(stem):
        raise CheckpointError(f"{values.file}: tensor {named(values.name)} is FP4 ({values.dtype}); strata reads FP4 in the routed "
                              f"experts only (expert_dtype \"fp4\"), as DeepSeek-V4 ships them; {_FIX}")
    if len(values.shape) != 2 or values.shape[1] % (MX_GROUP // 2):
        raise CheckpointError(f"{values.file}: FP4 tensor {named(values.name)} has shape {list(values.shape)}, not "
                              f"[N, K/2] with K a multiple of {MX_GROUP}; {_FIX}")
    n, half = values.shape
    groups = half // (MX_GROUP // 2)
    if scale.dtype != "F8_E8M0" or scale.shape != (n, groups):
        raise CheckpointError(f"{scale.file}: tensor {named(scale.name)} is {scale.dtype} {list(scale.shape)} but FP4 "
                              f"{named(values.name)} {list(values.shape)} needs F8_E8M0 {[n, groups]} (one ue8m0 scale "
                              f"per {MX_GROUP} values); {_FIX}")
    blocks = replace(values, name=stem + ".weight" + MX_BLOCKS, dtype="U8", shape=(n, groups, MX_GROUP // 2))
    scales = replace(scale, name=stem + ".weight" + MX_SCALES, dtype="U8")
    return blocks, scales
