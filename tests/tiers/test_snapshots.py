"""What callers outside the tier manager read instead of its maps: `usable_keys`, `pinned_addresses`,
`lookup_counts` and `lock`, on a real store (the GPU tier on a CPU slab)."""

from __future__ import annotations

import threading

import pytest
import torch

from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore


@pytest.fixture(scope="module")
def store(tiny_model_dir, tmp_path_factory):
    s = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("store") / "tiny", progress=False))
    yield s
    s.close()


@pytest.fixture()
def manager(store):
    m = TierManager(store, TierBudgets(gpu_slots=4, pinned_slots=8), gpu_device=torch.device("cpu"), policy="lru",
                    io_threads=2)
    yield m
    m.close()


def test_usable_keys_and_addresses_follow_the_maps(store, manager: TierManager):
    m = manager
    keys = store.keys()[:3]
    m.release(m.acquire(keys, "gpu"))
    usable = m.usable_keys()
    assert set(usable) == {"gpu", "pinned"} and usable["gpu"] == set(keys) and usable["pinned"] == set(keys)
    addresses = m.pinned_addresses()
    assert set(addresses) == set(keys)
    assert sorted(addresses.values()) == sorted(m.pool.slot_address(s) for s in m.hold_resident(keys))
    m.drop_held(keys)
    cold = store.keys()[5]
    with m.lock:  # the read lands on a worker, which needs the lock to mark it landed: it stays in flight here
        m.prefetch([cold], "cpu")
        assert cold in m.pinned.slot_of and cold not in m.usable_keys()["pinned"]
        assert m.residency(cold) == ["disk"]
    assert m.wait_settled(10) and cold in m.usable_keys()["pinned"]


def test_lookup_counts_are_copies_of_the_counters(store, manager: TierManager):
    m = manager
    layer = store.keys()[0][0]
    m.release(m.acquire([(layer, 0), (layer, 1)], "cpu"))
    m.note_hits(layer, [1, 1, 2], "gpu")
    experts, layers = m.lookup_counts()
    assert experts == {(layer, 0): 1, (layer, 1): 3, (layer, 2): 1} and layers == {layer: 5}
    experts[(layer, 0)] = 99
    assert m.lookup_counts()[0][(layer, 0)] == 1
    assert m.stats()["layers"][layer]["lookups"] == 5


def test_lookup_sources_run_under_the_manager_lock(manager: TierManager):
    """`stats()` drains lookup sources holding `lock`: a caller with a lock of its own that a source also takes
    (the mailbox books) takes `lock` first, or the two deadlock."""
    m, seen = manager, []

    def source():
        acquired = [None]
        other = threading.Thread(target=lambda: acquired.__setitem__(0, m.lock.acquire(timeout=0.05)))
        other.start()
        other.join()
        if acquired[0]:
            m.lock.release()
        seen.append(acquired[0])
        return []

    m.add_lookup_source(source)
    m.stats()
    m.remove_lookup_source(source)
    m.stats()
    assert seen == [False]  # another thread could not take the lock while the source ran, and it ran once


def test_a_manager_without_gpu_slots_has_only_the_pinned_tier(store):
    m = TierManager(store, TierBudgets(gpu_slots=0, pinned_slots=4), io_threads=1)
    try:
        m.release(m.acquire([store.keys()[0]], "cpu"))
        assert set(m.usable_keys()) == {"pinned"} and m.stream_slots == [] and m.gpu is None
    finally:
        m.close()

