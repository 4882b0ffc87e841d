"""Engram: hashing and layer outputs equal the plain reference (tests/support/engram_reference.py); the tiered
row store equals the in-memory tables in every tier; damaged tables stop start-up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import engram_reference as ref
import numpy as np
import pytest
import torch

from strata import Engine
from strata.errors import CheckpointError
from strata.runtime.generation.sampler import SamplingParams
from strata.runtime.generation.scheduler import GenRequest
from strata.runtime.model.engram.hashing import EngramConfig, NgramHasher
from strata.runtime.model.kv_cache import KVCache, StepBatch
from strata.tiers.rows.cache import RowCache

PROMPTS = [list(range(5, 45)), [7, 7, 7, 300, 12, 99, 7, 7, 301, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def hf_cfg(tiny_model_dir) -> dict:
    return json.loads((tiny_model_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def memory_engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, config={"runtime": {"experts": "memory", "dtype": "float32"}},
                                  device="cpu")


def _layer_weights(engine, layer: int) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in engine.model.layers[layer].engram.state_dict().items()}


def _capture(model) -> tuple[list, callable]:
    """Record (input x, Engram output) of every Engram layer call; returns the log and a remover."""
    log = []
    hooks = [layer.engram.register_forward_hook(lambda m, args, out: log.append((m.layer, args[0].clone(), out.clone())))
             for layer in model.layers if layer.engram is not None]
    return log, lambda: [h.remove() for h in hooks]


def _engram_outputs(engine, ids: list[int]) -> list:
    """(layer, x, Engram output) of every Engram layer call while `engine` scores `ids`."""
    log, remove = _capture(engine.model)
    try:
        engine.score(ids)
    finally:
        remove()
    return log


def _scheduler_decode(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy-decode `prompts` together through the scheduler (two at a time); their token ids."""
    sched = engine.scheduler(max_batch=2, token_budget=16)
    sched.start()
    try:
        handles = [sched.submit(GenRequest(p, SamplingParams(max_tokens=max_tokens))) for p in prompts]
        events = [list(h.iter_events(timeout=120)) for h in handles]
        errors = [ev.error for evs in events for ev in evs if getattr(ev, "error", None)]
        assert not errors, errors
        return [[ev.token_id for ev in evs if ev.token_id is not None] for evs in events]
    finally:
        sched.stop()


def test_hash_equals_reference_with_history(hf_cfg, memory_engine):
    cfg = hf_cfg["engram"]
    token_map = memory_engine.model.engram.token_map.cpu().numpy()
    hasher = NgramHasher(EngramConfig(**cfg), torch.from_numpy(token_map))
    ids = torch.randint(0, hf_cfg["vocab_size"], (37,), generator=torch.Generator().manual_seed(3))
    for layer in cfg["layer_ids"]:
        want = torch.from_numpy(ref.hash_ids(cfg, token_map, ids.numpy(), layer))
        assert torch.equal(hasher.rows(layer, hasher.grams(ids, ids[:0])), want)
        for cut in (1, 2, 10):  # a later chunk sees the tokens before it, not padding
            got = hasher.rows(layer, hasher.grams(ids[cut:], ids[:cut]))
            assert torch.equal(got, want[cut:])
        sizes = EngramConfig(**cfg).table_sizes(layer)
        assert sizes == ref.table_sizes(cfg)[layer] and len(set(sizes)) == len(sizes)


