"""A DeepSeek-V4 checkpoint that ships no chat template (as DeepSeek's V4 releases) served on the live server: chat
requests, with tools, render through the built-in V4 encoding (strata.runtime.generation.text.chat_dsv4), its output is
read as DSML calls, and the internal developer role is refused in one line.

The tiny demo's tokenizer lacks V4's special tokens, so `<｜User｜>` and the like encode as several ordinary tokens;
the tests therefore check the prompt the server builds as text (decoded from /tokenize, and the prompt token count
of a completion) against what the encoding renders."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import MODEL, LiveServer, start_live_server

from strata.runtime.generation.text.chat_dsv4 import render_chat
from strata.server.tools.calls import TOOL_FORMATS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


CONTEXT = 2048  # the tools section alone is ~1K demo tokens: V4's special strings are many tokens each here


def serve(model_dir) -> LiveServer:
    """A real uvicorn server on a free localhost port, in a thread, serving `model_dir` with a context of CONTEXT."""
    return start_live_server(model_dir, max_batch=2, max_queue=8, token_budget=512,
                             config={"runtime": {"max_context": CONTEXT}})


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from strata.runtime.demo.model import write_demo_model

    model_dir = write_demo_model(tmp_path_factory.mktemp("dsv4") / "tiny", "tiny", arch="deepseek_v4", engram=False,
                                 progress=False)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)  # as the V4 releases: no template at all
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config), encoding="utf-8")
    srv = serve(model_dir)
    assert srv.engine.checkpoint.config.model_type == "deepseek_v4"
    yield srv
    srv.close()


def _post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json={"model": MODEL, **body}, timeout=60)


def test_the_server_renders_tools_and_calls_in_the_v4_encoding(live):
    expected = render_chat(MESSAGES, tools=TOOLS)  # thinking mode: V4's default
    assert "## Tools" in expected and "<｜DSML｜invoke name=\"get_weather\">" in expected
    assert expected.endswith("<｜Assistant｜><think>")
    r = _post(live, "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert live.engine.tokenizer.decode(r.json()["tokens"]) == expected
    state = live.server.config.app.state.strata
    assert state.template_renders_tools and state.tool_format.name == "deepseek_v4"


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_with_tools_is_served(live, stream):
    """Chat mode with a named tool_choice: the prompt is the encoding's plus the DSML call opening; the tiny model's
    greedy continuation comes back (as a call or as text), whole and streamed."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 6, "temperature": 0, "stream": stream,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"enable_thinking": False}}
    prompt = render_chat(MESSAGES, tools=TOOLS, enable_thinking=False) + \
        TOOL_FORMATS["deepseek_v4"].forced_prefix("get_weather")
    tok = live.engine.tokenizer
    if not stream:
        r = _post(live, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] == len(tok.encode(prompt, False))
        msg = out["choices"][0]["message"]
        assert msg["role"] == "assistant" and (msg.get("content") or msg.get("tool_calls"))
        return
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, **body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens"] == len(tok.encode(prompt, False))
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] is not None


def test_the_internal_developer_role_is_refused(live):
    r = _post(live, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "no developer role" in message and "\n" not in message
