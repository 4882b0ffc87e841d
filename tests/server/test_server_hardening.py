"""The HTTP layer's protections and edges: access log, Host check, API key, JSON-only bodies, lone surrogates, roles,
the unsupported embeddings endpoint, 405's Allow, prompts refused before tokenizing, memory handed back, the chat
max_tokens cap, /health while starting and when experts are damaged, a model without a tokenizer, and the schema."""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from test_server import CHAT, MODEL, start_live_server

from strata.server.app import create_app
from strata.server.guard import HostRule


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    srv = start_live_server(tiny_model_dir)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(live):
    with TestClient(create_app(live.engine, live.scheduler, MODEL)) as c:
        yield c


CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0}


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- access log ----------------------------------------------------------------------------------------


def test_access_log_has_one_line_per_request_with_tokens(client, caplog):
    caplog.set_level(logging.INFO, logger="strata.access")
    r = client.post("/v1/chat/completions", json=CHAT_BODY)
    usage = r.json()["usage"]
    streamed = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                                    "stream": True, "temperature": 0})
    assert streamed.status_code == 200
    client.get("/nothing-here")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "strata.access"]
    assert len(lines) == 3, lines
    assert re.fullmatch(rf'\S+ "POST /v1/chat/completions" 200 prompt_tokens={usage["prompt_tokens"]} '
                        rf'completion_tokens={usage["completion_tokens"]} \d+\.\d{{3}}s', lines[0]), lines[0]
    assert re.search(r'"POST /v1/completions" 200 prompt_tokens=\d+ completion_tokens=2 ', lines[1]), lines[1]
    assert re.fullmatch(r'\S+ "GET /nothing-here" 404 \d+\.\d{3}s', lines[2]), lines[2]


def test_usage_of_a_stream_the_client_left_counts_the_tokens_it_streamed():
    """A client that disconnects mid-stream leaves its sequences without a last event: the access log's usage
    counts the tokens they streamed, not zero."""
    from strata.server.render import CompletionFormat, Seq, TokenText

    fmt = CompletionFormat(TokenText(None), None, False, False, ["hello there"], n=1)
    left = Seq(0, [5, 6, 7, 8], handle=None, timer=None, tokens=7)
    finished = Seq(1, [5, 6], handle=None, timer=None, tokens=3, finish_reason="length", prompt_tokens=2,
                   completion_tokens=3)
    assert fmt.usage([left, finished]) == {"prompt_tokens": 6, "completion_tokens": 10, "total_tokens": 16,
                                           "prompt_tokens_details": {"cached_tokens": 0}}


# ---- start-up, roles, content, unsupported routes, methods --------------------------------------------------


def test_health_probes_while_starting_are_not_request_errors(live):
    with TestClient(create_app(None, None, MODEL)) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 503
        assert 'status="503"' not in c.get("/metrics").text
        assert c.post("/v1/chat/completions", json=CHAT_BODY).status_code == 503  # a real request refused: counted
        assert 'strata:request_errors_total{status="503"} 1.0' in c.get("/metrics").text