def _run_chunked_batched(engine, prompts, chunk, decode_steps):
    """Prefill `prompts` in chunks, two sequences per StepBatch, then decode greedily; returns each
    sequence's token ids and, per Engram layer, its x and output rows in order."""
    model, cfg = engine.model, engine.checkpoint.config
    cache = KVCache(cfg, len(prompts), 128, engine.dtype, engine.device)
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)
    log, remove = _capture(model)
    per_seq = {i: {layer: ([], []) for layer in cfg.engram.layer_ids} for i in range(len(prompts))}
    with torch.inference_mode():
        while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
            step_plan = [(i, done[i], prompts[i][done[i] : done[i] + chunk]) for i in range(len(prompts)) if done[i] < len(prompts[i])]
            _step(model, cache, step_plan, log, per_seq)
            for i, _, piece in step_plan:
                done[i] += len(piece)
        for _ in range(decode_steps):
            plan = []
            for i in range(len(prompts)):
                tok = int(model.logits(_last_hidden[i]).argmax())
                seqs[i].append(tok)
                plan.append((i, len(seqs[i]) - 1, [tok]))
            _step(model, cache, plan, log, per_seq)
    remove()
    return seqs, per_seq


_last_hidden: dict = {}  # sequence -> hidden state of its last fed token [1, H]


def _step(model, cache, plan, log, per_seq):
    ids = torch.tensor([t for _, _, p in plan for t in p])
    batch = StepBatch([i for i, _, _ in plan], [s for _, s, _ in plan], [len(p) for _, _, p in plan])
    log.clear()
    hidden = model(ids, batch, cache)
    for (i, _, _), row in zip(plan, batch.last_token_rows(), strict=True):
        _last_hidden[i] = hidden[row : row + 1]
    for layer, x, out in log:
        for (i, _, _), off, n in zip(plan, batch.offsets, batch.lengths, strict=True):
            per_seq[i][layer][0].append(x[off : off + n])
            per_seq[i][layer][1].append(out[off : off + n])


@pytest.mark.parametrize("prompts", [PROMPTS, [[42], PROMPTS[1][:2], PROMPTS[0]]], ids=["long", "starts"])
def test_chunked_batched_decode_equals_reference(hf_cfg, memory_engine, prompts):
    """Decode steps take the vectorised host path (`host_decode_inputs`); "starts" decodes right after
    1- and 2-token prompts, where the n-grams reach back before the sequence start (padding)."""
    cfg = hf_cfg["engram"]
    token_map = memory_engine.model.engram.token_map.cpu().numpy()
    seqs, per_seq = _run_chunked_batched(memory_engine, prompts, chunk=7, decode_steps=5)
    for i, ids in enumerate(seqs):
        for layer in cfg["layer_ids"]:
            x = torch.cat(per_seq[i][layer][0])
            got = torch.cat(per_seq[i][layer][1])
            assert x.shape[0] == len(ids)
            want = ref.engram_output(cfg, token_map, ids, x, layer, _layer_weights(memory_engine, layer))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture()
