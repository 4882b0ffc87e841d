"""The OpenAI-compatible server on the tiny demo model: the official `openai` client against a live
uvicorn server (real Engine, real Scheduler), streaming, logprobs, concurrency, disconnects, metrics,
and the `strata serve` command (plan refusal, dry run, port in use, SIGTERM)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

MODEL = "tiny-demo"
CHAT = [{"role": "user", "content": "Tell me about the experts."}]


@dataclass
class LiveServer:
    url: str
    engine: Any
    scheduler: Any
    server: Any
    thread: threading.Thread

    def client(self) -> Any:
        openai = pytest.importorskip("openai")  # the `dev` extra has it; test_server_errors.py does not need it
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert m, f"{name} missing from /metrics"
        return float(m.group(1))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.scheduler.stop(drain=False)
        self.engine.close()


def start_live_server(model_dir, max_batch: int = 8, max_queue: int = 64, config: dict | None = None,
                      token_budget: int = 256) -> LiveServer:
    """A real uvicorn server on a free localhost port, in a thread, serving `model_dir` (the engine's `config`)."""
    from strata import Engine
    from strata.server.app import create_app
    from strata.server.serve import bind_socket

    engine = Engine.from_pretrained(model_dir, device="cpu", config=config)
    sched = engine.scheduler(max_batch=max_batch, token_budget=token_budget, max_queue=max_queue)
    sched.start()
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, sched, MODEL), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, sched, server, thread)


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    srv = start_live_server(tiny_model_dir)
    yield srv
    srv.close()


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", CHAT), **kw)


def test_chat_and_completions(live):
    c = live.client()
    r = _chat(c, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    prompt = live.engine.tokenizer.encode(live.engine.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt)
    assert 1 <= r.usage.completion_tokens <= 12 and r.usage.total_tokens == len(prompt) + r.usage.completion_tokens
    r = c.completions.create(model=MODEL, prompt="The experts of a mixture", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.usage.prompt_tokens == len(live.engine.tokenizer.encode(
        "The experts of a mixture"))
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 10
    # token-id prompts and batches of prompts
    ids = live.engine.tokenizer.encode("The experts of a mixture")
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    r3 = c.completions.create(model=MODEL, prompt=["The experts of a mixture", "Hello"], max_tokens=10, temperature=0)
    assert [ch.index for ch in r3.choices] == [0, 1] and r3.choices[0].text == r.choices[0].text


def test_streaming_matches_whole_and_reports_usage(live):
    c = live.client()
    whole = _chat(c, max_tokens=16, temperature=0)
    chunks = list(_chat(c, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    plain = list(_chat(c, max_tokens=4, temperature=0, stream=True))  # no include_usage: no usage chunk
    assert all(ch.choices for ch in plain)
    whole = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0)
    parts = list(c.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0, stream=True,
                                      stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings(live):
    c = live.client()
    text = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0).choices[0].text
    k = next(k for k in range(2, len(text) - 3) if "\ufffd" not in text[: k + 3] and text.find(text[k:k + 3]) == k)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                             stop=[text[k:k + 3], "never-there"])
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                         stop=text[k:k + 3], stream=True))
    assert "".join(p.choices[0].text for p in streamed) == text[:k]


def test_seeds_reproduce_and_n_uses_consecutive_seeds(live):
    c = live.client()
    a = _chat(c, max_tokens=12, temperature=1.0, seed=123)
    b = _chat(c, max_tokens=12, temperature=1.0, seed=123)
    assert a.choices[0].message.content == b.choices[0].message.content
    multi = _chat(c, max_tokens=12, temperature=1.0, seed=123, n=3)
    solo = [a] + [_chat(c, max_tokens=12, temperature=1.0, seed=seed) for seed in (124, 125)]
    assert [ch.index for ch in multi.choices] == [0, 1, 2]
    assert [ch.message.content for ch in multi.choices] == [r.choices[0].message.content for r in solo]
    assert multi.usage.prompt_tokens == a.usage.prompt_tokens  # the shared prompt counts once
    assert multi.usage.completion_tokens == sum(r.usage.completion_tokens for r in solo)
    streamed = list(_chat(c, max_tokens=12, temperature=1.0, seed=123, n=3, stream=True))
    for i in range(3):
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices and ch.choices[0].index == i)
        assert text == multi.choices[i].message.content


