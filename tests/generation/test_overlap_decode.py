"""Overlapped decode ([debug] overlap_decode): each decode step is queued before the host reads the token it is
fed. Forced on here on the CPU, where the same code runs synchronously: the tokens, texts and finish reasons
must equal the step-by-step loop's, and the overlap must really happen (one step more than tokens read)."""

from __future__ import annotations

import json

import pytest
import torch

from strata import Engine
from strata.errors import ConfigError
from strata.runtime.generation.sampler import SamplingParams
from strata.runtime.generation.scheduler import GenRequest


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    on = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"debug": {"overlap_decode": True}})
    off = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"debug": {"overlap_decode": False}})
    assert on.overlap_decode and not off.overlap_decode
    yield on, off
    on.close()
    off.close()


def count_forwards(engine):
    """Wrap the engine's model forward; returns the list its calls' token counts are appended to."""
    calls: list[int] = []
    model = engine.model
    inner = model.forward

    def forward(ids, batch, cache):
        calls.append(int(ids.numel()))
        return inner(ids, batch, cache)

    model.forward = forward
    return calls


def test_overlap_resolves_auto_per_device(tiny_model_dir):
    from strata.runtime.generation.overlap import overlap_on

    assert overlap_on("auto", torch.device("cuda")) and not overlap_on("auto", torch.device("cpu"))
    assert overlap_on(True, torch.device("cpu")) and not overlap_on(False, torch.device("cuda"))
    assert not overlap_on("auto", torch.device("cuda"), cards=2) and overlap_on(True, torch.device("cuda"), cards=2)
    with pytest.raises(ConfigError, match="overlap_decode"):
        Engine.from_pretrained(tiny_model_dir, device="cpu", config={"debug": {"overlap_decode": "sometimes"}})


@pytest.mark.parametrize("kwargs", [dict(max_tokens=1), dict(max_tokens=2), dict(max_tokens=13),
                                    dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=5),
                                    dict(max_tokens=12, temperature=1.2, top_k=20, seed=11)],
                         ids=["one", "two", "greedy", "top-p", "top-k"])
def test_generate_overlapped_equals_step_by_step(engines, kwargs):
    on, off = engines
    ids = on.tokenizer.encode("The river runs through the valley and")
    a, b = on.generate(ids, **kwargs), off.generate(ids, **kwargs)
    assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert len(a.token_ids) == kwargs["max_tokens"]


def test_a_stop_token_wastes_one_queued_step_not_a_token(engines):
    """The step queued behind the stop token runs but is never sampled: one forward more than the
    step-by-step loop, the same tokens."""
    on, off = engines
    ids = on.tokenizer.encode("Once upon a time")
    free = off.generate(ids, max_tokens=10, temperature=1.0, seed=2)
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop)  # the first time that token comes
    calls_on, calls_off = count_forwards(on), count_forwards(off)
    try:
        a = on.generate(ids, max_tokens=10, temperature=1.0, seed=2, stop_token_ids=[stop])
        b = off.generate(ids, max_tokens=10, temperature=1.0, seed=2, stop_token_ids=[stop])
    finally:
        del on.model.forward, off.model.forward
    assert a.token_ids == b.token_ids == free.token_ids[:cut] and a.finish_reason == b.finish_reason == "stop"
    decode_on, decode_off = [c for c in calls_on if c == 1], [c for c in calls_off if c == 1]
    assert len(decode_off) == cut  # each token read before the next step: the stop token's step is never run
    assert len(decode_on) == cut + 1  # overlapped: the step fed the stop token was already queued


