"""CUDA-graph decode: replays equal eager decode (plain, Engram and tiered models), graphs captured again after
every graph was freed, segmented graphs around cold experts, and one-graph split decode reading the GPU's share
in place. GPU only (each test is marked); the kernels' own tests are in test_decode_path.py.
"""

from __future__ import annotations

import pytest
import torch
from decode_checks import assert_batched_decode_identical

from strata import Engine
from strata.runtime.model.kv_cache import KVCache, StepBatch


@pytest.fixture(scope="module")
def plain_tiny(tmp_path_factory):
    """The tiny demo model without Engram layers (these tests are about experts and graphs alone)."""
    from strata.runtime.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("plain") / "tiny", size="tiny", engram=False)


@pytest.mark.gpu
def test_graph_replays_equal_eager_decode(plain_tiny):
    """CUDA graphs (every expert resident) give bit-identical tokens and scores to eager decode."""
    eager = Engine.from_pretrained(plain_tiny, device="cuda",
                                   config={"runtime": {"experts": "memory"}, "debug": {"cuda_graphs": False}})
    graphs = Engine.from_pretrained(plain_tiny, device="cuda", config={"runtime": {"experts": "memory"}})
    ids = eager.tokenizer.encode("The river runs through the valley and the town")
    a = eager.generate(ids, max_tokens=40)
    b = graphs.generate(ids, max_tokens=40)
    assert a.token_ids == b.token_ids
    assert graphs.model.graphs.replays > 0 and eager.model.graphs.replays == 0
    assert_batched_decode_identical(eager, graphs, steps=30)
    assert graphs.model.graphs.captures >= 2  # batch of 1 and batch of 3


@pytest.mark.gpu
def test_graphs_are_captured_again_after_every_graph_was_freed(plain_tiny):
    """A cache whose graphs were all dropped (a scheduler stopped: its cache freed) leaves the shared graph pool
    with no user; the next capture must not reuse its handle (the allocator asserts), so later caches still
    decode in graphs."""
    import gc

    eng = Engine.from_pretrained(plain_tiny, device="cuda", config={"runtime": {"experts": "memory"}})
    g = eng.model.graphs
    for round_ in range(2):
        cache = KVCache(eng.model.cfg, 2, 256, eng.dtype, "cuda")
        with torch.inference_mode():
            eng.model(torch.arange(5, 15, device="cuda"), StepBatch([0, 1], [0, 0], [5, 5]), cache)
            for t in range(3):
                eng.model(torch.tensor([7, 8], device="cuda"), StepBatch([0, 1], [5 + t] * 2, [1, 1]), cache)
        assert g.captures == round_ + 1 and not g.failed
        del cache
        gc.collect()
        assert not g.graphs  # the cache's graphs went with it


@pytest.mark.gpu
def test_after_queued_runs_once_the_steps_work_is_queued(plain_tiny):
    """The graph step hooks' `after_queued` (the mailbox books' wake) runs once per replayed step, after
    `queue_decode` has queued the step's LM head and sampling, never inside the replay; a caller that does not call `step_queued`
    gets it at its next step's start. It is given an event recorded after that work, reached once the GPU has
    done it (inline books stop there)."""
    from strata.runtime.generation.overlap import queue_decode
    from strata.runtime.generation.sampler import SamplingParams, make_generator

    eng = Engine.from_pretrained(plain_tiny, device="cuda", config={"runtime": {"experts": "memory"}})
    model, events, dones, launches = eng.model, [], [], []

    class Books:  # the model's `GraphStepHooks` (strata.runtime.model.hooks)
        def before_step(self) -> None:
            launches.append(len(events))

        def after_queued(self, until: torch.cuda.Event) -> None:
            events.append("wake")
            dones.append(until)

    model.enable_decode_graphs(lambda: "full", hooks=Books())
    g = model.graphs
    logits = model.logits
    model.logits = lambda hidden: (events.append("logits"), logits(hidden))[1]
    cache = KVCache(model.cfg, 1, 256, eng.dtype, "cuda")
    sampler = [(SamplingParams(max_tokens=8), make_generator(0, "cuda"))]
    with torch.inference_mode():
        model(torch.arange(5, 15, device="cuda"), StepBatch([0], [0], [10]), cache)
        ids = torch.tensor([7], device="cuda")
        for t in range(5):
            ids = queue_decode(model, cache, [0], [10 + t], ids, sampler).tokens
        assert g.replays >= 3 and events.count("wake") == g.replays
        assert all(events[i - 1] == "logits" for i, e in enumerate(events) if e == "wake")
        n = len(events)
        model(ids, StepBatch([0], [15], [1]), cache)  # replayed; its caller never says the step is queued
        assert events[n:] == []
        model(ids, StepBatch([0], [16], [1]), cache)  # the last step's hook runs before this one is launched
        assert events[n:] == ["wake"]
        g.step_queued()
        g.step_queued()  # once per step
        assert events[n:] == ["wake", "wake"]
        torch.cuda.synchronize()
        assert len(dones) == events.count("wake") and all(isinstance(d, torch.cuda.Event) and d.query() for d in dones)
    assert len(launches) == g.captures + g.replays  # `before_step`: once a graph step, captured or replayed
    eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["memory", "pinned", "disk"])
