"""The decode fast path: slot-indexed pair kernels, fixed-shape decode attention, cold pairs served
from other tiers. CPU tests run the torch fallback and a CPU-simulated GPU tier; the GPU tests run the
Triton kernels on CUDA. The CUDA-graph replays are tested in test_decode_graphs.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference_models import ARCHS, VOCAB, build_reference
from strata.kernels.experts import moe_forward
from strata.kernels.gpu.experts.grouped import SlotWeights, combine_pairs, pair_experts
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.kv_cache import DecodeBatch, KVCache, StepBatch, kv_bucket
from strata.runtime.model.loader import load_model
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore


def _random_experts(e=6, h=32, i=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g, dtype=dtype), torch.randn(e, h, i, generator=g, dtype=dtype)


def _routes(n, e, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return ids, torch.rand(n, k, generator=g)


def test_pair_kernels_equal_grouped_experts():
    gu, dn = _random_experts()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    ids, w = _routes(5, 6, 3)
    y = torch.zeros(15, 32)
    used = pair_experts(x, SlotWeights(gu, dn), torch.arange(6, dtype=torch.int32), ids.reshape(-1), y)
    assert torch.equal(used, ids.reshape(-1).int())
    torch.testing.assert_close(combine_pairs(y, w, torch.float32), moe_forward(x, gu, dn, ids, w), rtol=1e-4, atol=1e-4)  # fp32 sums


@pytest.mark.parametrize("form", ["plain", "gpt_oss"])
def test_in_memory_pair_forward_equals_the_reference(form):
    """`Experts.pair_forward` (in-memory experts' decode path on CUDA; here the pair kernels' torch fallback) passes
    its form, gate_up biases and extra term through: the experts' sum in gpt-oss's clamped, interleaved form with
    per-expert biases plus the extra and the residual equals `apply_experts`' reference math, and the plain call
    equals `moe_forward`."""
    from types import SimpleNamespace

    from strata.kernels.experts import SwiGLUForm, apply_experts, group_by_expert
    from strata.runtime.model.moe import Experts

    gu, dn = _random_experts()
    experts = Experts(SimpleNamespace(num_experts=gu.shape[0], moe_intermediate_size=dn.shape[2],
                                      hidden_size=dn.shape[1]))
    experts.gate_up_proj.data, experts.down_proj.data = gu, dn
    g = torch.Generator().manual_seed(2)
    x, residual = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    ids, w = _routes(4, 6, 3)
    if form == "plain":
        got = experts.pair_forward(x, ids, w, residual)
        torch.testing.assert_close(got, moe_forward(x, gu, dn, ids, w) + residual, rtol=1e-4, atol=1e-4)
        return
    shape = SwiGLUForm(limit=0.5, alpha=1.702, up_offset=1.0, interleaved=True)
    bias, extra = torch.randn(6, gu.shape[1], generator=g), torch.randn(4, 32, generator=g)
    got = experts.pair_forward(x, ids, w, residual, form=shape, gate_up_bias=bias, extra=extra)
    want = apply_experts(x, w, 3, group_by_expert(ids, 6), lambda e: (gu[e], dn[e]), form=shape, gate_up_bias=bias)
    torch.testing.assert_close(got, want + extra + residual, rtol=1e-4, atol=1e-4)
    assert (moe_forward(x, gu, dn, ids, w) - want).abs().max() > 1e-2  # the form and biases matter here


def test_pair_kernels_read_a_slab_and_skip_what_is_not_resident():
    gu, dn = _random_experts()
    h, i, size = 32, 16, 4
    gu_bytes = 2 * i * h * size
    slab = torch.zeros(4, gu_bytes + h * i * size + 100, dtype=torch.uint8)  # padded slots, like the GPU tier
    sw = SlotWeights.from_slab(slab, torch.float32, (2 * i, h), (h, i), gu_bytes)
    slot_of = torch.full((6,), -1, dtype=torch.int32)
    for slot, e in enumerate([1, 3, 4, 5]):
        sw.gate_up[slot].copy_(gu[e])
        sw.down[slot].copy_(dn[e])
        slot_of[e] = slot
    x = torch.randn(4, h)
    ids, _ = _routes(4, 6, 2, seed=1)
    full = torch.zeros(8, h)
    pair_experts(x, SlotWeights(gu, dn), torch.arange(6, dtype=torch.int32), ids.reshape(-1), full)
    y = torch.full((8, h), 7.0)
    used = pair_experts(x, sw, slot_of, ids.reshape(-1), y)
    resident = used >= 0
    assert torch.equal(resident, slot_of[ids.reshape(-1)] >= 0) and (~resident).any()
    assert torch.equal(y[resident], full[resident])
    assert (y[~resident] == 7.0).all()  # cold rows left for the cold path


def test_slot_weights_reject_mismatched_shapes():
    gu, dn = _random_experts()
    with pytest.raises(ValueError, match="does not match"):
        SlotWeights(gu, dn[:, :, :8])


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_batch_attention_equals_step_batch(arch, tmp_path):
    """Fixed-shape decode (masked window of the cache, several sequences) == per-sequence prefix attention."""
    _, d = build_reference(arch, tmp_path / arch, long=arch in ("qwen2_moe", "mixtral"))  # sliding windows
    model = load_model(Checkpoint.open(d), torch.float32, "cpu")
    cfg = model.cfg
    a, b = KVCache(cfg, 3, 700, torch.float32, "cpu"), KVCache(cfg, 3, 700, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    lengths = [5, 310, 1]  # one past the sliding windows of the long configs
    with torch.inference_mode():
        for slot, n in enumerate(lengths):
            prompt = torch.randint(0, VOCAB, (n,), generator=g)
            for cache in (a, b):
                model.run_layers(prompt, StepBatch([slot], [0], [n]), cache)
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (3,), generator=g)
            want = model.run_layers(ids, StepBatch([0, 1, 2], lengths, [1, 1, 1]), a)
            batch = DecodeBatch(torch.tensor([0, 1, 2]), torch.tensor(lengths), kv_bucket(max(lengths), 700))
            got = model.run_layers(ids, batch, b)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            lengths = [n + 1 for n in lengths]


def _engram_model_and_two_caches(model_dir):
    """The tiny Engram model in fp32 on the CPU and two empty caches of 3 slots (reference, candidate)."""
    model = load_model(Checkpoint.open(model_dir), torch.float32, "cpu")
    assert model.engram is not None
    cfg = model.cfg
    return model, cfg, KVCache(cfg, 3, 512, torch.float32, "cpu"), KVCache(cfg, 3, 512, torch.float32, "cpu")


def _assert_same_engram_state(cfg, a: KVCache, b: KVCache) -> None:
    """Both caches hold the same token history and convolution rings."""
    assert torch.equal(a.engram.tokens, b.engram.tokens)
    for layer in cfg.engram.layer_ids:
        torch.testing.assert_close(b.engram.conv[layer], a.engram.conv[layer], rtol=1e-4, atol=1e-4)


def test_static_engram_inputs_equal_the_eager_engram_step(tiny_model_dir):
    """What a captured decode step of an Engram model reads (`StaticEngramStep`: rows, conv taps and ring
    indices copied into fixed buffers, reloaded every step) gives the eager per-sequence step's hidden states."""
    from strata.runtime.model.engram.static import StaticEngramStep

    model, cfg, a, b = _engram_model_and_two_caches(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    lengths = [4, 37, 1]
    statics = None
    with torch.inference_mode():
        for slot, n in enumerate(lengths):
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g)
            for cache in (a, b):
                model(prompt, StepBatch([slot], [0], [n]), cache)
        for _ in range(6):
            ids = torch.randint(0, cfg.vocab_size, (3,), generator=g)
            want = model(ids, StepBatch([0, 1, 2], lengths, [1, 1, 1]), a)
            step = model.engram.begin(ids, StepBatch([0, 1, 2], lengths, [1, 1, 1]), b, model.layers)
            if statics is None:
                statics = StaticEngramStep(step)
            else:
                statics.load(step)
            batch = DecodeBatch(torch.tensor([0, 1, 2]), torch.tensor(lengths), kv_bucket(max(lengths), 512),
                                engram=statics)
            got = model.run_layers(ids, batch, b)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            lengths = [n + 1 for n in lengths]
    _assert_same_engram_state(cfg, a, b)


