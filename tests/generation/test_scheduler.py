"""Continuous batching: batched sequences equal their solo runs; chunked prefill; cancel; queue limits."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from strata import RequestError
from strata.runtime.generation.sampler import SamplingParams
from strata.runtime.generation.scheduler import GenRequest, QueueFullError, Scheduler


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
    """The engine's own scheduler (the one its generate runs on), with four slots and a 24-token budget."""
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
    s = Scheduler(tiny_engine, max_batch=1, token_budget=8, max_queue=1)  # not started: nothing drains
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


# ---- reproducible requests ---------------------------------------------------------------------------------


def _trace(events):
    """Tokens with their log-probabilities: equal floats mean bit-identical logits."""
    return [(e.token_id, e.logprob, e.top_logprobs) for e in events if e.token_id is not None]


def test_reproducible_request_is_bit_identical_alone_and_in_a_batch(tiny_engine):
    """The same seeded sampling request, alone and submitted among three others that prefill and decode with it."""
    ps = prompts(tiny_engine)
    s = Scheduler(tiny_engine, max_batch=4, token_budget=24, max_queue=16)
    s.repro_chunk = 8  # the 11-token prompt crosses a chunk boundary (the default is runtime.prefill_chunk)
    s.start()
    try:
        def mine():
            return GenRequest(ps[1], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7), logprobs=3,
                              prompt_logprobs=2, reproducible=True)

        [alone] = run_all(s, [mine()])
        others = [GenRequest(ps[i], SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True)) for i in (0, 3)]
        batch = run_all(s, [others[0], mine(), others[1],
                            GenRequest(ps[4], SamplingParams(max_tokens=20, seed=11, temperature=1.0), reproducible=True)])
        assert len(_trace(alone)) == 16
        assert _trace(batch[1]) == _trace(alone)
        assert batch[1][0].prompt_logprobs == alone[0].prompt_logprobs
        assert "".join(e.text for e in batch[1]) == "".join(e.text for e in alone)
        assert all(len(tokens_of(ev)) == 20 for ev in (batch[0], batch[2]))
        assert max(st["passes"] for st in s.recent_steps()) >= 2  # they really ran beside each other
    finally:
        s.stop()
    assert tiny_engine.executor.reproducible is False  # the scheduler restores the compute's mode


def test_reproducible_request_equals_engine_generate(tiny_engine, sched):
    """Through the scheduler (busy with others) and through `Engine.generate(reproducible=True)`: the same tokens."""
    ps = prompts(tiny_engine)
    sp = SamplingParams(max_tokens=12, temperature=0.7, seed=5)
    busy = [GenRequest(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in ps[:3]]
    results = run_all(sched, [*busy, GenRequest(ps[3], sp, reproducible=True)])
    solo = tiny_engine.generate(ps[3], max_tokens=12, temperature=0.7, seed=5, reproducible=True)
    assert tokens_of(results[-1]) == solo.token_ids


def test_reproducible_must_be_a_bool():
    with pytest.raises(RequestError, match="reproducible"):
        GenRequest([1, 2], SamplingParams(max_tokens=2), reproducible="required")


# ---- prefill pacing under decode pressure ------------------------------------------------------------------


def test_prompt_chunks_shrink_while_others_decode(tiny_engine):
    """With a gap target no step can meet, prompts advance while sequences decode in chunks that start at the
    minimum and at most double a step (more only where the pacer finds a prompt step's cost fixed: fewer, larger
    chunks), by the whole budget while none do, and results still equal solo runs."""
    s = Scheduler(tiny_engine, max_batch=4, token_budget=64, max_queue=8, decode_gap_target=1e-9, prefill_chunk_min=4)
    s.start()
    try:
        short = tiny_engine.tokenizer.encode("hello there")
        long = tiny_engine.tokenizer.encode(" ".join(f"word{i}" for i in range(40)))
        assert len(long) > 48
        first = s.submit(GenRequest(short, SamplingParams(max_tokens=2000, ignore_eos=True)))
        it = first.iter_events(timeout=60)
        next(it)  # decoding now, and until it is cancelled
        later = s.submit(GenRequest(long, SamplingParams(max_tokens=3)))
        out = list(later.iter_events(timeout=60))
        first.cancel()
        assert list(it)[-1].finish_reason == "abort"
    finally:
        s.stop()
    steps = s.recent_steps()
    assert steps[0]["decode"] == 0 and steps[0]["prompt"] == len(short)  # nobody decoding: no pacing
    pressured = [st for st in steps if st["decode"] and st["prompt"]]
    assert pressured and pressured[0]["prompt"] <= 2 * 4 and all(st["prompt"] <= st["allowance"] for st in pressured)
    assert all(b["allowance"] <= 2 * a["allowance"] for a, b in zip(pressured, pressured[1:], strict=False))
    assert tokens_of(out) == tiny_engine.generate(long, max_tokens=3).token_ids


def test_pacing_off_fills_the_token_budget(tiny_engine):
    s = Scheduler(tiny_engine, max_batch=2, token_budget=32, decode_gap_target=0)
    s.start()
    try:
        first = s.submit(GenRequest([5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True)))
        it = first.iter_events(timeout=60)
        next(it)
        later = s.submit(GenRequest(list(range(10, 90)), SamplingParams(max_tokens=1)))
        list(later.iter_events(timeout=60))
        first.cancel()
        list(it)
    finally:
        s.stop()
    assert max(st["prompt"] for st in s.recent_steps() if st["decode"]) == 31


def test_a_long_prompt_alone_prefills_in_prefill_chunk_sized_steps(tiny_engine):
    """Nobody decoding: a prompt longer than the token budget goes through in steps of runtime.prefill_chunk
    (512 here), as Engine.generate's prefill does, with the same tokens."""
    s = Scheduler(tiny_engine, max_batch=2, token_budget=32)
    prompt = list(range(10, 90))
    s.start()
    try:
        out = list(s.submit(GenRequest(prompt, SamplingParams(max_tokens=3))).iter_events(timeout=60))
    finally:
        s.stop()
    steps = s.recent_steps()
    assert steps[0]["decode"] == 0 and steps[0]["prompt"] == len(prompt) > 32  # one step, past the budget
    assert tokens_of(out) == tiny_engine.generate(prompt, max_tokens=3).token_ids


@pytest.mark.gpu
def test_reproducible_on_gpu_with_cold_experts_in_fork_mode(tiny_model_dir):
    """On CUDA with most experts cold and the CPU split on ("fork"): alone, in a batch, and Engine.generate agree."""
    from strata import Engine

    slot = 12288  # one tiny-model expert in bf16
    cfg = {"tiers": {"gpu": {"budget": str(4 * slot)}}, "runtime": {"cpu_numerics": "fork"}}
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config=cfg) as engine:
        ps = prompts(engine)
        s = engine.scheduler(max_batch=4, token_budget=64)
        s.start()
        try:
            def mine():
                return GenRequest(ps[3], SamplingParams(max_tokens=16, temperature=0.9, seed=2), logprobs=2,
                                  reproducible=True)

            [alone] = run_all(s, [mine()])
            others = [GenRequest(ps[i], SamplingParams(max_tokens=16, temperature=0.8, seed=i)) for i in (0, 1, 2)]
            batch = run_all(s, [others[0], mine(), others[1], others[2]])
        finally:
            s.stop()
        assert _trace(batch[1]) == _trace(alone)
        solo = engine.generate(ps[3], max_tokens=16, temperature=0.9, seed=2, reproducible=True)
        assert tokens_of(alone) == solo.token_ids
        assert engine.executor.reproducible is False


