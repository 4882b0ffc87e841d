"""The fused decode kernels (strata.kernels.gpu.fused, strata.kernels.gpu.decode_attention) against the torch chains
they replace. On CUDA in bf16 (marked gpu); locally also on CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, Triton installed), in fp16, since the interpreter rounds to bf16 by truncation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_device import DEVICE, DTYPE, MARKS

from strata.kernels.gpu import decode_attention as da
from strata.kernels.gpu import decode_gemv, fused
from strata.kernels.gpu.experts.grouped import combine_pairs
from strata.kernels.routing import softmax_topk
from strata.runtime.model.attention import attend_decode
from strata.runtime.model.rope import apply_rope

pytestmark = MARKS


def torch_norm(x, w, eps):
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def close_in_dtype(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-3) -> None:
    """Equal up to one rounding step of the dtype; almost every element bit-identical (only sums reorder)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=atol)
    assert (a != b).float().mean().item() < 0.05


def rope_tables(positions, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DTYPE).to(DEVICE), emb.sin().to(DTYPE).to(DEVICE)


@pytest.mark.parametrize("rows,d", [(1, 2048), (7, 4096), (3, 7168), (2, 96)])
def test_rms_norm_equals_the_torch_chain(rows, d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(rows, d, generator=g) * 3).to(DTYPE).to(DEVICE)
    w = (torch.randn(d, generator=g) * 0.2 + 1).to(DTYPE).to(DEVICE)
    close_in_dtype(fused.rms_norm(x, w, 1e-6), torch_norm(x, w, 1e-6))
    assert fused.rms_norm(x[:, None, :], w, 1e-6).shape == (rows, 1, d)  # any leading dims


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads,d", [(32, 128), (4, 64)])
def test_norm_rope_equals_norm_then_rotary(norm, heads, d):
    g = torch.Generator().manual_seed(heads + d)
    x = torch.randn(5, heads, d, generator=g).to(DTYPE).to(DEVICE)
    w = (torch.randn(d, generator=g) * 0.2 + 1).to(DTYPE).to(DEVICE) if norm else None
    cos, sin = rope_tables(torch.tensor([0, 1, 17, 500, 4095]), d)
    assert fused.norm_rope_ok(x, cos, w)
    ref = apply_rope(torch_norm(x, w, 1e-6) if norm else x, cos, sin)
    out = fused.norm_rope(x, cos, sin, w, 1e-6)
    if not norm and DEVICE == "cuda":  # no reduction: every op rounded as torch rounds it, so bit-identical
        assert torch.equal(out, ref)
    # with the norm, its sum of squares adds in another order: a last-bit flip can meet a cancellation
    close_in_dtype(out, ref, atol=2e-2)


@pytest.mark.parametrize("experts,k,normalize", [(128, 8, True), (64, 6, False), (8, 2, True)])
def test_softmax_topk_picks_the_same_experts(experts, k, normalize):
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(9, experts, generator=g).to(DTYPE).to(DEVICE)
    weights, ids = softmax_topk(logits, k, normalize)  # the fused kernel here
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ref_w, ref_ids = torch.topk(probs, k, dim=-1)
    if normalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("extra", [False, True])
def test_combine_equals_weighted_sum(extra):
    g = torch.Generator().manual_seed(3)
    n, k, h = 3, 8, 2048
    y = torch.randn(n * k, h, generator=g).to(DEVICE)
    w = torch.rand(n, k, generator=g).to(DEVICE)
    cpu_part = torch.randn(n, h, generator=g).to(DEVICE) if extra else None
    ref = (y.view(n, k, h) * w[..., None]).sum(dim=1)
    ref = (ref + cpu_part if extra else ref).to(DTYPE)
    out = combine_pairs(y, w, DTYPE, extra=cpu_part)
    close_in_dtype(out, ref)