@pytest.mark.parametrize("window_steps", [(0, 1, 3, 4, 6), ()], ids=["mixed", "device-only"])
def test_device_engram_decode_equals_the_host_step(tiny_model_dir, window_steps):
    """Decode steps whose Engram work runs on the device (hashing from the device history, taps and ring
    slots from positions: what a CUDA graph holds) give the host step's hidden states, and the two can
    alternate on one sequence: both read and write the same history."""
    model, cfg, a, b = _engram_model_and_two_caches(tiny_model_dir)
    g = torch.Generator().manual_seed(2)
    lengths = [1, 9, 40]
    with torch.inference_mode():
        for slot, n in enumerate(lengths):
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g)
            for cache in (a, b):
                for at in range(0, n, 7):  # chunked prefill: histories cross chunk boundaries
                    model(prompt[at : at + 7], StepBatch([slot], [at], [min(7, n - at)]), cache)
        assert model.engram.direct_tables(model.layers) is not None  # in-memory tables: the device reads them
        for step in range(8):
            ids = torch.randint(0, cfg.vocab_size, (3,), generator=g)
            want = model(ids, StepBatch([0, 1, 2], lengths, [1, 1, 1]), a)  # the host step
            if step in window_steps:
                got = model(ids, StepBatch([0, 1, 2], lengths, [1, 1, 1]), b)
            else:
                batch = DecodeBatch(torch.tensor([0, 1, 2]), torch.tensor(lengths), kv_bucket(max(lengths), 512))
                got = model.run_layers(ids, batch, b)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            lengths = [n + 1 for n in lengths]
    _assert_same_engram_state(cfg, a, b)


