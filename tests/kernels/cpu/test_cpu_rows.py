"""A CPU decode step's small ops as compiled calls (strata.kernels.cpu.rows): RMSNorm (with the residual add), the
per-head norm and rotary, and one-query attention, each against the torch chain it replaces; then a bf16 model's
decode steps with them and without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import experts as ce
from strata.kernels.cpu import rows
from strata.runtime.model.attention import attend_one
from strata.runtime.model.rope import apply_rope

pytestmark = pytest.mark.skipif(not any(ce.available_isa(b) for b in ("avx512_bf16", "avx512", "avx2")),
                                reason="the compiled CPU kernel is not available here")
AVX512 = any(ce.available_isa(b) for b in ("avx512_bf16", "avx512"))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("n, d", [(1, 2048), (3, 100), (16, 7168), (2, 1)])
def test_rms_norm_is_the_torch_chain(n, d):
    g = _gen(n * d)
    x = (torch.randn(n, d, generator=g) * 3).bfloat16()
    w = (torch.rand(d, generator=g) + 0.5).bfloat16()
    y = rows.rms_norm(x, w, 1e-6)
    assert y is not None and y.dtype == torch.bfloat16
    ref = _torch_rms_norm(x, w, 1e-6)
    # the same roundings; only the fp32 sum of squares may differ in its last bit, which bf16 rarely shows
    assert (y != ref).float().mean() < 0.01
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2)


def test_add_rms_norm_rounds_the_sum_as_torch_adds():
    g = _gen(1)
    x, delta = torch.randn(4, 2048, generator=g).bfloat16(), torch.randn(4, 2048, generator=g).bfloat16()
    w = (torch.rand(2048, generator=g) + 0.5).bfloat16()
    total, y = rows.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(y, _torch_rms_norm(x + delta, w, 1e-5), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("d, rot", [(128, 128), (64, 32)])  # rot < d: a partial rotary, the rest passed through
def test_norm_rope_is_the_torch_chain(normed, d, rot):
    g = _gen(d + rot)
    n, heads = 3, 8
    x = torch.randn(n, heads, d, generator=g).bfloat16()
    angles = torch.rand(n, rot // 2, generator=g) * 50
    cos, sin = (torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16())
    w = (torch.rand(d, generator=g) + 0.5).bfloat16() if normed else None
    y = rows.norm_rope(x, cos, sin, w, 1e-6)
    ref = apply_rope(_torch_rms_norm(x, w, 1e-6) if normed else x, cos, sin)
    assert y is not None and y.shape == x.shape
    assert (y != ref).float().mean() < 0.01
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=2e-2)


def test_norm_rope_reads_strided_token_rows():
    """q as the projections' split leaves it: each token's heads contiguous, tokens a wider row apart."""
    g = _gen(5)
    qkv = torch.randn(2, 6 * 64, generator=g).bfloat16()
    q = qkv[:, : 4 * 64].view(2, 4, 64)
    angles = torch.rand(2, 32, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()
    assert torch.equal(rows.norm_rope(q, cos, sin, None, 0.0), apply_rope(q, cos, sin))


def _attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [heads, d], k/v [S, kv_heads, d] -> [heads, d] in float64."""
    group = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, d]
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    p = torch.softmax((kk @ q.double()[:, :, None])[..., 0] * scale, dim=-1)
    return (p[:, None, :] @ vv)[:, 0]


@pytest.mark.skipif(not AVX512, reason="the compiled attention is AVX-512 code")
@pytest.mark.parametrize("d, heads, kv_heads", [(128, 32, 4), (64, 8, 8), (256, 16, 2)])
def test_attention_over_each_sequences_cache(d, heads, kv_heads):
    """Sequences in scattered slots of one cache, of several lengths (one key; a block's tail; thousands), each
    within bf16 rounding of the exact attention, and equal to the torch decode path's result to that rounding."""
    g = _gen(d)
    cache_k = torch.randn(4, 3000, kv_heads, d, generator=g).bfloat16()
    cache_v = torch.randn(4, 3000, kv_heads, d, generator=g).bfloat16()
    slots, lengths = [2, 0, 3], [1, 77, 2999]
    q = (torch.randn(3, heads, d, generator=g) * 2).bfloat16()
    keys = [cache_k[s, :n] for s, n in zip(slots, lengths, strict=True)]
    values = [cache_v[s, :n] for s, n in zip(slots, lengths, strict=True)]
    out = rows.attend(q, keys, values, d ** -0.5)
    assert out is not None and out.shape == (3, heads, d) and out.dtype == torch.bfloat16
    for i in range(3):
        ref = _attention_reference(q[i], keys[i], values[i], d ** -0.5)
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-2, atol=1e-2)
        old = attend_one(q[i][:, None], keys[i].transpose(0, 1), values[i].transpose(0, 1), d ** -0.5)[:, 0]
        torch.testing.assert_close(out[i], old, rtol=1e-2, atol=1e-2)
    # a sequence's result does not depend on the others in the call
    assert torch.equal(out[1:2], rows.attend(q[1:2], keys[1:2], values[1:2], d ** -0.5))