@pytest.mark.parametrize("batch,heads,kv_heads,d,length,window", [
    (1, 32, 4, 128, 256, None),  # Qwen3-30B-A3B, one stream
    (3, 8, 8, 64, 2048, None),  # plain multi-head, several splits
    (2, 16, 2, 128, 1024, 100),  # a sliding window (Mixtral-style)
])
def test_decode_attention_equals_sdpa_over_the_gathered_window(batch, heads, kv_heads, d, length, window):
    g = torch.Generator().manual_seed(length)
    slots_total = 5
    kc = torch.randn(slots_total, length, kv_heads, d, generator=g).to(DTYPE).to(DEVICE)
    vc = torch.randn(slots_total, length, kv_heads, d, generator=g).to(DTYPE).to(DEVICE)
    q = torch.randn(batch, heads, d, generator=g).to(DTYPE).to(DEVICE)
    slots = torch.tensor([4, 0, 2][:batch], device=DEVICE)
    pos = torch.tensor([length - 1, 0, 700][:batch], device=DEVICE).clamp(max=length - 1)
    assert da.decode_attention_ok(q, kc)
    out = da.decode_attention(q, kc, vc, slots, pos, length, window, d ** -0.5)
    ref = attend_decode(q.float(), kc[slots].float(), vc[slots].float(), pos, window, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    # the second sequence sits at position 0: its output is exactly its one value row
    if batch > 1:
        group = heads // kv_heads
        expect = vc[0, 0].repeat_interleave(group, dim=0)
        torch.testing.assert_close(out[1].float(), expect.float(), rtol=1e-2, atol=1e-2)


def test_fusion_off_runs_the_torch_chain():
    """A forward pass whose engine has `[debug] fused_kernels = false` (its kernel options) takes torch's chains."""
    from strata.kernels.options import KernelOptions, kernel_options

    x = torch.randn(2, 64).to(DTYPE).to(DEVICE)
    with kernel_options(KernelOptions(fused=False)):
        assert not fused.fused_ok(x)
        assert fused.softmax_topk(x, 2, True) is None
        assert torch.equal(fused.rms_norm(x, torch.ones(64, dtype=DTYPE, device=DEVICE), 1e-6),
                           torch_norm(x, torch.ones(64, dtype=DTYPE, device=DEVICE), 1e-6))
    assert fused.fused_ok(x) == (fused.triton is not None and (x.is_cuda or fused._INTERPRET))


@pytest.mark.parametrize("norm", [True, False])
def test_folded_rope_into_cache_equals_rope_then_index_put(norm, monkeypatch):
    """A fold: keys normed and rotated straight into the cache with the values, at each sequence's
    (slot, position); the rest of the cache untouched. Equal to norm_rope followed by two index_put_."""
    monkeypatch.setattr(fused, "FOLDS", True)
    g = torch.Generator().manual_seed(11)
    b, kv_heads, d, slots, length = 3, 4, 128, 5, 64
    k = torch.randn(b, kv_heads, d, generator=g).to(DTYPE).to(DEVICE)
    v = torch.randn(b, kv_heads, d, generator=g).to(DTYPE).to(DEVICE)
    w = (torch.randn(d, generator=g) * 0.2 + 1).to(DTYPE).to(DEVICE) if norm else None
    cos, sin = rope_tables(torch.tensor([3, 0, 63]), d)
    slot_t, pos_t = torch.tensor([4, 0, 2], device=DEVICE), torch.tensor([3, 0, 63], device=DEVICE)
    kc, vc = (torch.randn(slots, length, kv_heads, d, generator=g).to(DTYPE).to(DEVICE) for _ in range(2))
    want_k, want_v = kc.clone(), vc.clone()
    want_k[slot_t, pos_t] = fused.norm_rope(k, cos, sin, w, 1e-6)
    want_v[slot_t, pos_t] = v
    assert fused.cache_write_ok(k, v, cos, w, kc, vc)
    kc2, vc2 = kc.clone(), vc.clone()
    assert fused.norm_rope_into_cache(k, v, cos, sin, w, 1e-6, kc, vc, slot_t, pos_t) is None
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # with the queries in the same launch (their own norm weight and eps; 4 query heads a KV head, strided rows as
    # the stacked q/k/v projection leaves them): the queries equal norm_rope's, the caches are written the same
    qkv = torch.randn(b, (4 * kv_heads + 2 * kv_heads) * d, generator=g).to(DTYPE).to(DEVICE)
    q = qkv[:, : 4 * kv_heads * d].view(b, 4 * kv_heads, d)
    qw = (torch.randn(d, generator=g) * 0.2 + 1).to(DTYPE).to(DEVICE) if norm else None
    got_q = fused.norm_rope_into_cache(k, v, cos, sin, w, 1e-6, kc2, vc2, slot_t, pos_t, q=q, q_weight=qw, q_eps=1e-5)
    assert torch.equal(got_q, fused.norm_rope(q, cos, sin, qw, 1e-5))
    assert torch.equal(kc2, want_k) and torch.equal(vc2, want_v)
    monkeypatch.setattr(fused, "FOLDS", False)
    assert not fused.cache_write_ok(k, v, cos, w, kc, vc)  # off unless the folds are on


def test_folded_add_rms_norm_equals_add_then_norm(monkeypatch):
    monkeypatch.setattr(fused, "FOLDS", True)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 2048, generator=g).to(DTYPE).to(DEVICE)
    delta = torch.randn(3, 2048, generator=g).to(DTYPE).to(DEVICE)
    w = (torch.randn(2048, generator=g) * 0.2 + 1).to(DTYPE).to(DEVICE)
    total, normed = fused.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)  # the add rounds as torch's does
    assert torch.equal(normed, fused.rms_norm(x + delta, w, 1e-6))  # then exactly the fused norm
    monkeypatch.setattr(fused, "FOLDS", False)
    assert fused.add_rms_norm(x, delta, w, 1e-6) is None


