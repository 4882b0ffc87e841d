"""PrefillPacer: prompt chunks under decode pressure sized from observed step times.

Step times here come from synthetic cost models (no clocks), so every expectation is exact.
"""

from __future__ import annotations

import pytest

from strata.errors import StrataError
from strata.runtime.generation.pacing import PrefillPacer


def prefill_under_pressure(pacer: PrefillPacer, prompt: int, n_decode: int, cost) -> list[tuple[int, float]]:
    """Prefill `prompt` tokens while `n_decode` sequences decode; (chunk, step seconds) of every step."""
    steps, done = [], 0
    for _ in range(5):  # decode-only steps before the prompt arrives: the pacer learns the base cost
        pacer.observe(n_decode, 0, cost(n_decode, 0, 0))
    while done < prompt:
        n = min(pacer.allowance(n_decode), prompt - done)
        assert n > 0, "prefill must always progress"
        seconds = cost(n_decode, n, done)
        pacer.observe(n_decode, n, seconds)
        steps.append((n, seconds))
        done += n
    return steps


def linear(n_decode: int, n_prompt: int, position: int) -> float:
    return 0.05 + 0.002 * n_decode + 0.001 * n_prompt


def with_attention(n_decode: int, n_prompt: int, position: int) -> float:
    """Prompt tokens cost more the deeper they sit in the context (attention over the prefix)."""
    return 0.05 + 0.002 * n_decode + n_prompt * (0.0004 + 2e-7 * (position + n_prompt / 2))


def test_no_decode_pressure_uses_the_whole_budget():
    p = PrefillPacer(token_budget=512, gap_target=0.5, min_chunk=16)
    assert p.allowance(0) == 512
    assert p.allowance(4) == 16  # under pressure and nothing measured yet: start small


def test_a_step_nobody_decodes_in_takes_the_idle_budget():
    """Nothing decodes: a prompt may take the larger idle budget (runtime.prefill_chunk) in one chunk; as soon
    as a sequence decodes, the token budget and the pacing apply again."""
    p = PrefillPacer(token_budget=512, gap_target=0.5, min_chunk=16, idle_budget=8192)
    assert p.allowance(0) == 8192
    assert p.allowance(1) == 16
    assert PrefillPacer(token_budget=512, idle_budget=128).allowance(0) == 512  # never below the token budget


def test_pacing_off_fills_the_budget_minus_decodes():
    p = PrefillPacer(token_budget=512, gap_target=0, min_chunk=16)
    p.observe(4, 0, 0.05)
    p.observe(4, 500, 10.0)
    assert p.allowance(4) == 508


# with attention a chunk's tokens cost more than the previous chunk's (deeper in the context): the headroom
# absorbs most of it, and what is left is a few percent on the steps where chunks are still growing
@pytest.mark.parametrize("cost,biggest,slack", [(linear, 250, 1.0), (with_attention, 400, 1.05)])
def test_steps_stay_under_the_target(cost, biggest, slack):
    target = 0.5
    p = PrefillPacer(token_budget=2048, gap_target=target, min_chunk=16)
    steps = prefill_under_pressure(p, 8000, 4, cost)
    assert max(s for _, s in steps) <= target * slack
    assert max(s for _, s in steps[len(steps) // 2 :]) <= target  # once the estimate has settled
    assert sum(n for n, _ in steps) == 8000
    # growth is at most 2x a step, and chunks do reach a size near what the target allows
    chunks = [n for n, _ in steps]
    assert all(b <= 2 * max(a, 16) for a, b in zip(chunks, chunks[1:], strict=False))
    assert max(chunks) >= biggest  # linear: the target allows (0.85 * 0.5 - 0.058) / 0.001 = 367 tokens


def test_a_slow_step_shrinks_the_next_chunk_at_once():
    p = PrefillPacer(token_budget=4096, gap_target=0.5, min_chunk=16)
    prefill_under_pressure(p, 4000, 2, linear)
    big = p.allowance(2)
    p.observe(2, big, 2.0)  # something made the last chunk four times slower
    assert p.allowance(2) < big / 2


def test_a_base_over_the_target_leaves_the_minimum_chunk():
    p = PrefillPacer(token_budget=512, gap_target=0.1, min_chunk=24)
    steps = prefill_under_pressure(p, 200, 8, lambda d, n, pos: 0.3 + 0.001 * n)
    assert {n for n, _ in steps[:-1]} == {24}


def test_allowance_never_exceeds_the_room_left_by_decodes():
    p = PrefillPacer(token_budget=64, gap_target=10.0, min_chunk=8)
    for _ in range(10):
        p.observe(60, p.allowance(60), 0.01)
    assert p.allowance(60) == 4 and p.allowance(64) == 0


def test_bad_settings_are_refused():
    with pytest.raises(StrataError):
        PrefillPacer(token_budget=0)
    with pytest.raises(StrataError):
        PrefillPacer(token_budget=8, gap_target=-1)
    with pytest.raises(StrataError):
        PrefillPacer(token_budget=8, min_chunk=0)


def test_free_looking_prompt_steps_do_not_grow_chunks_past_a_full_base():
    """A prompt step measured faster than the decode-only base (jitter) must not grow chunks when decode
    steps alone already take the whole target."""
    p = PrefillPacer(token_budget=512, gap_target=0.1, min_chunk=8)
    p.observe(2, 0, 0.2)
    for _ in range(5):
        p.observe(2, p.allowance(2), 0.15)
    assert p.allowance(2) == 8


def tiered(n_decode: int, n_prompt: int, position: int) -> float:
    """A tiered model: any prompt chunk routes to nearly every expert, so its cold ones cost ~1 s whatever its size."""
    return 0.022 + 0.001 * n_decode + (1.0 + 0.0005 * n_prompt if n_prompt else 0.0)


def test_a_fixed_prompt_cost_over_the_target_takes_few_large_chunks():
    """8 prompts of 128 tokens beside a decoding stream on a tiered model: no chunk keeps a 0.5 s target, so the
    pacer finds the fixed part and takes chunks whose per-token part matches it (steps of at most ~2x the least
    a prompt step takes), not 32 steps of 32 tokens that each cost the whole fixed second."""
    p = PrefillPacer(token_budget=2048, gap_target=0.5, min_chunk=32)
    steps = prefill_under_pressure(p, 8 * 128, 1, tiered)
    least = tiered(1, 32, 0)
    assert len(steps) <= 6 and max(s for _, s in steps) <= 2 * least, steps
    assert p.fixed_s == pytest.approx(1.0) and p.snapshot()["prefill_fixed_s"] == pytest.approx(1.0)
    # the same prompts where the fixed part fits the target: paced under it as before
    cheap = PrefillPacer(token_budget=2048, gap_target=0.5, min_chunk=32)
    steps = prefill_under_pressure(cheap, 8 * 128, 1, lambda d, n, pos: tiered(d, n, pos) - (0.8 if n else 0))
    assert max(s for _, s in steps) <= 0.5


def test_one_slow_step_does_not_make_a_per_token_cost_look_fixed():
    """A tail chunk slowed by something else (2 s for 16 tokens) among per-token steps: the pacer does not take it for a fixed cost,
    and the chunks after it keep the target."""
    p = PrefillPacer(token_budget=4096, gap_target=0.5, min_chunk=16)
    prefill_under_pressure(p, 4000, 2, linear)
    p.observe(2, 16, 2.0)
    assert p.fixed_s is None  # not the fixed-cost regime
    after = prefill_under_pressure(p, 2000, 2, linear)
    assert max(s for _, s in after) <= 0.5
