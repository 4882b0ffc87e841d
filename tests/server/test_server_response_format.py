"""response_format on the live server (the tiny random-weight model): json_schema and json_object answers parse
and validate, streamed too, through the official `openai` client's structured-output helper as well; a bad schema
is an OpenAI-shaped 400 naming response_format."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import CHAT, MODEL, start_live_server

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    "kind": {"enum": ["town", "port"]},
    "open": {"type": "boolean"}},
    "required": ["city", "rank", "kind", "open"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    srv = start_live_server(tiny_model_dir)
    yield srv
    srv.close()


def _post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=60)


def check_place(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["city", "rank", "kind", "open"], value
    assert isinstance(value["city"], str) and len(value["city"]) <= 6
    assert type(value["rank"]) is int and 1 <= value["rank"] <= 9
    assert value["kind"] in ("town", "port") and isinstance(value["open"], bool)


def test_chat_json_schema_answers_parse_and_validate(live):
    r = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 200, "n": 3,
                                             "temperature": 1.0, "seed": 5, "response_format": FORMAT})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        check_place(choice["message"]["content"])


def test_streamed_chat_json_schema_parses(live):
    text, finish = [], None
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": CHAT, "max_tokens": 200, "stream": True, "seed": 5,
            "response_format": FORMAT}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    assert finish == "stop"
    check_place("".join(text))


def test_completions_json_object_answers_are_objects(live):
    # greedy: an object's strings are unbounded, and a sampled walk may write one until max_tokens
    r = _post(live, "/v1/completions", {"model": MODEL, "prompt": "A JSON object:", "max_tokens": 200,
                                        "temperature": 0, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict)


def test_the_openai_clients_structured_output_helper(live):
    """`client.chat.completions.parse` sends a pydantic model as a strict json_schema and parses the answer back."""
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=6)
        kind: Literal["town", "port"]
        open: bool

    completion = live.client().chat.completions.parse(model=MODEL, messages=CHAT, max_tokens=200,
                                                      response_format=Place)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Place)
    assert Place.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("schema,problem", [({"type": "foo"}, 'Unsupported type "foo"'),
                                            ({"type": "object", "required": "city"}, "required must be an array"),
                                            ({"anyOf": []}, "admits no JSON value")])
def test_a_bad_schema_is_a_400_naming_it(live, schema, problem):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})):
        r = _post(live, path, {"model": MODEL, "max_tokens": 4, "response_format": fmt, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "response_format", err
        assert problem in err["message"] and "json_schema.schema" in err["message"]
    r = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200  # and the server serves on


@pytest.mark.parametrize("value,problem", [
    ({"type": "xml"}, "'xml' is unknown"), ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "JSON Schema object")])
def test_a_malformed_response_format_is_a_400(live, value, problem):
    r = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                             "response_format": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert problem in r.json()["error"]["message"]


def test_a_new_schema_compiles_off_the_event_loop(tiny_model_dir, monkeypatch):
    """A schema xgrammar has not seen takes it 0.7-2 s to compile; meanwhile the server answers everyone else: here a
    compile held until /health has answered finishes, and its request is served."""
    import threading

    from strata.runtime.generation.grammar import GrammarCompiler

    health_answered, compiling = threading.Event(), threading.Event()
    compile_ = GrammarCompiler.compile

    def held_compile(self, fmt):
        compiling.set()
        assert health_answered.wait(timeout=30), "/health was not answered while a grammar compiled"
        return compile_(self, fmt)

    monkeypatch.setattr(GrammarCompiler, "compile", held_compile)
    srv = start_live_server(tiny_model_dir)
    try:
        result = {}
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "response_format": FORMAT}
        worker = threading.Thread(target=lambda: result.update(r=_post(srv, "/v1/chat/completions", body)))
        worker.start()
        assert compiling.wait(timeout=30)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        health_answered.set()
        worker.join(timeout=60)
        assert result["r"].status_code == 200, result["r"].text
        check_place(result["r"].json()["choices"][0]["message"]["content"])
    finally:
        health_answered.set()
        srv.close()