@pytest.mark.skipif(not AVX512, reason="the compiled attention is AVX-512 code")
@pytest.mark.parametrize("d, heads, kv_heads, normed, rot", [(128, 32, 4, True, 128), (64, 8, 8, False, 32)])
def test_decode_attention_is_the_norms_the_cache_writes_and_attend(d, heads, kv_heads, normed, rot):
    """`decode_attention` on a q/k/v projection's rows: the caches get each token's rotated key and its value at
    (slot, position), nothing else, and the output is, bit for bit, `norm_rope` of the queries attended (`attend`)
    over each slot's keys up to and including the new one."""
    g = _gen(d + rot)
    n, slots, positions = 3, [2, 0, 3], [0, 40, 9]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    cos, sin = torch.randn(n, rot, generator=g).bfloat16(), torch.randn(n, rot, generator=g).bfloat16()
    wq, wk = ((torch.rand(d, generator=g) + 0.5).bfloat16() for _ in range(2))
    k_cache = torch.randn(4, 64, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(4, 64, kv_heads, d, generator=g).bfloat16()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = rows.norm_rope(q.view(n, heads, d), cos, sin, wq if normed else None, 1e-6)
    k = rows.norm_rope(k.view(n, kv_heads, d), cos, sin, wk if normed else None, 1e-6)
    for i, (s, p) in enumerate(zip(slots, positions, strict=True)):
        want_k[s, p], want_v[s, p] = k[i], v[i].view(kv_heads, d)
    want = rows.attend(q, [want_k[s, : p + 1] for s, p in zip(slots, positions, strict=True)],
                       [want_v[s, : p + 1] for s, p in zip(slots, positions, strict=True)], d ** -0.5)
    norms = ((wq, 1e-6), (wk, 1e-6)) if normed else (None, None)
    got = rows.decode_attention(qkv, heads, kv_heads, cos, sin, *norms, k_cache, v_cache, slots, positions, d ** -0.5)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # a position past the cache, or a slot outside it: refused, nothing written
    for bad_slots, bad_positions in [(slots, [0, 64, 9]), ([2, 4, 3], positions)]:
        assert rows.decode_attention(qkv, heads, kv_heads, cos, sin, *norms, k_cache, v_cache, bad_slots,
                                     bad_positions, d ** -0.5) is None
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_other_inputs_are_left_to_torch():
    x, w = torch.randn(2, 64), torch.randn(64)
    assert rows.rms_norm(x, w, 1e-6) is None  # fp32: the reference path stays torch's
    assert rows.rms_norm(torch.randn(rows.MAX_ROWS + 1, 64).bfloat16(), w.bfloat16(), 1e-6) is None  # a prompt
    q = torch.randn(1, 4, 48).bfloat16()
    assert rows.attend(q, [torch.randn(5, 2, 48).bfloat16()], [torch.randn(5, 2, 48).bfloat16()], 0.1) is None
    from strata.kernels.options import KernelOptions, kernel_options

    xb, wb = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()
    assert rows.rms_norm(xb, wb, 1e-6) is not None
    with kernel_options(KernelOptions(fused=False)):  # [debug] fused_kernels = false: torch's chains, the reference
        assert rows.rms_norm(xb, wb, 1e-6) is None


@pytest.mark.skipif(not AVX512, reason="the compiled attention is AVX-512 code")
def test_a_bf16_models_decode_steps_with_and_without_the_compiled_ops(tmp_path, monkeypatch):
    """A Qwen3-MoE checkpoint (per-head q/k norms, GQA, head_dim 64) in bf16 on the CPU: prompts, then decode steps
    of three sequences, once through the compiled ops and once through torch's; the same greedy tokens, hidden
    states within bf16 rounding."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.kv_cache import KVCache, StepBatch
    from strata.runtime.model.loader import load_model

    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, intermediate_size=256, moe_intermediate_size=64,
                         num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_model(Checkpoint.open(tmp_path), torch.bfloat16, "cpu")

    from strata.kernels.options import KernelOptions, kernel_options

    calls = {"attention": 0}
    decode_attention = rows.decode_attention

    def counted(*a, **k):
        out = decode_attention(*a, **k)
        calls["attention"] += out is not None
        return out

    def run(compiled: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        monkeypatch.setattr(rows, "decode_attention", counted)
        cache = KVCache(model.cfg, 3, 64, torch.bfloat16, "cpu")
        g = _gen(3)
        lengths = [9, 30, 2]
        hidden, picks = [], []
        with torch.inference_mode(), kernel_options(KernelOptions(fused=compiled)):
            for slot, n in enumerate(lengths):
                model.run_layers(torch.randint(0, 300, (n,), generator=g), StepBatch([slot], [0], [n]), cache)
            ids = torch.randint(0, 300, (3,), generator=g)
            for _ in range(6):
                h = model.run_layers(ids, StepBatch([0, 1, 2], lengths, [1, 1, 1]), cache)
                ids = model.logits(h).argmax(-1)
                hidden.append(h.float())
                picks.append(ids.tolist())
                lengths = [n + 1 for n in lengths]
        return hidden, picks

    (h_torch, p_torch), before = run(False), calls["attention"]
    assert before == 0
    h_rows, p_rows = run(True)
    assert calls["attention"] == 6 * 2  # every decode step's every layer
    assert p_rows == p_torch
    for a, b in zip(h_rows, h_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
