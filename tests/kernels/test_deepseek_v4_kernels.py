"""DeepSeek-V4's fused decode kernels (strata.kernels.gpu.deepseek_v4) against the torch chains of
strata.runtime.model.deepseek_v4 they replace: the hyper-connection weights (the sigmoids, the softmax and every
Sinkhorn-Knopp iteration of `comb`, and the collapse of the streams), their mixing of the streams, the interleaved
rotary embedding (and its conjugate), the norm with an fp32 weight, a decode step's keys, their attention weights
with the sinks, its compressors, routers and shared experts. On CUDA in bf16 (marked gpu); on the CPU under Triton's
interpreter in fp16 (tests/kernels/test_kernels_interpreted.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fused_device import DEVICE, DTYPE, MARKS

from strata.kernels import options
from strata.kernels.gpu import deepseek_v4 as v4_kernels
from strata.kernels.gpu.deepseek_v4_attention import compress_step, sink_softmax, window_keys
from strata.runtime.model.deepseek_v4.cache import CompressedState
from strata.runtime.model.deepseek_v4.compressor import Compressor
from strata.runtime.model.deepseek_v4.decode import _window_keys, compress_decode, entry_reads, sink_probs
from strata.runtime.model.deepseek_v4.hyper import HyperConnection, mix
from strata.runtime.model.deepseek_v4.moe import ClippedMLP, HashRouter, TopKRouter
from strata.runtime.model.deepseek_v4.norms import FloatRMSNorm
from strata.runtime.model.deepseek_v4.rope import normed_rotate, rotate

pytestmark = MARKS


def _connection(n: int, hidden: int, iters: int, seed: int) -> HyperConnection:
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnection(hidden, n, iters, 1e-6, 1e-6)
    with torch.no_grad():  # random where the release's are trained: every weight and sign reaches the kernel
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.02)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.tensor([0.7, -1.3, 2.1]))
    return hc.to(DEVICE)


def _streams(rows: int, n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, n, hidden, generator=torch.Generator().manual_seed(seed)).to(DTYPE).to(DEVICE)


@pytest.mark.parametrize(("rows", "n", "hidden", "iters"), [(1, 4, 2048, 20), (3, 4, 300, 20), (2, 3, 1100, 5),
                                                            (2, 4, 64, 1)])
def test_the_fused_weights_are_the_torch_chains(rows, n, hidden, iters):
    """One token or several, the released shape (4 streams, 20 iterations), a stream count that pads the kernel's
    blocks (3), a hidden size not a multiple of its tile (300, 1100), and a single normalisation (iters 1)."""
    hc, streams = _connection(n, hidden, iters, seed=rows + n), _streams(rows, n, hidden, seed=hidden)
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
        with options.kernel_options(options.KernelOptions(fused=False)):
            ref_post, ref_comb, ref_collapsed = hc(streams)
    assert post.shape == (rows, n) and comb.shape == (rows, n, n) and collapsed.shape == (rows, hidden)
    torch.testing.assert_close(post, ref_post, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-6)
    # the collapse sums the same fp32 products in the same order and rounds once: at most a rounding step apart
    assert collapsed.dtype == DTYPE
    torch.testing.assert_close(collapsed.float(), ref_collapsed.float(), rtol=2 ** -7, atol=1e-3)
    assert (collapsed != ref_collapsed).float().mean().item() < 0.05
    # doubly stochastic after the iterations: the columns sum to ~1 (the last normalisation's), the rows near it
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(rows, n, device=DEVICE), rtol=0, atol=1e-4)


def test_the_fused_kernel_steps_aside():
    """Off with the fused kernels (`[debug] fused_kernels = false`), for more streams than its registers hold and for
    weights not in fp32: the torch chain runs (None)."""
    hc, streams = _connection(4, 64, 20, seed=0), _streams(2, 4, 64, seed=1)
    mixes = torch.zeros(2, 24, device=DEVICE)
    assert v4_kernels.hyper_weights(mixes, hc.base, hc.scale, streams, 20, 1e-6) is not None
    with options.kernel_options(options.KernelOptions(fused=False)):
        assert v4_kernels.hyper_weights(mixes, hc.base, hc.scale, streams, 20, 1e-6) is None
    assert v4_kernels.hyper_weights(mixes.half(), hc.base, hc.scale, streams, 20, 1e-6) is None
    wide = _streams(1, v4_kernels.MAX_STREAMS + 1, 64, seed=2)
    n = v4_kernels.MAX_STREAMS + 1
    assert v4_kernels.hyper_weights(torch.zeros(1, (2 + n) * n, device=DEVICE), torch.zeros((2 + n) * n, device=DEVICE),
                               hc.scale, wide, 20, 1e-6) is None


def _torch(fn, *args, **kwargs):
    with options.kernel_options(options.KernelOptions(fused=False)):
        return fn(*args, **kwargs)


@pytest.mark.parametrize(("heads", "d", "r"), [(8, 512, 64), (1, 512, 64), (3, 96, 96), (2, 40, 16)])
@pytest.mark.parametrize("conjugate", [False, True], ids=["rotate", "conjugate"])
def test_the_fused_rotation_is_the_torch_chains(heads, d, r, conjugate):
    """V4's shapes (a head of 512 with its last 64 channels rotated; one head: the compressor's and the key), the whole
    head rotated, and a head that is not a power of two; the rotation and its conjugate (the output's)."""
    g = torch.Generator().manual_seed(d + heads)
    x = torch.randn(3, heads, d, generator=g).to(DTYPE).to(DEVICE)
    angle = torch.rand(3, r // 2, generator=g) * 6.3
    cos, sin = angle.cos().to(DTYPE).to(DEVICE), angle.sin().to(DTYPE).to(DEVICE)
    got = rotate(x, cos, sin, conjugate)
    assert v4_kernels.rotate(x, cos, sin, conjugate) is not None
    want = _torch(rotate, x, cos, sin, conjugate)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got[..., : d - r], x[..., : d - r])  # the channels before the rotated slice, untouched
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert (got != want).float().mean().item() < 0.05
    # the conjugate undoes the rotation (to the dtype's rounding)
    back = rotate(rotate(x, cos, sin), cos, sin, conjugate=True)
    torch.testing.assert_close(back.float(), x.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize(("rows", "d"), [(1, 4096), (5, 1024), (2, 100)])
def test_the_fused_float_norm_is_the_torch_chains(rows, d):
    g = torch.Generator().manual_seed(d)
    norm = FloatRMSNorm(d, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g).to(DEVICE))
    x = (torch.randn(rows, d, generator=g) * 3).to(DTYPE).to(DEVICE)
    with torch.no_grad():
        got, want = norm(x), _torch(norm, x)
    assert v4_kernels.float_rms_norm(x, norm.weight, 1e-6) is not None
    assert got.dtype == DTYPE and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert (got != want).float().mean().item() < 0.05
    assert v4_kernels.float_rms_norm(x, norm.weight.to(DTYPE), 1e-6) is None  # its weight is kept in fp32


@pytest.mark.parametrize(("rows", "n", "hidden"), [(1, 4, 4096), (3, 4, 300), (2, 3, 1100)])
def test_the_fused_mix_is_the_torch_chains(rows, n, hidden):
    """post * out + comb^T @ streams: the released shape, a hidden size not a multiple of the tile, 3 streams."""
    hc, streams = _connection(n, hidden, 20, seed=rows), _streams(rows, n, hidden, seed=hidden + 1)
    out = _streams(rows, 1, hidden, seed=hidden + 2)[:, 0]
    with torch.no_grad():
        post, comb, _ = hc(streams)
        got = mix(streams, out, post, comb)
        want = _torch(mix, streams, out, post, comb)
    assert v4_kernels.mix_streams(streams, out, post, comb) is not None
    assert got.shape == streams.shape and got.dtype == streams.dtype
    # two terms, each rounded once (cuBLAS's product may round the other way), then their sum: where they cancel, a
    # step of either is a large share of the result, so the bound is a step of each term's magnitude and of the sum's
    dt = streams.dtype
    spread = (post.to(dt).float().unsqueeze(-1) * out.float().unsqueeze(-2)).abs()
    acc = torch.matmul(comb.to(dt).float().abs().transpose(-1, -2), streams.float().abs())
    bound = 2 ** -7 * (spread + acc + want.float().abs()) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()  # (cuBLAS's bf16 product rounds a quarter the other way)
    # the weights matter: a stream's output is its own mix, not its neighbour's
    swapped = mix(streams, out, post, comb.transpose(-1, -2).contiguous())
    assert not torch.allclose(swapped.float(), got.float(), atol=1e-2)


@pytest.mark.parametrize(("b", "heads", "p"), [(1, 64, 640), (3, 4, 300), (2, 1, 17)])
def test_the_fused_sink_softmax_is_the_torch_chain(b, heads, p):
    """A decode step's attention weights: V4-Flash's 64 heads over window ++ picks, a key count not a power of two,
    one head; keys unseen at random and a sequence that sees none (its weights all 0: the sink takes everything)."""
    g = torch.Generator().manual_seed(b * 100 + p)
    scores = (torch.randn(b, heads, p, generator=g) * 8).to(DTYPE).to(DEVICE)
    seen = (torch.rand(b, p, generator=g) < 0.7).to(DEVICE)
    seen[-1] = False if b > 1 else seen[-1]
    sinks = (torch.randn(heads, generator=g) * 2).to(DEVICE)
    got = sink_probs(scores, seen, sinks, 0.0442)
    want = _torch(sink_probs, scores, seen, sinks, 0.0442)
    assert sink_softmax(scores, seen, sinks, 0.0442) is not None
    assert got.shape == scores.shape and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)
    assert (got[~seen[:, None].expand_as(got)] == 0).all()  # unseen keys weigh exactly 0
    if b > 1:
        assert (got[-1] == 0).all()
    # the sink takes its share: the weights sum to 1 - its probability, per head
    share = got.float().sum(-1)
    assert (share <= 1 + 1e-2).all() and (share[0] < 0.999).any()
    # each head its own sink: swapped sinks move the weights
    assert not torch.equal(sink_probs(scores, seen, sinks.flip(0), 0.0442), got) or heads == 1


