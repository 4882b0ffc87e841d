"""Continuous batching: batched sequences equal their solo runs; chunked prefill; cancel; queue limits."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from strata import RequestError
from strata.runtime.sampler import SamplingParams
from strata.runtime.scheduler import GenRequest, QueueFullError


def run_all(sched, requests):
    handles = [sched.submit(r) for r in requests]
    out = []
    for h in handles:
        events = list(h.iter_events(timeout=120))
        out.append(events)
    return out


def tokens_of(events):
    return [e.token_id for e in events if e.token_id is not None]


@pytest.fixture(scope="module")
def sched(tiny_engine):
    s = tiny_engine.scheduler(max_batch=4, token_budget=24, max_queue=16)
    s.start()
    yield s
    s.stop()


def prompts(engine):
    texts = ["The river runs", "Once upon a time in a land far away there lived", "hello",
             "Cooking pasta needs salted water and patience, said the chef to the", "a b c d e f"]
    return [engine.tokenizer.encode(t) for t in texts]


def test_batched_greedy_equals_solo(tiny_engine, sched):
    """Five requests over four slots and a 24-token budget (prompts prefill in chunks alongside decodes)."""
    ps = prompts(tiny_engine)
    reqs = [GenRequest(p, SamplingParams(max_tokens=12)) for p in ps]
    results = run_all(sched, reqs)
    for p, events in zip(ps, results, strict=True):
        solo = tiny_engine.generate(p, max_tokens=12)
        assert tokens_of(events) == solo.token_ids
        assert "".join(e.text for e in events) == solo.text
        assert events[-1].finish_reason == solo.finish_reason
        assert events[-1].completion_tokens == len(solo.token_ids) and events[-1].prompt_tokens == len(p)
    assert sched.stats()["steps"] > 0 and sched.stats()["running"] == 0


def test_seeded_sampling_is_batch_independent(tiny_engine, sched):
    ps = prompts(tiny_engine)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i) for i in range(len(ps))]
    batched = run_all(sched, [GenRequest(p, sp) for p, sp in zip(ps, params, strict=True)])
    for p, sp, events in zip(ps, params, batched, strict=True):
        solo = tiny_engine.generate(p, max_tokens=10, temperature=0.9, top_p=0.9, seed=sp.seed)
        assert tokens_of(events) == solo.token_ids


def test_logprobs_match_score(tiny_engine, sched):
    p = tiny_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog and then some more words")
    [events] = run_all(sched, [GenRequest(p, SamplingParams(max_tokens=4), logprobs=3, prompt_logprobs=2)])
    first = events[0]
    ref = tiny_engine.score(p)
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        assert abs(first.prompt_logprobs[i] - float(ref[i - 1, p[i]])) < 1e-4
        assert len(first.prompt_top_logprobs[i]) == 2
    gen = tokens_of(events)
    ref_gen = tiny_engine.score(p + gen[:-1])
    for j, e in enumerate(e for e in events if e.token_id is not None):
        assert abs(e.logprob - float(ref_gen[len(p) - 1 + j, e.token_id])) < 1e-4
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0][1] >= e.logprob - 1e-6


def test_stop_strings_in_batch(tiny_engine, sched):
    p = tiny_engine.tokenizer.encode("The")
    full = tiny_engine.generate(p, max_tokens=20, temperature=1.0, seed=3)
    stop = full.text[2:4]
    [events] = run_all(sched, [GenRequest(p, SamplingParams(max_tokens=20, temperature=1.0, seed=3, stop=[stop]))])
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop" and text == full.text[: full.text.index(stop)]


def test_cancel_frees_the_slot(tiny_engine, sched):
    p = tiny_engine.tokenizer.encode("keep going")
    h = sched.submit(GenRequest(p, SamplingParams(max_tokens=2000, ignore_eos=True)))
    it = h.iter_events(timeout=60)
    next(it)
    h.cancel()
    rest = list(it)
    assert rest[-1].finish_reason == "abort"
    assert sched.stats()["kv_slots_free"] == sched.max_batch


def test_context_and_queue_limits(tiny_engine):
    s = tiny_engine.scheduler(max_batch=1, token_budget=8, max_queue=1)  # not started: nothing drains
    with pytest.raises(RequestError, match="context_length_exceeded"):
        s.submit(GenRequest([5] * 10, SamplingParams(max_tokens=tiny_engine.max_context)))
    s.submit(GenRequest([5, 6], SamplingParams(max_tokens=2)))
    with pytest.raises(QueueFullError):
        s.submit(GenRequest([5, 6], SamplingParams(max_tokens=2)))
    s.stop(drain=False)


def test_async_events(tiny_engine, sched):
    p = tiny_engine.tokenizer.encode("async hello")

    async def go():
        h = sched.submit(GenRequest(p, SamplingParams(max_tokens=5)))
        return [e async for e in h.events()]

    events = asyncio.run(go())
    assert tokens_of(events) == tiny_engine.generate(p, max_tokens=5).token_ids


def test_many_threads_submit(tiny_engine, sched):
    ps = prompts(tiny_engine)
    results: dict[int, list[int]] = {}

    def client(i):
        h = sched.submit(GenRequest(ps[i % len(ps)], SamplingParams(max_tokens=6)))
        results[i] = tokens_of(list(h.iter_events(timeout=120)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, toks in results.items():
        assert toks == tiny_engine.generate(ps[i % len(ps)], max_tokens=6).token_ids
    assert torch.is_grad_enabled()  # the scheduler thread's inference_mode does not leak