def test_unknown_role_is_400_naming_it_and_text_parts_are_content(client):
    err = _error(client.post("/v1/chat/completions", json={**CHAT_BODY, "messages": [{"role": "wizard",
                                                                                      "content": "hi"}]}), 400)
    assert err["param"] == "messages.0.role" and "wizard" in err["message"]
    assert all(role in err["message"] for role in ("system", "user", "assistant", "tool"))
    plain = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Tell me about it"}]}).json()
    parts = client.post("/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Tell me"}, {"type": "text", "text": " about it"}]}]}).json()
    assert parts["tokens"] == plain["tokens"]
    r = client.post("/v1/chat/completions", json={**CHAT_BODY, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Tell me about it"}]}]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == plain["count"]


def test_embeddings_say_completions_only(client):
    err = _error(client.post("/v1/embeddings", json={"model": MODEL, "input": "hello"}), 404, "unsupported_endpoint")
    assert "completions only" in err["message"]


def test_405_keeps_allow_and_every_error_is_openai_shaped(client):
    r = client.get("/v1/chat/completions")
    _error(r, 405)
    assert r.headers["allow"] == "POST"
    r = client.delete("/health")
    _error(r, 405)
    assert r.headers["allow"] == "GET"
    _error(client.get("/v1/nothing"), 404)
    _error(client.post("/v1/nothing", json={}), 404)


# ---- bad text: lone surrogates --------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "tiny-demo", "prompt": "x\\udfff"}', "prompt"),
    ("/v1/completions", '{"model": "tiny-demo", "prompt": ["ok", "\\ud83d"]}', "prompt.1"),
    ("/v1/chat/completions", '{"model": "tiny-demo", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "tiny-demo", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\uDABC"}]}]}', "messages.0.content.0.text"),
    ("/v1/chat/completions", '{"model": "tiny-demo", "messages": [{"role": "user", "content": "hi"}], '
                             '"stop": ["\\ud800"]}', "stop.0"),
])
def test_lone_surrogates_are_400_naming_the_field(client, path, body, param):
    err = _error(client.post(path, content=body.encode(), headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and "surrogate" in err["message"]
    paired = body.replace("\\ud800", "\\ud83d\\ude00")  # a valid pair is an emoji, served as usual
    if paired != body and path == "/tokenize":
        assert client.post(path, content=paired.encode(), headers={"content-type": "application/json"}).status_code \
            == 200


# ---- web pages on the same machine: JSON only, Host check, API key ------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_posts_must_be_json(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode(),
                    headers=headers)
    err = _error(r, 415, "unsupported_media_type")
    assert "application/json" in err["message"]


def test_json_with_a_charset_is_json(client):
    r = client.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode(),
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_host_rule_for_each_kind_of_bind():
    loopback = HostRule.for_bind("127.0.0.1", 8090)
    for ok in ("127.0.0.1:8090", "localhost:8090", "LOCALHOST:8090", "[::1]:8090"):
        assert loopback.accepts(ok), ok
    for bad in ("evil.example:8090", "localhost:9999", "127.0.0.1", "127.0.0.1.evil.example:8090", "", None,
                "[::1]:80"):
        assert not loopback.accepts(bad), bad
    assert HostRule.for_bind("::1", 8090).accepts("localhost:8090")
    assert HostRule.for_bind("localhost", 80).accepts("localhost")  # port 80 may be left out
    for wildcard in ("0.0.0.0", "::"):
        assert HostRule.for_bind(wildcard, 8090).accepts("anything.example:1")
    lan = HostRule.for_bind("192.168.1.5", 8090)
    assert lan.accepts("192.168.1.5:8090") and not lan.accepts("localhost:8090")
    named = HostRule.for_bind("127.0.0.1", 8090, allowed="gpu-box.lan, proxy.example:443")
    assert named.accepts("gpu-box.lan:1234") and named.accepts("gpu-box.lan") and not named.accepts("localhost:8090")
    assert not named.accepts("proxy.example:443")  # a name with another port than the server's never reaches it
    assert HostRule.for_bind("127.0.0.1", 8090, allowed="*").accepts("evil.example")


def test_a_foreign_host_header_is_refused(live):
    app = create_app(live.engine, live.scheduler, MODEL, hosts=HostRule.for_bind("127.0.0.1", 8090))
    with TestClient(app, base_url="http://127.0.0.1:8090") as c:
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models", headers={"host": "localhost:8090"}).status_code == 200
        err = _error(c.get("/v1/models", headers={"host": "rebound.example:8090"}), 400, "invalid_host")
        assert "rebound.example" in err["message"] and "--allowed-hosts" in err["message"]
        _error(c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers={"host": "x.example:8090"}),
               400, "invalid_host")


def test_api_key_guards_everything_but_health(live):
    with TestClient(create_app(live.engine, live.scheduler, MODEL, api_key="s3cret-key")) as c:
        assert c.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/v1/strata/stats", "/openapi.json"):
            r = c.get(path)
            _error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        _error(c.get("/v1/models", headers={"authorization": "Bearer wrong"}), 401, "invalid_api_key")
        _error(c.get("/v1/models", headers={"authorization": "Basic s3cret-key"}), 401)
        _error(c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 401)
        ok = {"authorization": "Bearer s3cret-key"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, headers=ok)
        assert r.status_code == 200
        schema = c.get("/openapi.json", headers=ok).json()
        assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}, {"x_api_key": []}]
        assert "security" not in schema["paths"]["/health"]["get"]


def test_api_key_leaves_the_dashboard_page_open_but_not_its_data(live):
    with TestClient(create_app(live.engine, live.scheduler, MODEL, api_key="s3cret-key")) as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        files = re.findall(r'(?:src|href)="(dashboard/static/[^"]+)"', page.text)
        assert "dashboard/static/dashboard_auth.js" in files and "dashboard/static/dashboard.css" in files, files
        for name in files:  # the page's scripts and style sheet: no data, no key
            assert c.get("/" + name).status_code == 200, name
        assert 'id="key-form"' in page.text  # where the page asks for the key
        # the data the page draws needs the key; so does anything else under the dashboard's paths
        for path in ("/v1/strata/stats", "/v1/strata/residency", "/v1/strata/history",
                     "/dashboard/static/nope.js", "/dashboard/"):
            _error(c.get(path), 401, "invalid_api_key")
        ok = {"authorization": "Bearer s3cret-key"}
        for path in ("/v1/strata/stats", "/v1/strata/residency", "/v1/strata/history"):
            assert c.get(path, headers=ok).status_code == 200, path


