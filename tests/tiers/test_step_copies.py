"""`TierManager.stage_gpu`: one decode layer's cold experts copied to GPU slots in one batch.

Checked on a CPU-simulated GPU tier here and on CUDA (`gpu` marker): the slots hold exact copies, the
device map agrees with the host mirror, evicted experts read -1, objects that are not pinned-resident
take the general path in the same call, and a released batch becomes evictable again.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore


@pytest.fixture(scope="module")
def store(tiny_model_dir, tmp_path_factory):
    s = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("st") / "tiny", progress=False))
    yield s
    s.close()


def _check_batch(store, m, staged):
    staged.wait()
    assert len(staged.experts) == len(staged.slots) == len(set(staged.slots))
    for e, slot in zip(staged.experts, staged.slots, strict=True):
        gate_up, down = store.expert_views(store.read_expert((staged.layer, e)))
        got_gu, got_dn = store.expert_views(m.slots.view(slot))
        assert torch.equal(got_gu.cpu(), gate_up) and torch.equal(got_dn.cpu(), down)
    if m.slots.is_cuda:
        torch.cuda.synchronize()
    device_map = m.slots.slot_of.cpu().numpy()
    assert (device_map == m.slots.slot_of_host).all()
    for e, slot in zip(staged.experts, staged.slots, strict=True):
        assert device_map[staged.layer, e] == slot


def _run(store, device: str):
    layer = store.index.moe_layers[0]
    n_experts = max(k[1] for k in store.keys()) + 1
    m = TierManager(store, TierBudgets(gpu_slots=4, pinned_slots=n_experts), gpu_device=torch.device(device), io_threads=2)
    try:
        # everything of the layer in pinned RAM except the last expert, which stays on disk (general path)
        m.release(m.acquire([(layer, e) for e in range(n_experts - 1)], "cpu"))
        base = m.stats()
        first = m.stage_gpu(layer, [0, 1, 2])
        _check_batch(store, m, first)
        m.release_staged(first)
        # 1 and 2 are resident; 3 is copied in a batch, the disk-only expert takes `acquire` (one eviction)
        second = m.stage_gpu(layer, [1, 3, n_experts - 1, 2])
        assert sorted(second.experts) == sorted([1, 3, n_experts - 1, 2])
        assert [h.key[1] for h in second.handles] == [n_experts - 1]
        _check_batch(store, m, second)
        evicted = [e for e in (0, 1, 2, 3) if m.slots.slot_of_host[layer, e] < 0]
        assert evicted == [0]
        if m.slots.is_cuda:
            torch.cuda.synchronize()
        assert m.slots.slot_of.cpu().numpy()[layer, 0] == -1
        # a held batch is never evicted: all 4 slots are pinned, so a fifth expert cannot get a slot now
        assert m.gpu.refs and all(m.gpu.refs.get((layer, e), 0) == 1 for e in second.experts)
        m.release_staged(second)
        assert not m.gpu.refs
        third = m.stage_gpu(layer, [5, 6])  # released slots are reusable
        _check_batch(store, m, third)
        m.release_staged(third)
        stats = m.stats()
        assert stats["lookups"] - base["lookups"] == 3 + 4 + 2
        assert stats["tiers"]["gpu"]["hits"] == 2  # experts 1 and 2 in the second batch
        assert stats["paths"]["pinned->gpu"]["objects"] == 3 + 1 + 1 + 2
        assert m.pending_work() == 0 or m.wait_settled(10)
        assert not m.pinned.refs  # every pinned source was released once its copy landed
    finally:
        m.close()


def test_stage_gpu_cpu_slab(store):
    _run(store, "cpu")


@pytest.mark.gpu
def test_stage_gpu_cuda(store):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _run(store, "cuda")


def _stream(store, device: str) -> None:
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=6, pinned_slots=16), gpu_device=torch.device(device), io_threads=2,
                    stream_slots=2)
    try:
        assert m.gpu.capacity == 4 and m.stream_slots == [4, 5]
        m.release(m.acquire([(layer, e) for e in range(5)], "cpu"))  # 0-4 in pinned RAM; 5 and up only on disk
        base = m.stats()
        assert m.stream_gpu(layer, [0, 1, 2]) is None  # more than the stream slots
        assert m.stream_gpu(layer, [0, 7]) is None  # 7 is not in pinned RAM
        batch = m.stream_gpu(layer, [3, 1])
        assert batch is not None and batch.slots == [4, 5] and batch.experts == [3, 1]
        assert m.stream_gpu(layer, [2]) is None  # the first batch is still out: no slot free
        batch.wait()
        _assert_holds(store, m, layer, batch)
        assert not m.gpu.slot_of and (m.slots.slot_of_host < 0).all()  # the cached tier and its map are untouched
        m.release_staged(batch)
        # a prefill's double buffer: two batches of one slot each out at once, the third refused until one is back
        first, second = m.stream_gpu(layer, [2]), m.stream_gpu(layer, [0])
        assert first.slots == [4] and second.slots == [5] and m.stream_gpu(layer, [4]) is None
        m.release_staged(first)
        third = m.stream_gpu(layer, [4])  # into slot 4 once first's readers are done
        assert third is not None and third.slots == [4]
        for b in (second, third):
            b.wait()
            _assert_holds(store, m, layer, b)
            m.release_staged(b)
        if m.slots.is_cuda:
            torch.cuda.synchronize()
        stats = m.stats()
        assert stats["lookups"] - base["lookups"] == 5
        assert stats["tiers"]["pinned"]["hits"] - base["tiers"]["pinned"]["hits"] == 5
        assert stats["paths"]["pinned->gpu"]["objects"] == 5
        assert not m.pinned.refs  # every pinned source was released once its copy landed
    finally:
        m.close()


def _assert_holds(store, m, layer, batch) -> None:
    for e, slot in zip(batch.experts, batch.slots, strict=True):
        gate_up, down = store.expert_views(store.read_expert((layer, e)))
        got_gu, got_dn = store.expert_views(m.slots.view(slot))
        assert torch.equal(got_gu.cpu(), gate_up) and torch.equal(got_dn.cpu(), down)


def test_stream_gpu_cpu_slab(store):
    """`stream_gpu`: one step's copies into the slots set aside for them: exact bytes, the cached tier and the
    device map untouched, batches out at once only in free slots, pinned-resident experts only, sources
    released."""
    _stream(store, "cpu")


@pytest.mark.gpu
def test_stream_gpu_cuda(store):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _stream(store, "cuda")


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_worth_caching_admits_what_is_used_more_than_its_victim(store, policy):
    """Which copied experts the GPU tier keeps in split mode: everything while it has free slots; then, under
    a frequency policy, an expert used more than twice as often as the one it would evict, and not a rarely
    used one; under LRU, nothing (one step's copy says nothing about the next)."""
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2,
                    policy=policy)
    try:
        m.release(m.acquire([(layer, e) for e in range(8)], "cpu"))
        assert m.worth_caching(layer, [0, 1, 2, 3]) == [0, 1, 2]  # three free slots
        m.release_staged(m.stage_gpu(layer, [0, 1, 2]))
        m.note_gpu_misses(layer, [5] * 12 + [6])  # 5 is popular, 6 was used once (like 0-2)
        m.note_hits(layer, [0, 1, 2])
        want = [5] if policy == "lfu" else []
        assert m.worth_caching(layer, [5, 6]) == want
        if policy == "lfu":
            scores = m.gpu_scores(layer, [5, 6])
            assert scores[5] > 5 * scores[6] > 0
    finally:
        m.close()


