"""The public Engine API on the tiny demo model: generate, stream, chat, score, stats, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata import ConfigError, Engine, RequestError, StrataError


def test_generate_returns_text_ids_and_reason(tiny_engine):
    out = tiny_engine.generate("The river runs", max_tokens=12)
    assert out.finish_reason in ("stop", "length")
    assert len(out.token_ids) <= 12
    assert out.text == tiny_engine.tokenizer.decode(out.token_ids)
    assert out.prompt_tokens == len(tiny_engine.tokenizer.encode("The river runs"))


def test_greedy_is_deterministic_and_matches_score(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("Once upon a time")
    a = tiny_engine.generate(prompt, max_tokens=10)
    b = tiny_engine.generate(prompt, max_tokens=10)
    assert a.token_ids == b.token_ids
    # greedy token t+1 is the argmax of score over prompt + tokens[:t]
    if a.token_ids:
        logp = tiny_engine.score(prompt + a.token_ids[:-1])
        assert logp[len(prompt) - 1 :].argmax(-1).tolist() == a.token_ids


def test_score_is_log_probabilities(tiny_engine):
    ids = tiny_engine.tokenizer.encode("a b c d e f g")
    logp = tiny_engine.score(ids)
    assert logp.shape == (len(ids), tiny_engine.checkpoint.config.vocab_size)
    assert logp.dtype == torch.float32
    assert torch.allclose(logp.exp().sum(-1), torch.ones(len(ids)), atol=1e-4)
    # scoring a prefix gives the same rows (causality; nothing leaks from later tokens)
    assert torch.allclose(tiny_engine.score(ids[:3]), logp[:3], atol=1e-5)


def test_stream_pieces_join_to_generate(tiny_engine):
    kwargs = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    pieces = list(tiny_engine.stream("Tell me", **kwargs))
    assert "".join(pieces) == tiny_engine.generate("Tell me", **kwargs).text


def test_seed_reproducible_and_varies(tiny_engine):
    kwargs = dict(max_tokens=16, temperature=1.5)
    a = tiny_engine.generate("Hello", seed=1, **kwargs).token_ids
    assert a == tiny_engine.generate("Hello", seed=1, **kwargs).token_ids
    others = {tuple(tiny_engine.generate("Hello", seed=s, **kwargs).token_ids) for s in range(2, 6)}
    assert others != {tuple(a)}


def test_stop_string_truncates_and_reports_stop(tiny_engine):
    full = tiny_engine.generate("The", max_tokens=24, temperature=1.0, seed=3)
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = tiny_engine.generate("The", max_tokens=24, temperature=1.0, seed=3, stop=[stop])
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert full.text.startswith(out.text)
    assert out.text == full.text[: full.text.index(stop)]


def test_stop_token_ids_end_generation(tiny_engine):
    full = tiny_engine.generate("The", max_tokens=20, temperature=1.0, seed=5)
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = tiny_engine.generate("The", max_tokens=20, temperature=1.0, seed=5, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[:first]
    assert out.finish_reason == "stop"


def test_eos_ends_generation_without_being_emitted(tiny_model_dir):
    """Declare the greedy continuation's first token EOS: generation must stop before emitting it."""
    engine = Engine.from_pretrained(tiny_model_dir, device="cpu")
    assert engine.eos_token_ids >= set(engine.checkpoint.eos_token_ids)  # config + generation_config
    prompt = engine.tokenizer.encode("x y z")
    greedy = engine.generate(prompt, max_tokens=6)
    engine.eos_token_ids = {greedy.token_ids[3]}
    out = engine.generate(prompt, max_tokens=6)
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(greedy.token_ids[3])]
    assert out.finish_reason == "stop"


def test_context_full_reports_length(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, config={"runtime": {"max_context": 20}}, device="cpu")
    prompt = list(range(3, 18))  # 15 tokens
    out = engine.generate(prompt, max_tokens=50, stop_token_ids=[])
    assert len(prompt) + len(out.token_ids) <= 21 and out.finish_reason in ("length", "stop")
    with pytest.raises(RequestError, match="context"):
        engine.generate(list(range(3, 25)), max_tokens=2)
    with pytest.raises(RequestError, match="context"):
        engine.score(list(range(3, 30)))