@pytest.mark.parametrize("bias", [True, False])
def test_folded_qkv_projection_equals_three_and_shares_their_memory(bias, monkeypatch):
    """With the folds on, GQAAttention projects q/k/v with one GEMM over the stacked weights: the same values
    as three separate projections (to one rounding step), the parameters become views of the stacked tensor (no
    second copy), and replacing a weight afterwards is seen (the stack is rebuilt, not served stale)."""
    from strata.runtime.model.attention import GQAAttention
    from strata.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_hf({"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 256, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                               "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                               "shared_expert_intermediate_size": 32, "rms_norm_eps": 1e-6})
    attn = GQAAttention(cfg, 0).to(DTYPE).to(DEVICE)
    if not bias:
        for p in (attn.q_proj, attn.k_proj, attn.v_proj):
            p.bias = None
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(13)).to(DTYPE).to(DEVICE)
    monkeypatch.setattr(fused, "FOLDS", False)
    want = attn._project(x)
    assert attn._qkv is None  # folds off: three projections, nothing stacked
    monkeypatch.setattr(fused, "FOLDS", True)
    got = attn._project(x)
    for a, b in zip(got, want, strict=True):
        close_in_dtype(a, b, atol=2e-2)
    stacked_w, stacked_b = attn._qkv
    assert attn.q_proj.weight.data_ptr() == stacked_w.data_ptr() and stacked_w.shape == (4 * 64 + 2 * 2 * 64, 256)
    assert (stacked_b is not None) == bias
    new_k = torch.randn_like(attn.k_proj.weight)
    attn.k_proj.weight.data = new_k  # e.g. weights reloaded: the stale stack must not be used
    assert torch.equal(attn._project(x)[1], decode_gemv.linear(x, new_k, attn.k_proj.bias))
    assert attn.k_proj.weight.data_ptr() != new_k.data_ptr()  # re-stacked: k is a view of the new stack


def test_folds_leave_prefill_sized_batches_to_the_unfolded_ops(monkeypatch):
    """The folds are for decode-sized batches: beyond FOLD_MAX_ROWS rows (a prefill chunk, bound by its GEMMs,
    not by launches) the residual add + norm is not folded, and q/k/v are projected by three GEMMs."""
    from strata.runtime.model.attention import GQAAttention
    from strata.runtime.model.config import ModelConfig

    monkeypatch.setattr(fused, "FOLDS", True)
    monkeypatch.setattr(fused, "FOLD_MAX_ROWS", 4)
    w = torch.ones(64, dtype=DTYPE, device=DEVICE)
    small, large = (torch.randn(n, 64).to(DTYPE).to(DEVICE) for n in (4, 5))
    assert fused.add_rms_norm(small, small, w, 1e-6) is not None
    assert fused.add_rms_norm(large, large, w, 1e-6) is None
    cfg = ModelConfig.from_hf({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                               "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 4,
                               "num_experts_per_tok": 2, "rms_norm_eps": 1e-6})
    attn = GQAAttention(cfg, 0).to(DTYPE).to(DEVICE)
    attn._project(large)
    assert attn._qkv is None
    attn._project(small)
    assert attn._qkv is not None


