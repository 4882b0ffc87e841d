"""The prefix cache through the server: `usage.prompt_tokens_details.cached_tokens` and the /metrics counters."""

from __future__ import annotations

import pytest
from test_server import MODEL, start_live_server


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    srv = start_live_server(tiny_model_dir, max_batch=2)
    yield srv
    srv.close()


def test_a_conversations_next_turn_reports_cached_tokens(live):
    c = live.client()
    computed0, cached0 = live.metric("strata:prompt_tokens_computed_total"), live.metric("strata:prompt_tokens_cached_total")
    turn = [{"role": "system", "content": "You answer in the words of the King James Bible, briefly."},
            {"role": "user", "content": "What is wisdom?"}]
    first = c.chat.completions.create(model=MODEL, messages=turn, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And what is folly?"}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=turn, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    # at least the whole first prompt (it ends where the assistant's first answer begins) came from the cache
    assert first.usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    whole = c.chat.completions.create(model=MODEL, messages=turn, max_tokens=12, temperature=0)
    # the same prompt again: the demo model's Engram layers let it reuse up to where a pass ended, no further
    assert usage.prompt_tokens_details.cached_tokens <= whole.usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == whole.choices[0].message.content
    cached = live.metric("strata:prompt_tokens_cached_total") - cached0
    computed = live.metric("strata:prompt_tokens_computed_total") - computed0
    assert cached == usage.prompt_tokens_details.cached_tokens + whole.usage.prompt_tokens_details.cached_tokens
    assert computed == first.usage.prompt_tokens + 2 * usage.prompt_tokens - cached
    assert 0 < live.metric("strata:prefix_cache_hit_ratio") < 1
    stats = live.scheduler.stats()["prefix_cache"]
    assert stats["cached_tokens"] >= cached and stats["hits"] >= 2
