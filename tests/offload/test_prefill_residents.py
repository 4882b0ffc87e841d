"""runtime.prefill_keeps_resident: a prompt's cold experts stream through the step-copy slots and the GPU tier's
residents survive the prefill (a CPU-simulated GPU tier: the copies are real, into slots in host memory)."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.experts import moe_forward
from strata.kernels.gpu.experts.grouped import SlotWeights
from strata.kernels.gpu.experts.grouped_gemm import grouped_experts
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.runtime.offload.tiered_prefill import AHEAD_PAIRS_PER_EXPERT
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")


@pytest.fixture()
def store(tiny_model_dir, tmp_path):
    s = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    yield s
    s.close()


@pytest.mark.parametrize("keep", [True, False])
def test_a_long_prompt_leaves_the_other_layers_residents_in_place(store, keep):
    first, second = store.index.moe_layers[:2]
    e = store.index.num_experts
    # 12 cached GPU slots (+ 4 step-copy slots), both layers' 6 residents filling them
    m = TierManager(store, TierBudgets(gpu_slots=16, pinned_slots=4 * e), gpu_device=torch.device("cpu"),
                    io_threads=2, stream_slots=4)
    try:
        for key in store.keys():  # every expert in pinned RAM: the copies' source
            m.release(m.acquire([key], "cpu"))
        for layer in (first, second):
            m.release_staged(m.stage_gpu(layer, list(range(6))))
        before = {layer: m.resident_experts(layer, "gpu") for layer in (first, second)}
        assert before[second] == set(range(6))
        compute = ExpertCompute(m, "gpu", "gpu")  # copies only
        compute.grouped_prefill, compute.prefill_keeps_resident = True, keep
        compute.moe_layers = [first, second]
        gu, dn = store.load_layer_experts(first, torch.float32, "cpu")
        g = torch.Generator().manual_seed(0)
        n, k = 64, 4
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        w, x = torch.rand(n, k, generator=g), torch.randn(n, gu.shape[2], generator=g).to(store.dtype)
        used = set(ids.unique().tolist())
        copies, looked = m.stats()["paths"]["pinned->gpu"]["objects"], m.stats()["layers"].get(first)
        got = TieredExperts(first, e, compute)(x, ids, w).float()
        want = moe_forward(x.float(), gu, dn, ids, w)
        assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()
        # served in several batches (residents, then cold ones two at a time): bit for bit the all-in-memory sum
        native = SlotWeights(*store.load_layer_experts(first, store.dtype, "cpu"))
        assert torch.equal(got, grouped_experts(x, w, ids, native, ids).to(x.dtype).float())
        copied = m.stats()["paths"]["pinned->gpu"]["objects"] - copies
        assert copied == len(used - before[first])  # each cold expert crosses once, the residents not at all
        after = {layer: m.resident_experts(layer, "gpu") for layer in (first, second)}
        if keep:
            assert after == before  # the tier is as it was
        else:
            assert after[second] != before[second]  # staged through the tier: the next layer's residents evicted
        # every expert the prompt used is one lookup; the copied ones are the misses, streamed or staged
        now = m.stats()["layers"][first]
        assert now["lookups"] - looked["lookups"] == len(used) and now["misses"] - looked["misses"] == copied
        # and in fp32 activations, where a different order of the adds would show
        x32 = x.float()
        assert torch.equal(TieredExperts(first, e, compute)(x32, ids, w), grouped_experts(x32, w, ids, native, ids))
    finally:
        m.close()


@pytest.fixture()
def ahead_tier(store):
    """A CPU-simulated GPU tier of three layers' slots, every expert in pinned RAM, and an ExpertCompute over the
    first two MoE layers that copies cold experts (no CPU share): (manager, compute)."""
    e = store.index.num_experts
    m = TierManager(store, TierBudgets(gpu_slots=3 * e, pinned_slots=4 * e), gpu_device=torch.device("cpu"), io_threads=2)
    for key in store.keys():
        m.release(m.acquire([key], "cpu"))
    compute = ExpertCompute(m, "gpu", "gpu")
    compute.grouped_prefill, compute.moe_layers = True, store.index.moe_layers[:2]
    yield m, compute
    m.close()


def chunk(store, seed: int, pairs_per_expert: int = 64, k: int = 4):
    """A prompt chunk's routing and activations: ids [N, k], weights [N, k], x [N, H] in the store's dtype."""
    e = store.index.num_experts
    g = torch.Generator().manual_seed(seed)
    n = pairs_per_expert * e // k
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    hidden = store.load_layer_experts(store.index.moe_layers[0], torch.float32, "cpu")[0].shape[2]
    return ids, w, torch.randn(n, hidden, generator=g).to(store.dtype)


def unpinned(m: TierManager) -> bool:
    """No handle or staged batch holds a GPU slot."""
    return sum(m.maps.holders.values()) == 0 and not any(m.maps.gpu.refs.values())


def test_a_many_token_chunk_stages_the_next_layer_behind_its_own(store, ahead_tier):
    """Enough pairs to use every expert: the first layer stages its own experts and the next layer's at once, the
    next layer finds them mapped, every cold expert crosses once, and nothing stays pinned after the pass."""
    m, compute = ahead_tier
    layers, e = compute.moe_layers, store.index.num_experts
    ids, w, x = chunk(store, seed=1)  # 64 pairs an expert: every expert used, the next layer staged ahead
    copied = lambda: m.stats()["paths"].get("pinned->gpu", {}).get("objects", 0)  # noqa: E731
    copies = copied()
    first = TieredExperts(layers[0], e, compute)(x, ids, w)
    assert set(compute.prefill_ahead) == {layers[1]}  # staged behind the first layer, still held
    assert m.resident_experts(layers[1], "gpu") == set(range(e))
    assert copied() - copies == 2 * e  # both layers, once each
    second = TieredExperts(layers[1], e, compute)(x, ids, w)
    assert compute.prefill_ahead == {}  # the last MoE layer of the pass stages nothing
    assert copied() - copies == 2 * e  # the second layer copied nothing more
    for layer, got in zip(layers, (first, second), strict=True):
        native = SlotWeights(*store.load_layer_experts(layer, store.dtype, "cpu"))
        assert torch.equal(got, grouped_experts(x, w, ids, native, ids).to(x.dtype))
    assert unpinned(m)
    # a shorter chunk leaves its few-token cold experts to the cost model (the CPU's share): nothing staged ahead
    ids, w, x = chunk(store, seed=1, pairs_per_expert=AHEAD_PAIRS_PER_EXPERT // 2)
    TieredExperts(layers[0], e, compute)(x, ids, w)
    assert compute.prefill_ahead == {}
    # as does one whose pairs all go to half the experts (skewed routing): the next layer may not use the rest
    ids, w, x = chunk(store, seed=1)
    TieredExperts(layers[0], e, compute)(x, ids % (e // 2), w)
    assert compute.prefill_ahead == {}


def test_a_pass_that_stops_releases_what_it_staged_ahead(store, ahead_tier, monkeypatch):
    """A layer that fails after staging the next layer's experts unpins them: nothing stays held."""
    m, compute = ahead_tier
    layers = compute.moe_layers
    ids, w, x = chunk(store, seed=2)
    layer = TieredExperts(layers[0], store.index.num_experts, compute)

    def fail(*args, **kwargs):
        assert set(compute.prefill_ahead) == {layers[1]}  # staged before the layer's own compute
        raise RuntimeError("out of memory")

    monkeypatch.setattr(layer, "_tier_forward", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        layer(x, ids, w)
    assert compute.prefill_ahead == {}
    assert unpinned(m)
