"""The Engine's calls on its scheduler: streams on several threads, and several on one thread, decode together; a
stream closed early frees its KV slot; generate and score run while a stream is open; faults reach the caller;
and a checkpoint without tokenizer files serves token ids."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from strata import Engine, RequestError, StrataError

PROMPTS = ([5, 17, 42, 9, 88, 3], [7, 7, 120, 31, 64])


def bounded(fn, timeout: float = 120.0):
    """Run `fn` on a thread of its own and return its result; a call that deadlocks fails the test instead of
    hanging it."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', 'the call')} did not finish in {timeout:.0f} s (deadlocked)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    pause = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if condition():
            return True
        pause.wait(0.005)
    return condition()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The tiny model with two KV slots (planner.max_batch) and no EOS, so every request runs to max_tokens."""
    eng = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"planner": {"max_batch": 2}})
    eng.eos_token_ids = set()
    yield eng
    eng.close()


def spy_passes(engine, monkeypatch, gate: threading.Event | None = None) -> list[list[int]]:
    """Record each forward pass's per-sequence token counts; with `gate`, passes wait until it is set."""
    passes: list[list[int]] = []
    forward = engine.model.forward

    def spy(ids, batch, cache):
        assert gate is None or gate.wait(60), "the gate was never opened"
        passes.append(list(batch.lengths))
        return forward(ids, batch, cache)

    monkeypatch.setattr(engine.model, "forward", spy)
    return passes


def test_the_engine_has_one_scheduler_sized_by_the_planner(engine):
    sched = engine.scheduler()
    assert sched is engine.scheduler() and sched.max_batch == 2  # planner.max_batch
    steps = sched.stats()["steps"]
    engine.generate(PROMPTS[0], max_tokens=3)
    assert sched.stats()["steps"] > steps  # generate ran on it
    assert not hasattr(engine, "cache")  # no KV cache of the engine's own beside the scheduler's


def test_engine_scheduler_configures_that_same_scheduler(engine):
    sched = engine.scheduler()
    try:
        assert engine.scheduler(max_batch=3, token_budget=48) is sched
        assert sched.cache.num_slots == 3 and sched.stats()["kv_slots_free"] == 3 and sched.token_budget == 48
        s = engine.stream(PROMPTS[0], max_tokens=2000)
        next(s)
        with pytest.raises(StrataError, match="1 request.* in flight"):
            engine.scheduler(max_batch=2)
        assert engine.scheduler(max_batch=3) is sched  # the same sizes: nothing to change
        s.close()
        assert wait_for(lambda: sched.stats()["running"] == 0)
    finally:
        engine.scheduler(max_batch=2, token_budget=engine.prefill_chunk)
    assert sched.cache.num_slots == 2 and engine.generate(PROMPTS[1], max_tokens=3).finish_reason == "length"


