"""A Kimi K2.5 checkpoint (kimi_k25 config, its language model under `language_model.`, Kimi's tiktoken tokenizer)
on the live server: chat through its template, /tokenize as tiktoken encodes, and a json_schema answer that
parses (xgrammar compiled from the tokenizer's equivalent tokenizer.json)."""

from __future__ import annotations

import httpx
import pytest
from kimi_models import build_kimi, oracle_encoding, write_kimi_tokenizer
from test_server import MODEL, start_live_server
from test_server_response_format import FORMAT, check_place


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    _, directory = build_kimi(tmp_path_factory.mktemp("kimi") / "k25", nested=True)
    srv = start_live_server(directory)
    yield srv
    srv.close()


def test_chat_tokenize_and_json_schema(live, tmp_path):
    messages = [{"role": "user", "content": "模型 reads the text."}]
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    ranks, specials = write_kimi_tokenizer(tmp_path / "tok")  # the files build_kimi wrote (deterministic)
    prompt = live.engine.tokenizer.apply_chat_template(messages)
    assert prompt == "<|im_user|>user<|im_middle|>模型 reads the text.<|im_end|><|im_assistant|>assistant<|im_middle|>"
    tok = httpx.post(live.url + "/tokenize", json={"prompt": prompt}).json()
    assert tok["tokens"] == oracle_encoding(ranks, specials).encode(prompt, allowed_special="all")
    r = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "max_tokens": 200, "temperature": 1.0, "seed": 3,
        "response_format": FORMAT})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    check_place(choice["message"]["content"])