@pytest.mark.parametrize("pairs", [8, 200])
def test_cold_pairs_grouped_by_expert(pairs):
    """The host step's grouping of cold pairs (few: a Python loop; many: numpy) against a plain reference:
    experts ascending, each with its pairs ascending."""
    from strata.runtime.offload.step_io import pairs_by_expert as _pairs_by_expert

    rng = np.random.default_rng(pairs)
    experts = rng.integers(0, 16, pairs).astype(np.int32)
    cold = np.flatnonzero(rng.random(pairs) < 0.7)
    want: dict[int, list[int]] = {}
    for p in cold:
        want.setdefault(int(experts[p]), []).append(int(p))
    got = _pairs_by_expert(experts, cold)
    assert list(got) == sorted(want) and all(got[e].tolist() == want[e] for e in want)
    assert _pairs_by_expert(experts, cold[:0]) == {}


def test_kv_bucket():
    assert kv_bucket(0, 4096) == 256 and kv_bucket(255, 4096) == 256 and kv_bucket(256, 4096) == 512
    assert kv_bucket(5000, 4096) == 4096


@pytest.fixture(scope="module")
def store(tiny_model_dir, tmp_path_factory):
    s = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("store") / "tiny", progress=False))
    yield s
    s.close()


@pytest.fixture(scope="module")
def mxfp4_store(tiny_model_dir, tmp_path_factory):
    s = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("store") / "tiny-mxfp4",
                                            progress=False, experts="mxfp4"))
    yield s
    s.close()


@pytest.mark.parametrize("numerics", ["gpu", "fork", "fork-async", "fork-auto", "fork-stream"],
                         ids=["exact", "forked", "forked-async", "forked-auto", "forked-stream"])
def test_tiered_decode_serves_cold_pairs_from_other_tiers(store, numerics):
    """A CPU-simulated GPU tier with fewer slots than a step needs: resident pairs by slot, cold pairs
    copied (gpu numerics) or split with the CPU kernel (fork); the layer output equals all-in-memory.
    forked-stream: 3 more slots set aside for one step's copies (`stream_gpu`), which serve the copied
    cold experts whenever they fit."""
    layer = store.index.moe_layers[0]
    gu, dn = store.load_layer_experts(layer, torch.float32, "cpu")
    e, h = gu.shape[0], gu.shape[2]
    stream = 3 if numerics == "fork-stream" else 0
    m = TierManager(store, TierBudgets(gpu_slots=3 + stream, pinned_slots=16), gpu_device=torch.device("cpu"),
                    io_threads=2, stream_slots=stream)
    streamed = []
    if stream:  # the stream path copies from pinned RAM: the layer's experts are all there first
        m.release(m.acquire([(layer, i) for i in range(e)], "cpu"))
        stream_gpu = m.stream_gpu
        m.stream_gpu = lambda layer, experts: streamed.append(b := stream_gpu(layer, experts)) or b
    numerics = numerics.removesuffix("-stream")
    base = m.stats()["lookups"]
    try:
        compute = ExpertCompute(m, "gpu", numerics.removesuffix("-async").removesuffix("-auto"))
        # the CPU share started before the copies are staged, after them, or (auto) first when any are copied
        compute.cpu_async = None if numerics.endswith("-auto") else numerics.endswith("-async")
        compute.pair_path = True
        # tiny experts: staging a copy costs far more host time than computing one, so the cost model would
        # send every cold expert to the CPU; pretend staging is free (and keep it so) to exercise both paths
        compute.rates.copy_host_s = 0.0
        compute.rates.observe_stage = lambda copies, seconds: None
        experts = TieredExperts(layer, e, compute)
        k = 2
        for step in range(6):
            ids, w = _routes(3, e, k, seed=step)
            x = torch.randn(3, h, generator=torch.Generator().manual_seed(step)).to(store.dtype)
            want = moe_forward(x.float(), gu, dn, ids, w)
            got = experts(x, ids, w).float()
            tol = 2e-2 if numerics != "gpu" else 1e-2  # bf16 weights in slots, fp32 reference
            assert (got - want).abs().max().item() < tol * want.abs().max().item()
        stats = m.stats()
        assert stats["lookups"] - base == sum(len(np.unique(_routes(3, e, k, seed=s)[0])) for s in range(6))
        assert stats["tiers"]["gpu"]["evictions"] > 0 or any(streamed)  # 3 slots cannot hold a step's experts
        assert stats["tiers"]["gpu"]["capacity"] == 3
        if numerics != "gpu":
            assert compute.cpu_experts > 0
        if stream:
            assert any(streamed) and all(b is None or b.slots == [3, 4, 5][: len(b.slots)] for b in streamed)
    finally:
        m.close()


