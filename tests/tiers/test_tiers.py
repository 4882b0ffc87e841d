"""The tier manager on a real store, on real disk and tmpfs: placement, movement, eviction, concurrency,
integrity, prefetch accounting, and a tiered engine equal to the all-in-memory one.

The GPU tier runs on a CPU slab here (same bookkeeping, plain copies); tests/tiers/test_gpu_tiers.py runs
it on CUDA.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from strata import CheckpointError, Engine
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierFullError, TierManager
from strata.tiers.store.store import ExpertStore

SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def store_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("store") / "tiny", progress=False)


@pytest.fixture()
def store(store_dir):
    s = ExpertStore.open(store_dir)
    yield s
    s.close()


def make_manager(store, gpu=0, pinned=8, policy="lru", **kw) -> TierManager:
    return TierManager(store, TierBudgets(gpu_slots=gpu, pinned_slots=pinned, **kw.pop("budgets", {})),
                       gpu_device=torch.device("cpu") if gpu else None, policy=policy, io_threads=4, **kw)


def reference(store, key):
    gate_up, down = store.expert_views(store.read_expert(key))
    return gate_up.clone(), down.clone()


def assert_handle_matches(store, h):
    gate_up, down = reference(store, h.key)
    assert torch.equal(h.gate_up.cpu(), gate_up) and torch.equal(h.down.cpu(), down)


@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "cost"])
def test_budgets_hold_and_every_copy_is_right(store, policy):
    m = make_manager(store, gpu=5, pinned=20, policy=policy)
    try:
        keys = store.keys()
        rng = random.Random(0)
        for _ in range(60):
            batch = rng.sample(keys, 4)
            for device in ("gpu", "cpu"):
                handles = m.acquire(batch, device)
                for h in handles:
                    assert_handle_matches(store, h)
                m.release(handles)
            s = m.stats()
            assert s["tiers"]["gpu"]["resident"] <= 5 and s["tiers"]["pinned"]["resident"] <= 20
        s = m.stats()
        assert s["tiers"]["gpu"]["evictions"] > 0 and s["tiers"]["pinned"]["evictions"] > 0
        assert s["lookups"] == 60 * 8
        assert s["paths"]["disk->pinned"]["objects"] > 0 and s["paths"]["pinned->gpu"]["objects"] > 0
        assert set(s["hit_rate"]) <= {"gpu", "pinned", "disk", "tmpfs"}
        assert abs(sum(s["hit_rate"].values()) - 1.0) < 1e-9
    finally:
        m.close()


def test_gpu_slot_map_follows_residency(store):
    m = make_manager(store, gpu=3, pinned=4)
    try:
        handles = m.acquire([(1, 0), (1, 5), (2, 7)], "gpu")
        slot_of = m.slots.slot_of_host
        for h in handles:
            assert slot_of[h.key] == h.slot
        m.release(handles)
        m.release(m.acquire([(2, 1), (2, 2), (2, 3)], "gpu"))  # evicts all three
        assert slot_of[1, 0] == -1 and slot_of[1, 5] == -1 and slot_of[2, 7] == -1
        assert sorted(m.residency((2, 1))) == sorted(["gpu", "pinned", "disk"])
    finally:
        m.close()


def test_nothing_in_use_is_evicted_and_full_tier_is_an_error(store):
    m = make_manager(store, gpu=0, pinned=4)
    try:
        held = m.acquire([(1, 0), (1, 1), (1, 2), (1, 3)], "cpu")
        with pytest.raises(TierFullError, match="pinned"):
            m.acquire([(1, 4)], "cpu")
        for h in held:  # still intact after the failed attempt
            assert_handle_matches(store, h)
        m.prefetch([(2, 0)], "cpu")  # best effort: silently skipped, nothing evicted
        assert m.stats()["tiers"]["pinned"]["evictions"] == 0
        m.release(held)
        m.release(m.acquire([(1, 4)], "cpu"))
        assert m.stats()["tiers"]["pinned"]["evictions"] == 1
    finally:
        m.close()


def test_concurrent_acquires_share_transfers_and_never_see_evicted_data(store):
    m = make_manager(store, gpu=16, pinned=24, policy="lfu")
    errors: list[BaseException] = []
    keys = store.keys()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                batch = rng.sample(keys, 2)
                device = rng.choice(["gpu", "cpu"])
                if rng.random() < 0.3:
                    m.prefetch(rng.sample(keys, 2), device)
                try:
                    handles = m.acquire(batch, device)
                except TierFullError:
                    continue  # a clear refusal when every slot is held, never corruption
                for h in handles:
                    assert_handle_matches(store, h)
                m.release(handles)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors[0]
        s = m.stats()
        assert s["lookups"] > 200
    finally:
        m.close()


def test_no_double_transfer(store):
    """Many simultaneous requests for the same cold object cause exactly one disk read."""
    m = make_manager(store, gpu=0, pinned=32)
    try:
        barrier = threading.Barrier(16)

        def grab():
            barrier.wait()
            m.release(m.acquire([(2, 9)], "cpu"))

        threads = [threading.Thread(target=grab) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert m.stats()["paths"]["disk->pinned"]["objects"] == 1
        assert m.stats()["lookups"] == 16
    finally:
        m.close()


def test_prefetch_accounting_and_async_acquire(store):
    m = make_manager(store, gpu=0, pinned=4)
    try:
        m.prefetch([(1, 0), (1, 1)], "cpu")
        handles = asyncio.run(m.acquire_async([(1, 0)], "cpu"))
        assert_handle_matches(store, handles[0])
        m.release(handles)
        m.release(m.acquire([(2, 0), (2, 1), (2, 2), (2, 3)], "cpu"))  # pushes (1, 1) out unused
        p = m.stats()["prefetch"]
        assert p["issued"] == 2 and p["used"] == 1 and p["unused"] >= 1
        assert 0 < p["precision"] <= 0.5
    finally:
        m.close()


def test_per_layer_budgets(store):
    m = make_manager(store, gpu=0, pinned=8, budgets={"per_layer": True})
    try:
        assert m.max_acquire("cpu") == 4
        for e in range(8):
            m.release(m.acquire([(1, e)], "cpu"))
        m.release(m.acquire([(2, 0)], "cpu"))
        layers = [k[0] for k in m.pinned.slot_of]
        assert layers.count(1) <= 4 and layers.count(2) >= 1
    finally:
        m.close()


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_corruption_is_detected_on_first_read(store_dir, tmp_path, where):
    root = SHM if where == "tmpfs" else tmp_path
    if where == "tmpfs" and not SHM.is_dir():
        pytest.skip("no /dev/shm")
    bad = Path(shutil.copytree(store_dir, root / f"strata-test-corrupt-{os.getpid()}"))
    try:
        s = ExpertStore.open(bad)
        path, offset, _ = s.location((2, 3))
        with open(path, "r+b") as f:
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        m = make_manager(s, gpu=0, pinned=8)
        try:
            with pytest.raises(CheckpointError, match=r"layer 2.*expert 3|\(2, 3\)"):
                m.acquire([(2, 3)], "cpu")
            assert m.stats()["checksum_failures"] == 1
            m.release(m.acquire([(2, 4)], "cpu"))  # other objects still served
        finally:
            m.close()
            s.close()
    finally:
        shutil.rmtree(bad, ignore_errors=True)


def test_tmpfs_mirror_serves_reads(store):
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    root = SHM / f"strata-test-mirror-{os.getpid()}"
    m = make_manager(store, gpu=0, pinned=32, budgets={"tmpfs_bytes": 1 << 30}, tmpfs_dir=root)
    try:
        assert m.tmpfs.wait(timeout=30)
        handles = m.acquire([(1, 2), (2, 2)], "cpu")
        for h in handles:
            assert_handle_matches(store, h)
        m.release(handles)
        s = m.stats()
        assert s["paths"]["tmpfs->pinned"]["objects"] == 2 and "disk->pinned" not in s["paths"]
        assert s["tiers"]["tmpfs"]["resident"] == 32
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "cost"])
def test_tiered_engine_equals_memory_engine(tiny_model_dir, policy):
    memory = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"experts": "memory"}})
    cfg = {"tiers": {"pinned": {"budget": str(4 * 12288)}}, "policy": {"eviction": policy},
           "runtime": {"cpu_numerics": "gpu"}}  # the reference math: bit-identical
    with Engine.from_pretrained(tiny_model_dir, device="cpu", config=cfg) as tiered:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        assert torch.equal(tiered.score(ids), memory.score(ids))
        assert tiered.generate(ids, max_tokens=12).token_ids == memory.generate(ids, max_tokens=12).token_ids
        stats = tiered.stats()
        assert stats["experts"] == "tiered" and stats["tiers"]["tiers"]["pinned"]["capacity"] == 4
        assert stats["tiers"]["tiers"]["pinned"]["evictions"] > 0
        assert stats["tiers"]["prefetch"]["issued"] > 0


def test_engine_accepts_a_store_directory(store_dir, tiny_model_dir):
    memory = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"experts": "memory"}})
    with Engine.from_pretrained(store_dir, device="cpu", config={"runtime": {"cpu_numerics": "gpu"}}) as from_store:
        ids = memory.tokenizer.encode("hello there")
        assert torch.equal(from_store.score(ids), memory.score(ids))


def test_fork_numerics_use_the_cpu_kernel_within_tolerance(tiny_model_dir):
    """The default CPU path (compiled bf16 kernel) stays within its tolerance of the reference."""
    memory = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"experts": "memory"}})
    with Engine.from_pretrained(tiny_model_dir, device="cpu") as fast:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        assert (fast.score(ids) - memory.score(ids)).abs().max().item() < 2e-2


def test_table_rows_through_the_manager(store_dir, tmp_path):
    from strata.tiers.store.writer import add_table

    d = Path(shutil.copytree(store_dir, tmp_path / "with-table"))
    table = torch.randint(0, 256, (20_000, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    add_table(d, "ngram", table)
    s = ExpertStore.open(d)
    m = make_manager(s, gpu=0, pinned=4)
    try:
        rows = torch.randint(0, 20_000, (3000,), generator=torch.Generator().manual_seed(1))
        got = m.fetch_rows("ngram", rows).result(timeout=30)
        assert torch.equal(got, table[rows])
        assert m.stats()["paths"]["rows:ngram"]["bytes"] == 3000 * 48
    finally:
        m.close()
        s.close()


def test_background_scrub_finds_damage(store_dir, tmp_path):
    d = Path(shutil.copytree(store_dir, tmp_path / "scrub"))
    s = ExpertStore.open(d)
    path, offset, _ = s.location((1, 11))
    with open(path, "r+b") as f:
        f.seek(offset + 7)
        old = f.read(3)
        f.seek(offset + 7)
        f.write(bytes(b ^ 0x5A for b in old))
    m = make_manager(s, gpu=0, pinned=4)
    try:
        assert m.scrub().result(timeout=60) == [(1, 11)]
        stats = m.stats()
        assert stats["damaged"] == [[1, 11]] and stats["checksum_failures"] == 1
    finally:
        m.close()
        s.close()


def test_a_full_tier_waits_for_another_thread_to_release(store):
    """The CPU expert worker holding every pinned slot must not make the compute thread fail: it waits."""
    m = make_manager(store, gpu=0, pinned=4)
    try:
        held = m.acquire([(1, 0), (1, 1), (1, 2), (1, 3)], "cpu")
        releaser = threading.Timer(0.3, m.release, args=(held,))
        got: list = []
        worker = threading.Thread(target=lambda: got.append(m.acquire([(1, 4)], "cpu")))
        releaser.start()
        worker.start()
        worker.join(timeout=20)
        assert got and got[0][0].key == (1, 4)
        assert_handle_matches(store, got[0][0])
        m.release(got[0])
    finally:
        m.close()


def test_wait_settled_covers_background_placement(store):
    """The start-up placement runs in the background; `wait_settled` returns once every queued read has
    landed (what benchmarks wait for before timing), and `pending_work` counts what is left."""
    m = make_manager(store, gpu=2, pinned=32)
    try:
        keys = sorted(store.keys(), key=lambda k: (k[1], k[0]))
        m.prefetch(keys, "cpu", warm=True)
        m.prefetch(keys[:2], "gpu", warm=True)
        assert m.wait_settled(timeout=60)
        assert m.pending_work() == 0 and m.stats()["pending_work"] == 0
        assert all("pinned" in m.residency(k) for k in keys)  # every read really landed
        assert all("gpu" in m.residency(k) for k in keys[:2])
    finally:
        m.close()


def test_all_resident_waits_for_the_last_copy_to_land(store):
    """A decode step that believes every expert resident skips its cold path, so `all_resident` must not say
    so while a copy (and the map entry written after it on the copy stream) is still on its way: on CUDA the
    copy leaves `inflight` as soon as it is enqueued."""
    keys = store.keys()
    m = make_manager(store, gpu=len(keys), pinned=0)
    try:
        m.place(keys, "gpu")
        assert m.wait_settled(60) and m.all_resident()

        class Pending:  # a copy batch's end event that the device has not reached yet
            done = False

            def query(self):
                return self.done

            def elapsed_time(self, other):
                return 1.0

        end = Pending()
        with m.lock:
            m.copies.add(Pending(), end, [])
        assert not m.all_resident()
        end.done = True
        assert m.all_resident()
    finally:
        m.close()


def test_initial_placement_fills_a_gpu_tier_through_few_staging_slots(store):
    """A GPU budget that holds every expert leaves the pinned tier its 16 staging slots only: placement
    waits for them to come free and goes on (`prefetch` stops at the first key with no room), so the GPU
    tier ends up holding every expert, each copy intact."""
    keys = store.keys()
    assert len(keys) > 16
    m = make_manager(store, gpu=len(keys), pinned=0)
    try:
        assert m.pinned.capacity < len(keys)
        m.place(keys, "gpu")
        assert m.wait_settled(60)
        assert set(m.gpu.slot_of) == set(keys) and m.all_resident()
        handles = m.acquire(keys, "gpu")
        try:
            for h in handles:
                h.wait()
                assert_handle_matches(store, h)
        finally:
            m.release(handles)
    finally:
        m.close()


def test_close_waits_for_initial_placement_to_stop(store, caplog):
    """A placement thread waiting for room when the manager closes has returned when `close` does: it would
    otherwise copy into freed memory, or be stopped inside torch at interpreter exit (which aborts the process). One
    that does not stop in time is reported."""
    m = make_manager(store, pinned=2)
    keys, n = store.keys(), m.pinned.capacity
    held = m.acquire(keys[:n], "cpu")  # every pinned slot in use: placing one more waits for room
    m.place(keys[n : n + 1], "cpu")
    assert any(t.name == "strata-placement" for t in threading.enumerate())
    with caplog.at_level("WARNING", logger="strata.tiers"):
        m.placer.wait_stopped(timeout=0.1)  # the jobs still open: the thread goes on waiting, and the log says so
    assert any("placement thread(s) still running" in r.message for r in caplog.records)
    m.close()
    assert not any(t.name == "strata-placement" for t in threading.enumerate())
    del held


def test_close_keeps_the_pinned_pool_while_a_copy_out_of_it_is_in_flight(store, caplog, monkeypatch):
    """A tier worker still inside a copy out of the pinned pool (an initial placement's, pinned -> GPU tier) when
    `close` stops waiting for it: the pool is not freed under the copy (the log says it stays), and the copy, let go
    afterwards, lands the expert's bytes."""
    m = make_manager(store, gpu=2, pinned=8)
    entered, go, copied = threading.Event(), threading.Event(), []
    copy_in = m.slots.copy_in

    def held_copy(slot, src, *args, **kw):  # the worker's copy, held until the test lets it go
        entered.set()
        go.wait(10)
        event = copy_in(slot, src, *args, **kw)
        copied.append(slot)
        return event

    monkeypatch.setattr(m.slots, "copy_in", held_copy)
    key = store.keys()[0]
    m.place([key], "gpu")
    assert entered.wait(10)
    with caplog.at_level("WARNING", logger="strata.tiers"):
        m.close(timeout=0.1)
    assert "stays allocated" in caplog.text
    go.set()
    deadline = time.monotonic() + 10
    while not copied and time.monotonic() < deadline:
        time.sleep(0.01)
    assert copied, "the held copy never ran"
    assert torch.equal(m.slots.slab[copied[0]], store.read_expert(key)[: store.slot_bytes])
    m.pool.close()