def test_overlapped_scheduler_equals_step_by_step_engine(engines):
    """A batch chained step after step (greedy, seeded, a stop string, a stop token, a logprobs request that
    makes steps land first, requests over the slots so finished slots are reused) gives each request the
    tokens of the step-by-step engine's solo run."""
    on, off = engines
    texts = ["The river runs", "Once upon a time in a land far away there lived", "hello",
             "Cooking pasta needs salted water and patience, said the chef to the", "a b c d e f", "zebra"]
    ps = [on.tokenizer.encode(t) for t in texts]
    stop_text = off.generate(ps[2], max_tokens=20, temperature=1.0, seed=3).text[2:4]
    stop_tok = off.generate(ps[4], max_tokens=16).token_ids[6]
    params = [SamplingParams(max_tokens=14), SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=1),
              SamplingParams(max_tokens=20, temperature=1.0, seed=3, stop=[stop_text]),
              SamplingParams(max_tokens=3), SamplingParams(max_tokens=16, stop_token_ids=[stop_tok]),
              SamplingParams(max_tokens=11, temperature=0.7, seed=8)]
    logprob_req = GenRequest(ps[5], SamplingParams(max_tokens=5), logprobs=2)
    sched = on.scheduler(max_batch=3, token_budget=24, max_queue=16)
    assert sched.overlap
    sched.start()
    try:
        handles = [sched.submit(GenRequest(p, sp)) for p, sp in zip(ps, params, strict=True)]
        handles.append(sched.submit(logprob_req))
        results = [list(h.iter_events(timeout=120)) for h in handles]
    finally:
        sched.stop()
    for p, sp, events in zip(ps + [ps[5]], params + [logprob_req.params], results, strict=True):
        want = off.generate(p, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                            stop=sp.stop, stop_token_ids=sp.stop_token_ids)
        assert [e.token_id for e in events if e.token_id is not None] == want.token_ids
        assert "".join(e.text for e in events) == want.text
        assert events[-1].finish_reason == want.finish_reason
    assert all(e.logprob is not None for e in results[-1] if e.token_id is not None)
    assert sched.chained_steps > 0  # steps were really queued behind unread ones
    stats = sched.stats()
    assert stats["kv_slots_free"] == 3 and stats["running"] == 0
    assert stats["overlap_decode"] and stats["chained_steps"] == sched.chained_steps


SMALL_JSON = {"type": "json_schema", "json_schema": {"name": "item", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "count"]}}}


@pytest.mark.parametrize("with_free", [False, True], ids=["grammars-only", "beside-free-text"])
def test_rows_with_grammars_chain_and_equal_step_by_step(engines, with_free):
    """Structured requests decode in chained steps too (a row with a grammar is sampled once the host has read the
    token before and advanced the grammar), alone and batched with free-text ones: each request gets the
    step-by-step engine's solo tokens and text, and its JSON parses."""
    on, off = engines
    texts = ["Describe an item as JSON:", "Another one:", "The river runs"]
    params = [SamplingParams(max_tokens=60, response_format=SMALL_JSON),
              SamplingParams(max_tokens=60, temperature=1.0, seed=7, response_format=SMALL_JSON),
              SamplingParams(max_tokens=12, temperature=0.8, seed=2)][: 3 if with_free else 2]
    ps = [on.tokenizer.encode(t) for t in texts[: len(params)]]
    sched = on.scheduler(max_batch=3, token_budget=64, max_queue=8)
    sched.start()
    try:
        results = [list(h.iter_events(timeout=120)) for h in
                   [sched.submit(GenRequest(p, sp)) for p, sp in zip(ps, params, strict=True)]]
    finally:
        sched.stop()
    for p, sp, events in zip(ps, params, results, strict=True):
        want = off.generate(p, max_tokens=sp.max_tokens, temperature=sp.temperature, seed=sp.seed,
                            response_format=sp.response_format)
        assert [e.token_id for e in events if e.token_id is not None] == want.token_ids
        assert "".join(e.text for e in events) == want.text and events[-1].finish_reason == want.finish_reason
    for events in results[:2]:
        value = json.loads("".join(e.text for e in events))
        assert set(value) == {"name", "count"} and events[-1].finish_reason == "stop"
    assert sched.chained_steps > 0


