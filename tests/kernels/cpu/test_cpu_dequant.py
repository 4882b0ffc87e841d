"""The compiled dequantizer (csrc/cpu_dequant.cpp, strata.kernels.cpu.dequant) and the hand-off it serves: quantized
experts with a prompt's tokens dequantized to bf16 for torch's GEMMs where those run on AMX (`quant_max_tokens`).

Every GGUF type, FP8 (its NaN codes too) and MXFP4 (every e8m0 scale) bit for bit the oracle's fp32 value rounded to
bf16, in the AVX-512 and the portable code, on one and two threads; the hand-off forced (`torch_gemms_on_amx`
patched: it runs on any CPU, through avx512_bf16's emulation where the CPU lacks it) within the backend's tolerance of
the fp32 reference, and bit for bit what plain bf16 experts holding the rounded weights give through the same GEMMs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks_random import random_blocks

from strata.kernels.cpu import dequant
from strata.kernels.cpu import experts as ce
from strata.kernels.experts import expert_swiglu
from strata.kernels.gguf_blocks import BLOCK_TYPES, dequantize_rows_gguf
from strata.kernels.quant import ExpertFormat, ExpertLayout, QuantMatrix, quantize_fp8, quantize_mxfp4

pytest.importorskip("gguf")
needs_kernel = pytest.mark.skipif(ce.library() is None, reason="needs the compiled CPU library")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def check(m: QuantMatrix, want: torch.Tensor) -> None:
    """Every code path of the dequantizer writes `want` (bf16) for m."""
    for portable in (False, True):
        for threads in (1, 2):
            got = dequant.dequantize(m, threads=threads, portable=portable)
            assert torch.equal(bits(got), bits(want)), (m.kind, portable, threads)


@needs_kernel
@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_gguf_types_bit_for_bit_the_oracle(name):
    t = BLOCK_TYPES[name]
    rows, k = 6, 512 if t.block_values == 256 else 96  # (Q8_0: an odd count of blocks a row)
    raw = torch.from_numpy(random_blocks(name, rows, k, np.random.default_rng(t.ggml_id))).reshape(-1)
    m = QuantMatrix("gguf", raw, torch.tensor([t.ggml_id], dtype=torch.uint8), (rows, k))
    check(m, dequantize_rows_gguf(raw, t.ggml_id, rows, k).to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("shape,block", [((40, 256), (16, 32)), ((33, 200), (16, 16)), ((64, 128), (128, 128))])
def test_fp8_bit_for_bit_the_oracle(shape, block):
    """Quantized weights, then every byte (0x7f, 0xff: NaN); blocks the vector code reads and ones it leaves to the
    scalar code (columns not a multiple of 32 a block)."""
    g = torch.Generator().manual_seed(shape[0])
    values, scales = quantize_fp8(torch.randn(shape, generator=g) * 0.05, block)
    for v in (values, torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)):
        m = QuantMatrix("fp8", v, scales, shape, block)
        check(m, m.dequantize(torch.float32).to(torch.bfloat16))


@needs_kernel
def test_mxfp4_bit_for_bit_the_oracle_for_every_scale():
    """Scales 0 (a subnormal power of two) to 255 (inf: zero codes make NaN)."""
    values, _ = quantize_mxfp4(torch.randn(64, 128))
    scales = torch.arange(256, dtype=torch.uint8).reshape(64, 4)
    m = QuantMatrix("mxfp4", values, scales, (64, 128))
    check(m, m.dequantize(torch.float32).to(torch.bfloat16))


def gguf_expert(types, H, inter, seed, fmt=None):
    """A GGUF expert of (gate, up, down) types, random valid blocks, in `fmt`'s layout (default: its types'): its
    QuantMatrix pair."""
    fmt = fmt or ExpertFormat("gguf", ggml=tuple((t,) for t in types))
    layout = ExpertLayout.build(fmt, H, inter)
    rng = np.random.default_rng(seed)
    shapes = ((inter, H), (inter, H), (H, inter))
    return layout.matrices(layout.pack_gguf(*((t, torch.from_numpy(random_blocks(t, n, k, rng)))
                                              for t, (n, k) in zip(types, shapes, strict=True))))


@needs_kernel
def test_an_expert_into_its_scratch_gate_and_up_each_in_its_type():
    gate_up, down = gguf_expert(("Q4_K", "Q6_K", "Q8_0"), 512, 256, seed=1)
    scratch = dequant.scratch(gate_up.shape, down.shape)
    assert dequant.scratch(gate_up.shape, down.shape)[0] is scratch[0]  # kept for the thread
    assert dequant.dequantize_expert(gate_up, down, scratch)
    for got, m in zip(scratch, (gate_up, down), strict=True):
        assert torch.equal(bits(got), bits(m.dequantize(torch.float32).to(torch.bfloat16)))


def experts_of(kind: str, count: int, H: int, inter: int):
    """`count` experts of format kind `kind` (QuantMatrix pairs)."""
    if kind == "gguf":  # (one layout for the call's experts, each matrix of the types any of them has)
        types = [("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q6_K", "Q4_K"), ("Q5_K", "Q8_0", "Q4_K")][:count]
        fmt = ExpertFormat("gguf", ggml=tuple(tuple(sorted({t[j] for t in types})) for j in range(3)))
        return [gguf_expert(t, H, inter, seed=e, fmt=fmt) for e, t in enumerate(types)]
    layout = ExpertLayout.build(ExpertFormat(kind, block=(32, 32)) if kind == "fp8" else ExpertFormat(kind), H, inter)
    g = torch.Generator().manual_seed(7)
    return [layout.matrices(layout.pack(torch.randn(2 * inter, H, generator=g) * 0.05,
                                        torch.randn(H, inter, generator=g) * 0.05)) for _ in range(count)]


def hand_off_backend() -> str:
    """avx512_bf16 where the CPU runs it, else its emulation (it hands experts off as the kernel it copies)."""
    return "avx512_bf16" if "avx512_bf16" in ce.available_backends() else "avx512_bf16_emulated"


@needs_kernel
@pytest.mark.parametrize("kind", ["gguf", "fp8", "mxfp4"])
def test_quantized_experts_handed_to_the_gemms_on_amx(monkeypatch, kind):
    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: True)
    name = hand_off_backend()
    if ce.backend(name, kind) != name:  # (fp8 on avx512_bf16 without AVX512_VBMI: avx512, which hands nothing off)
        name = "avx512_bf16_emulated"
    H, inter, N = 512, 256, 48
    mats = experts_of(kind, 3, H, inter)
    g = torch.Generator().manual_seed(3)
    idx = [torch.randperm(N, generator=g)[:n].sort().values for n in (30, 31, 48)]  # all > AMX_QUANT_KERNEL_TOKENS
    tw = [torch.rand(i.numel(), generator=g) for i in idx]
    x = torch.randn(N, H, generator=g)
    assert ce.quant_max_tokens(name, kind) == min(ce.max_tokens(name), ce.AMX_QUANT_KERNEL_TOKENS[kind])
    calls, shipped = [], dequant.dequantize_expert
    monkeypatch.setattr(dequant, "dequantize_expert", lambda *a: calls.append(1) or shipped(*a))
    out = ce.cpu_experts_forward(x, mats, idx, tw, backend=name)
    assert len(calls) == 3
    ref = torch.zeros(N, H)
    for (gu, dn), i, w in zip(mats, idx, tw, strict=True):
        y = expert_swiglu(x[i], gu.dequantize(torch.float32), dn.dequantize(torch.float32))
        ref.index_add_(0, i, y * w[:, None])
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= ce.tolerance(name, kind)
    plain = [(gu.dequantize(torch.float32).bfloat16(), dn.dequantize(torch.float32).bfloat16()) for gu, dn in mats]
    assert torch.equal(out, ce.cpu_experts_forward(x, plain, idx, tw, backend=name))
    calls.clear()
    kept = ce.cpu_experts_forward(x, mats, idx, tw, backend=name, hand_off=False)  # the kernel, in groups
    assert not calls and ((kept - ref).abs().max() / ref.abs().max()).item() <= ce.tolerance(name, kind)


@needs_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_quantized_experts_stay_on_the_kernel_without_amx(monkeypatch, amx):
    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: amx)
    for name in ("avx512_bf16", "avx512_bf16_emulated", "avx512", "avx2"):
        for kind, tokens in ce.AMX_QUANT_KERNEL_TOKENS.items():
            handed = amx and name.startswith("avx512_bf16")
            want = min(ce.max_tokens(name), tokens) if handed else ce.max_tokens(name)
            assert ce.quant_max_tokens(name, kind) == want
            assert ce.quant_max_tokens(name, kind, hand_off=False) == ce.max_tokens(name)
