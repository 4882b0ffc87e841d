"""A Qwen3.5-MoE checkpoint (the tiny `--arch qwen3_5_moe` demo model) on the live server: several sequences of one
request decode together, each from its own state, and a repeated prompt is computed whole (no prefix cache)."""

from __future__ import annotations

import httpx
import pytest
from test_server import MODEL, start_live_server


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from strata.runtime.demo.model import write_demo_model

    srv = start_live_server(write_demo_model(tmp_path_factory.mktemp("q35") / "tiny", size="tiny",
                                             arch="qwen3_5_moe", progress=False))
    yield srv
    srv.close()


def test_chat_sequences_share_steps_and_reuse_no_prefix(live):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river and the valley."}],
            "max_tokens": 12, "temperature": 0.0}
    r = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={**body, "n": 3})
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1  # greedy: three sequences in shared steps, each its own state
    again = httpx.post(live.url + "/v1/chat/completions", timeout=120, json=body).json()
    assert again["choices"][0]["message"]["content"] == texts[0]
    assert (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert live.engine.scheduler().prefix.stats()["enabled"] is False
