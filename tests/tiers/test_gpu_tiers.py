"""The tier manager and the tiered engine on a real GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def store(tiny_model_dir, tmp_path_factory):
    s = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("st") / "tiny", progress=False))
    yield s
    s.close()


def test_gpu_slots_hold_exact_copies_and_the_device_map_agrees(store):
    m = TierManager(store, TierBudgets(gpu_slots=6, pinned_slots=8), gpu_device=torch.device("cuda"))
    try:
        assert m.pool.pinned
        for batch in ([(1, 0), (1, 1), (2, 5)], [(2, 6), (2, 7), (1, 9), (1, 10)], [(1, 0), (2, 15)]):
            handles = m.acquire(batch, "gpu")
            for h in handles:
                h.wait()
                assert h.gate_up.is_cuda
                gate_up, down = store.expert_views(store.read_expert(h.key))
                assert torch.equal(h.gate_up.cpu(), gate_up) and torch.equal(h.down.cpu(), down)
            m.release(handles)
            torch.cuda.synchronize()
            device_map = m.slots.slot_of.cpu().numpy()
            assert (device_map == m.slots.slot_of_host).all()
            for h in handles:
                assert device_map[h.key] in (h.slot, -1)
        assert m.stats()["paths"]["pinned->gpu"]["objects"] >= 9
    finally:
        m.close()


def test_copies_overlap_compute(store):
    """A copy on the tier's copy stream completes while a long kernel still runs on the compute stream."""
    m = TierManager(store, TierBudgets(gpu_slots=4, pinned_slots=8), gpu_device=torch.device("cuda"))
    try:
        m.release(m.acquire([(1, 3)], "cpu"))  # staged in pinned RAM: the GPU copy is pure H2D
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        for _ in range(40):  # ~tens of ms of work queued on the compute stream
            a = a @ a
            a = a / a.norm()
        handles = m.acquire([(1, 3)], "gpu")
        handles[0].event.synchronize()
        assert not torch.cuda.current_stream().query(), "the copy waited for compute"
        m.release(handles)
        torch.cuda.synchronize()
    finally:
        m.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "cost"])
def test_tiered_engine_on_gpu_equals_memory_engine(tiny_model_dir, policy):
    memory = Engine.from_pretrained(tiny_model_dir, device="cuda", config={"runtime": {"experts": "memory"}})
    slot = 12288  # one tiny-model expert: 3 x 32 x 64 bf16, 4 KiB aligned
    cfg = {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(6 * slot)}},  # 1 GPU slot per layer
           "policy": {"eviction": policy}, "runtime": {"cpu_numerics": "gpu"}}  # cold experts copied: bit-identical
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config=cfg) as tiered:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        assert torch.equal(tiered.score(ids), memory.score(ids))
        assert tiered.generate(ids, max_tokens=12).token_ids == memory.generate(ids, max_tokens=12).token_ids
        assert tiered.stats()["tiers"]["tiers"]["gpu"]["capacity"] >= 2


def test_tiered_engine_with_experts_on_cpu_under_a_gpu_model(tiny_model_dir):
    """GPU budget 0: attention on the GPU, experts computed on the CPU from RAM (fp32), results close."""
    memory = Engine.from_pretrained(tiny_model_dir, device="cuda", config={"runtime": {"experts": "memory"}})
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config={"tiers": {"gpu": {"budget": "0"}}}) as tiered:
        ids = memory.tokenizer.encode("The river runs through the valley")
        assert (tiered.score(ids) - memory.score(ids)).abs().mean().item() < 0.02


def test_cpu_gpu_split_stays_within_tolerance(tiny_model_dir):
    """fork numerics with one GPU slot per layer: part of the cold experts run on the CPU kernel."""
    memory = Engine.from_pretrained(tiny_model_dir, device="cuda", config={"runtime": {"experts": "memory"}})
    cfg = {"tiers": {"gpu": {"budget": str(2 * 12288)}, "pinned": {"budget": str(32 * 12288)}}}
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config=cfg) as split:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        for _ in range(3):
            split.generate(ids, max_tokens=8)
        assert (split.score(ids) - memory.score(ids)).abs().mean().item() < 0.02
        compute = split.model.layers[1].mlp.experts.compute
        assert compute.cpu_experts > 0


