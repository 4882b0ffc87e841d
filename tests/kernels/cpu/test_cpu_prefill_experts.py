"""Prefill-sized experts on the CPU (more than the backend's `max_tokens`): torch's bf16 GEMMs on the weights as stored
under the compiled backends, the fp32 reference under "torch"; both against `expert_swiglu` on the upcast weights."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.cpu import experts as ce
from strata.kernels.cpu import numerics
from strata.kernels.cpu.expert_args import torch_expert
from strata.kernels.experts import expert_swiglu


def _experts(count: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).bfloat16(),
             (torch.randn(hidden, inter, generator=g) / inter**0.5).bfloat16()) for _ in range(count)]


def _reference(x, experts, rows, weights):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for (gu, dn), idx, w in zip(experts, rows, weights, strict=True):
        out.index_add_(0, idx, expert_swiglu(x.float()[idx], gu.float(), dn.float()) * w[:, None])
    return out


def test_prefill_sized_experts_run_bf16_gemms_within_the_bf16_kernels_bound():
    hidden, inter, n = 256, 96, 3 * ce.max_tokens(ce.backend())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, hidden, generator=g).bfloat16()
    experts = _experts(3, hidden, inter)
    rows = [torch.arange(n), torch.arange(0, n, 2), torch.arange(5)]  # two above the backend's max_tokens, one below
    weights = [torch.rand(len(r), generator=g) for r in rows]
    ref = _reference(x, experts, rows, weights)
    fast = ce.cpu_experts_forward(x, experts, rows, weights, threads=2)
    err = ((fast - ref).abs().max() / ref.abs().max()).item()
    assert err < numerics.tolerance("avx512_bf16", "plain"), err
    assert not torch.equal(fast, ref)  # bf16 activations: not the fp32 path
    exact = ce.cpu_experts_forward(x, experts, rows, weights, backend="torch")
    want = torch.zeros(x.shape, dtype=torch.float32)
    for (gu, dn), idx, w in zip(experts, rows, weights, strict=True):
        torch_expert(x.float(), gu, dn, idx, w, want)
    assert torch.equal(exact, want)  # "torch" stays the fp32 reference, prefill-sized experts included


@pytest.mark.parametrize("count", [1, 4])
def test_one_bf16_expert_matches_its_swiglu(count):
    hidden, inter = 128, 64
    x = torch.randn(50, hidden).bfloat16()
    for gu, dn in _experts(count, hidden, inter, seed=count):
        idx, w = torch.arange(3, 50), torch.rand(47)
        out = torch.zeros(x.shape, dtype=torch.float32)
        ce.bf16_expert(x, gu, dn, idx, w, out)
        ref = torch.zeros_like(out).index_add_(0, idx, expert_swiglu(x.float()[idx], gu.float(), dn.float()) * w[:, None])
        assert ((out - ref).abs().max() / ref.abs().max()) < numerics.tolerance("avx512_bf16", "plain")
        assert torch.equal(out[:3], torch.zeros(3, hidden))  # rows without the expert are untouched


def test_the_tile_backends_keep_twice_the_tokens_an_expert_on_the_kernel(monkeypatch):
    """avx512_bf16's four-row tile keeps experts of up to 2 x MAX_TOKENS tokens on the kernel; the fp32 backends and
    the emulations hand longer ones to torch at MAX_TOKENS."""
    monkeypatch.setattr(ce, "MAX_TOKENS", 16)
    assert ce.max_tokens("avx512_bf16") == 32
    assert [ce.max_tokens(b) for b in ("avx512", "avx2", "avx512_bf16_emulated")] == [16, 16, 16]


@pytest.mark.parametrize("amx", [False, True])
def test_plain_experts_go_to_torch_sooner_where_its_gemms_run_on_amx(monkeypatch, amx):
    """Where torch's bf16 GEMMs run on AMX, a plain expert with more than AMX_KERNEL_TOKENS tokens is computed by them
    under avx512_bf16 (`bf16_expert`, bit for bit), one with that many on the kernel; elsewhere, and for the fp32
    backends, the kernel keeps up to max_tokens. (Quantized experts: tests/kernels/cpu/test_cpu_dequant.py.)"""
    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: amx)
    name = ce.backend()
    limit = min(ce.max_tokens(name), ce.AMX_KERNEL_TOKENS) if amx and name == "avx512_bf16" else ce.max_tokens(name)
    assert ce.plain_max_tokens(name) == limit
    assert [ce.plain_max_tokens(b) for b in ("avx512", "avx2")] == [ce.max_tokens("avx512")] * 2  # fp32: unchanged
    if name == "torch":
        pytest.skip("no compiled kernel here")
    hidden, inter = 256, 96
    (gu, dn), = _experts(1, hidden, inter, seed=3)
    x = torch.randn(limit + 1, hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    for n in (limit, limit + 1):
        idx, w = torch.arange(n), torch.rand(n, generator=torch.Generator().manual_seed(n))
        out = ce.cpu_experts_forward(x, [(gu, dn)], [idx], [w])
        gemms = torch.zeros(x.shape, dtype=torch.float32)
        ce.bf16_expert(x, gu, dn, idx, w, gemms)
        assert torch.equal(out, gemms) == (n > limit), n
    # without the hand-off (the CPU share beside a GPU) the kernel keeps every count up to max_tokens
    assert ce.plain_max_tokens(name, hand_off=False) == ce.max_tokens(name)
    idx, w = torch.arange(limit + 1), torch.rand(limit + 1, generator=torch.Generator().manual_seed(limit + 1))
    kept = ce.cpu_experts_forward(x, [(gu, dn)], [idx], [w], hand_off=False)
    gemms = torch.zeros(x.shape, dtype=torch.float32)
    ce.bf16_expert(x, gu, dn, idx, w, gemms)
    assert torch.equal(kept, gemms) == (limit + 1 > ce.max_tokens(name))


def test_a_prompts_token_counts_take_a_few_gemm_shapes():
    """`bf16_expert` computes an expert's T tokens in `gemm_rows(T)` rows (the rest zero, dropped): at most 15 or an
    eighth more than T, and few distinct shapes over every count a prompt may give an expert (oneDNN keeps a primitive per
    bf16 GEMM shape); a padded count gives the same rows as the unpadded GEMM would, within bf16's bound."""
    from strata.kernels.cpu.expert_args import gemm_rows

    rows = [gemm_rows(t) for t in range(1, 4097)]
    assert all(t <= r <= t + max(15, t // 8) for t, r in zip(range(1, 4097), rows, strict=True))
    assert len(set(rows)) <= 50 and gemm_rows(16) == 16 and gemm_rows(17) == 32 and gemm_rows(300) == 320
    hidden, inter = 128, 64
    (gu, dn), = _experts(1, hidden, inter, seed=5)
    x = torch.randn(120, hidden).bfloat16()
    idx, w = torch.arange(3, 104), torch.rand(101)  # 101 tokens: 112 rows
    out = torch.zeros(x.shape, dtype=torch.float32)
    ce.bf16_expert(x, gu, dn, idx, w, out)
    ref = torch.zeros_like(out).index_add_(0, idx, expert_swiglu(x.float()[idx], gu.float(), dn.float()) * w[:, None])
    assert ((out - ref).abs().max() / ref.abs().max()) < numerics.tolerance("avx512_bf16", "plain")
    assert torch.equal(out[:3], torch.zeros(3, hidden)) and torch.equal(out[104:], torch.zeros(16, hidden))