class _StepSpy:
    """Where DecodeGraphs sits on CUDA (decode steps go through `run`; `step_queued` says a step is all queued), on
    CPU: the layers run eagerly, and the log records each token drawn and each `step_queued`."""

    def __init__(self, model, log):
        self.model, self.log = model, log

    def run(self, input_ids, batch, cache):
        return self.model.run_layers(input_ids, batch, cache)

    def step_queued(self):
        self.log.append("queued")


def test_a_step_is_all_queued_sampling_included_before_its_books_run(tiny_engine, monkeypatch):
    """The non-overlapped pass samples every sequence on the device before `step_queued` (whose hook runs the
    mailbox's books until the GPU is done: sampling queued after it would wait for them), and reads the tokens back
    after it. Three seeded streams decode together; the tokens are still each stream's own."""
    import strata.runtime.generation.passes as passes_mod

    log: list[str] = []
    real_sample = passes_mod.sample_rows

    def logged_sample(logits, samplers, rows=None):
        log.extend(["sample"] * len(samplers))
        return real_sample(logits, samplers, rows)

    monkeypatch.setattr(passes_mod, "sample_rows", logged_sample)
    monkeypatch.setattr(tiny_engine.model, "graphs", _StepSpy(tiny_engine.model, log))
    ps = prompts(tiny_engine)[:3]
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=10 + i, ignore_eos=True) for i in range(3)]
    s = Scheduler(tiny_engine, max_batch=4, token_budget=64, max_queue=8)
    s.overlap = False
    s.start()
    try:
        handles = s.submit_together([GenRequest(p, sp) for p, sp in zip(ps, params, strict=True)])  # one first pass
        out = [list(h.iter_events(timeout=120)) for h in handles]
    finally:
        s.stop()
    monkeypatch.setattr(tiny_engine.model, "graphs", None)
    # six passes (the prompts' one, five decode steps), each three rows drawn and then `step_queued`
    assert "".join("S" if e == "sample" else "|" for e in log) == "SSS|" * 6
    for p, sp, events in zip(ps, params, out, strict=True):
        solo = tiny_engine.generate(p, max_tokens=6, temperature=0.8, seed=sp.seed)  # stops at an EOS, if drawn
        assert solo.token_ids and tokens_of(events)[: len(solo.token_ids)] == solo.token_ids
