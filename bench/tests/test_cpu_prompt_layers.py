"""bench/cpu/cpu_prompt_layers.py on tiny experts: every knob set measured, outputs compared, knobs restored."""

from __future__ import annotations

import sys

import pytest

from bench.cpu.cpu_prompt_layers import make_layers, measure, routing, split_knobs
from strata.kernels.cpu import experts as ce
from strata.kernels.cpu import library


def test_routing_gives_each_token_top_k_distinct_experts():
    idx, w = routing(10, 16, 4)
    assert sum(i.numel() for i in idx) == 10 * 4
    assert all(float(v) == 0.25 for ws in w for v in ws)


def test_each_knob_set_is_timed_on_the_same_call():
    if ce.library() is None:
        pytest.skip("compiled CPU kernel not available")
    layers = make_layers(2, 64, 32, 16)
    saved: dict[str, int] = {}
    before = ce.tune(down_stream=5000)
    try:
        sets = [({"down_stream": 0}, None, None), ({"down_stream": 1 << 17, "claim_ahead": 0}, None, None)]
        res = measure(layers, 6, sets, 2, 0.01, 2, saved, hidden=64)
        used = res["experts_used"]
        assert 0 < used <= 16 and res["bytes"] == used * 3 * 32 * 64 * 2
        assert [c["knobs"] for c in res["cases"]] == [{"down_stream": 0}, {"down_stream": 1 << 17, "claim_ahead": 0}]
        assert all(len(c["rounds_ms"]) == 2 and c["ms"] == min(c["rounds_ms"]) for c in res["cases"])
        assert saved["down_stream"] == 5000  # the value before the first setting, for the restore
    finally:
        ce.tune(**before)


def test_a_knob_set_may_move_plain_experts_to_torchs_gemms():
    """plain_max=N splits off the kernel's knobs; a set with plain_max=2 (6 tokens: experts of 3 or more go to torch's
    GEMMs) is timed beside the shipped hand-off, its output within bf16's bound, and the hand-off put back."""
    assert split_knobs("down_stream=0,plain_max=12") == ({"down_stream": 0}, 12, None)
    assert split_knobs("plain_max=64") == ({}, 64, None)
    assert split_knobs("down_stream=0") == ({"down_stream": 0}, None, None)
    if ce.library() is None:
        pytest.skip("compiled CPU kernel not available")
    shipped = ce.plain_max_tokens
    res = measure(make_layers(2, 64, 32, 4), 6, [({}, None, None), ({}, 2, None)], 2, 0.01, 2, {}, hidden=64)
    assert [c["knobs"] for c in res["cases"]] == [{}, {"plain_max": 2}]
    assert ce.plain_max_tokens is shipped


def test_a_knob_set_may_set_the_prefetch_distance():
    """prefetch=N sets the software prefetch distance for its set (results bit-identical: it only reads ahead), and the
    distance in force before is put back after the run."""
    assert split_knobs("prefetch=2048,down_stream=0") == ({"down_stream": 0}, None, 2048)
    if ce.library() is None:
        pytest.skip("compiled CPU kernel not available")
    before = library.prefetch_bytes()
    res = measure(make_layers(2, 64, 32, 4), 6, [({}, None, 0), ({}, None, 2048)], 2, 0.01, 2, {}, hidden=64)
    assert [c["knobs"] for c in res["cases"]] == [{"prefetch": 0}, {"prefetch": 2048}]
    assert library.prefetch_bytes() == before
    # a set with the kernel's own knobs and no prefetch runs at the distance in force, which is put back after too
    seen = []
    forward = sys.modules[measure.__module__].forward

    def spy(*args, **kwargs):
        seen.append(library.prefetch_bytes())
        return forward(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[measure.__module__], "forward", spy)
        measure(make_layers(2, 64, 32, 4), 6, [({"down_stream": 0}, None, None), ({}, None, 512)], 1, 0.01, 2, {},
                hidden=64)
    assert seen[0] == before and 512 in seen
    assert library.prefetch_bytes() == before