@pytest.mark.parametrize("rows,experts,k,hidden,normalize", [
    (1, 128, 8, 2048, True),  # Qwen3-30B-A3B, one stream
    (8, 128, 8, 2048, True),  # eight streams
    (3, 64, 6, 1000, False),  # hidden not a power of two, no renormalising
    (2, 8, 2, 4096, True),  # Mixtral-like: few experts, a wide hidden size
])
def test_decode_router_equals_linear_then_softmax_topk(rows, experts, k, hidden, normalize, monkeypatch):
    """The one-launch decode router (GEMV, softmax, top-k, slot lookup) against torch's linear then the softmax
    top-k: the same experts in the same order, the same weights to fp32 rounding, each pair's slot from slot_of, and
    its counters back at zero, so a second call (as a replayed graph makes) gives the same answer."""
    from strata.kernels.gpu import decode_router

    monkeypatch.setattr(fused, "FOLDS", True)
    monkeypatch.setattr(decode_router, "ENABLED", True)
    g = torch.Generator().manual_seed(rows * 100 + experts)
    x = torch.randn(rows, hidden, generator=g).to(DTYPE).to(DEVICE)
    w = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(DTYPE).to(DEVICE)
    slot_of = torch.randint(-1, 500, (experts,), generator=g, dtype=torch.int32).to(DEVICE)
    assert decode_router.available(x, w, k)
    counts = decode_router.new_counts(x.device)
    ref_w, ref_ids = softmax_topk(F.linear(x.float(), w.float()).to(DTYPE), k, normalize)  # fp32 sums, then rounded
    for _ in range(2):
        weights, ids, used = decode_router.route(x, w, k, normalize, counts, slot_of)
        assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-7)
        assert used.dtype == torch.int32 and torch.equal(used, slot_of[ids.reshape(-1)])
        assert not counts.any()
    assert decode_router.route(x, w, k, normalize, counts)[2] is None  # no table, no lookup
    monkeypatch.setattr(decode_router, "ENABLED", False)
    assert not decode_router.available(x, w, k)
    monkeypatch.setattr(decode_router, "ENABLED", True)
    assert not decode_router.available(torch.zeros(decode_router.MAX_ROWS + 1, hidden, dtype=DTYPE, device=DEVICE), w, k)


def test_router_module_takes_the_decode_router_for_decode_batches_only(monkeypatch):
    """`Router` uses the one-launch kernel for decode-sized batches (same routing as its torch path) and
    torch's GEMM for a prefill chunk; the kernel's counters are made once per device."""
    from strata.kernels.gpu import decode_router
    from strata.runtime.model.config import ModelConfig
    from strata.runtime.model.moe import Router

    monkeypatch.setattr(fused, "FOLDS", True)
    monkeypatch.setattr(decode_router, "ENABLED", True)
    cfg = ModelConfig.from_hf({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 256, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                               "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 32,
                               "num_experts_per_tok": 4, "rms_norm_eps": 1e-6, "norm_topk_prob": True})
    router = Router(cfg).to(DTYPE).to(DEVICE)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 256, generator=torch.Generator().manual_seed(5)) / 16)
    x = torch.randn(decode_router.MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(6)).to(DTYPE).to(DEVICE)
    w_big, ids_big, used = router(x)  # a prefill-sized batch: torch's path
    assert used is None and not router._counts
    w_dec, ids_dec, used = router(x[:3], torch.arange(32, dtype=torch.int32, device=DEVICE))
    assert list(router._counts) == [str(x.device)]
    assert torch.equal(ids_dec, ids_big[:3]) and torch.equal(used, ids_dec.reshape(-1).to(torch.int32))
    torch.testing.assert_close(w_dec, w_big[:3], rtol=1e-5, atol=1e-7)
    # a prediction beside the layer's routing (warm-ahead): the same choice through its own counters, or the torch
    # path without them; the router's counters are not touched
    own = decode_router.new_counts(x.device)
    assert torch.equal(router.choose(x[:3], own), ids_dec) and torch.equal(router.choose(x[:3]), ids_dec)
    assert torch.equal(router.choose(x, own), ids_big)  # prefill-sized: torch's path
    assert not own.any() and not router._counts[str(x.device)].any()  # each call's last programs reset them


def test_combine_adds_the_residual_as_torch_does(monkeypatch):
    """The combine with the layer's residual: exactly `residual + combine(...)` (the MoE output rounded to the
    model dtype, then the add rounded again), with and without the CPU's partial sum; the same bits with the fold
    switched off (a second launch adds it)."""
    monkeypatch.setattr(fused, "FOLDS", True)
    monkeypatch.setattr(fused, "RESIDUAL_FOLD", True)
    g = torch.Generator().manual_seed(4)
    n, k, h = 3, 8, 2048
    y = torch.randn(n * k, h, generator=g).to(DEVICE)
    w = torch.rand(n, k, generator=g).to(DEVICE)
    extra = torch.randn(n, h, generator=g).to(DEVICE)
    residual = (torch.randn(n, h, generator=g) * 4).to(DTYPE).to(DEVICE)
    for part in (None, extra):
        want = residual + combine_pairs(y, w, DTYPE, extra=part)
        assert torch.equal(fused.combine(y, w, DTYPE, part, residual), want)
        assert torch.equal(combine_pairs(y, w, DTYPE, extra=part, residual=residual), want)
    monkeypatch.setattr(fused, "RESIDUAL_FOLD", False)
    assert torch.equal(combine_pairs(y, w, DTYPE, extra=extra, residual=residual), want)