def test_cancel_a_structured_request_while_its_rows_wait(engines):
    """A structured request cancelled while its chained step waits for its grammar's mask ends "abort", and the
    slot serves the next structured request, which gets the step-by-step engine's tokens."""
    on, off = engines
    sched = on.scheduler(max_batch=2, token_budget=32, max_queue=4)
    sched.start()
    try:
        p = on.tokenizer.encode("Describe an item as JSON:")
        free = sched.submit(GenRequest(p, SamplingParams(max_tokens=200, ignore_eos=True)))  # keeps steps chained
        h = sched.submit(GenRequest(p, SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                                                      response_format=SMALL_JSON)))
        it = h.iter_events(timeout=60)
        for _ in range(3):
            next(it)
        h.cancel()
        assert list(it)[-1].finish_reason == "abort"
        after = sched.submit(GenRequest(p, SamplingParams(max_tokens=60, response_format=SMALL_JSON)))
        got = [e.token_id for e in after.iter_events(timeout=60) if e.token_id is not None]
        assert got == off.generate(p, max_tokens=60, response_format=SMALL_JSON).token_ids
        free.cancel()
        assert sched.chained_steps > 0
    finally:
        sched.stop()


def test_cancel_while_a_step_is_in_flight(engines):
    on, _ = engines
    sched = on.scheduler(max_batch=2, token_budget=16, max_queue=4)
    sched.start()
    try:
        p = on.tokenizer.encode("keep going")
        h = sched.submit(GenRequest(p, SamplingParams(max_tokens=2000, ignore_eos=True)))
        it = h.iter_events(timeout=60)
        for _ in range(4):
            next(it)
        h.cancel()
        rest = list(it)
        assert rest[-1].finish_reason == "abort"
        after = sched.submit(GenRequest(p, SamplingParams(max_tokens=6)))  # the freed slot serves the next one
        got = [e.token_id for e in after.iter_events(timeout=60) if e.token_id is not None]
        assert got == on.generate(p, max_tokens=6).token_ids
        assert sched.stats()["kv_slots_free"] == 2
    finally:
        sched.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["memory", "mailbox"])
def test_overlapped_decode_on_cuda_equals_step_by_step(tmp_path, experts):
    """On CUDA "auto" overlaps: all experts in VRAM (one graph a step), and the one-graph split decode (two experts
    in VRAM, the rest on the mailbox worker; no GPU share and no promotions, so both engines keep the same
    residents): Engine.generate and the scheduler give the step-by-step engine's tokens bit for bit."""
    from strata.runtime.demo.model import write_demo_model

    model = write_demo_model(tmp_path / "tiny", size="tiny", engram=False)
    slot = 12288
    cfg = ({"runtime": {"experts": "memory"}} if experts == "memory" else
           {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(64 * slot)}}, "policy": {"promote": False},
            "debug": {"gpu_share": 0}})
    on = Engine.from_pretrained(model, device="cuda", config=cfg)
    off = Engine.from_pretrained(model, device="cuda", config={**cfg, "debug": {**cfg.get("debug", {}),
                                                                                 "overlap_decode": False}})
    try:
        assert on.overlap_decode and not off.overlap_decode
        ids = on.tokenizer.encode("The river runs through the valley and the town")
        for e in (on, off):
            assert e.wait_settled(60)
            e.generate(ids, max_tokens=2)  # the mailbox opens once placement is done
        for kwargs in (dict(max_tokens=24), dict(max_tokens=20, temperature=1.0, seed=4)):
            assert on.generate(ids, **kwargs).token_ids == off.generate(ids, **kwargs).token_ids
        mode = on.model.graphs.mode()
        assert mode == ("full" if experts == "memory" else "mailbox") and not on.model.graphs.failed
        sched = on.scheduler(max_batch=3, token_budget=64)
        sched.start()
        try:
            ps = [ids, ids[:5], on.tokenizer.encode("Once upon a time"), ids[3:]]
            params = [SamplingParams(max_tokens=18, temperature=1.0, seed=i) for i in range(len(ps))]
            handles = [sched.submit(GenRequest(p, sp)) for p, sp in zip(ps, params, strict=True)]
            got = [[e.token_id for e in h.iter_events(timeout=120) if e.token_id is not None] for h in handles]
        finally:
            sched.stop()
        for p, sp, tokens in zip(ps, params, got, strict=True):
            assert tokens == off.generate(p, max_tokens=18, temperature=1.0, seed=sp.seed).token_ids
        assert sched.chained_steps > 0
    finally:
        on.close()
        off.close()