def test_echo_logprobs_equal_engine_score(live):
    c = live.client()
    prompt = "The capital of the experts is"
    ids = live.engine.tokenizer.encode(prompt)
    ref = live.engine.score(ids)
    for max_tokens in (0, 3):  # 0: score the prompt only
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2,
                                 temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < 1e-4
        assert len(lp.tokens) == len(ids) + (r.usage.completion_tokens if max_tokens else 0)
    assert r.usage.completion_tokens == 3 and lp.text_offset[:2] == [0, len(lp.tokens[0])]


def test_generated_token_logprobs(live):
    c = live.client()
    r = _chat(c, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)  # greedy picks the top token
    plain = _chat(c, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None
    streamed = list(_chat(c, max_tokens=8, temperature=0, logprobs=True, top_logprobs=1, stream=True))
    got = [e.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert got == pytest.approx([e.logprob for e in entries], abs=1e-6)
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for top, value in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-6)


def test_eight_concurrent_streams_match_solo_runs(live):
    c = live.client()
    prompts = [f"Story number {i} begins with" for i in range(8)]
    solo = [c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text for p in prompts]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        stream = live.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0,
                                                  stream=True)
        results[i] = "".join(p.choices[0].text for p in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(8)] == solo


def test_reproducible_field_gives_identical_tokens_alone_and_among_others(live):
    """`strata_reproducible: "required"`: the same tokens and log-probabilities (bit for bit) alone and while three
    other streams share the scheduler; "off" is accepted and batched as usual."""
    body = {"model": MODEL, "prompt": "The experts of a mixture", "max_tokens": 16, "temperature": 0.9, "seed": 11,
            "top_p": 0.9, "top_k": 40, "logprobs": 2, "strata_reproducible": "required"}

    def post(b: dict) -> dict:
        r = httpx.post(live.url + "/v1/completions", json=b, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    alone = post(body)
    others: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: others.append(post(
        {"model": MODEL, "prompt": f"Other story {i} and more words", "max_tokens": 200, "temperature": 0.7, "seed": i,
         "ignore_eos": True, "strata_reproducible": "off"}))) for i in range(3)]
    for t in threads:
        t.start()
    assert _wait_for(lambda: live.scheduler.stats()["running"] >= 1, 10)
    inside = post(body)
    for t in threads:
        t.join(60)
    assert len(others) == 3 and inside["text"] == alone["text"]
    assert inside["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
    assert inside["logprobs"]["top_logprobs"] == alone["logprobs"]["top_logprobs"]
    solo = live.engine.generate("The experts of a mixture", max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=11,
                                reproducible=True)
    assert alone["text"] == solo.text


def _wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_client_disconnect_frees_the_sequence(live):
    body = {"model": MODEL, "prompt": "A very long story", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", live.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert live.metric("strata:num_requests_running") == 1
    # 3000 tokens take far longer than this: the sequence was cancelled, not finished
    assert _wait_for(lambda: live.metric("strata:num_requests_running") == 0, 5)
    assert live.metric("strata:kv_slots_free") == live.scheduler.max_batch
    # a non-streaming request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    assert _wait_for(lambda: live.metric("strata:num_requests_running") == 0, 5)
    assert _chat(live.client(), max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_metrics_and_side_routes(live):
    c = live.client()
    _chat(c, max_tokens=4, temperature=0)
    text = httpx.get(live.url + "/metrics").text
    for name in ("strata:num_requests_running", "strata:num_requests_waiting", "strata:prompt_tokens_total",
                 "strata:generation_tokens_total", "strata:time_to_first_token_seconds_bucket",
                 "strata:inter_token_latency_seconds_count", "strata:e2e_request_latency_seconds_sum",
                 "strata:tier_bytes_moved_total{", "strata:tier_bandwidth_bytes_per_second{",
                 "strata:tier_stall_seconds_total{", "strata:prefetch_precision{", "strata:tier_resident_bytes{",
                 "strata:tier_promotions_total{"):
        assert name in text, name
    assert re.search(r'strata:tier_hits_total\{device="cpu",tier="pinned"\} [1-9]', text)
    assert re.search(r'strata:tier_hit_ratio\{device="cpu",tier="pinned"\} ', text)
    assert live.metric("strata:generation_tokens_total") > 0
    assert httpx.get(live.url + "/health").status_code == 200
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    stats = httpx.get(live.url + "/v1/strata/stats").json()
    assert stats["scheduler"]["max_batch"] == 8 and stats["tiers"]["lookups"] > 0
    tok = httpx.post(live.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tok["tokens"] == live.engine.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    chat_tok = httpx.post(live.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat_tok["tokens"] == live.engine.tokenizer.encode(live.engine.tokenizer.apply_chat_template(CHAT),
                                                              add_special_tokens=False)
    detok = httpx.post(live.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "Hello world"}


def test_health_while_loading(live):
    from fastapi.testclient import TestClient

    from strata.server.app import create_app

    app = create_app(None, None, MODEL)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert "strata:server_ready 0.0" in client.get("/metrics").text
        app.state.strata.warming_up = True  # loaded, running its warm-up: still 503, and it says so
        r = client.get("/health")
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        app.state.strata.attach(live.engine, live.scheduler)
        assert client.get("/health").status_code == 200
        assert "strata:server_ready 1.0" in client.get("/metrics").text


def test_reasoning_splitter():
    from strata.server.render import ReasoningSplitter

    def run(pieces, **kw):
        s, r, c = ReasoningSplitter(**kw), [], []
        for p in pieces:
            a, b = s.feed(p)
            r.append(a)
            c.append(b)
        a, b = s.flush()
        return "".join(r) + a, "".join(c) + b

    assert run(["<think>", "plan", " it", "</think>", "\n\nAnswer"]) == ("plan it", "\n\nAnswer")
    assert run(["<th", "ink>pl", "an</th", "ink>ok"]) == ("plan", "ok")  # tags split across deltas
    assert run(["  <think>a</think>b"]) == ("a", "b")
    assert run(["Just", " an answer <think>"]) == ("", "Just an answer <think>")
    assert run(["still thinking", "</think>", "done"], in_reasoning=True) == ("still thinking", "done")
    assert run(["<think>cut off by max_tokens"]) == ("cut off by max_tokens", "")
    assert run(["<"]) == ("", "<")


def test_thinking_goes_to_reasoning_content(live):
    """Chat rendering of thinking text, streamed and whole (the random tiny model never opens <think> itself)."""
    from strata.runtime.generation.scheduler import TokenEvent
    from strata.server.render import ChatFormat, Seq, TokenText

    tok = live.engine.tokenizer
    fmt = ChatFormat(TokenText(tok), logprobs=False, think=True, in_reasoning=False)
    seq = Seq(0, [1, 2], handle=None, timer=None)
    pieces = ["<think>", "let me", " see", "</think>", "The answer", "."]
    deltas = []
    for i, text in enumerate(pieces):
        ev = TokenEvent("r", tok.token_to_id("<think>") if i == 0 else 100 + i, text,
                        finish_reason="stop" if i == len(pieces) - 1 else None)
        seq.finish_reason = ev.finish_reason
        if (d := fmt.on_event(seq, ev)) is not None:
            deltas.append(d["delta"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "let me see"
    assert "".join(d.get("content", "") for d in deltas) == "The answer."
    assert fmt.choices([seq])[0]["message"] == {"role": "assistant", "content": "The answer.",
                                                "reasoning_content": "let me see"}


# ---- `strata serve` ------------------------------------------------------------------------------------


def _serve_argv() -> list[str]:
    """`python -m strata serve` once the CLI has the command, else the module's own entry point."""
    from strata.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return ["-m", "strata", "serve"] if "serve" in sub.choices else ["-m", "strata.server.serve"]


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *_serve_argv(), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def held_port():
    """A port something else is listening on."""
    s = socket.create_server(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


def test_serve_dry_run_prints_plan_and_binds_nothing(tiny_model_dir, held_port):
    r = _serve(str(tiny_model_dir), "--dry-run", "--port", str(held_port))  # the port is taken: dry run never binds
    assert r.returncode == 0, r.stderr
    assert "plan for" in r.stdout and "NUMA:" in r.stdout and "[runtime]" in r.stdout and "[serve]" in r.stdout
    assert f"127.0.0.1:{held_port}/v1" in r.stdout and "max_batch = 8" in r.stdout
    assert "decode_gap_target = 0.5" in r.stdout


def test_serve_takes_a_gguf_file_as_the_other_commands_do(tmp_path, held_port):
    """`strata serve model.gguf` plans the file's store (as generate, plan and Engine.from_pretrained take it); a path
    that is neither a directory nor a .gguf file is a one-line error."""
    from strata.cli import main

    assert main(["demo-model", str(tmp_path / "tiny"), "--size", "tiny", "--no-engram", "--gguf", "q8_0"]) == 0
    r = _serve(str(tmp_path / "tiny" / "model-q8_0.gguf"), "--dry-run", "--port", str(held_port))
    assert r.returncode == 0, r.stderr
    assert "plan for" in r.stdout and "gguf Q8_0" in r.stdout and "would serve 'model-q8_0.gguf'" in r.stdout
    r = _serve(str(tmp_path / "tiny" / "missing.gguf"), "--dry-run")
    assert r.returncode == 2 and "missing.gguf: no such checkpoint, store directory or GGUF file" in r.stderr


def test_serve_dry_run_shows_the_guards_but_never_the_key(tiny_model_dir, held_port):
    r = _serve(str(tiny_model_dir), "--dry-run", "--port", str(held_port), "--api-key", "sekret-123",
               "--allowed-hosts", "box.lan", "--max-tokens-default", "512", "--no-access-log")
    assert r.returncode == 0, r.stderr
    assert "sekret-123" not in r.stdout + r.stderr and 'api_key = "set"' in r.stdout
    assert 'allowed_hosts = "box.lan"' in r.stdout and "max_tokens_default = 512" in r.stdout
    assert "access_log = false" in r.stdout
    r = _serve(str(tiny_model_dir), "--dry-run", "--max-tokens-default", "0")
    assert r.returncode == 2 and "--max-tokens-default" in r.stderr


def test_serve_decode_gap_target_and_no_warmup_flags(tiny_model_dir, held_port):
    r = _serve(str(tiny_model_dir), "--dry-run", "--port", str(held_port), "--decode-gap-target", "0.25")
    assert r.returncode == 0, r.stderr
    assert "decode_gap_target = 0.25" in r.stdout and 'warmup = "auto"' in r.stdout
    r = _serve(str(tiny_model_dir), "--dry-run", "--port", str(held_port), "--no-warmup")
    assert r.returncode == 0 and "warmup = false" in r.stdout, r.stderr
    r = _serve(str(tiny_model_dir), "--dry-run", "--decode-gap-target", "-1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--decode-gap-target" in lines[0]


def test_serve_refuses_a_plan_that_cannot_fit_before_binding(tiny_model_dir, tmp_path, held_port):
    cfg = tmp_path / "big.toml"
    cfg.write_text('[tiers.pinned]\nbudget = "1000TiB"\n')
    r = _serve(str(tiny_model_dir), "--config", str(cfg), "--port", str(held_port))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: error:") and "tiers.pinned.budget" in lines[0]


def test_serve_port_in_use_is_one_line(tiny_model_dir, held_port):
    r = _serve(str(tiny_model_dir), "--port", str(held_port))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: error: cannot listen on 127.0.0.1:")


def test_serve_end_to_end_and_sigterm(tiny_model_dir, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    cfg = tmp_path / "warm.toml"
    cfg.write_text("[runtime]\nwarmup = true\n")  # "auto" warms up on CUDA only; forced here on the CPU
    proc = subprocess.Popen([sys.executable, *_serve_argv(), str(tiny_model_dir), "--port", str(port),
                             "--served-model-name", MODEL, "--shutdown-timeout", "1", "--device", "cpu",
                             "--max-batch", "3", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None
        assert _wait_for(healthy, 60) and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"]
        metrics = httpx.get(url + "/metrics").text
        assert "strata:tier_lookups_total{" in metrics
        # the warm-up's requests are not traffic: the engine's counters (the dashboard's) hold this request alone
        stats = httpx.get(url + "/v1/strata/stats").json()
        assert stats["requests"] == 1 and stats["prompt_tokens"] == r.json()["usage"]["prompt_tokens"], stats
        # a request in flight at SIGTERM: given --shutdown-timeout, then cancelled; the process exits cleanly
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "stream": True}
        started = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                    for _ in r.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(20)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "plan for" in out and "NUMA:" in out and f"127.0.0.1:{port}/v1" in out and "ready in" in out
    assert "warming up (decode batch sizes 1-3" in out and "warmed up in" in out and "decode batch sizes 1-3," in out
    assert out.index("warming up") < out.index("warmed up") < out.index("ready in")
    assert "shut down cleanly" in err
    # the access log is on by default (at the default --log-level warning): one line per request, with its tokens
    usage = r.json()["usage"]
    assert (f'"POST /v1/chat/completions" 200 prompt_tokens={usage["prompt_tokens"]} '
            f'completion_tokens={usage["completion_tokens"]} ') in err
    assert err.count('"GET /v1/strata/stats" 200') == 1


def test_stats_json_is_serialisable(live):
    stats = httpx.get(live.url + "/v1/strata/stats").json()
    json.dumps(stats)
    assert stats["served_model"] == MODEL and "recent_steps" not in stats
    assert stats["scheduler"]["decode_gap_target_s"] == live.engine.config.runtime.decode_gap_target
    _chat(live.client(), max_tokens=2)
    steps = httpx.get(live.url + "/v1/strata/stats?steps=1").json()["recent_steps"]
    assert steps and {"t", "seconds", "decode", "prompt", "passes", "allowance"} <= set(steps[-1])


def test_serve_interrupted_while_loading_exits_at_once_and_cleanly(tiny_model_dir):
    """SIGINT while the model loads: the server stops and the process leaves with 0 at once, without waiting for
    the load. The interpreter used to stop the loading thread inside torch at exit, which aborted the process
    ("terminate called without an active exception")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = f"""
import sys, time, torch
from strata.engine import Engine

real = Engine.from_pretrained
def slow_load(*args, **kwargs):
    print("loading slowly", flush=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        torch.empty(1 << 16)  # inside torch, as a real load is for most of its time
    return real(*args, **kwargs)
Engine.from_pretrained = slow_load

from strata.cli import main
sys.exit(main(["serve", {str(tiny_model_dir)!r}, "--port", "{port}", "--device", "cpu"]))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "loading slowly" in line:
                break
        assert lines and "loading slowly" in lines[-1], "".join(lines) + proc.stderr.read()
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert "shut down while loading the model" in err and "terminate called" not in err
        assert time.monotonic() - t0 < 30  # not after the two-minute load
    finally:
        if proc.poll() is None:
            proc.kill()