def test_chat_applies_template(tiny_engine):
    messages = [{"role": "user", "content": "hi"}]
    out = tiny_engine.chat(messages, max_tokens=8)
    rendered = tiny_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tiny_engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.token_ids == tiny_engine.generate(ids, max_tokens=8).token_ids
    assert out.prompt_tokens == len(ids)


def test_stats_counts_requests(tiny_engine):
    before = tiny_engine.stats()
    tiny_engine.generate("count me", max_tokens=3)
    after = tiny_engine.stats()
    assert after["requests"] == before["requests"] + 1
    assert after["prompt_tokens"] > before["prompt_tokens"]
    assert after["device"] == "cpu" and after["dtype"] == "float32" and after["model_type"] == "deepseek_v3"


def test_generation_runs_one_forward_per_token_after_the_first(tiny_engine, monkeypatch):
    """n tokens take the prefill and n - 1 decode steps (the first token comes from the prefill's logits; no
    step runs for logits nobody samples), and the stats count those n - 1 as decode tokens."""
    calls = []
    forward = tiny_engine.model.forward
    monkeypatch.setattr(tiny_engine.model, "forward", lambda *a, **k: calls.append(a[0].shape[0]) or forward(*a, **k))
    before = tiny_engine.stats()
    out = tiny_engine.generate([5, 6, 7, 8], max_tokens=5, temperature=1.0, seed=0, stop_token_ids=[])
    after = tiny_engine.stats()
    assert len(out.token_ids) == 5
    assert calls == [4, 1, 1, 1, 1]
    assert after["decode_tokens"] - before["decode_tokens"] == 4


@pytest.mark.parametrize(
    "kwargs, param",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_k": -2}, "top_k"), ({"stop": [""]}, "stop")],
)
def test_bad_sampling_arguments(tiny_engine, kwargs, param):
    with pytest.raises(RequestError, match=param):
        tiny_engine.generate("x", **kwargs)


def test_bad_prompts(tiny_engine):
    vocab = tiny_engine.checkpoint.config.vocab_size
    with pytest.raises(RequestError, match="vocabulary"):
        tiny_engine.generate([1, vocab + 5])
    with pytest.raises(RequestError, match="empty"):
        tiny_engine.generate([])
    with pytest.raises(RequestError, match="must be integers"):
        tiny_engine.generate(["a", None])
    with pytest.raises(RequestError, match="must be integers"):
        tiny_engine.generate([1, 2.7])  # never cut down to 2
    with pytest.raises(RequestError, match="string or a list of token ids, got int"):
        tiny_engine.generate(5)
    assert tiny_engine.check_token_ids([np.int64(3), torch.tensor(4)]) == [3, 4]  # numpy's and 0-d tensors' ints