def test_a_prompts_cpu_share_gets_only_its_tokens_rows(tiny_model_dir, monkeypatch):
    """Prefill-sized layers (pairs beyond the pair kernels' limit) with fork numerics: the CPU share is handed
    the rows of its own tokens only (not the whole prompt's activations), and its partial sums land on the
    right rows: the score stays within tolerance of the memory engine."""
    memory = Engine.from_pretrained(tiny_model_dir, device="cuda", config={"runtime": {"experts": "memory"}})
    cfg = {"tiers": {"gpu": {"budget": str(2 * 12288)}, "pinned": {"budget": str(32 * 12288)}}}
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config=cfg) as split:
        compute = split.model.layers[1].mlp.experts.compute
        calls, start = [], compute.start_cpu

        def spy(layer, x, weights, k, groups, background=True):
            if background:  # the share's own start (cpu_forward, its fallback, starts it again in the foreground)
                calls.append((x.shape[0], weights.shape[0], k, [torch.as_tensor(s).clone() for _, s in groups]))
            return start(layer, x, weights, k, groups, background=background)

        monkeypatch.setattr(compute, "start_cpu", spy)
        plan = TieredExperts._plan_split

        def one_on_cpu(self, groups):  # the CPU share cut to one expert (<= 32 tokens): fewer rows than the prompt
            cpu, gpu = plan(self, groups)
            return cpu[:1], sorted(gpu + cpu[1:], key=lambda g: g[0])

        monkeypatch.setattr(TieredExperts, "_plan_split", one_on_cpu)
        ids = memory.tokenizer.encode("The river runs through the valley and the town, past the mill and the "
                                      "bridge, under the old stone arches where the herons wait for the fish "
                                      "that come down from the hills every spring and autumn")
        assert len(ids) * 4 > 128  # beyond PAIR_LIMIT: the grouped (prefill) path, not the pair kernels
        diff = (split.score(ids) - memory.score(ids)).abs().mean().item()
    assert calls, "no prefill layer sent a cold expert to the CPU"
    for rows, weight_rows, k, sels in calls:
        tokens = torch.unique(torch.cat(sels) // k)
        assert rows == weight_rows == tokens.numel()  # exactly the rows its pairs use, renumbered 0..R-1
        assert tokens.tolist() == list(range(rows))
    assert all(rows < len(ids) for rows, *_ in calls)
    assert diff < 0.02


def test_prefill_keeping_residents_scores_alike_and_leaves_the_tier(tiny_model_dir):
    """runtime.prefill_keeps_resident on a real GPU tier: a long prompt's cold experts stream through the step-copy
    slots; the score stays within tolerance and the GPU tier's residents are the same before and after."""
    memory = Engine.from_pretrained(tiny_model_dir, device="cuda", config={"runtime": {"experts": "memory"}})
    cfg = {"tiers": {"gpu": {"budget": str(20 * 12288)}, "pinned": {"budget": str(32 * 12288)}},
           "runtime": {"prefill_keeps_resident": True}}
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config=cfg) as split:
        split.wait_settled()
        ids = memory.tokenizer.encode(" ".join(["The river runs through the valley and the town, past the mill."] * 24))
        assert len(ids) * 4 > 32 * 16  # over 32 tokens an expert: copied, not left to the CPU
        tiers = split.tiers
        assert tiers.stream_slots
        before = {layer: tiers.resident_experts(layer, "gpu") for layer in split._compute.moe_layers}
        copies = tiers.stats()["paths"]["pinned->gpu"]["objects"]
        diff = (split.score(ids) - memory.score(ids)).abs().mean().item()
        copied = tiers.stats()["paths"]["pinned->gpu"]["objects"] - copies
        after = {layer: tiers.resident_experts(layer, "gpu") for layer in split._compute.moe_layers}
    assert diff < 0.02 and copied > 0 and after == before


def test_kvikio_disk_to_gpu_path(store):
    """tiers.disk.reader = "kvikio": verified experts not in pinned RAM go disk -> GPU slot directly."""
    pytest.importorskip("kvikio")
    m = TierManager(store, TierBudgets(gpu_slots=8, pinned_slots=16), gpu_device=torch.device("cuda"),
                    disk_reader="kvikio")
    try:
        keys = store.keys()
        for k in keys:  # first reads go through pinned RAM and verify every checksum
            m.release(m.acquire([k], "cpu"))
        cold = [k for k in keys if "pinned" not in m.residency(k)][:6]
        assert cold
        handles = m.acquire(cold, "gpu")
        for h in handles:
            h.wait()
            gate_up, down = store.expert_views(store.read_expert(h.key))
            assert torch.equal(h.gate_up.cpu(), gate_up) and torch.equal(h.down.cpu(), down)
        m.release(handles)
        assert m.stats()["paths"]["disk->gpu"]["objects"] == len(cold)
    finally:
        m.close()
