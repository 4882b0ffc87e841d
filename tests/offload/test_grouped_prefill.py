"""Prefill-sized expert compute through grouped GEMMs (strata.kernels.gpu.experts.grouped_gemm, [debug]
grouped_prefill): the same sums as the per-expert loop, in memory and on tiers (a CPU-simulated GPU tier here; torch's
grouped GEMM runs its reference loop on the CPU)."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.kernels.experts import moe_forward
from strata.kernels.gpu.experts.grouped import SlotWeights
from strata.kernels.gpu.experts.grouped_gemm import grouped_experts, grouped_ok
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")

E, H, INTER, N, K = 6, 32, 16, 9, 3


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    gu, dn = torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)
    x = torch.randn(N, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return gu, dn, x, ids, torch.rand(N, K, generator=g)


def test_grouped_experts_equal_the_per_expert_loop_in_fp32():
    gu, dn, x, ids, w = _experts()
    sw = SlotWeights(gu, dn)
    assert grouped_ok(x, sw)
    assert torch.equal(grouped_experts(x, w, ids, sw, ids), moe_forward(x, gu, dn, ids, w))


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_pairs_in_pieces_equal_one_grouped_gemm(monkeypatch, rows):
    """A long prompt's pairs run in pieces of about PIECE_ROWS, cut between experts (an expert with more rows is
    a piece of its own): the same outputs, bit for bit."""
    import strata.kernels.gpu.experts.grouped_gemm as gg

    gu, dn, x, ids, w = _experts(2)
    sw = SlotWeights(gu, dn)
    whole = grouped_experts(x, w, ids, sw, ids)
    monkeypatch.setattr(gg, "PIECE_ROWS", rows)
    assert torch.equal(grouped_experts(x, w, ids, sw, ids), whole)


def test_grouped_experts_read_slab_slots_and_skip_pairs_not_in_the_call():
    """Slots in any order (the GPU tier's), some experts absent (-1): those pairs add nothing."""
    gu, dn, x, ids, w = _experts(1)
    gu_bytes = 2 * INTER * H * 4
    slab = torch.zeros(4, gu_bytes + H * INTER * 4 + 4096, dtype=torch.uint8)  # padded slots
    sw = SlotWeights.from_slab(slab, torch.float32, (2 * INTER, H), (H, INTER), gu_bytes)
    slot_of = {1: 2, 3: 0, 4: 3, 5: 1}
    table = torch.full((E,), -1, dtype=torch.int64)
    for e, s in slot_of.items():
        sw.gate_up[s].copy_(gu[e])
        sw.down[s].copy_(dn[e])
        table[e] = s
    present = (table[ids] >= 0).float()
    assert (present == 0).any()
    assert torch.equal(grouped_experts(x, w, table[ids], sw, ids), moe_forward(x, gu, dn, ids, w * present))


def test_memory_engine_scores_the_same_with_grouped_prefill(tiny_model_dir):
    exact = {"experts": "memory", "dtype": "float32"}
    plain = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": exact})
    grouped = Engine.from_pretrained(tiny_model_dir, device="cpu",
                                     config={"runtime": exact, "debug": {"grouped_prefill": True}})
    ids = plain.tokenizer.encode("The river runs through the valley and the town")
    assert any(getattr(m, "grouped", False) for m in grouped.model.modules())
    assert not any(getattr(m, "grouped", False) for m in plain.model.modules())  # "auto": CUDA only
    assert torch.equal(plain.score(ids), grouped.score(ids))  # fp32: the same sums in the same order


def test_tiered_prefill_with_grouped_gemms_equals_memory(tiny_model_dir, tmp_path):
    """A CPU-simulated GPU tier smaller than the chunk's experts: staged in chunks, each through the grouped
    GEMMs, within bf16 rounding of the all-in-memory layer."""
    store = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    layer = store.index.moe_layers[0]
    gu, dn = store.load_layer_experts(layer, torch.float32, "cpu")
    e, h = gu.shape[0], gu.shape[2]
    m = TierManager(store, TierBudgets(gpu_slots=5, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "gpu")  # copies only: every expert computed from a GPU slot
        compute.grouped_prefill = True
        experts = TieredExperts(layer, e, compute)
        g = torch.Generator().manual_seed(3)
        n, k = 40, 2
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        w = torch.rand(n, k, generator=g)
        x = torch.randn(n, h, generator=g).to(store.dtype)
        calls = []
        original = TieredExperts._grouped_forward
        TieredExperts._grouped_forward = lambda self, *a: calls.append(1) or original(self, *a)
        try:
            got = experts(x, ids, w).float()
        finally:
            TieredExperts._grouped_forward = original
        want = moe_forward(x.float(), gu, dn, ids, w)
        assert calls and (got - want).abs().max().item() < 2e-2 * want.abs().max().item()
    finally:
        m.close()
        store.close()


def test_operands_the_grouped_gemm_refuses_fall_back_to_the_loop(monkeypatch):
    from strata.kernels.gpu.experts import grouped_gemm
    from strata.runtime.model.moe import Experts

    gu, dn, x, ids, w = _experts(2)
    layer = Experts.__new__(Experts)
    torch.nn.Module.__init__(layer)
    layer.gate_up_proj, layer.down_proj = torch.nn.Parameter(gu), torch.nn.Parameter(dn)
    layer._slot_of, layer.grouped = None, True

    def refuse_all(*a, **k):
        raise RuntimeError("mat_b must be column-major")

    monkeypatch.setattr(grouped_gemm.torch, "_grouped_mm", refuse_all)
    monkeypatch.setattr(grouped_gemm, "_refused", set())
    assert torch.equal(layer(x, ids, w), moe_forward(x, gu, dn, ids, w))
    assert not grouped_ok(x, SlotWeights(gu, dn))  # refused once, not tried again


def _cuda_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_sm90(), reason="needs an sm90+ GPU (torch's CUTLASS grouped GEMM)")
def test_grouped_experts_on_cuda_agree_with_the_loop_in_bf16():
    """The GPU's CUTLASS grouped GEMM (bf16) against the per-expert loop in fp32: within bf16 rounding, no refusal."""
    from strata.kernels.gpu.experts import grouped_gemm

    g = torch.Generator().manual_seed(4)
    e, h, inter, n, k = 16, 256, 128, 700, 4
    gu = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).cuda().bfloat16()
    dn = (torch.randn(e, h, inter, generator=g) / inter**0.5).cuda().bfloat16()
    x = torch.randn(n, h, generator=g).cuda().bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).cuda()
    w = torch.rand(n, k, generator=g).cuda()
    sw = SlotWeights(gu, dn)
    assert grouped_ok(x, sw)
    got = grouped_experts(x, w, ids, sw, ids)
    want = moe_forward(x.float(), gu.float(), dn.float(), ids, w)
    assert not grouped_gemm._refused
    assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_sm90(), reason="needs an sm90+ GPU (torch's CUTLASS grouped GEMM)")
def test_cuda_engines_with_grouped_prefill_agree_with_the_loop(tiny_model_dir):
    """bf16 on the GPU: in memory and on tiers (one GPU slot per layer, cold experts copied), the grouped
    prefill scores within bf16 rounding of the per-expert loop; in memory and tiered agree exactly."""
    ids = list(range(3, 200, 3))
    loop = Engine.from_pretrained(tiny_model_dir, device="cuda", config={"runtime": {"experts": "memory"},
                                                                         "debug": {"grouped_prefill": False}})
    grouped = Engine.from_pretrained(tiny_model_dir, device="cuda", config={"runtime": {"experts": "memory"}})
    assert any(getattr(m, "grouped", False) for m in grouped.model.modules())
    want = loop.score(ids)
    got = grouped.score(ids)
    assert (got - want).abs().mean().item() < 0.02
    slot = 12288
    cfg = {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(6 * slot)}},
           "runtime": {"cpu_numerics": "gpu"}}
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config=cfg) as tiered:
        assert torch.equal(tiered.score(ids), got)