@pytest.mark.parametrize("form", ["deepseek_v4", "gpt_oss"])
def test_tiered_decode_computes_the_experts_form_and_biases(store, form):
    """DeepSeek-V4's clipped SwiGLU and gpt-oss's clamped, interleaved one with per-expert biases through the pair
    path of a CPU-simulated GPU tier of 3 slots: resident pairs, cold ones copied for the step's late pass and, past
    the budget, in chunks; each bias row is its pair's expert's and the down biases are added once. The layer
    output equals the reference math's (`apply_experts` in that form, plus `down_bias_term`), and it would not
    without the clamp, the biases or the interleave."""
    from types import SimpleNamespace

    from strata.kernels.experts import SwiGLUForm, apply_experts, down_bias_term, group_by_expert

    layer = store.index.moe_layers[0]
    gu, dn = store.load_layer_experts(layer, torch.float32, "cpu")
    e, h, i2 = gu.shape[0], gu.shape[2], gu.shape[1]
    g = torch.Generator().manual_seed(7)
    shape = SwiGLUForm(limit=0.02) if form == "deepseek_v4" else \
        SwiGLUForm(limit=0.02, alpha=1.702, up_offset=1.0, interleaved=True)
    biases = SimpleNamespace(gate_up_proj_bias=torch.randn(e, i2, generator=g) * 0.05,
                             down_proj_bias=torch.randn(e, h, generator=g) * 0.01) if form == "gpt_oss" else None
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "gpu")
        compute.pair_path, compute.form = True, shape
        if biases is not None:
            compute.expert_biases[layer] = biases
        experts = TieredExperts(layer, e, compute)
        k, clamped = 2, 0
        for step in range(6):
            ids, w = _routes(3 if step % 2 else 1, e, k, seed=step)  # 1 token: cold pairs fit the late pass
            x = torch.randn(ids.shape[0], h, generator=torch.Generator().manual_seed(step)).to(store.dtype)
            groups = group_by_expert(ids, e)
            bias = None if biases is None else biases.gate_up_proj_bias
            want = apply_experts(x.float(), w, k, groups, lambda j: (gu[j], dn[j]), form=shape, gate_up_bias=bias)
            if biases is not None:
                want = want + down_bias_term(w, ids, biases.down_proj_bias)
            plain = moe_forward(x.float(), gu, dn, ids, w)
            clamped += int((torch.nn.functional.linear(x.float(), gu[ids[0, 0]]).abs() > 0.02).sum())
            got = experts(x, ids, w).float()
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() < 1e-2 * scale
            assert (plain - want).abs().max().item() > 0.1 * scale  # the form and biases matter here
            if biases is not None:  # and each pair's own expert's bias row
                rolled = apply_experts(x.float(), w, k, groups, lambda j: (gu[j], dn[j]), form=shape,
                                       gate_up_bias=bias.roll(1, 0)) + down_bias_term(w, ids, biases.down_proj_bias)
                assert (rolled - want).abs().max().item() > 0.05 * scale
        assert clamped > 0 and m.stats()["tiers"]["gpu"]["evictions"] > 0
    finally:
        m.close()


def test_split_copies_the_most_used_cold_experts(store):
    """The cost model says how many cold experts to copy; the copies are the ones the GPU tier's history says
    are used most (they may be kept), the rest go to the CPU."""
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=4, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "fork")
        compute.rates.cpu_bytes_per_s = compute.rates.pcie_bytes_per_s = 50e9  # same speed: about half are copied
        compute.rates.copy_host_s = 0.0
        experts = TieredExperts(layer, 16, compute)
        m.note_gpu_misses(layer, [9] * 8 + [11] * 8 + [3])
        on_cpu, _ = experts._cpu_share({e: 1 for e in (1, 3, 9, 11)})
        assert on_cpu == {1, 3}
        # auto (None): the CPU share starts before the copies are staged when the plan copies any ...
        assert experts._cpu_share({e: 1 for e in (1, 3, 9, 11)}, None) == ({1, 3}, True)
        compute.rates.pcie_bytes_per_s = 1e6  # ... and runs on this thread when the link is too slow to copy
        assert experts._cpu_share({e: 1 for e in (1, 3, 9, 11)}, None) == ({1, 3, 9, 11}, False)
    finally:
        m.close()


