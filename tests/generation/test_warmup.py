"""The serving warm-up (strata.runtime.generation.warmup) and the scheduler's together-submission it rests on: every decode batch
size from max_batch down to 1 runs once, the warm-up is not counted as traffic, a failure is one clear error, and on
a GPU every size's decode graph is captured before the first real request (which then captures nothing)."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.errors import ConfigError, StrataError
from strata.runtime.generation.requests import QueueFullError
from strata.runtime.generation.sampler import SamplingParams
from strata.runtime.generation.scheduler import GenRequest, Scheduler
from strata.runtime.generation.warmup import warm_up, warmup_on, warmup_requests


def test_warmup_steps_through_every_batch_size_and_is_not_traffic(tiny_engine):
    sched = tiny_engine.scheduler(max_batch=5)
    try:
        report = warm_up(sched)
        alone = len(warmup_requests(5, 100, tiny_engine.max_context)) - 1  # the short prompt, then one a KV bucket
        assert tiny_engine.max_context >= 4096 and alone == 5
        assert report.batch_sizes == [5, 4, 3, 2, 1] + [1] * alone
        assert report.buckets == [256, 512, 1024, 2048, 4096]
        assert report.captures == 0  # the CPU has no graphs
        assert "decode batch sizes 1-5, KV buckets 256-4096" in report.describe()
        stats = tiny_engine.stats()
        assert stats["requests"] == 0 and stats["generated_tokens"] == 0 and stats["prompt_tokens"] == 0
        assert sched.stats()["running"] == 0 and sched.stats()["kv_slots_free"] == 5
        # the scheduler serves on after it, and a request counts again
        ids = tiny_engine.tokenizer.encode("The river runs through the valley and")
        out = list(sched.submit(GenRequest(ids, SamplingParams(max_tokens=6))).iter_events(timeout=60))
        assert tiny_engine.stats()["requests"] == 1
        assert [e.token_id for e in out if e.token_id is not None] == tiny_engine.generate(ids, max_tokens=6).token_ids
    finally:
        sched.stop()


def test_warmup_under_overlapped_decode_visits_every_size(tiny_model_dir):
    """With overlapped decode (the CUDA default; forced on here) steps chain while no sequence finishes: a finishing
    request still ends each chain, so every size is decoded once."""
    with Engine.from_pretrained(tiny_model_dir, device="cpu", config={"debug": {"overlap_decode": True}}) as eng:
        sched = eng.scheduler(max_batch=4)
        try:
            assert warm_up(sched).batch_sizes[:5] == [4, 3, 2, 1, 1]
        finally:
            sched.stop()


def test_warmup_requests_fit_a_short_context_and_reach_each_bucket():
    from strata.runtime.model.kv_cache import kv_bucket

    for max_batch, ctx in [(8, 4096), (8, 16), (40, 48), (1, 16), (4, 1024), (8, 40960)]:
        batch, *alone = warmup_requests(max_batch, 100, ctx)
        assert len(batch) == max_batch and all(len(r) == 1 for r in alone)
        alone = [r for (r,) in alone]
        for i, r in enumerate(batch + alone):
            assert len(r.prompt_ids) + r.params.max_tokens <= ctx and max(r.prompt_ids) < 100
            assert len(r.prompt_ids) < 64 or len(r.prompt_ids) % 16  # most prompts are not a multiple of 16 long
            if ctx == 4096 and i < max_batch:
                assert r.params.max_tokens == max_batch + 1 - i and len(r.prompt_ids) == 13
        assert len(alone[0].prompt_ids) <= 16  # the short prompt alone takes the pair kernels
        # one decode step in each bucket above the smallest, up to the context or WARM_CONTEXT
        decoded = [kv_bucket(len(r.prompt_ids), ctx) for r in alone[1:]]
        want = [b for b in (512, 1024, 2048, 4096) if b <= ctx]
        assert decoded == want, (ctx, decoded)


def test_submit_together_admits_all_in_one_step_or_queues_none(tiny_engine):
    sched = Scheduler(tiny_engine, max_batch=3, max_queue=3)  # a fresh one: its first step is the three prompts'
    reqs = [GenRequest([5, 6, 7 + i], SamplingParams(max_tokens=2)) for i in range(4)]
    with pytest.raises(QueueFullError):
        sched.submit_together(reqs)
    assert sched.stats()["waiting"] == 0  # none of the four was queued
    with pytest.raises(Exception, match="context_length_exceeded"):
        sched.submit_together([reqs[0], GenRequest([1] * 10, SamplingParams(max_tokens=10**6))])
    assert sched.stats()["waiting"] == 0
    handles = sched.submit_together(reqs[:3])
    sched.start()
    try:
        for h in handles:
            list(h.iter_events(timeout=60))
    finally:
        sched.stop()
    assert sched.recent_steps()[0]["prompt"] == 9  # the three prompts in the first step


def test_warmup_failure_is_one_clear_error(tiny_model_dir):
    with Engine.from_pretrained(tiny_model_dir, device="cpu") as eng:
        inner = eng.model.forward

        def failing(ids, batch, cache):
            if all(n == 1 for n in batch.lengths):
                raise RuntimeError("device fault")
            return inner(ids, batch, cache)

        eng.model.forward = failing
        sched = eng.scheduler(max_batch=3)
        try:
            with pytest.raises(StrataError, match="warm-up failed: device fault.*runtime.warmup = false"):
                warm_up(sched)
        finally:
            sched.stop()


def test_warmup_past_its_timeout_is_one_clear_error_and_a_short_queue_caps_the_sizes(tiny_engine):
    sched = tiny_engine.scheduler(max_batch=4)
    try:
        with pytest.raises(StrataError, match="warm-up took longer than 0 s.*runtime.warmup = false"):
            warm_up(sched, timeout=1e-6)
    finally:
        sched.stop()
    sched = tiny_engine.scheduler(max_batch=4, max_queue=2)  # all of a round is queued at once: 2 at most
    try:
        assert warm_up(sched).batch_sizes[:3] == [2, 1, 1]
    finally:
        sched.stop()


def test_warmup_setting(tiny_model_dir):
    assert warmup_on("auto", torch.device("cuda")) and not warmup_on("auto", torch.device("cpu"))
    assert warmup_on(True, torch.device("cpu")) and not warmup_on(False, torch.device("cuda"))
    with pytest.raises(ConfigError, match="runtime.warmup"):
        Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"warmup": "yes"}})


@pytest.fixture(scope="module")
def plain_tiny(tmp_path_factory):
    """The tiny demo model without Engram layers."""
    from strata.runtime.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("plain") / "tiny", size="tiny", engram=False)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", ["memory", "split"])
def test_warmup_captures_every_decode_graph_before_the_first_request(plain_tiny, budget):
    """On CUDA: after the warm-up each batch size's graph exists, so requests of 1..max_batch streams (at the
    smallest KV bucket) capture nothing more; all in VRAM, their tokens equal a fresh engine's without a warm-up
    (split, the CPU's forked numerics depend on where each expert sits then, which placement timing moves)."""
    cfg = {"runtime": {"experts": "memory"}} if budget == "memory" else {
        "tiers": {"gpu": {"budget": str(2 * 12288)}, "pinned": {"budget": str(64 * 12288)}}}
    with Engine.from_pretrained(plain_tiny, device="cuda", config=cfg) as eng:
        sched = eng.scheduler(max_batch=4)
        try:
            report = warm_up(sched)
            g = eng.model.graphs
            assert report.batch_sizes[:5] == [4, 3, 2, 1, 1] and not g.failed
            assert report.captures >= 4 + 4, report  # each batch size, and one stream at each larger bucket
            before = g.captures
            ids = eng.tokenizer.encode("The river runs through the valley and")
            reqs = [GenRequest(ids, SamplingParams(max_tokens=8 + i, temperature=0.8, seed=i)) for i in range(3)]
            outs = [list(h.iter_events(timeout=120)) for h in sched.submit_together(reqs)]
            long = GenRequest([3 + j % 500 for j in range(700)], SamplingParams(max_tokens=4))  # one stream, bucket 1024
            list(sched.submit(long).iter_events(timeout=120))
            assert g.captures == before, "a request captured a decode graph the warm-up should have"
            got = [[e.token_id for e in out if e.token_id is not None] for out in outs]
        finally:
            sched.stop()
    if budget != "memory":
        return
    with Engine.from_pretrained(plain_tiny, device="cuda", config=cfg) as fresh:
        sched = fresh.scheduler(max_batch=4)
        sched.start()
        try:
            want = [[e.token_id for e in out if e.token_id is not None]
                    for out in ([list(h.iter_events(timeout=120)) for h in sched.submit_together(reqs)])]
        finally:
            sched.stop()
    assert got == want
