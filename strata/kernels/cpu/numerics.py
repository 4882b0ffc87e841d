"""How close the CPU expert kernel's backends come to the reference, per weight format.

The reference is `expert_swiglu` (strata.kernels.experts) in fp32 on the same weights upcast: bf16 experts as they
are, FP8 and MXFP4 experts dequantized (`ExpertLayout.dequantize(blob, torch.float32)`, the oracle of
strata.kernels.quant). `tolerance(backend, kind)` bounds max |out - ref| / max |ref| over a call. The same bounds hold
for every SwiGLU form and gate_up bias (reference `strata.kernels.experts.expert_swiglu`), with the clamps active: the form is
applied in fp32 to the same sums, and its clamps only shrink values (tests/kernels/cpu/test_cpu_expert_forms.py).

bf16 experts (`TOLERANCE`): the fp32 paths (avx2, avx512) differ only by summation order (measured <= 2e-6);
avx512_bf16 rounds x and silu(gate)*up to bf16, which costs a median 3e-3 and at most 7.3e-3 over 200 random inputs
for each of 15 shapes with I >= 19 (bound 1.5e-2; a tiny intermediate width such as I = 5 reached 2.4e-2 in 3,000
trials). That is the rounding a bf16 GPU GEMM applies to its activations; use avx512 (fp32 activations, about as fast
while memory-bound) where fp32-class agreement matters.

FP8 and MXFP4 experts (`QUANT_TOLERANCE`): the kernel's conversions are exact. An e4m3 value is exact in bf16
(avx512_bf16 looks up its two bytes) and in fp32 (the fp32 paths read it as the fp16 bits of value / 256 and widen
them, so the two NaN codes, which no quantizer writes, read as +-480 there). MXFP4's E2M1[code] * 2^(scale - 127) is
exact in fp32 (torch's own product, the fp32 paths' tables) and in bf16 for scales 2..252 (avx512_bf16's tables for
the groups past a row's last 128-value step); avx512_bf16 reads the rest as the exact E2M1 values and multiplies each
group's partial sums by its power of two. FP8's scale_inv multiplies each block's partial sum (bk columns) rather
than each weight. Either way the same products, rounded in another order, so each format keeps its backend's
numerics on bf16 experts: the fp32 paths a reordered fp32 sum, avx512_bf16 its bf16 activations (measured by
tests/kernels/cpu/test_cpu_quant_experts.py).

GGUF experts (avx512_bf16 and its emulation; the other backends take the torch path): a block's codes are exact in bf16
(q, or 128 + q), and every sub-block's products are summed before its scale multiplies them; mins, and the 128 of
128 + q, are subtracted through each sub-block's sum of the same bf16 activations. The offset's products are as large
as 128 |x|, so their fp32 sums round at ~2^-24 * 128 sum|x|, far under the bf16 activations' 2^-9 (measured by
tests/kernels/cpu/test_cpu_gguf_experts.py).

Quantized experts handed to torch's GEMMs (avx512_bf16 where they run on AMX, more than `experts.quant_max_tokens`
tokens): their weights are dequantized and rounded to bf16 (to nearest even, csrc/cpu_dequant.cpp), then computed as a
plain bf16 expert with those weights is (`expert_args.bf16_expert`, bit for bit): the weights' rounding, 2^-9 of each
weight at most, adds to the bf16 activations' and the same bound holds (tests/kernels/cpu/test_cpu_dequant.py). As for plain
experts there (`experts.plain_max_tokens`), a token's result may then depend on the other tokens of its pass.
"""

from __future__ import annotations

TOLERANCE = {"torch": 1e-5, "avx2": 1e-4, "avx512": 1e-4, "avx512_bf16": 1.5e-2, "avx512_emulated": 1e-4,
             "avx512_bf16_emulated": 1.5e-2}
"""Bound on max |out - reference| / max |reference| for each backend on bf16 experts."""

QUANT_TOLERANCE = {
    "fp8": {"torch": 1e-5, "avx2": 1e-4, "avx512": 1e-4, "avx512_bf16": 1.5e-2, "avx512_emulated": 1e-4,
            "avx512_bf16_emulated": 1.5e-2},
    "mxfp4": {"torch": 1e-5, "avx2": 1e-4, "avx512": 1e-4, "avx512_bf16": 1.5e-2, "avx512_emulated": 1e-4,
              "avx512_bf16_emulated": 1.5e-2},
    "gguf": {"torch": 1e-5, "avx2": 1e-5, "avx512": 1e-5, "avx512_bf16": 1.5e-2, "avx512_emulated": 1e-5,
             "avx512_bf16_emulated": 1.5e-2},  # (the fp32 backends run the torch path)
}
"""The same bound for FP8, MXFP4 and GGUF experts, against the reference on their dequantized weights."""


def tolerance(backend: str, kind: str = "plain") -> float:
    """The accuracy bound of `backend` on experts of format kind `kind` ("plain": bf16, "fp8", "mxfp4", "gguf")."""
    return TOLERANCE[backend] if kind == "plain" else QUANT_TOLERANCE[kind][backend]
