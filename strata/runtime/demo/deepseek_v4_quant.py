"""`strata demo-model --arch deepseek_v4 --experts fp8|mxfp4`: the DeepSeek-V4 demo model as the quantized releases
ship it (strata.runtime.model.deepseek_v4.release_quant reads them).

The weights are the bf16 demo model's (same seed, same values before rounding), written under the release's names:

- mxfp4 (DeepSeek-V4-Flash / -Pro): the routed experts in FP4, `experts.E.w{1,2,3}.weight` I8 [N, K/2] (two e2m1
  codes a byte, element 2j in the low nibble) + `.scale` F8_E8M0 [N, K/32]; attention's wq_a, wq_b, wkv, wo_a, wo_b,
  the indexer's wq_b and the shared experts in FP8, `.weight` F8_E4M3 + `.scale` F8_E8M0, one power-of-two scale per
  block; config.json's quantization_config {quant_method "fp8", fmt "e4m3", scale_fmt "ue8m0", weight_block_size}
  and `expert_dtype` "fp4".
- fp8 (DeepSeek-V4-Flash-Base): the same linears and the routed experts in FP8 with F32 scales (amax / 448),
  quantization_config without scale_fmt, `expert_dtype` "fp8".

Everything else (embeddings, head, routers, the compressors' and indexer's other projections, norms, hyper-connections)
stays as the bf16 model has it. The block is `fp8_block_for` the expert width (the releases' 128 x 128 for the small
and bench sizes, 32 x 32 for tiny, whose experts are 32 wide).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata.kernels.quant import FP8_MAX, MX_GROUP, fp8_block_for, quantize_fp8, quantize_mxfp4

V4_EXPERTS = ("bf16", "fp8", "mxfp4")  # `--experts` for --arch deepseek_v4
_FP8_LINEAR = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])"
                         r"\.weight")
_ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "F32": 4}


@dataclass(frozen=True)
class QuantV4Tensor:
    """One tensor a quantized release writes: the values or the scales (`part`) of bf16 tensor `source` (the
    `source_index`-th of the bf16 checkpoint, which seeds it) in `kind` "fp8" (block `block`, ue8m0 scales when
    `ue8m0`) or "fp4"."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: object  # the bf16 model's DemoTensor
    source_index: int
    part: str  # "values" | "scale"
    kind: str
    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _BYTES[self.dtype]

    def make(self, make_source: Callable[[object, int], torch.Tensor]) -> torch.Tensor:
        """This tensor's bytes as a tensor of its dtype, from `make_source(t, index)` (the bf16 model's tensor)."""
        w = make_source(self.source, self.source_index).float()
        if self.kind == "fp4" and self.part == "scale":  # (rounding the values too would double a bench write)
            return mxfp4_scales(w).view(torch.float8_e8m0fnu)
        if self.kind == "fp4":
            return quantize_mxfp4(w)[0].view(torch.int8)  # [N, K/2] two e2m1 codes a byte
        q, s = quantize_fp8_ue8m0(w, self.block) if self.ue8m0 else quantize_fp8(w, self.block)
        return q if self.part == "values" else s


def mxfp4_scales(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> the e8m0 scales [N, K/32] uint8 `quantize_mxfp4` gives (the smallest 2**e with amax / 2**e <= 6,
    e in [-127, 127]; -127 for an all-zero group), without rounding the values."""
    amax = w.float().reshape(w.shape[0], -1, MX_GROUP).abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    return (torch.where(amax > 0, exp, torch.full_like(exp, -127)) + 127).to(torch.uint8)


def quantize_fp8_ue8m0(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (values float8_e4m3fn, scales float8_e8m0fnu [ceil(N/bn), ceil(K/bk)]): each block's scale the
    smallest power of two >= amax / 448 (as transformers' FP8 quantizer rounds for scale_fmt "ue8m0")."""
    _, scale = quantize_fp8(w, block)  # amax / 448 (1 for an all-zero block)
    pow2 = torch.exp2(torch.ceil(torch.log2(scale)))
    n, k = w.shape
    full = pow2.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    values = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, pow2.to(torch.float8_e8m0fnu)


def v4_quantization(experts: str, cfg: dict) -> dict:
    """config.json's keys of a release with `experts` "fp8" or "mxfp4": quantization_config and expert_dtype."""
    block = list(fp8_block_for(cfg["moe_intermediate_size"]))
    q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": block}
    if experts == "mxfp4":
        q["scale_fmt"] = "ue8m0"
    return {"quantization_config": q, "expert_dtype": "fp4" if experts == "mxfp4" else "fp8"}


def v4_quantized_tensors(tensors: list, experts: str, cfg: dict) -> list:
    """The bf16 model's `tensors` (DemoTensors, in checkpoint order) as the release with `experts` writes them: each
    quantized weight becomes its values and `.scale`, the rest stays as it is."""
    block = fp8_block_for(cfg["moe_intermediate_size"])
    ue8m0 = experts == "mxfp4"
    out: list = []
    for i, t in enumerate(tensors):
        stem = t.name.removesuffix(".weight")
        n, k = t.shape if len(t.shape) == 2 else (0, 0)
        if experts == "mxfp4" and _ROUTED.fullmatch(t.name):
            out += [QuantV4Tensor(t.name, (n, k // 2), "I8", t, i, "values", "fp4"),
                    QuantV4Tensor(stem + ".scale", (n, k // MX_GROUP), "F8_E8M0", t, i, "scale", "fp4")]
        elif _FP8_LINEAR.fullmatch(t.name) or (experts == "fp8" and _ROUTED.fullmatch(t.name)):
            grid = (-(-n // block[0]), -(-k // block[1]))
            out += [QuantV4Tensor(t.name, (n, k), "F8_E4M3", t, i, "values", "fp8", block, ue8m0),
                    QuantV4Tensor(stem + ".scale", grid, "F8_E8M0" if ue8m0 else "F32", t, i, "scale", "fp8", block,
                                  ue8m0)]
        else:
            out.append(t)
    return out


def bytes_per_value(t) -> int:
    """Bytes per element of a demo tensor (bf16 model's or quantized), for ordering a shard widest first."""
    return _BYTES.get(t.dtype) or {"BF16": 2, "I32": 4}[t.dtype]