def shm_dir():
    """A fresh directory in the host's tmpfs (/dev/shm): the planner only puts tables in a RAM filesystem."""
    import tempfile

    from strata.runtime.plan.host import probe_host

    if not Path("/dev/shm").is_dir() or probe_host("/dev/shm", "/tmp").tmpfs_free == 0:
        pytest.skip("no tmpfs at /dev/shm")
    d = tempfile.mkdtemp(prefix="strata-test-engram-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("tier", ["pinned", "tmpfs", "disk"])
def test_tiered_rows_equal_memory_tables(tiny_model_dir, memory_engine, shm_dir, tier):
    # a row cache of 16 rows and reads of 5 rows: prompts span many read batches and evict constantly
    conf = {"runtime": {"dtype": "float32"}, "engram": {"tier": tier, "row_cache": "256B"},
            "debug": {"engram_read_batch": 5}, "tiers": {"disk": {"scrub": False}, "tmpfs": {"path": shm_dir}}}
    with Engine.from_pretrained(tiny_model_dir, config=conf, device="cpu") as eng:
        ids = PROMPTS[0] + PROMPTS[1]
        for (la, _, oa), (lb, _, ob) in zip(_engram_outputs(memory_engine, ids), _engram_outputs(eng, ids), strict=True):
            assert la == lb
            torch.testing.assert_close(ob, oa, rtol=1e-5, atol=1e-6)
        # batched greedy decode through the scheduler equals solo decode on the in-memory tables
        got = _scheduler_decode(eng, PROMPTS, max_tokens=6)
        want = [memory_engine.generate(p, max_tokens=6).token_ids for p in PROMPTS]
        assert got == want
        st = eng.model.engram.stats()
        assert st["tier"] == tier and st["lookups"] > 0 and st["hits"].get(tier, 0) > 0
        if tier != "pinned":  # CPU-only: the pinned tier is RAM already, no cache in front of it
            assert st["cache_evictions"] > 0 and st["hits"].get("cache", 0) > 0


def _admit(cache: RowCache, rows: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
    """Place `rows` and write their data (row id in every column), as the row store does."""
    slots = cache.place(rows, protect)
    ok = slots >= 0
    cache.slab[slots[ok]] = rows[ok][:, None].float().expand(-1, 4)
    return slots


def test_row_cache_keeps_hot_rows():
    cache = RowCache(total_rows=10_000, capacity=64, dim=4, dtype=torch.float32, device=torch.device("cpu"))
    hot = torch.arange(8)
    none = torch.empty(0, dtype=torch.int64)
    _admit(cache, hot, none)
    rng = np.random.default_rng(0)
    for _ in range(200):
        cache.lookup(hot)  # the head is used every step
        cold = torch.from_numpy(rng.choice(np.arange(100, 10_000), 16, replace=False))
        slots = cache.lookup(cold)
        _admit(cache, cold[slots < 0], none)
    slots = cache.lookup(hot)
    assert bool((slots >= 0).all())
    assert torch.equal(cache.slab[slots][:, 0], hot.float())
    assert cache.evictions > 0


def test_row_cache_place_keeps_present_rows_and_protected_slots():
    """`place` returns a present row's own slot, new slots for absent ones, -1 where no room is left
    without evicting protected slots; bookkeeping stays a bijection."""
    cache = RowCache(total_rows=1000, capacity=8, dim=4, dtype=torch.float32, device=torch.device("cpu"))
    first = _admit(cache, torch.arange(6), torch.empty(0, dtype=torch.int64))
    assert sorted(first.tolist()) == sorted(set(first.tolist())) and bool((first >= 0).all())
    again = cache.place(torch.tensor([3, 100, 101]), first)  # 3 is present; 2 free slots for 100, 101
    assert again[0] == first[3] and bool((again[1:] >= 0).all()) and not set(again[1:].tolist()) & set(first.tolist())
    full = cache.place(torch.tensor([200, 201]), torch.cat([first, again[1:]]))  # all 8 slots protected
    assert full.tolist() == [-1, -1]
    later = _admit(cache, torch.tensor([300]), first)  # may evict only 100 or 101
    assert int(later[0]) in again[1:].tolist()
    for row, slot in ((r, int(cache.slot_of[r])) for r in (*range(6), 300)):
        assert int(cache.row_of[slot]) == row and cache.slab[slot, 0] == row


def _store_of(engine) -> str:
    return engine.checkpoint.directory


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_damaged_table_stops_startup(tiny_model_dir, tmp_path, damage):
    with Engine.from_pretrained(tiny_model_dir, config={"tiers": {"disk": {"scrub": False}}}, device="cpu") as e:
        store = tmp_path / "store"
        shutil.copytree(_store_of(e), store)
    table = store / "tables" / "engram.1.bin"
    if damage == "flip":
        data = bytearray(table.read_bytes())
        data[100] ^= 0xFF
        table.write_bytes(bytes(data))
    elif damage == "truncate":
        with open(table, "r+b") as f:
            f.truncate(table.stat().st_size - 4096)
    else:
        table.unlink()
    conf = {"engram": {"tier": "disk"}, "tiers": {"disk": {"scrub": False}}}
    with pytest.raises(CheckpointError, match="engram.1"):
        Engine.from_pretrained(store, config=conf, device="cpu")


def test_no_engram_demo(tmp_path):
    from strata.runtime.demo.model import demo_config, write_demo_model
    from strata.tiers.store.safetensors_index import TensorIndex

    assert "engram" not in demo_config("tiny", engram=False)
    out = write_demo_model(tmp_path / "plain", "tiny", progress=False, engram=False)
    assert not any(".engram." in n or n.startswith("model.engram") for n in TensorIndex.from_dir(out).names())
    assert Engine.from_pretrained(out, device="cpu").model.engram is None


@pytest.mark.gpu
@pytest.mark.parametrize("tier, zero_copy", [("gpu", True), ("pinned", True), ("pinned", False), ("tmpfs", True),
                                             ("tmpfs", False), ("disk", True)])
def test_gpu_tiers_equal_memory(tiny_model_dir, shm_dir, tier, zero_copy):
    mem = Engine.from_pretrained(tiny_model_dir, config={"runtime": {"experts": "memory", "dtype": "float32"}}, device="cuda")
    conf = {"runtime": {"dtype": "float32"}, "tiers": {"disk": {"scrub": False}, "tmpfs": {"path": shm_dir}},
            "engram": {"tier": tier, "row_cache": "512B"},
            "debug": {"engram_read_batch": 5, "engram_zero_copy": zero_copy}}
    with Engine.from_pretrained(tiny_model_dir, config=conf, device="cuda") as eng:
        # pinned and tmpfs tables are read in place by the GPU (no row cache) unless zero_copy is off
        assert eng.model.engram.stats()["zero_copy"] == (tier in ("pinned", "tmpfs") and zero_copy)
        for (_, _, oa), (_, _, ob) in zip(_engram_outputs(mem, PROMPTS[0]), _engram_outputs(eng, PROMPTS[0]), strict=True):
            torch.testing.assert_close(ob, oa, rtol=1e-4, atol=1e-5)
        got = _scheduler_decode(eng, PROMPTS, max_tokens=6)
        assert got == [mem.generate(p, max_tokens=6).token_ids for p in PROMPTS]


@pytest.mark.gpu
def test_device_view_reads_and_sees_pinned_memory():
    """`device_view` aliases pinned RAM: the same address, gathers on the GPU equal the host's, later host
    writes are seen; pageable memory gets no view."""
    from strata.tiers.storage.uva import device_view

    dev = torch.device("cuda", torch.cuda.current_device())
    host = torch.arange(4096 * 16, dtype=torch.float32).view(4096, 16).to(torch.bfloat16).pin_memory()
    view = device_view(host, dev)
    assert view is not None and view.is_cuda and view.data_ptr() == host.data_ptr()
    assert device_view(host, torch.device("cuda")) is not None  # an unindexed device means the current card
    assert view.shape == host.shape and view.dtype == host.dtype
    idx = torch.randint(0, 4096, (333,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(view[idx.to(dev)].cpu(), host[idx])
    host[idx[0]] = -1.0
    torch.cuda.synchronize()
    assert torch.equal(view[idx[0]].cpu(), host[idx[0]])
    assert device_view(torch.zeros(16), dev) is None  # not page-locked
    assert device_view(host, torch.device("cpu")) is None


def test_device_view_is_none_without_cuda(tmp_path):
    from strata.tiers.storage.uva import device_view, register_file

    assert device_view(torch.zeros(8), torch.device("cpu")) is None
    if not torch.cuda.is_available():
        (tmp_path / "t.bin").write_bytes(bytes(64))
        assert register_file(str(tmp_path / "t.bin"), 64) is None


@pytest.mark.gpu
def test_registered_tmpfs_file_is_read_in_place(tmp_path):
    """A file mapped and page-locked (`register_file`) is gathered by the GPU straight from its pages."""
    import os

    from strata.tiers.storage.uva import device_view, register_file

    root = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(root, f"strata-test-uva-{os.getpid()}.bin")
    data = torch.randint(-1000, 1000, (2048, 32), dtype=torch.int16, generator=torch.Generator().manual_seed(3))
    Path(path).write_bytes(data.numpy().tobytes())
    dev = torch.device("cuda", torch.cuda.current_device())
    reg = register_file(path, data.numel() * 2)
    try:
        assert reg is not None
        view = device_view(reg.tensor.view(torch.int16).view(2048, 32), dev)
        assert view is not None and view.is_cuda
        idx = torch.randint(0, 2048, (100,), generator=torch.Generator().manual_seed(4))
        assert torch.equal(view[idx.to(dev)].cpu(), data[idx])
        torch.cuda.synchronize()
    finally:
        if reg is not None:
            reg.close()
        os.unlink(path)


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole-step", "segmented"])
def test_decode_graph_rows_from_the_host_cache_by_slot(tiny_model_dir, memory_engine, per_layer):
    """What a decode graph does with tables on disk (the host row cache read in place): the host finishes
    each step (reads into the cache, a slot per asked-for row) and the graph gathers by slot. Rows equal
    the in-memory tables step after step while the small cache evicts; a cache too small for one step's
    rows is refused before anything is consumed. Segmented: the host finishes one layer at a time, right
    before it (`publish`), the later layers' reads still in flight and their hits protected."""
    from strata.runtime.model.engram.static import StaticEngramStep

    cfg = memory_engine.checkpoint.config
    conf = {"engram": {"tier": "disk", "row_cache": "2KiB"}, "debug": {"engram_read_batch": 7},
            "tiers": {"disk": {"scrub": False}}}
    with Engine.from_pretrained(tiny_model_dir, config=conf, device="cpu") as eng:
        rt, ref_rt = eng.model.engram, memory_engine.model.engram
        store = rt.source
        assert store.gather_view is not None and store.stats()["cache_in"] is not None
        caches = [KVCache(cfg, 3, 64, eng.dtype, "cpu") for _ in range(2)]
        g = torch.Generator().manual_seed(0)
        statics, evictions = None, 0
        for pos in range(12):  # three sequences decoding from their start, one token each per step
            ids = torch.randint(3, cfg.vocab_size, (3,), generator=g)
            batch = StepBatch([0, 1, 2], [pos] * 3, [1, 1, 1])
            step = rt.begin(ids, batch, caches[0], eng.model.layers)
            want = ref_rt.begin(ids, StepBatch([0, 1, 2], [pos] * 3, [1, 1, 1]), caches[1], memory_engine.model.layers)
            if statics is None:
                statics = StaticEngramStep(step)  # the capture: built from the first step
                statics._per_layer = per_layer  # as a segmented capture sets it
            else:
                statics.bind(step)  # every later step: slots uploaded, rows gathered "in the graph"
            for layer in cfg.engram.layer_ids:
                if per_layer and pos:
                    statics.publish(layer)  # the host step before the layer
                got = statics.rows(layer)
                torch.testing.assert_close(got, want.rows(layer).to(got.dtype), rtol=0, atol=0)  # bf16 tables: exact
            statics.replayed()
            evictions = store.stats()["cache_evictions"]
        assert evictions > 0  # 2 KiB of rows: the cache turned over while the steps stayed right
        big = rt.begin(torch.arange(3, 3 + 48), StepBatch([0], [0], [48]), caches[0], eng.model.layers)
        with pytest.raises(RuntimeError, match="row_cache"):
            big.finish()
        assert big.tickets  # nothing consumed: the step can still run eagerly
        for layer in list(big.tickets):
            assert big.rows(layer).shape[0] == 48
        # a graph for a batch whose rows could outgrow the cache is refused at capture (that shape runs eagerly)
        wide = KVCache(cfg, 40, 64, eng.dtype, "cpu")
        many = rt.begin(torch.arange(3, 43), StepBatch(list(range(40)), [0] * 40, [1] * 40), wide, eng.model.layers)
        with pytest.raises(RuntimeError, match="row_cache"):
            StaticEngramStep(many)
        assert many.tickets