@pytest.mark.parametrize("pinned", [16, 2], ids=["all-pinned", "through-handles"])
def test_a_cpu_only_hosts_layer_equals_its_cpu_share_over_group_by_expert(store, pinned):
    """With no GPU tier a layer on CPU activations groups its tokens on the host (in Python for a decode step's
    few pairs, numpy for a prompt's) and must give, bit for bit, the CPU share computed over `group_by_expert`'s
    groups (same experts, same pair order), from pinned slots by address or through handles, and count every token
    routed to an expert in the tier history."""
    from strata.kernels.experts import group_by_expert

    layer = store.index.moe_layers[0]
    e, hidden = sum(key[0] == layer for key in store.keys()), store.expert_shapes[0][1]
    m = TierManager(store, TierBudgets(gpu_slots=2, pinned_slots=pinned), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        compute = ExpertCompute(m, "cpu", "fork")
        experts = TieredExperts(layer, e, compute)
        for n, k, seed in [(3, 2, 0), (40, 2, 1)]:  # 6 pairs: grouped in Python; 80: in numpy
            ids, weights = _routes(n, e, k, seed)
            x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(store.dtype)
            before = m.gpu_scores(layer, range(e))
            got = experts(x, ids, weights)
            uses = {ex: v - before[ex] for ex, v in m.gpu_scores(layer, range(e)).items()}
            want = compute.cpu_forward(layer, x, weights, k, group_by_expert(ids, e)).to(x.dtype)
            assert got.dtype == x.dtype and torch.equal(got, want)
            counts = torch.bincount(ids.reshape(-1), minlength=e).tolist()
            assert [round(uses[ex]) for ex in range(e)] == [max(0, c - 1) for c in counts]  # (`note_uses`)
    finally:
        m.close()


@pytest.mark.parametrize("tier", ["gpu", "cpu"], ids=["beside-a-gpu", "cpu-only"])
def test_only_a_cpu_only_host_hands_many_token_experts_to_torch(store, monkeypatch, tier):
    """On a CPU whose AMX tiles torch's GEMMs run on, a bf16 expert of more than AMX_KERNEL_TOKENS tokens goes to them
    where the CPU computes every expert ("cpu"); beside a GPU (the split) the CPU share keeps it on the kernel. The
    CPU share's sum is, bit for bit, the kernel's or the GEMMs' (`hand_off` of cpu_experts_forward)."""
    from strata.kernels.cpu import experts as ce

    if store.dtype != torch.bfloat16 or ce.backend() not in ("avx512_bf16", "avx512_bf16_emulated"):
        pytest.skip("the hand-off applies to bf16 experts on avx512_bf16 (or its emulation)")
    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: True)
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=2, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        compute = ExpertCompute(m, tier, "fork")
        assert compute.hands_off == (tier == "cpu")
        hidden = store.expert_shapes[0][1]
        n, k = ce.AMX_KERNEL_TOKENS + 8, 2  # every token to experts 1 and 3: 20 tokens each
        x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
        weights = torch.rand(n, k, generator=torch.Generator().manual_seed(8))
        groups = [(1, torch.arange(0, n * k, k)), (3, torch.arange(1, n * k, k))]
        got = compute.cpu_forward(layer, x, weights, k, groups)
        handles = m.acquire([(layer, 1), (layer, 3)], "cpu")
        try:
            experts = [(h.gate_up, h.down) for h in handles]
            sums = {}
            for hand_off in (False, True):
                sums[hand_off] = ce.cpu_experts_forward(x, experts, [sel // k for _, sel in groups],
                                                        [weights.reshape(-1)[sel] for _, sel in groups],
                                                        hand_off=hand_off)
        finally:
            m.release(handles)
        assert not torch.equal(sums[False], sums[True])  # the kernel and the GEMMs round differently
        assert torch.equal(got, sums[tier == "cpu"])
    finally:
        m.close()


@pytest.mark.parametrize("tier", ["gpu", "cpu"], ids=["beside-a-gpu", "cpu-only"])
def test_only_a_cpu_only_host_dequantizes_many_token_quantized_experts_for_the_gemms(mxfp4_store, monkeypatch, tier):
    """The same for MXFP4 experts (a store quantized while packing): where the CPU computes every expert, one with more
    than `quant_max_tokens` tokens is dequantized to bf16 (`strata.kernels.cpu.dequant`) for torch's GEMMs, also when
    its experts sit in pinned RAM (the packed path, `CpuCompute.start_cpu`, leaves them to it), and the CPU share
    equals `cpu_experts_forward` with the hand-off, bit for bit; beside a GPU nothing is dequantized and it equals the
    kernel's sum."""
    from strata.kernels.cpu import dequant
    from strata.kernels.cpu import experts as ce

    if ce.backend(None, "mxfp4") not in ("avx512_bf16", "avx512_bf16_emulated"):
        pytest.skip("quantized experts are handed off on avx512_bf16 (or its emulation)")
    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: True)
    store = mxfp4_store
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=2, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    calls, shipped = [], dequant.dequantize_expert
    monkeypatch.setattr(dequant, "dequantize_expert", lambda *a: calls.append(1) or shipped(*a))
    try:
        compute = ExpertCompute(m, tier, "fork")
        hidden = store.expert_shapes[0][1]
        n, k = ce.quant_max_tokens(ce.backend(None, "mxfp4"), "mxfp4") + 8, 2  # every token to experts 1 and 3
        x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
        weights = torch.rand(n, k, generator=torch.Generator().manual_seed(8))
        groups = [(1, torch.arange(0, n * k, k)), (3, torch.arange(1, n * k, k))]
        m.release(m.acquire([(layer, 1), (layer, 3)], "cpu"))  # resident in pinned RAM: the packed path's case
        got = compute.cpu_forward(layer, x, weights, k, groups)
        assert len(calls) == (2 if tier == "cpu" else 0)
        handles = m.acquire([(layer, 1), (layer, 3)], "cpu")
        try:
            experts = [h.matrices for h in handles]
            want = ce.cpu_experts_forward(x, experts, [sel // k for _, sel in groups],
                                          [weights.reshape(-1)[sel] for _, sel in groups], hand_off=tier == "cpu")
        finally:
            m.release(handles)
        assert torch.equal(got, want)
    finally:
        m.close()


def test_split_decode_promotes_a_popular_cpu_expert(store):
    """Cold experts the split computes on the CPU never cross to the GPU by themselves; once one is used over
    twice as often as the GPU tier's victim, it is copied there in the background (one per layer and step),
    and a rarely used one is not."""
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "fork")
        m.release(m.acquire([(layer, i) for i in range(8)], "cpu"))
        m.release_staged(m.stage_gpu(layer, [0, 1, 2]))  # the GPU tier is full
        m.note_hits(layer, [0, 1, 2])
        m.note_gpu_misses(layer, [6])  # as often as the residents: not worth a slot
        compute.promote_one(layer, {6})
        assert m.wait_settled(10) and (layer, 6) not in m.gpu.slot_of and compute.promotions == 0
        m.note_gpu_misses(layer, [5] * 12 + [7] * 6)
        compute.promote_one(layer, {5, 6, 7})
        assert m.wait_settled(10)
        assert (layer, 5) in m.gpu.slot_of and (layer, 7) not in m.gpu.slot_of  # the most used, one per step
        assert compute.promotions == 1
    finally:
        m.close()