def test_api_key_file_and_its_errors(tmp_path):
    from argparse import Namespace

    from strata.errors import ConfigError
    from strata.server.serve import api_key

    key = tmp_path / "key"
    key.write_text("abc123\nignored\n")
    assert api_key(Namespace(api_key=None, api_key_file=str(key))) == "abc123"
    assert api_key(Namespace(api_key="k", api_key_file=None)) == "k"
    assert api_key(Namespace(api_key=None, api_key_file=None)) is None
    key.write_text("\n")
    for bad in (Namespace(api_key="k", api_key_file=str(key)), Namespace(api_key=None, api_key_file=str(key)),
                Namespace(api_key=None, api_key_file=str(tmp_path / "missing")),
                Namespace(api_key="has space", api_key_file=None)):
        with pytest.raises(ConfigError):
            api_key(bad)


def test_models_do_not_expose_the_store_path(client, live):
    card = client.get("/v1/models").json()["data"][0]
    assert card["root"] == MODEL and str(live.engine.checkpoint.directory) not in json.dumps(card)


# ---- prompts far past the context, memory -----------------------------------------------------------------


def test_a_huge_prompt_is_refused_without_tokenizing(live, monkeypatch):
    import strata.server.memory as memory

    tok = live.engine.tokenizer
    calls, released = [], []
    real_encode, real_release = tok.encode, memory.release_memory
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(len(a[0])) or real_encode(*a, **k))
    monkeypatch.setattr(memory, "release_memory", lambda: released.append(1) or real_release())
    huge = "the experts of a mixture " * ((4 << 20) // 25)  # 4 MiB: far past the tiny model's context
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": huge}]}),
                       ("/v1/completions", {"model": MODEL, "prompt": huge}), ("/tokenize", {"prompt": huge})):
        r = httpx.post(live.url + path, json=body, timeout=60)
        err = _error(r, 400, "context_length_exceeded")
        assert str(live.engine.max_context) in err["message"]
    assert calls == []  # refused on its length alone
    # each large body is followed by handing memory back, once its answer has been sent
    deadline = time.monotonic() + 20
    while len(released) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(released) == 3
    # a prompt just long enough to overflow but within the bound is still tokenized and refused by its count
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hello " * live.engine.max_context},
                   timeout=60)
    _error(r, 400, "context_length_exceeded")
    assert len(calls) == 1


def test_tokenizing_runs_off_the_event_loop(live, monkeypatch):
    """While a prompt is being tokenized, /health answers: the tokenizer runs on a worker thread."""
    tok = live.engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    real_encode = tok.encode

    def slow_encode(*a, **k):
        entered.set()
        assert release.wait(20), "the test never released the tokenizer"
        return real_encode(*a, **k)

    monkeypatch.setattr(tok, "encode", slow_encode)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(
        live.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 1}, timeout=60)))
    t.start()
    try:
        assert entered.wait(20)
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200  # answered while encode waits
    finally:
        release.set()
        t.join(60)
    assert result["r"].status_code == 200


def test_release_memory_trims_the_heap_on_glibc():
    import platform

    from strata.server.memory import release_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert release_memory() is True


# ---- defaults, health, a model without a tokenizer -----------------------------------------------------------


def test_max_tokens_default_caps_chat_without_max_tokens(live):
    with TestClient(create_app(live.engine, live.scheduler, MODEL, max_tokens_default=3)) as c:
        body = {"model": MODEL, "messages": CHAT, "ignore_eos": True, "temperature": 0}
        assert c.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 3
        r = c.post("/v1/chat/completions", json={**body, "max_tokens": 5})
        assert r.json()["usage"]["completion_tokens"] == 5  # an explicit max_tokens is the client's to choose
    from strata.errors import ConfigError

    with pytest.raises(ConfigError):
        create_app(live.engine, live.scheduler, MODEL, max_tokens_default=0)


def _store_of(engine) -> Path:
    return Path(engine.tiers.store.directory)


