"""Bad requests get OpenAI-shaped errors with the right status, and never take the server down."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from test_server import CHAT, MODEL, start_live_server


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    srv = start_live_server(tiny_model_dir)
    yield srv
    srv.close()


def _post(live, path: str, body, **kw) -> httpx.Response:
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()  # Python's json writes Infinity, as some clients do
    return httpx.post(live.url + path, content=body, headers={"content-type": "application/json"}, timeout=30, **kw)


def _assert_error(r: httpx.Response, status: int, param: str | None = "", code: str | None = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param != "":
        assert err["param"] == param, err
    if code != "":
        assert err["code"] == code, err
    return err


def _good(live) -> None:
    r = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


CHAT_BASE = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
COMP_BASE = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}

# (field, bad value, the `param` the error must name); every field with a wrong type or an out-of-range value
CHAT_BAD = [
    ("model", 5, "model"), ("messages", "hi", "messages"), ("messages", ["hi"], "messages.0"),
    ("messages", [{"content": "no role"}], "messages.0.role"), ("messages", [{"role": "user", "content": 5}], "messages.0.content"),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}], "messages"),
    ("stream", "yes", "stream"), ("stream", 1, "stream"), ("n", 0, "n"), ("n", 17, "n"), ("n", "2", "n"),
    ("n", 2.5, "n"), ("max_tokens", -1, "max_tokens"), ("max_tokens", 0, "max_tokens"),
    ("max_tokens", "4", "max_tokens"), ("max_tokens", True, "max_tokens"), ("max_tokens", 1.5, "max_tokens"),
    ("max_completion_tokens", -5, "max_tokens"), ("temperature", -1, "temperature"),
    ("temperature", "hot", "temperature"), ("temperature", True, "temperature"), ("temperature", 1e999, "temperature"),
    ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"), ("top_p", [1], "top_p"), ("top_k", -1, "top_k"),
    ("top_k", 2.5, "top_k"), ("seed", "x", "seed"), ("seed", 1.5, "seed"), ("stop", 5, "stop"),
    ("stop", [""], "stop"), ("stop", ["s"] * 17, "stop"), ("stop", {"a": 1}, "stop"), ("logprobs", "yes", "logprobs"),
    ("top_logprobs", 21, "top_logprobs"), ("top_logprobs", 2, "top_logprobs"), ("top_logprobs", -1, "top_logprobs"), ("stop_token_ids", [-1], "stop_token_ids"),
    ("ignore_eos", "no", "ignore_eos"), ("stream_options", {"include_usage": True}, "stream_options"),
    ("stream_options", "yes", "stream_options"), ("strata_reproducible", "always", "strata_reproducible"),
    ("strata_reproducible", True, "strata_reproducible"), ("strata_reproducible", "preferred", "strata_reproducible"),
    ("strata_reproducible", 1, "strata_reproducible"),
    ("chat_template_kwargs", [1], "chat_template_kwargs"),
    # OpenAI fields strata does not implement, sent with a value that would change the output
    ("logit_bias", {"5": 100}, "logit_bias"), ("logit_bias", "x", "logit_bias"),
    ("presence_penalty", 0.5, "presence_penalty"), ("frequency_penalty", -1, "frequency_penalty"),
    ("frequency_penalty", True, "frequency_penalty"), ("response_format", {"type": "yaml"}, "response_format"),
    ("response_format", {"type": "json_schema", "json_schema": {}}, "response_format"),
    ("response_format", "json", "response_format"),
    ("tools", [{"type": "retrieval"}], "tools.0"), ("tools", "f", "tools"), ("functions", [{"name": 5}], "functions.0"),
    ("tool_choice", "sometimes", "tool_choice"), ("tool_choice", "required", "tool_choice"),
    ("function_call", {"name": "f"}, "function_call"), ("parallel_tool_calls", "yes", "parallel_tool_calls"),
    ("messages", [{"role": "assistant", "tool_calls": [{"id": "x"}]}], "messages.0.tool_calls.0"),
]
COMP_BAD = [
    ("prompt", 5, "prompt"), ("prompt", [], "prompt"), ("prompt", [[]], "prompt"), ("prompt", [-1], "prompt"),
    ("prompt", [10**9], "prompt"), ("prompt", [1.5], "prompt"), ("prompt", None, "prompt"), ("prompt", "", "prompt"),
    ("echo", "yes", "echo"), ("logprobs", 21, "logprobs"), ("logprobs", -1, "logprobs"), ("logprobs", True, "logprobs"),
    ("suffix", "tail", "suffix"), ("max_tokens", -3, "max_tokens"), ("n", -1, "n"),
    ("best_of", 3, "best_of"), ("logit_bias", {"1": 5}, "logit_bias"), ("presence_penalty", 1, "presence_penalty"),
]


@pytest.mark.parametrize("field,value,param", CHAT_BAD, ids=[f"{f}={v!r}"[:40] for f, v, _ in CHAT_BAD])
def test_chat_bad_fields_are_400(live, field, value, param):
    err = _assert_error(_post(live, "/v1/chat/completions", {**CHAT_BASE, field: value}), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("field,value,param", COMP_BAD, ids=[f"{f}={v!r}"[:40] for f, v, _ in COMP_BAD])
def test_completions_bad_fields_are_400(live, field, value, param):
    err = _assert_error(_post(live, "/v1/completions", {**COMP_BASE, field: value}), 400)
    if param is not None:
        assert err["param"] == param, err


def test_unimplemented_openai_fields_pass_when_neutral(live):
    """What many clients always send (an empty bias, zero penalties, text output, tools with tool_choice "none",
    best_of equal to n) changes nothing, so it is served; the same fields set otherwise are 400s (above)."""
    neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"},
               "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none", "functions": []}
    r = _post(live, "/v1/chat/completions", {**CHAT_BASE, **neutral})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
    r = _post(live, "/v1/chat/completions", {**CHAT_BASE, "functions": [{"name": "f"}], "function_call": "none"})
    assert r.status_code == 200, r.text
    r = _post(live, "/v1/completions", {**COMP_BASE, "n": 2, "best_of": 2, "logit_bias": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    err = _assert_error(_post(live, "/v1/chat/completions", {**CHAT_BASE, "response_format": {"type": "yaml"}}),
                        400, "response_format")
    assert "json_object" in err["message"] and "json_schema" in err["message"]
    _good(live)


def test_sampling_errors_reuse_sampling_params_messages(live):
    from strata.errors import RequestError
    from strata.runtime.generation.sampler import SamplingParams

    with pytest.raises(RequestError) as e:
        SamplingParams(temperature="hot")
    err = _assert_error(_post(live, "/v1/chat/completions", {**CHAT_BASE, "temperature": "hot"}), 400, "temperature")
    assert err["message"] == str(e.value)


@pytest.mark.parametrize("body", [b"", b"{", b"\x00\xff\xfe binary garbage \x89PNG", b"[1, 2]", b'"text"', b"null",
                                  b'{"model": "\xff"}', b"[" * 100_000, b"{" + b"a" * 1000])
def test_malformed_bodies_are_400(live, body):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        _assert_error(_post(live, path, body), 400, param=None)


def test_model_missing_is_400_and_unknown_is_404(live):
    _assert_error(_post(live, "/v1/chat/completions", {"messages": CHAT}), 400, "model")
    err = _assert_error(_post(live, "/v1/chat/completions", {**CHAT_BASE, "model": "gpt-4"}), 404, "model",
                        "model_not_found")
    assert "gpt-4" in err["message"]
    _assert_error(_post(live, "/v1/completions", {**COMP_BASE, "model": "nope"}), 404, "model", "model_not_found")
    _assert_error(_post(live, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model")


def test_empty_messages_and_context_length(live):
    _assert_error(_post(live, "/v1/chat/completions", {**CHAT_BASE, "messages": []}), 400, "messages")
    ctx = live.engine.max_context
    err = _assert_error(_post(live, "/v1/chat/completions", {**CHAT_BASE, "max_tokens": 10**30}), 400, "messages",
                        "context_length_exceeded")
    assert str(ctx) in err["message"]
    _assert_error(_post(live, "/v1/completions", {**COMP_BASE, "max_tokens": ctx}), 400, "prompt",
                  "context_length_exceeded")
    _assert_error(_post(live, "/v1/completions", {**COMP_BASE, "prompt": [5] * (ctx + 1)}), 400, "prompt",
                  "context_length_exceeded")
    long_text = "hello " * ctx  # longer than the context once tokenized; no max_tokens given
    _assert_error(_post(live, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                     "content": long_text}]}),
                  400, "messages", "context_length_exceeded")


def test_reproducible_sampling_without_a_seed_is_400(live):
    body = {**COMP_BASE, "strata_reproducible": "required", "temperature": 0.8}
    err = _assert_error(_post(live, "/v1/completions", body), 400, "seed")
    assert "seed" in err["message"]
    for ok in ({"seed": 3}, {"temperature": 0}):
        assert _post(live, "/v1/completions", {**body, **ok}).status_code == 200


def test_other_routes_errors(live):
    _assert_error(httpx.get(live.url + "/v1/nothing-here"), 404)
    _assert_error(httpx.get(live.url + "/v1/chat/completions"), 405)
    _assert_error(_post(live, "/detokenize", {"tokens": [1, 10**9]}), 400, "tokens")
    _assert_error(_post(live, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    _assert_error(_post(live, "/tokenize", {"prompt": "x", "messages": CHAT}), 400)
    _assert_error(_post(live, "/v1/completions", {**COMP_BASE, "prompt": ["a"] * 8, "n": 16}), 400, "n")


def test_oversized_body_is_413(live):
    body = b'{"model": "' + b"x" * (33 << 20) + b'"}'
    _assert_error(_post(live, "/v1/chat/completions", body), 413)


def test_queue_full_is_429_and_a_request_past_the_queue_is_400(live):
    """A scheduler that never runs fills its queue deterministically: a request that does not fit now is a 429 with
    Retry-After and queues none of its sequences; one with more sequences than the queue holds is a 400 naming it."""
    from fastapi.testclient import TestClient

    from strata.runtime.generation.sampler import SamplingParams
    from strata.runtime.generation.scheduler import GenRequest, Scheduler
    from strata.server.app import create_app

    # a scheduler of its own, never started: nothing leaves its queue
    sched = Scheduler(live.engine, max_batch=1, token_budget=8, max_queue=2)
    with TestClient(create_app(live.engine, sched, MODEL)) as client:
        err = _assert_error(client.post("/v1/completions", json={**COMP_BASE, "n": 3}), 400, "n", "too_many_sequences")
        assert "at most 2" in err["message"] and "--max-queue" in err["message"] and "never" in err["message"]
        err = _assert_error(client.post("/v1/completions", json={**COMP_BASE, "prompt": ["a", "b", "c"]}), 400, "n")
        assert "3 prompt(s) x n=1" in err["message"]
        assert sched.stats()["waiting"] == 0
        sched.submit(GenRequest(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=1)))  # waits for good
        r = client.post("/v1/completions", json={**COMP_BASE, "n": 2})
        err = _assert_error(r, 429, code="queue_full")
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
        assert sched.stats()["waiting"] == 1  # all or none: nothing of the refused request was queued


def test_http_level_garbage_and_the_server_keeps_serving(live):
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n")
        s.recv(1024)  # uvicorn answers 400 or closes; either way it must survive
    with socket.create_connection((host, int(port)), timeout=5) as s:  # a client that hangs up mid-body
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
    _good(live)
    r = _post(live, "/v1/completions", {**COMP_BASE, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    assert httpx.get(live.url + "/health").status_code == 200


def test_server_survives_every_bad_request_above(live):
    # run all bad bodies again back to back, interleaved with good requests: nothing stalls or dies
    for field, value, _ in CHAT_BAD[::3]:
        _post(live, "/v1/chat/completions", {**CHAT_BASE, field: value})
    _good(live)
    json.dumps(httpx.get(live.url + "/v1/strata/stats").json())
    assert live.metric("strata:num_requests_running") == 0


def test_a_failed_step_is_an_error_not_an_empty_answer(live):
    """A fault inside a scheduler step reaches the client with its message: a 500, or an error chunk mid-stream."""
    from fastapi.testclient import TestClient

    from strata.server.app import create_app

    def fail() -> None:
        raise RuntimeError("boom in the step")

    from strata.runtime.generation.scheduler import Scheduler

    sched = Scheduler(live.engine, max_batch=1, token_budget=8, max_queue=4)  # its own: the live one keeps serving
    sched._step = fail
    sched.start()
    try:
        with TestClient(create_app(live.engine, sched, MODEL)) as client:
            err = _assert_error(client.post("/v1/completions", json={**COMP_BASE, "max_tokens": 2}), 500)
            assert "boom in the step" in err["message"]
            r = client.post("/v1/completions", json={**COMP_BASE, "max_tokens": 2, "stream": True})
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert "boom in the step" in chunks[-1]["error"]["message"]
    finally:
        sched.stop()