def test_engram_model_graph_replays_equal_eager_decode(tiny_model_dir, tier):
    """An Engram model's decode steps replay as CUDA graphs with tokens and hidden states bit-identical to
    eager decode: tables in memory and pinned RAM (read in place: the Engram step runs inside the graph)
    and on disk (rows gathered on the host through the row cache, copied into the graph's buffers)."""
    conf = ({"runtime": {"experts": "memory"}} if tier == "memory" else
            {"engram": {"tier": tier, "row_cache": "64KiB"}, "runtime": {"cpu_numerics": "gpu"}})
    eager = Engine.from_pretrained(tiny_model_dir, device="cuda", config={**conf, "debug": {"cuda_graphs": False}})
    graphs = Engine.from_pretrained(tiny_model_dir, device="cuda", config=conf)
    assert graphs.model.engram is not None
    assert eager.wait_settled(60) and graphs.wait_settled(60)
    ids = eager.tokenizer.encode("The river runs through the valley and the town")
    assert eager.generate(ids, max_tokens=40).token_ids == graphs.generate(ids, max_tokens=40).token_ids
    assert graphs.model.graphs.replays > 0 and not graphs.model.graphs.failed and eager.model.graphs.replays == 0
    assert_batched_decode_identical(eager, graphs, steps=20)
    for m in (eager, graphs):
        m.close()


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["gpu", "fork"], ids=["exact", "forked"])
def test_segmented_graphs_with_cold_experts(plain_tiny, numerics):
    """One GPU slot per layer: steps replay as graphs between host steps; gpu numerics stay bit-identical
    to all-in-memory, fork numerics (CPU kernel for part of the cold experts) within tolerance."""
    memory = Engine.from_pretrained(plain_tiny, device="cuda", config={"runtime": {"experts": "memory"}})
    slot = 12288
    cfg = {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(32 * slot)}},
           "runtime": {"cpu_numerics": numerics}}
    with Engine.from_pretrained(plain_tiny, device="cuda", config=cfg) as tiered:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        want = memory.generate(ids, max_tokens=24, temperature=1.0, seed=5)
        got = tiered.generate(ids, max_tokens=24, temperature=1.0, seed=5)
        assert tiered.model.graphs.replays > 0 and not tiered.model.graphs.failed
        if numerics == "gpu":
            assert got.token_ids == want.token_ids
            assert torch.equal(tiered.score(ids), memory.score(ids))
        else:
            assert (tiered.score(ids) - memory.score(ids)).abs().mean().item() < 0.02
            assert tiered.executor.cpu_experts > 0
        stats = tiered.stats()["tiers"]
        if numerics == "gpu":  # every cold expert crosses to a GPU slot
            assert stats["misses"] > 0 and stats["tiers"]["gpu"]["evictions"] > 0
        else:  # the cost model may send every cold expert to the CPU on a model this small: read from pinned
            assert stats["tiers"]["pinned"]["hits"] > 0


