"""The Engram rows' handshake (strata.tiers.rows.handshake): a decode step posts its row ids, a host thread
reads the misses from the disk tier into the host row cache and answers each layer, the step gathers by the
answered slots. On this CPU-only box the "device" side is the same memory and waits natively; the host thread,
the disk reads and the cache are the real ones. The GPU tests run it inside CUDA graphs."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from strata import Engine
from strata.runtime.model.kv_cache import DecodeBatch, KVCache, StepBatch
from strata.tiers.rows.handshake import RowHandshake
from strata.tiers.storage import native_io

pytestmark = pytest.mark.skipif(not native_io.available(), reason="needs the native helpers (a C++ compiler)")

DISK = {"engram": {"tier": "disk", "row_cache": "2KiB"}, "debug": {"engram_read_batch": 7},
        "tiers": {"disk": {"scrub": False}}}


@pytest.fixture(scope="module")
def memory_engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, config={"runtime": {"experts": "memory"}}, device="cpu")


def _attach(eng, max_tokens: int) -> RowHandshake:
    rt, store = eng.model.engram, eng.model.engram.source
    store.handshake = rt.handshake = RowHandshake(store, rt.cfg.layer_ids, rt.cfg.num_heads, max_tokens,
                                                  torch.device("cpu"))
    return rt.handshake


def _decode(eng, memory_engine, steps: int, seed: int, check=None) -> None:
    """`steps` decode steps of three sequences through the handshake; every layer's rows equal the in-memory
    tables' (`check(step)` runs after each step)."""
    cfg = memory_engine.checkpoint.config
    rt, ref_rt = eng.model.engram, memory_engine.model.engram
    caches = [KVCache(cfg, 3, 64, eng.dtype, "cpu") for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    for pos in range(steps):
        ids = torch.randint(3, cfg.vocab_size, (3,), generator=g)
        ids[0] = 7  # one sequence repeats a token: its rows are cache hits after the first steps
        rt.device_step_queued(eng.model.layers, 3)
        slots, p = torch.tensor([0, 1, 2]), torch.full((3,), pos)
        step = rt.begin(ids, DecodeBatch(slots, p, 64), caches[0], eng.model.layers)  # posts the row ids
        want = ref_rt.begin(ids, StepBatch([0, 1, 2], [pos] * 3, [1, 1, 1]), caches[1], memory_engine.model.layers)
        for layer in cfg.engram.layer_ids:
            got = step.rows(layer)  # waits for the host thread's answer, gathers from the host cache
            torch.testing.assert_close(got, want.rows(layer).to(got.dtype), rtol=0, atol=0)
        taps, dst, src = step.indices(torch.device("cpu"))
        want_taps, want_dst, want_src = want.indices(torch.device("cpu"))
        assert torch.equal(taps, want_taps) and torch.equal(dst, want_dst) and torch.equal(src, want_src)
        if check is not None:
            check(pos)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_handshake_serves_rows_equal_to_the_tables(tiny_model_dir, memory_engine, native):
    """Step after step, with a 2 KiB cache turning over, the answered rows equal the tables; the statistics
    count every lookup, and later steps hit the cache. Native: each layer served in one C call
    (strata.tiers.rows.serve); python: through `start` and `finish_one`."""
    from strata.tiers.rows.serve import NativeRowServer

    with Engine.from_pretrained(tiny_model_dir, config=DISK, device="cpu") as eng:
        hs = _attach(eng, max_tokens=4)
        if not native:
            eng.model.engram.source.steps.native = False
        _decode(eng, memory_engine, steps=30, seed=0)
        stats = eng.model.engram.stats()
        heads, layers = eng.model.engram.cfg.num_heads, len(eng.model.engram.cfg.layer_ids)
        assert stats["handshake"]["steps"] == 30
        assert stats["lookups"] == 30 * 3 * heads * layers
        assert stats["hits"].get("cache", 0) > 0 and stats["hits"]["disk"] > 0
        assert stats["cache_evictions"] > 0  # 2 KiB of rows: the cache turned over while the rows stayed right
        hs.check()  # nothing failed
        assert isinstance(eng.model.engram.source.steps.row_server, NativeRowServer) == native


def test_native_layer_serving_keeps_the_cache_consistent(tiny_model_dir, memory_engine):
    """Many steps of two "layers" each (the tiny model's one Engram layer served twice a step, with different
    ids) through the native server and a 2 KiB cache: every answered slot holds its row, the first layer's slots
    survive the second's evictions (they are protected), and the cache's maps stay each other's inverse."""
    import numpy as np

    layer = memory_engine.checkpoint.config.engram.layer_ids[0]
    table = memory_engine.model.layers[layer].engram.multi_head_embedding.embedding.weight.detach()
    with Engine.from_pretrained(tiny_model_dir, config=DISK, device="cpu") as eng:
        store = eng.model.engram.source
        cache = store.cache
        rng = np.random.default_rng(0)
        rows = store.tables[layer].num_rows
        hot = rng.integers(0, rows, 40)  # a head of popular rows, and a long tail
        for _ in range(60):
            held, answers = [], []
            for _ in range(2):
                ids = np.where(rng.random(24) < 0.5, rng.choice(hot, 24), rng.integers(0, rows, 24))
                out = np.empty(24, dtype=np.int64)
                store.serve_layer(layer, ids, held, out)
                answers.append((ids, out))
                cache.score[out] = 0.0  # the lowest scores: only the protection keeps them from the next eviction
            for ids, out in answers:  # both layers' rows, read back after the second layer's admissions
                got = cache.slab[torch.from_numpy(out)].float()
                torch.testing.assert_close(got, table[torch.from_numpy(ids)].float(), rtol=0, atol=0)
            used = cache.row_of >= 0
            assert np.array_equal(cache.slot_of[cache.row_of[used]], np.flatnonzero(used))
            assert int((cache.slot_of >= 0).sum()) == int(used.sum()) == cache.capacity - int(cache.counts[0])
        stats = store.stats()
        assert stats["cache_evictions"] > 0 and stats["hits"]["cache"] > 0
        assert stats["lookups"] == 60 * 2 * 24


def test_a_step_woken_for_but_never_run_does_not_desync(tiny_model_dir, memory_engine):
    """Generations count the steps that ran, not the wake-ups: an extra `expect` (a step whose launch failed)
    leaves the host thread waiting for the next step that does run, which it then serves right."""
    with Engine.from_pretrained(tiny_model_dir, config=DISK, device="cpu") as eng:
        hs = _attach(eng, max_tokens=4)
        hs.expect()  # woken for a step that never posts
        _decode(eng, memory_engine, steps=4, seed=1)
        assert hs.stats()["steps"] == 4


def test_a_failed_read_is_raised_at_the_next_step(tiny_model_dir, memory_engine, tmp_path):
    """A read that fails while serving does not leave the step waiting forever: the layer is answered, and
    the failure is raised (naming it) before the next step runs."""
    with Engine.from_pretrained(tiny_model_dir, config=DISK, device="cpu") as e:
        shutil.copytree(e.checkpoint.directory, tmp_path / "store")  # the test damages its own copy
    with Engine.from_pretrained(tmp_path / "store", config=DISK, device="cpu") as eng:
        hs = _attach(eng, max_tokens=4)
        store = eng.model.engram.source
        _decode(eng, memory_engine, steps=2, seed=2)
        for path in store.paths.values():  # the store's tables shrink under the open reader
            os.truncate(path, 4096)
        cfg = memory_engine.checkpoint.config
        cache = KVCache(cfg, 3, 64, eng.dtype, "cpu")
        eng.model.engram.device_step_queued(eng.model.layers, 3)
        ids = torch.tensor([cfg.vocab_size - 1, cfg.vocab_size - 2, cfg.vocab_size - 3])  # rows not cached yet
        step = eng.model.engram.begin(ids, DecodeBatch(torch.tensor([0, 1, 2]), torch.full((3,), 5), 64), cache,
                                      eng.model.layers)
        for layer in cfg.engram.layer_ids:
            step.rows(layer)  # answered although the reads failed
        with pytest.raises(RuntimeError, match="Engram rows failed.*truncated|Engram rows failed.*ended early"):
            eng.model.engram.device_step_queued(eng.model.layers, 3)
        assert hs.stats()["steps"] == 3


@pytest.mark.gpu
def test_decode_graphs_wait_on_the_device_for_disk_rows(tiny_model_dir):
    """Tables on disk on a GPU: decode steps replay as one graph each (no segments), hashing on the device and
    waiting there for the host thread's rows; greedy tokens equal the in-memory model's and those of the
    segmented host path (`[debug] engram_graph_wait = false`), batched and alone, over enough steps for the cache to turn over."""
    from test_engram import PROMPTS, _scheduler_decode

    mem = Engine.from_pretrained(tiny_model_dir, config={"runtime": {"experts": "memory", "dtype": "float32"}},
                                 device="cuda")
    want = [mem.generate(p, max_tokens=24).token_ids for p in PROMPTS]
    got = {}
    for wait in (True, False):
        conf = {"runtime": {"dtype": "float32"}, "tiers": {"disk": {"scrub": False}},
                "engram": {"tier": "disk", "row_cache": "2KiB"},
                "debug": {"engram_read_batch": 5, "engram_graph_wait": wait}}
        with Engine.from_pretrained(tiny_model_dir, config=conf, device="cuda") as eng:
            assert (eng.model.engram.handshake is not None) == wait
            got[wait] = _scheduler_decode(eng, PROMPTS, max_tokens=24)
            alone = eng.generate(PROMPTS[1], max_tokens=24).token_ids
            assert alone == want[1]
            graphs = eng.model.graphs
            assert graphs.replays > 0 and not graphs.failed
            segmented = [type(g.graph).__name__ == "SegmentRecorder" for g in graphs.graphs.values()]
            if wait:
                stats = eng.model.engram.stats()
                assert stats["handshake"]["steps"] >= graphs.replays
                assert stats["cache_evictions"] > 0 and stats["hits"]["disk"] > 0
                assert not any(segmented)  # one graph a step: the rows' waits are inside it
            else:
                assert all(segmented)
    assert got[True] == got[False] == want