def test_health_is_degraded_when_an_expert_is_damaged(live, tmp_path):
    from strata import Engine
    from strata.tiers.store.store import ExpertStore

    copy = Path(shutil.copytree(_store_of(live.engine), tmp_path / "store"))
    store = ExpertStore.open(copy)
    layer = min(layer for layer, _ in store.index.blobs)
    experts = sorted(e for lay, e in store.index.blobs if lay == layer)
    for expert in experts:  # every expert of one layer: any request routes to one of them
        path, offset, _ = store.location((layer, expert))
        with open(path, "r+b") as f:
            f.seek(offset + 10)
            byte = f.read(1)
            f.seek(offset + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
    store.close()
    engine = Engine.from_pretrained(copy, device="cpu")
    sched = engine.scheduler(max_batch=2, token_budget=64, max_queue=8)
    sched.start()
    try:
        with TestClient(create_app(engine, sched, MODEL)) as c:
            # the damage is found when an expert is first read (at load for those warmed into pinned memory, else
            # by the request that routes to it); either way the request is answered and /health says so
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code in (200, 500) and ("error" in r.json() or r.json()["choices"])
            health = c.get("/health")
            assert health.status_code == 200
            body = health.json()
            assert body["status"] == "degraded" and body["damaged"]
            assert all(lay == layer and e in experts for lay, e in body["damaged"])
            assert len({tuple(k) for k in body["damaged"]}) == len(body["damaged"])
    finally:
        sched.stop(drain=False)
        engine.close()


def test_a_model_without_a_tokenizer_serves_token_ids(tiny_model_dir, tmp_path):
    from strata import Engine

    bare = Path(shutil.copytree(tiny_model_dir, tmp_path / "bare"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink(missing_ok=True)
    engine = Engine.from_pretrained(bare, device="cpu")
    assert engine.tokenizer is None
    sched = engine.scheduler(max_batch=2, token_budget=64, max_queue=8)
    sched.start()
    try:
        with TestClient(create_app(engine, sched, MODEL)) as c:
            body = {"model": MODEL, "prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == "" and len(choice["token_ids"]) == 4
            assert all(isinstance(i, int) for i in choice["token_ids"])
            streamed = c.post("/v1/completions", json={**body, "stream": True}).text
            pieces = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
            assert [i for p in pieces for i in p["choices"][0].get("token_ids", [])] == choice["token_ids"]
            for path, req, param in (
                    ("/v1/completions", {"model": MODEL, "prompt": "text"}, "prompt"),
                    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT}, "messages"),
                    ("/tokenize", {"prompt": "text"}, "prompt"), ("/detokenize", {"tokens": [1, 2]}, "tokens")):
                err = _error(c.post(path, json=req), 400, "no_tokenizer")
                assert err["param"] == param and "tokenizer.json" in err["message"] and "\n" not in err["message"]
    finally:
        sched.stop(drain=False)
        engine.close()


# ---- the OpenAPI schema ---------------------------------------------------------------------------------


def test_openapi_lists_every_route_and_documents_real_answers(client, live):
    from fastapi.routing import APIRoute

    from strata.server.openapi import (
        AnthropicErrorResponse,
        ChatCompletion,
        Completion,
        ErrorResponse,
        Health,
        Message,
        ModelList,
        TokenCount,
        TokenizeResponse,
    )

    schema = client.get("/openapi.json").json()
    routes = {(r.path, m.lower()) for r in client.app.routes if isinstance(r, APIRoute) and r.include_in_schema
              for m in r.methods}
    documented = {(path, method) for path, ops in schema["paths"].items() for method in ops}
    assert routes == documented and ("/v1/chat/completions", "post") in documented
    for path, method in documented:
        op = schema["paths"][path][method]
        assert op["responses"], path
        shape = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        for status, answer in op["responses"].items():
            if status != "200":  # every error is documented with OpenAI's error body (Anthropic's for its API)
                assert answer["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{shape}"}
    chat_body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat_body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
    # the documented models accept what the routes really answer
    ChatCompletion.model_validate(client.post("/v1/chat/completions", json={**CHAT_BODY, "logprobs": True,
                                                                              "top_logprobs": 2}).json())
    Completion.model_validate(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                                   "logprobs": 1, "echo": True}).json())
    ModelList.model_validate(client.get("/v1/models").json())
    Health.model_validate(client.get("/health").json())
    TokenizeResponse.model_validate(client.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True}).json())
    ErrorResponse.model_validate(client.post("/v1/completions", json={"model": MODEL, "prompt": 5}).json())
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    Message.model_validate(client.post("/v1/messages", json={**ask, "max_tokens": 2}).json())
    TokenCount.model_validate(client.post("/v1/messages/count_tokens", json=ask).json())
    AnthropicErrorResponse.model_validate(client.post("/v1/messages", json=ask).json())  # no max_tokens
    for model in (ChatCompletion, Completion, ModelList, Health, TokenizeResponse, ErrorResponse):
        assert model.__name__ in schema["components"]["schemas"]
    ids = schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert ids["maximum"] == live.engine.checkpoint.config.vocab_size - 1  # what /detokenize accepts


def test_a_message_without_content_reaches_the_template_as_empty_text(client):
    """An assistant turn with no content (one that called tools) is valid OpenAI input, not a template error."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "more"}]
    r = client.post("/v1/chat/completions", json={**CHAT_BODY, "messages": messages})
    assert r.status_code == 200, r.text
    err = _error(client.post("/v1/chat/completions", json={**CHAT_BODY, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}), 400)
    assert '"text"' in err["message"]