def test_softmax_topk_breaks_ties_by_the_lowest_id_and_takes_zero_probabilities_in_order(monkeypatch):
    """Equal probabilities go to the lower expert id first (as the torch chain's reference semantics on CPU), and
    experts whose probability underflows to zero are still chosen, each once, in id order."""
    from strata.kernels.gpu import decode_router

    monkeypatch.setattr(fused, "FOLDS", True)
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 0.0, 2.0],
                           [0.0, -1e4, -1e4, -1e4, -1e4, -1e4, -1e4, -1e4]]).to(DTYPE).to(DEVICE)
    weights, ids = softmax_topk(logits, 4, False)
    assert ids.tolist() == [[1, 2, 4, 7], [0, 1, 2, 3]]
    assert weights[1].tolist() == [1.0, 0.0, 0.0, 0.0] and weights[0, 0] == weights[0, 1] == weights[0, 2]
    # the decode router's top-k is the same code: an identity "router" on one-hot rows gives the same ids
    eye = torch.eye(8, dtype=DTYPE, device=DEVICE)
    _, r_ids, _ = decode_router.route(logits, eye, 4, False, decode_router.new_counts(logits.device))
    assert torch.equal(r_ids, ids)


@pytest.mark.parametrize("out_features,in_features,bias", [(640, 512, False), (256, 1024, True), (100, 96, True),
                                                       (5120, 2048, False)])
def test_decode_gemv_equals_linear(out_features, in_features, bias, monkeypatch):
    """The decode GEMV gives the float64 product rounded once to bf16 (to one rounding step in a few elements: its
    fp32 sums reorder), with or without a bias, for widths that are not a multiple of its tiles, from a strided
    row of x; cuBLAS's F.linear, which may round before adding the bias, agrees to a rounding step. Past MAX_ROWS
    rows, and when switched off, it is F.linear itself."""
    g = torch.Generator().manual_seed(out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(DTYPE).to(DEVICE)
    b = torch.randn(out_features, generator=g).to(DTYPE).to(DEVICE) if bias else None
    x = torch.randn(1, in_features + 16, generator=g).to(DTYPE).to(DEVICE)[:, 8:-8]  # not at the storage's start
    assert decode_gemv.available(x, w)
    got = decode_gemv.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double() if bias else None).to(DTYPE)
    close_in_dtype(got, exact, atol=2e-2)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2 ** -7, atol=2e-2)
    wide = torch.randn(decode_gemv.MAX_ROWS + 1, in_features, generator=g).to(DTYPE).to(DEVICE)
    assert not decode_gemv.available(wide, w)
    assert torch.equal(decode_gemv.linear(wide, w, b), F.linear(wide, w, b))
    monkeypatch.setattr(decode_gemv, "ENABLED", False)
    assert torch.equal(decode_gemv.linear(x, w, b), F.linear(x, w, b))


def test_mlp_takes_the_gemv_for_one_row_only(monkeypatch):
    """A dense layer's (or shared expert's) SwiGLU MLP at one decode row runs its three projections through the
    GEMV, to a rounding step of the F.linear chain; two rows run the F.linear chain itself."""
    from strata.runtime.model.layers import MLP

    if DEVICE == "cpu":  # under the interpreter: CPU rows take the CPU kernel's dense path (tests/kernels/cpu/test_cpu_dense.py)
        pytest.skip("the MLP's projections reach the Triton GEMV on CUDA only")
    torch.manual_seed(3)
    mlp = MLP(256, 384).to(DTYPE).to(DEVICE)
    calls = []
    kernel = decode_gemv._gemv_kernel
    monkeypatch.setattr(decode_gemv, "_gemv_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (calls.append(grid), kernel[grid])[1]})())
    x = torch.randn(2, 256).to(DTYPE).to(DEVICE)
    reference = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    one = mlp(x[:1])
    assert len(calls) == 3
    torch.testing.assert_close(one.float(), reference[:1].float(), rtol=2 ** -6, atol=2e-2)
    assert torch.equal(mlp(x), reference) and len(calls) == 3