def test_two_threads_streaming_at_once_both_progress(engine, monkeypatch):
    """Each thread opens a stream and reads one piece, then waits for the other to have one too: under a lock held
    across a stream's yields the second stream could not start until the first was closed (the barrier breaks).
    The model's passes wait until both are queued, so their decode steps share passes."""
    gate = threading.Event()
    passes = spy_passes(engine, monkeypatch, gate)
    opened = threading.Barrier(2, action=gate.set, timeout=60)
    both_have_tokens = threading.Barrier(2, timeout=60)
    results: dict[int, tuple[str, list[int], str]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with engine.stream(PROMPTS[i], max_tokens=12, temperature=1.0, seed=10 + i) as s:
                opened.wait()
                first = next(s)
                both_have_tokens.wait()  # neither stream is read to its end before both have a piece
                results[i] = (first + "".join(s), s.output.token_ids, s.output.finish_reason)
        except BaseException as e:  # noqa: BLE001 - reported on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors and len(results) == 2, errors
    monkeypatch.undo()
    assert [1, 1] in passes  # a pass decoded both sequences
    for i in range(2):
        solo = engine.generate(PROMPTS[i], max_tokens=12, temperature=1.0, seed=10 + i)
        assert results[i] == (solo.text, solo.token_ids, "length")


def test_two_streams_on_one_thread_consumed_alternately(engine):
    def alternate():
        streams = [engine.stream(p, max_tokens=10, temperature=0.9, seed=3) for p in PROMPTS]
        pieces: list[list[str]] = [[], []]
        live = [0, 1]
        while live:
            for i in list(live):
                try:
                    pieces[i].append(next(streams[i]))
                except StopIteration:
                    live.remove(i)
        return ["".join(p) for p in pieces], [s.output for s in streams]

    texts, outputs = bounded(alternate)
    for p, text, out in zip(PROMPTS, texts, outputs, strict=True):
        want = engine.generate(p, max_tokens=10, temperature=0.9, seed=3)
        assert text == out.text == want.text and out.token_ids == want.token_ids and len(out.token_ids) == 10


@pytest.mark.parametrize("how", ["close", "break"])
def test_a_stream_closed_early_frees_its_slot(engine, how):
    sched = engine.scheduler()
    before = engine.stats()["generated_tokens"]
    if how == "close":
        s = engine.stream(PROMPTS[0], max_tokens=2000)
        next(s)
        s.close()
        with pytest.raises(StopIteration):
            next(s)
    else:
        for _ in engine.stream(PROMPTS[0], max_tokens=2000):
            break
    assert wait_for(lambda: sched.stats()["kv_slots_free"] == sched.max_batch), sched.stats()
    assert engine.stats()["generated_tokens"] - before < 2000  # cancelled, not run to its end
    assert engine.generate(PROMPTS[1], max_tokens=3).finish_reason == "length"  # and the slot serves again


def test_generate_and_score_while_a_stream_is_open_on_the_same_thread(engine):
    def during():
        with engine.stream(PROMPTS[0], max_tokens=8) as s:
            first = next(s)
            out = engine.generate(PROMPTS[1], max_tokens=8)
            logp = engine.score(PROMPTS[1] + out.token_ids)
            rest = "".join(s)
            return first + rest, s.output.token_ids, out, logp

    text, ids, out, logp = bounded(during)
    alone = engine.generate(PROMPTS[0], max_tokens=8)
    assert (text, ids) == (alone.text, alone.token_ids)
    assert out.token_ids == engine.generate(PROMPTS[1], max_tokens=8).token_ids
    assert torch.equal(logp, engine.score(PROMPTS[1] + out.token_ids))
    n = len(PROMPTS[1])
    assert logp[n - 1 : -1].argmax(-1).tolist() == out.token_ids  # greedy: each token the argmax of its position


def test_a_fault_in_a_step_reaches_the_caller(engine, monkeypatch):
    forward = engine.model.forward

    def failing(ids, batch, cache):
        if all(n == 1 for n in batch.lengths):  # decode steps fail; prefills run
            raise RuntimeError("device fault in a decode step")
        return forward(ids, batch, cache)

    monkeypatch.setattr(engine.model, "forward", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        bounded(lambda: engine.generate(PROMPTS[0], max_tokens=4))
    s = engine.stream(PROMPTS[1], max_tokens=4)
    with pytest.raises(RuntimeError, match="device fault"):
        bounded(lambda: list(s))

    def prefill_fails(ids, batch, cache):
        raise ValueError("prefill fault")

    monkeypatch.setattr(engine.model, "forward", prefill_fails)
    with pytest.raises(ValueError, match="prefill fault"):
        bounded(lambda: engine.score(PROMPTS[0]))
    monkeypatch.undo()
    assert engine.generate(PROMPTS[0], max_tokens=4).finish_reason == "length"  # the engine serves on
    with pytest.raises(RequestError, match="max_tokens"):  # bad arguments raise when the stream is made
        engine.stream(PROMPTS[0], max_tokens=0)


def test_a_closed_engine_cancels_its_streams(tiny_model_dir):
    eng = Engine.from_pretrained(tiny_model_dir, device="cpu")
    eng.eos_token_ids = set()
    s = eng.stream(PROMPTS[0], max_tokens=3000)
    next(s)
    eng.close()
    with pytest.raises(StrataError, match="cancelled"):
        bounded(lambda: list(s))


def test_an_engine_dropped_after_generating_is_released(tiny_model_dir):
    """Its scheduler runs no thread once idle and refers to it weakly: dropping the engine frees it (and its
    finalizer releases the tiers), as before it had a scheduler."""
    import weakref

    eng = Engine.from_pretrained(tiny_model_dir, device="cpu")
    eng.generate(PROMPTS[0], max_tokens=3)
    for _ in eng.stream(PROMPTS[1], max_tokens=50):
        break
    alive, released = weakref.ref(eng), eng._release
    del eng
    assert wait_for(lambda: alive() is None) and not released.alive


@pytest.fixture(scope="module")
def untokenized(tiny_model_dir, tmp_path_factory):
    """The tiny demo model without its tokenizer files."""
    d = tmp_path_factory.mktemp("untokenized") / "tiny-untokenized"
    shutil.copytree(tiny_model_dir, d, ignore=shutil.ignore_patterns("tokenizer*", "chat_template.jinja"))
    return d


def test_a_checkpoint_without_tokenizer_files_serves_token_ids(untokenized, tiny_engine):
    ids = tiny_engine.tokenizer.encode("The river runs through")
    with Engine.from_pretrained(untokenized, device="cpu", config={"runtime": {"dtype": "float32"}}) as eng:
        assert eng.tokenizer is None  # (float32, as tiny_engine: the same tokens and scores)
        out = eng.generate(ids, max_tokens=6, temperature=0.8, seed=1, stop_token_ids=[])
        want = tiny_engine.generate(ids, max_tokens=6, temperature=0.8, seed=1)
        assert out.text == "" and out.token_ids == want.token_ids and out.prompt_tokens == len(ids)
        s = eng.stream(ids, max_tokens=6, temperature=0.8, seed=1)
        assert list(s) == [] and s.output.token_ids == want.token_ids and s.output.finish_reason == want.finish_reason
        assert torch.allclose(eng.score(ids), tiny_engine.score(ids), atol=1e-5)
        for call in (lambda: eng.generate("The river"), lambda: eng.stream("The river"),
                     lambda: eng.chat([{"role": "user", "content": "hi"}]),
                     lambda: eng.generate(ids, stop=["x"])):
            with pytest.raises(RequestError) as e:
                call()
            msg = str(e.value)
            assert "no tokenizer (tokenizer.json)" in msg and str(untokenized) in msg and "\n" not in msg