def test_prefill_counts_each_token_in_the_gpu_tiers_history(store):
    """A prefill chunk stages each of its experts once, but the GPU tier's frequency history counts every
    token routed to it (`note_uses`): after a prompt that sends 10 tokens to expert 5 and one to expert 2,
    5 outranks 2, so later staging evicts 2 first and a decode step would promote 5, not 2."""
    layer = store.index.moe_layers[0]
    gu, _ = store.load_layer_experts(layer, torch.float32, "cpu")
    e, h = gu.shape[0], gu.shape[2]
    m = TierManager(store, TierBudgets(gpu_slots=4, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "gpu")
        compute.pair_path = False  # the prefill path: tokens grouped by expert
        experts = TieredExperts(layer, e, compute)
        ids = torch.tensor([[5, 1]] * 10 + [[2, 3]], dtype=torch.int64)  # [11 tokens, k = 2]
        x = torch.randn(11, h, generator=torch.Generator().manual_seed(0)).to(store.dtype)
        experts(x, ids, torch.full((11, 2), 0.5))
        score = m.gpu_scores(layer, [1, 2, 3, 5])
        assert score[5] > 9.0 and score[1] > 9.0  # ten uses each (decay over 22 lookups is negligible)
        assert score[2] < 1.5 and score[3] < 1.5
        assert not m.gpu.free and m.worth_caching(layer, [2, 5]) == [5]  # 5 beats the victim by the margin, 2 does not
    finally:
        m.close()


def test_split_prefetches_into_pinned_ram_and_idles_once_it_holds_every_expert(store):
    """Split decode computes cold experts on the CPU from pinned RAM: its prefetcher fetches ahead into pinned
    RAM, not GPU slots, and stops predicting for good once pinned RAM holds every expert (and can hold them
    all); a copy-only engine's prefetcher still targets the GPU tier."""
    from strata.config import StrataConfig

    keys = store.keys()
    calls = []
    predictors = {layer: (lambda h, layer=layer: calls.append(layer) or torch.zeros(1, 2, dtype=torch.long))
                  for layer in store.index.moe_layers}
    for pinned, numerics in [(len(keys), "fork"), (4, "fork"), (len(keys), "gpu")]:
        m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=pinned), gpu_device=torch.device("cpu"),
                        io_threads=2)
        try:
            pf = ExpertCompute(m, "gpu", numerics).start_prefetching(predictors, StrataConfig().prefetch.lookahead)
            assert pf.device_tier == ("cpu" if numerics == "fork" else "gpu")
            m.release(m.acquire(list(keys)[: min(pinned, len(keys))], "cpu"))
            assert m.all_pinned() == (pinned == len(keys))  # a smaller pool may evict: never idle for good
            calls.clear()
            pf(store.index.moe_layers[0], torch.zeros(1, 8))
            idle = numerics == "fork" and pinned == len(keys)
            assert (calls == []) == idle  # idle for good: no prediction at all
        finally:
            m.close()