def test_stage_gpu_waits_for_slots_a_step_holds(store):
    """A batch larger than the free slots evicts only what no step holds (never a slot in use)."""
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=16), gpu_device=torch.device("cpu"), io_threads=2)
    try:
        m.release(m.acquire([(layer, e) for e in range(6)], "cpu"))
        held = m.stage_gpu(layer, [0, 1])
        other = m.stage_gpu(layer, [2])
        m.release_staged(other)
        again = m.stage_gpu(layer, [3])  # must evict 2, not 0 or 1
        assert np.all(m.slots.slot_of_host[layer, [0, 1, 3]] >= 0) and m.slots.slot_of_host[layer, 2] == -1
        m.release_staged(again)
        m.release_staged(held)
    finally:
        m.close()


def test_cpu_experts_by_slot_address_equal_the_handle_path(store):
    """The decode CPU share reads pinned slots by address (no handles); same kernel, same expert order, so
    the partial sum is bit-identical to the handle path's, and the slots are released afterwards."""
    from strata.kernels.cpu import experts as ce
    from strata.runtime.offload.expert_compute import ExpertCompute

    if ce.backend() == "torch":
        pytest.skip("the compiled CPU kernel is not available here")
    layer = store.index.moe_layers[0]
    m = TierManager(store, TierBudgets(gpu_slots=0, pinned_slots=16), io_threads=2)
    try:
        m.release(m.acquire([(layer, e) for e in range(6)], "cpu"))
        compute = ExpertCompute(m, "cpu", "fork")
        g = torch.Generator().manual_seed(0)
        h = store.expert_shapes[0][1]
        x = torch.randn(3, h, generator=g)
        weights = torch.rand(3, 2, generator=g)
        groups = [(1, torch.tensor([0, 3])), (4, torch.tensor([1])), (5, torch.tensor([2, 4, 5]))]  # pair = token*2 + j
        fast = compute._cpu_packed(layer, x, weights, 2, groups)
        assert fast is not None and not m.pinned.refs
        by_handle = torch.zeros(3, h)
        handles = m.acquire([(layer, e) for e, _ in groups], "cpu")
        flat_w = weights.reshape(-1).float()
        ce.cpu_experts_forward(x, [(hd.gate_up, hd.down) for hd in handles], [sel // 2 for _, sel in groups],
                               [flat_w[sel] for _, sel in groups], out=by_handle)
        m.release(handles)
        assert torch.equal(fast, by_handle)
        assert compute._cpu_packed(layer, x, weights, 2, [(9, torch.tensor([0]))]) is None  # not in pinned RAM
        assert not m.pinned.refs
        # in the background (the kernel's launcher thread): the same sum; a second share started while the
        # first runs is computed at once in the caller; the slots stay held until each is waited for
        first = compute.start_cpu(layer, x, weights, 2, groups)
        second = compute.start_cpu(layer, x * 2, weights, 2, groups)
        assert m.pinned.refs
        assert torch.equal(first.wait(), by_handle)
        assert torch.equal(second.wait(), compute._cpu_packed(layer, x * 2, weights, 2, groups))
        assert not m.pinned.refs and compute.cpu_experts == 4 * len(groups)
    finally:
        m.close()


def _promote(store, device: str):
    """`promote` queues the move for a transfer worker: the caller returns before the copy is issued, the
    worker issues it without holding the manager's lock, and once settled the expert sits in a GPU slot with
    its exact bytes, the victim's map entry reads -1, and the device map agrees with the host mirror."""
    layer = store.index.moe_layers[0]
    n_experts = max(k[1] for k in store.keys()) + 1
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=n_experts), gpu_device=torch.device(device),
                    io_threads=2, policy="lfu")
    try:
        m.release(m.acquire([(layer, e) for e in range(n_experts)], "cpu"))
        m.release_staged(m.stage_gpu(layer, [0, 1, 2]))  # the GPU tier is full
        assert m.wait_settled(10)
        copy_in, free_during_copy = m.slots.copy_in, []

        def watched_copy_in(*args, **kw):  # can another thread take the manager's lock while the copy is issued?
            probe = threading.Thread(target=lambda: free_during_copy.append(m.lock.acquire(timeout=5) and
                                                                            (m.lock.release() or True)))
            probe.start()
            probe.join()
            return copy_in(*args, **kw)

        m.slots.copy_in = watched_copy_in
        with m.lock:  # a worker cannot run the promotion before this block ends: the call only queues it
            m.promote((layer, 5))
            assert (layer, 5) not in m.gpu.slot_of and m.jobs.queued()
        assert m.wait_settled(10) and (layer, 5) in m.gpu.slot_of
        assert free_during_copy == [True]  # issued after the worker let go of the lock (the decode thread needs it)
        slot = m.gpu.slot_of[(layer, 5)]
        gate_up, down = store.expert_views(store.read_expert((layer, 5)))
        got_gu, got_dn = store.expert_views(m.slots.view(slot))
        assert torch.equal(got_gu.cpu(), gate_up) and torch.equal(got_dn.cpu(), down)
        if m.slots.is_cuda:
            torch.cuda.synchronize()
        device_map = m.slots.slot_of.cpu().numpy()
        assert (device_map == m.slots.slot_of_host).all() and device_map[layer, 5] == slot
        assert sum(device_map[layer, e] >= 0 for e in (0, 1, 2)) == 2  # one of them was evicted for it
        promotions = m.stats()["promotions"]  # the worker's issue timed (host time the decoding thread may wait out)
        assert promotions["done"] == 1 and promotions["host_ms_each"] > 0
        assert m.slots.is_cuda or promotions["clears_behind_copy"] == 0  # no copy is ever in flight on a CPU slab
    finally:
        m.close()