@pytest.mark.gpu
def test_split_decode_copies_the_gpu_share(plain_tiny):
    """Split decode with a CPU made to look slow, so the cost model gives cold experts to the GPU, which copies
    them: the tokens follow the all-in-memory engine's within the forked numerics' tolerance."""
    memory = Engine.from_pretrained(plain_tiny, device="cuda", config={"runtime": {"experts": "memory"}})
    slot = 12288
    cfg = {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(32 * slot)}},
           "runtime": {"cpu_numerics": "fork"}}
    with Engine.from_pretrained(plain_tiny, device="cuda", config=cfg) as tiered:
        tiered.wait_settled(60)
        tiered.executor.rates.cpu_bytes_per_s = 1e6  # the CPU looks slow: the GPU takes the cold experts
        tiered.executor.rates.observe_cpu = lambda *a: None  # and stays so
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        assert (tiered.score(ids) - memory.score(ids)).abs().mean().item() < 0.02
        got = tiered.generate(ids, max_tokens=16)
        want = memory.generate(ids, max_tokens=16)
        assert tiered.model.graphs.replays > 0 and not tiered.model.graphs.failed
        assert got.token_ids[:4] == want.token_ids[:4]


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["gpu", "fork"], ids=["exact", "split"])
def test_all_resident_tiered_engine_uses_graphs_and_equals_memory(plain_tiny, numerics):
    """A GPU budget that holds every expert: decode becomes one graph per step, in split mode too (no step-copy
    slots are carved out of such a budget, which would keep the tier one short of every expert for good)."""
    memory = Engine.from_pretrained(plain_tiny, device="cuda", config={"runtime": {"experts": "memory"}})
    with Engine.from_pretrained(plain_tiny, device="cuda", config={"runtime": {"cpu_numerics": numerics}}) as tiered:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        tiered.generate(ids, max_tokens=2)  # placement finishes in the background
        for _ in range(200):
            if tiered.executor.all_resident():
                break
            import time

            time.sleep(0.05)
        assert tiered.executor.all_resident()
        assert tiered.generate(ids, max_tokens=24).token_ids == memory.generate(ids, max_tokens=24).token_ids
        assert tiered.model.graphs.replays > 0 and tiered.model.graphs.mode() == "full"
        assert tiered.stats()["tiers"]["lookups"] > 0  # device-side counts reach the statistics


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v2"])
def test_graphs_of_glm4_moe_and_deepseek_v2_equal_eager_decode(arch, tmp_path):
    """glm4_moe (half-rotary heads: rotated in torch, past the fused full-head kernels; q/k/v biases) and deepseek_v2
    (its softmax group router in fp32; MLA without q_lora_rank): decode graphs with every expert in memory, and
    one-graph decode with two GPU slots a layer (cold experts copied in), give eager decode's tokens."""
    from strata.runtime.demo.model import write_demo_model

    d = write_demo_model(tmp_path / arch, size="tiny", engram=False, arch=arch, progress=False)
    eager = Engine.from_pretrained(d, device="cuda", config={"runtime": {"experts": "memory"},
                                                             "debug": {"cuda_graphs": False}})
    graphs = Engine.from_pretrained(d, device="cuda", config={"runtime": {"experts": "memory"}})
    ids = eager.tokenizer.encode("The river runs through the valley and the town")
    want = eager.generate(ids, max_tokens=24)
    assert graphs.generate(ids, max_tokens=24).token_ids == want.token_ids
    assert graphs.model.graphs.replays > 0 and not graphs.model.graphs.failed
    assert_batched_decode_identical(eager, graphs, steps=12)
    slot = 3 * 64 * 32 * 2  # one bf16 expert of the tiny sizes
    cfg = {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(48 * slot)}},
           "runtime": {"cpu_numerics": "gpu"}}
    with Engine.from_pretrained(d, device="cuda", config=cfg) as tiered:
        assert tiered.generate(ids, max_tokens=24).token_ids == want.token_ids
        assert tiered.model.graphs.replays > 0 and not tiered.model.graphs.failed
        assert tiered.stats()["tiers"]["tiers"]["gpu"]["evictions"] > 0