# ---- CUDA ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_pair_kernels_equal_the_fallback(dtype):
    from strata.kernels.gpu.experts import grouped

    if grouped.triton is None:
        pytest.skip("triton is not installed")
    gu, dn = _random_experts(e=8, h=256, i=96, dtype=dtype)
    gu, dn = gu.cuda() / 16, dn.cuda() / 16
    x = torch.randn(6, 256, device="cuda", dtype=dtype)
    ids, _ = _routes(6, 8, 3)
    ids = ids.cuda()
    slot_of = torch.tensor([0, 1, -1, 2, 3, 4, -1, 5], dtype=torch.int32, device="cuda")
    sw = SlotWeights(gu[[0, 1, 3, 4, 5, 7]].contiguous(), dn[[0, 1, 3, 4, 5, 7]].contiguous())
    y_t, y_f = torch.zeros(18, 256, device="cuda"), torch.zeros(18, 256, device="cuda")
    used = pair_experts(x, sw, slot_of, ids.reshape(-1), y_t)
    grouped._pair_torch(x, sw, slot_of, ids.reshape(-1), torch.arange(18, device="cuda", dtype=torch.int32), 3, y_f,
                        torch.empty(18, dtype=torch.int32, device="cuda"))
    assert torch.equal(used, slot_of[ids.reshape(-1)])
    torch.testing.assert_close(y_t, y_f, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_pair_kernels_read_pinned_slots_in_place():
    """`pair_experts_in_place` (weights read over PCIe from page-locked host slots, by address) gives what the
    slot kernels give on the same weights in GPU memory, and leaves the other pairs' rows alone."""
    from strata.kernels.gpu.experts.grouped import HostExperts, pair_experts_in_place
    from strata.tiers.storage.pinned import PinnedPool

    e, h, i, k = 6, 256, 96, 3
    gu, dn = _random_experts(e=e, h=h, i=i, dtype=torch.bfloat16)
    slot_bytes = -(-(gu[0].numel() + dn[0].numel()) * 2 // 4096) * 4096
    pool = PinnedPool(slot_bytes, e, background=False)
    try:
        for j in range(e):  # the store's slot layout: gate_up, then down right after it
            flat = pool.slot(j).view(torch.bfloat16)
            flat[: gu[j].numel()].copy_(gu[j].reshape(-1))
            flat[gu[j].numel() : gu[j].numel() + dn[j].numel()].copy_(dn[j].reshape(-1))
        x = torch.randn(2, h, device="cuda", dtype=torch.bfloat16)
        ids, _ = _routes(2, e, k)
        flat_ids = ids.reshape(-1)
        addr = torch.tensor([pool.slot_address(int(j)) for j in flat_ids], dtype=torch.int64)
        addr[4] = 0  # pair 4 is not in this pass
        y = torch.full((2 * k, h), 5.0, device="cuda")
        pair_experts_in_place(x, HostExperts(torch.bfloat16, (2 * i, h), (h, i), gu[0].numel() * 2), addr.cuda(), y)
        ref = torch.zeros(2 * k, h, device="cuda")
        pair_experts(x, SlotWeights(gu.cuda(), dn.cuda()), torch.arange(e, dtype=torch.int32, device="cuda"),
                     flat_ids.cuda(), ref)
        keep = [0, 1, 2, 3, 5]  # the same kernels compiled for unaligned host pointers: fp32 sums may reorder
        torch.testing.assert_close(y[keep], ref[keep], rtol=1e-5, atol=1e-3)
        assert torch.all(y[4] == 5.0)
        # a split expert's GPU part: the intermediate rows from first_row[p] on (0: all of them; i: none)
        first = torch.tensor([0, 16, 40, 64, 0, 96], dtype=torch.int32)
        part = torch.full((2 * k, h), 5.0, device="cuda")
        pair_experts_in_place(x, HostExperts(torch.bfloat16, (2 * i, h), (h, i), gu[0].numel() * 2), addr.cuda(),
                              part, first_row=first.cuda())
        xf = x.float().cpu()
        for p, j in enumerate(flat_ids.tolist()):
            if p == 4:
                assert torch.all(part[4] == 5.0)  # not in this pass
                continue
            f, tok = int(first[p]), p // k
            gate, up = gu[j][f:i].float(), gu[j][i + f :].float()
            want = (torch.nn.functional.silu(gate @ xf[tok]) * (up @ xf[tok])) @ dn[j][:, f:].float().T
            torch.testing.assert_close(part[p].cpu(), want, rtol=1e-4, atol=1e-3)
    finally:
        torch.cuda.synchronize()
        pool.close()


@pytest.mark.parametrize("hit_ratio, pauses", [(0.05, True), (0.9, False)])
def test_prefetcher_pauses_when_its_predictions_are_wasted(hit_ratio, pauses):
    """Measured precision below the threshold pauses prediction (and it resumes later to re-measure)."""
    from strata.tiers.prefetch import LookaheadPrefetcher
    from strata.tiers.stats import TierStats

    class Manager:  # counts like TierManager: every prefetched key issued, a share of them used
        def __init__(self):
            self.stats_, self.n = TierStats(), 0

        def prefetch(self, keys, device):
            for _ in keys:
                self.n += 1
                self.stats_.prefetch_issued += 1
                self.stats_.prefetch_used += int((self.n * hit_ratio) % 1 < hit_ratio)

    m = Manager()
    pf = LookaheadPrefetcher(m, {1: lambda h: torch.arange(8).view(1, 8)}, 1, "gpu")
    calls_issuing = 0
    for _ in range(200):
        before = m.stats_.prefetch_issued
        pf(0, torch.zeros(1, 4))
        calls_issuing += m.stats_.prefetch_issued > before
    assert (pf.pauses > 0) == pauses
    assert calls_issuing < 200 if pauses else calls_issuing == 200


def test_cpu_rate_is_calibrated_from_the_kernel(store):
    """The cost model starts from the CPU kernel's measured rate on this model's expert shape."""
    m = TierManager(store, TierBudgets(gpu_slots=2, pinned_slots=8), gpu_device=torch.device("cpu"), io_threads=1)
    try:
        compute = ExpertCompute(m, "gpu", "fork")
        default = compute.rates.cpu_bytes_per_s
        rate = compute.calibrate_cpu(nbytes=4 * store.payload_bytes)
        assert rate > 0 and compute.rates.cpu_bytes_per_s == rate != default
    finally:
        m.close()


def test_bulk_lookup_counts_equal_single_ones():
    from strata.tiers.stats import TierStats

    a, b = TierStats(), TierStats()
    for _ in range(5):
        a.lookup(3, "gpu", False, 0.0, expert=7)
    b.lookup(3, "gpu", False, 0.0, expert=7, count=5)
    assert a.snapshot({}, {})["layers"] == b.snapshot({}, {})["layers"] and a.expert_lookups == b.expert_lookups


@pytest.mark.parametrize("heads,kv_heads,dv", [(8, 2, 16), (4, 4, 16), (4, 4, 8)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_later_prefill_chunk_attention_equals_the_masked_reference(heads, kv_heads, dv, device):
    """A prefill chunk after `start` cached positions (the lower-right causal path that keeps SDPA's
    flash kernel) equals softmax attention with an explicit [L, S] position mask."""
    from strata.runtime.model.attention import attend

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    g = torch.Generator().manual_seed(0)
    L, start, d = 7, 21, 16
    S = start + L
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(h, n, e, generator=g) for h, n, e in ((heads, L, d), (kv_heads, S, d), (kv_heads, S, dv)))
    out = attend(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), start, None, d**-0.5).float().cpu()
    rep = heads // kv_heads
    kk, vv = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ kk.transpose(1, 2)) * d**-0.5  # [heads, L, S]
    mask = torch.arange(S)[None, :] <= torch.arange(start, S)[:, None]
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vv
    assert out.shape == (heads, L, dv)
    torch.testing.assert_close(out, ref, atol=2e-2 if device == "cuda" else 1e-5, rtol=2e-2 if device == "cuda" else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("start", [0, 5])
def test_a_prompts_attention_on_cuda_leaves_cudnn_out_and_matches_the_math(start):
    """A prompt's SDPA call runs with cuDNN's backend switched off (its host cost per call), GQA heads included, and
    gives causal attention's fp32 result within bf16 rounding, for a first chunk and a later one."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from strata.runtime.model import attention

    seen = []

    class Spy(TorchFunctionMode):
        """Notes the cuDNN flag at each SDPA call. A mode, not a patched `F.scaled_dot_product_attention`: a later
        chunk's `CausalBias` mask dispatches only when that name is torch's own function."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return func(*args, **(kwargs or {}))

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(8, 24, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, start + 24, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, start + 24, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    with Spy():
        got = attention.attend(q, k, v, start, None, 0.125)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored for the rest of the process
    kf, vf = k.float().repeat_interleave(4, 0), v.float().repeat_interleave(4, 0)  # query head h reads KV head h // 4
    scores = q.float() @ kf.transpose(1, 2) * 0.125  # [heads, L, S]
    later = torch.arange(start + 24, device="cuda")[None, :] > torch.arange(start, start + 24, device="cuda")[:, None]
    want = scores.masked_fill(later, float("-inf")).softmax(-1) @ vf
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