@pytest.mark.gpu
def test_a_clear_behind_a_copy_in_flight_is_counted(store):
    """A victim whose own copy has not landed makes its clear's stream wait for that copy (the decode stream, for
    a promotion): `clears_behind_copy` counts it, and a clear after the copy has landed is not counted."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from strata.tiers.storage.gpu_slots import GpuSlots

    slots = GpuSlots(store.slot_bytes, 4, num_layers=2, num_experts=8, device=torch.device("cuda"))
    src = torch.zeros(store.slot_bytes, dtype=torch.uint8).pin_memory()
    with torch.cuda.stream(slots.copy_stream):
        torch.cuda._sleep(200_000_000)  # the copy stream busy for ~0.1 s: the load below stays in flight
    slots.load((0, 1), 0, src)
    slots.clear((0, 1))
    assert slots.clears_behind_copy == 1
    slots.load((0, 2), 1, src)
    torch.cuda.synchronize()
    slots.clear((0, 2))
    assert slots.clears_behind_copy == 1
    torch.cuda.synchronize()


def test_promote_cpu_slab(store):
    _promote(store, "cpu")


@pytest.mark.gpu
def test_promote_cuda(store):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _promote(store, "cuda")


def test_a_promotion_on_a_cpu_slab_waits_for_reads_of_unheld_slots(store):
    """Decode reads resident slots it holds no handle on (`pair_experts`); on a CPU-simulated GPU tier a
    promotion's eviction must not overwrite such a slot mid-read (no stream orders it, as on CUDA): inside
    `unheld_slot_reads` every mapped slot keeps its expert's bytes, and the promotion lands once it ends."""
    layer = store.index.moe_layers[0]
    n_experts = max(k[1] for k in store.keys()) + 1
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=n_experts), gpu_device=torch.device("cpu"),
                    io_threads=2, policy="lfu")
    try:
        m.release(m.acquire([(layer, e) for e in range(n_experts)], "cpu"))
        m.release_staged(m.stage_gpu(layer, [0, 1, 2]))  # the GPU tier is full
        assert m.wait_settled(10)
        before = {e: m.slots.view(m.gpu.slot_of[(layer, e)]).clone() for e in (0, 1, 2)}
        with m.unheld_slot_reads():  # a decode pass: its slot lookups done, its reads under way
            m.promote((layer, 5))
            time.sleep(0.2)  # a worker that could, would have evicted and overwritten a slot by now
            assert all((layer, e) in m.gpu.slot_of for e in (0, 1, 2)) and (layer, 5) not in m.gpu.slot_of
            for e in (0, 1, 2):
                assert torch.equal(m.slots.view(m.gpu.slot_of[(layer, e)]), before[e])
        assert m.wait_settled(10) and (layer, 5) in m.gpu.slot_of
        assert sum((layer, e) in m.gpu.slot_of for e in (0, 1, 2)) == 2  # one was evicted for it, afterwards
    finally:
        m.close()


@pytest.mark.parametrize("gpu_slots, experts, want", [(448, 448, 0), (500, 448, 0), (447, 448, 16), (100, 448, 6),
                                                      (15, 448, 0)])
def test_step_copy_slots_only_when_some_expert_can_be_cold(gpu_slots, experts, want):
    from strata.runtime.plan.build import step_copy_slots

    assert step_copy_slots(gpu_slots, experts) == want