def test_bad_config(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="runtime.nope"):
        Engine.from_pretrained(tiny_model_dir, config={"runtime": {"nope": 1}})
    with pytest.raises(ConfigError, match="max_context"):
        Engine.from_pretrained(tiny_model_dir, config={"runtime": {"max_context": "big"}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        Engine.from_pretrained(tiny_model_dir, config=bad)
    good = tmp_path / "good.toml"
    good.write_text("[runtime]\nmax_context = 64\n")
    assert Engine.from_pretrained(tiny_model_dir, config=good, device="cpu").max_context == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(StrataError, match="no CUDA GPU"):
        Engine.from_pretrained(tiny_model_dir, device="cuda")


def test_default_model_is_built_on_first_use(tmp_path, monkeypatch):
    """`Engine.from_pretrained()` with no path runs the trained demo model shipped in the package, its store built
    in the cache dir on first use."""
    from strata.runtime.demo.model import TRAINED_DIR

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    engine = Engine.from_pretrained(device="cpu")
    assert str(engine.checkpoint.directory).startswith(str(tmp_path))
    assert engine.checkpoint.directory.name.startswith(f"{TRAINED_DIR.name}-")
    assert engine.generate("hi", max_tokens=2).finish_reason in ("stop", "length")


def test_reproducible_generation_takes_the_exact_path_and_restores_it(tiny_engine, monkeypatch):
    compute = tiny_engine.executor
    assert compute is not None and compute.reproducible is False
    modes = []  # the compute's mode in each forward pass
    forward = tiny_engine.model.forward
    monkeypatch.setattr(tiny_engine.model, "forward", lambda *a, **k: modes.append(compute.reproducible) or forward(*a, **k))
    kwargs = dict(max_tokens=8, temperature=0.8, seed=4)
    a = tiny_engine.generate("Tell me", reproducible=True, **kwargs)
    assert modes and all(modes)  # every pass of the request
    modes.clear()
    tiny_engine.generate("Tell me", **kwargs)
    assert modes and not any(modes)  # and only its passes
    monkeypatch.undo()
    assert compute.reproducible is False
    before = tiny_engine.stats()["cpu_experts_computed"]
    assert a.token_ids == tiny_engine.generate("Tell me", reproducible=True, **kwargs).token_ids
    if compute.fast_cpu:  # the forked CPU kernel computed nothing: the reference math did
        assert tiny_engine.stats()["cpu_experts_computed"] == before
    messages = [{"role": "user", "content": "hi"}]
    ids = tiny_engine.tokenizer.encode(tiny_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                       add_special_tokens=False)
    assert tiny_engine.chat(messages, reproducible=True, **kwargs).token_ids == \
        tiny_engine.generate(ids, reproducible=True, **kwargs).token_ids
    with pytest.raises(RequestError, match="reproducible"):
        tiny_engine.generate("Hi", reproducible="yes")
    assert compute.reproducible is False


def test_stacking_parameters_into_views_keeps_their_values():
    """The q/k/v fold's helpers: stacked rows equal the parameters, which become views of them (one copy in
    memory), and a parameter replaced afterwards breaks the view check so the stack is rebuilt."""
    from torch import nn

    from strata.runtime.model.attention import _stack_into_views, _views_of

    params = [nn.Parameter(torch.randn(n, 8), requires_grad=False) for n in (6, 2, 2)]
    before = [p.detach().clone() for p in params]
    stacked = _stack_into_views(params)
    assert torch.equal(stacked, torch.cat(before)) and _views_of(stacked, params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    stacked[7].fill_(3.0)  # row 7 is k's second row: a view, so k sees it
    assert torch.equal(params[1][1], torch.full((8,), 3.0))
    params[2].data = torch.zeros(2, 8)
    assert not _views_of(stacked, params)


def test_an_engine_left_open_exits_cleanly(tiny_model_dir):
    """A script that loads a tiered engine and exits without closing it (its tier manager still placing
    experts) exits with 0: open engines are closed at exit, before the interpreter kills their threads inside
    torch (which aborted the process with "terminate called without an active exception")."""
    import subprocess
    import sys

    script = ("import sys; from strata import Engine; "
              "Engine.from_pretrained(sys.argv[1], config={'tiers': {'disk': {'scrub': False}}}, device='cpu'); "
              "print('loaded')")
    for _ in range(2):  # the abort depends on thread timing: two runs to catch it
        proc = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
        # and quietly: objects from_pretrained froze and nobody unfroze are never freed, which Triton's nanobind
        # (imported by torch where installed) reported at exit as hundreds of lines of "leaked instance"
        assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def _run_to_exit(script: str, model_dir) -> None:
    """Run `script` (given the model directory) in a process of its own: it prints "exiting" and exits with 0,
    not aborted ("terminate called without an active exception", a daemon thread stopped inside torch)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", script, str(model_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr


def test_exiting_while_a_request_runs_cancels_it_and_exits_cleanly(tiny_model_dir):
    """A script that exits with a long request still decoding exits with 0 and at once: the step thread is stopped
    at exit (its request cancelled) and joined, not killed inside torch (an abort) nor left to finish the request."""
    import time

    script = """
import sys
from strata import Engine
engine = Engine.from_pretrained(sys.argv[1], config={"tiers": {"disk": {"scrub": False}}}, device="cpu")
stream = engine.stream([5, 6, 7], max_tokens=100000)
next(iter(stream))
print("exiting", flush=True)
"""
    for _ in range(3):  # the abort depended on where the step thread was: a few runs
        t0 = time.monotonic()
        _run_to_exit(script, tiny_model_dir)
        assert time.monotonic() - t0 < 120  # 100,000 tokens were not generated


def test_an_engine_freed_on_the_step_thread_is_freed_before_exit(tiny_model_dir, tmp_path):
    """The step thread often holds the last reference to its engine as the main thread exits; freeing the engine's
    tensors on a thread the interpreter stops at exit aborted the process. The exit now waits for that thread: an
    object freed with the engine, slow to free, still finishes (it writes a mark)."""

    mark = tmp_path / "freed"
    script = f"""
import sys, threading, time
from strata import Engine
from strata.runtime.generation.scheduler import Scheduler

class SlowToFree:
    def __del__(self):
        time.sleep(0.5)  # the main thread reaches exit meanwhile
        open({str(mark)!r}, "w").write("done")

main_dropped = threading.Event()
real_run = Scheduler._run
def run_then_drop(self):
    engine = self.engine
    real_run(self)
    main_dropped.wait(10)
    del engine  # the last reference: the engine is freed on this thread
Scheduler._run = run_then_drop

engine = Engine.from_pretrained(sys.argv[1], config={{"tiers": {{"disk": {{"scrub": False}}}}}}, device="cpu")
engine.slow_to_free = SlowToFree()
engine.generate([5, 6, 7], max_tokens=2)
del engine
main_dropped.set()
print("exiting")
"""
    _run_to_exit(script, tiny_model_dir)
    assert mark.exists() and mark.read_text() == "done", "the engine's freeing was cut off at exit"


def test_closing_or_dropping_an_engine_unfreezes_what_loading_froze(tiny_model_dir):
    import gc

    from strata.engine import Engine

    for drop in (False, True):
        engine = Engine.from_pretrained(tiny_model_dir, config={"tiers": {"disk": {"scrub": False}}}, device="cpu")
        assert gc.get_freeze_count() > 0
        if drop:
            engine._release()  # what the finalizer runs for an engine dropped or left open at exit
        else:
            engine.close()
        assert gc.get_freeze_count() == 0


def test_a_failed_load_stops_the_tier_threads_it_started(tiny_model_dir, monkeypatch):
    """A load that fails (or is interrupted) after the tier manager started closes it: its threads would otherwise
    run on in a process that goes on, and be stopped inside torch at exit, which aborts the process."""
    import threading

    import strata.runtime.plan.build as build

    def fail(*args, **kwargs):
        raise RuntimeError("the weights could not be read")

    before = {t.ident for t in threading.enumerate()}
    monkeypatch.setattr(build, "load_model", fail)
    with pytest.raises(RuntimeError, match="could not be read"):
        Engine.from_pretrained(tiny_model_dir, config={"tiers": {"disk": {"scrub": False}}}, device="cpu")
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [name for name in left if name.startswith("strata-")], left


def test_a_bad_tokenizer_file_frees_the_loaded_tiers(tiny_model_dir, tmp_path):
    """The tokenizer loads after the model: when its file is bad, the one-line error comes and the tier manager the
    model load started is closed, not left running."""
    import shutil
    import threading

    bad = tmp_path / "bad-tokenizer"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "tokenizer.json").write_text("{not json")
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(StrataError, match="tokenizer"):
        Engine.from_pretrained(bad, config={"tiers": {"disk": {"scrub": False}}}, device="cpu")
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [name for name in left if name.startswith("strata-")], left