class _WindowRope:
    """cos, sin [B, pairs] at each position's window start (InterleavedRope.window_starts' shape), from a table."""

    def __init__(self, pairs: int):
        self.freq = 1.0 / (10000 ** (torch.arange(pairs) / pairs))

    def window_starts(self, pos, m, dtype):
        angle = (pos // m * m).float().cpu()[:, None] * self.freq[None]
        return angle.cos().to(dtype).to(pos.device), angle.sin().to(dtype).to(pos.device)


@pytest.mark.parametrize(("overlap", "m", "d", "r"), [(False, 8, 64, 16), (True, 4, 64, 16), (False, 16, 512, 64),
                                                      (True, 4, 128, 64), (False, 4, 40, 40)])
def test_the_fused_compressor_step_is_the_torch_chain(overlap, m, d, r):
    """A compressor's DecodeBatch steps, HCA (the ring one window) and CSA (window e - 1's first half channels and
    window e's second half; window 0 without its predecessor), a hidden size not a power of two: two sequences at
    different positions over more than two windows, every step's rings equal, the entries completed on the way
    within a rounding step of the torch chain's, and the entries not completed left alone."""
    g = torch.Generator().manual_seed(m * d + overlap)
    comp = Compressor(32, d, m, overlap=overlap, eps=1e-6)
    width, ring = (2 * d, 2 * m) if overlap else (d, m)
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn(m, width, generator=g))
        comp.kv_norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
    comp = comp.to(DEVICE)
    slots_n, n_entries = 3, 8
    state = {"entries": torch.randn(slots_n, n_entries, d, generator=g).to(DTYPE),
             "src_kv": torch.randn(slots_n, ring, width, generator=g).to(DTYPE),
             "src_gate": torch.randn(slots_n, ring, width, generator=g).to(DTYPE)}
    fused_state = CompressedState(**{k: v.clone().to(DEVICE) for k, v in state.items()}, rate=m)
    torch_state = CompressedState(**{k: v.clone().to(DEVICE) for k, v in state.items()}, rate=m)
    untouched = fused_state.entries.clone()
    rope, slots = _WindowRope(r // 2), torch.tensor([2, 0], device=DEVICE)
    start = torch.tensor([0, m + 1], device=DEVICE)
    for step in range(2 * m + 3):
        batch = SimpleNamespace(slots_t=slots, pos_t=start + step)
        kv = torch.randn(2, width, generator=g).to(DTYPE).to(DEVICE)
        gate = (torch.randn(2, width, generator=g) * 2).to(DTYPE).to(DEVICE)
        with torch.no_grad():
            compress_decode(comp, fused_state, batch, kv, gate, rope)
            _torch(compress_decode, comp, torch_state, batch, kv, gate, rope)
        assert torch.equal(fused_state.src_kv, torch_state.src_kv) and torch.equal(fused_state.src_gate,
                                                                                    torch_state.src_gate)
        torch.testing.assert_close(fused_state.entries.float(), torch_state.entries.float(), rtol=2 ** -6, atol=2e-2)
    assert compress_step(fused_state.src_kv, fused_state.src_gate, fused_state.entries, kv, gate, slots, start,
                         comp.position_bias, comp.kv_norm.weight, 1e-6, *rope.window_starts(start, m, DTYPE), m,
                         overlap)
    changed = (fused_state.entries != untouched).any(-1)  # [slots, E]: entries completed on the way
    assert changed[2, : (2 * m + 3) // m].all() and changed[0, 1 : (3 * m + 4) // m].all()
    assert not changed[1].any() and not changed[2, (2 * m + 3) // m :].any()
    assert (fused_state.entries != torch_state.entries).float().mean().item() < 0.05


@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
@pytest.mark.parametrize(("ring", "back"), [(8, 7), (8, 8)], ids=["window", "whole-ring"])
def test_the_fused_window_keys_are_the_torch_chain(mode, ring, back):
    """A decode step's keys and which each query sees, for a sliding-window layer (the ring's last positions and the
    new kv), HCA (the first entries, seen below (p + 1) // m) and CSA (the indexer's picks, -1 unseen): two sequences,
    one still inside its first window (positions below 0), over several steps; the ring after each step the same,
    including where the new kv replaces the row the step read first (back = ring)."""
    g = torch.Generator().manual_seed(ring + back + len(mode))
    d, m, n_entries = 40, 4, 6
    window = torch.randn(3, ring, d, generator=g).to(DTYPE).to(DEVICE)
    state = None if mode == "sliding" else CompressedState(
        entries=torch.randn(3, n_entries, d, generator=g).to(DTYPE).to(DEVICE), src_kv=window[:, :1],
        src_gate=window[:, :1], rate=m)
    fused_cache = SimpleNamespace(window=window.clone(), compressor=state)
    torch_cache = SimpleNamespace(window=window.clone(), compressor=state)
    slots, start = torch.tensor([1, 2], device=DEVICE), torch.tensor([2, 13], device=DEVICE)
    some_unseen = False
    for step in range(ring + 2):
        batch = SimpleNamespace(slots_t=slots, pos_t=start + step, kv_len=int(start.max()) + step + 1)
        kv = torch.randn(2, d, generator=g).to(DTYPE).to(DEVICE)
        picked = None
        if mode == "csa":
            picked = torch.randint(-1, n_entries, (2, 3), generator=g).to(DEVICE)
        span = 0 if state is None else entry_reads(batch.kv_len, state)
        got = window_keys(fused_cache.window, kv, slots, batch.pos_t, back, None if state is None else state.entries,
                          span, m, picked)
        assert got is not None
        want = _window_keys(torch_cache, kv, batch, back, picked)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(fused_cache.window, torch_cache.window)
        assert got[1].any(dim=1).all()
        some_unseen |= not got[1].all().item()
    assert some_unseen  # positions below 0, entries not complete yet, picks of -1


@pytest.mark.parametrize(("heads", "d", "r"), [(64, 512, 64), (3, 96, 96), (2, 40, 16)])
def test_the_fused_query_norm_and_rotation_are_the_torch_chains(heads, d, r):
    """The queries' per-head unweighted RMS norm and rotary in one launch (V4's 64 heads of 512, every channel rotated,
    a head size not a power of two), against `rotate(unweighted_rms_norm(x))`."""
    g = torch.Generator().manual_seed(heads + d)
    x = (torch.randn(3, heads, d, generator=g) * 3).to(DTYPE).to(DEVICE)
    angle = torch.rand(3, r // 2, generator=g) * 6
    cos, sin = angle.cos().to(DTYPE).to(DEVICE), angle.sin().to(DTYPE).to(DEVICE)
    got = normed_rotate(x, 1e-6, cos, sin)
    want = _torch(normed_rotate, x, 1e-6, cos, sin)
    assert v4_kernels.rotate(x, cos, sin, norm_eps=1e-6) is not None
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert (got != want).float().mean().item() < 0.05
    assert got.float().square().mean(-1).sub(1).abs().max() < 0.05  # unit RMS per head (a rotation keeps it)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize(("n", "experts", "k"), [(1, 256, 6), (3, 64, 8), (2, 100, 1)])
def test_the_fused_router_weights_are_the_torch_chain(scoring, n, experts, k):
    """A router after its linear: V4-Flash's 256 experts top-6, 8 of a count not a power of two, a single expert;
    both scoring functions; the top-k router (its correction bias choosing) and the hash router (its table's ids):
    the same experts and their weights within a rounding step, renormalised to `scaling`."""
    g = torch.Generator().manual_seed(n * experts + k)
    cfg = SimpleNamespace(num_experts_per_tok=k, router=scoring, routed_scaling_factor=1.5, num_experts=experts,
                          hidden_size=32, vocab_size=50)
    top, hashed = TopKRouter(cfg), HashRouter(cfg)
    with torch.no_grad():
        for r in (top, hashed):
            r.weight.copy_(torch.randn(experts, 32, generator=g))
        top.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.1)
        hashed.tid2eid.copy_(torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(50)]))
    top, hashed = top.to(DEVICE).to(DTYPE), hashed.to(DEVICE)
    hashed.weight.data = hashed.weight.data.to(DTYPE)
    top.e_score_correction_bias = top.e_score_correction_bias.float()
    x = torch.randn(n, 32, generator=g).to(DTYPE).to(DEVICE)
    tokens = torch.randint(0, 50, (n,), generator=g).to(DEVICE)
    assert v4_kernels.route_weights(x @ top.weight.t(), scoring, 1.5, bias=top.e_score_correction_bias, k=k) is not None
    for router in (top, hashed):
        with torch.no_grad():
            w, ids, _ = router(x, tokens)
            w_ref, ids_ref, _ = _torch(router, x, tokens)
        order, order_ref = ids.sort(dim=-1), ids_ref.sort(dim=-1)  # (torch's top-k leaves its order unspecified)
        assert torch.equal(order.values, order_ref.values)
        got, want = w.gather(1, order.indices).float(), w_ref.gather(1, order_ref.indices).float()
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(got.sum(-1), torch.full((n,), 1.5, device=DEVICE), rtol=2 ** -5, atol=0)
    if k > 1:  # the bias chooses: a large one on the lowest scores moves the picks
        biased = v4_kernels.route_weights(x @ top.weight.t(), scoring, 1.5, bias=-100 * torch.arange(
            experts, device=DEVICE, dtype=torch.float32).flip(0), k=k)[1]
        assert set(biased[0].tolist()) == set(range(experts - k, experts))


@pytest.mark.parametrize("shape", [(1, 2048), (3, 300)])
def test_the_fused_clipped_swiglu_is_the_torch_chain(shape):
    """The shared expert's activation, gate and up well past the limit (V4's 10) on both sides, against the torch
    chain; through a `ClippedMLP` too."""
    g = torch.Generator().manual_seed(shape[1])
    gate, up = ((torch.randn(2, *shape, generator=g) * 12).to(DTYPE).to(DEVICE)).unbind(0)
    got = v4_kernels.clipped_swiglu(gate, up, 10.0)
    want = torch.nn.functional.silu(gate.clamp(max=10.0)) * up.clamp(min=-10.0, max=10.0)
    assert got is not None and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert (got != want).float().mean().item() < 0.05
    assert got.float().abs().max() <= 10.0 * 10.0 * 1.01  # both clipped: |silu(g) u| <= limit^2
    mlp = ClippedMLP(shape[1], 64, 10.0).to(DEVICE).to(DTYPE)
    with torch.no_grad():
        x = (torch.randn(shape[0], shape[1], generator=g) * 4).to(DTYPE).to(DEVICE)
        torch.testing.assert_close(mlp(x).float(), _torch(mlp, x).float(), rtol=2 ** -6, atol=1e-2)
