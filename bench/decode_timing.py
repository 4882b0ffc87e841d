"""Timing one stream's decode phase apart from its prefill (the benches' shared measurement).

A 128-token prompt whose experts are cold takes a tenth of a second or more to prefill, as long as
dozens of decode steps: timing `engine.generate` whole would fold it into the decode rate. This submits
the request to the engine's scheduler (the loop `Engine.generate` runs on) and takes the engine's statistics
at the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class DecodeRun:
    tokens: list[int]
    ttft_s: float  # prefill and the first token
    decode_s: float  # the len(tokens) - 1 tokens after the first
    before: dict  # engine.stats() at the first token
    after: dict  # engine.stats() at the end

    @property
    def decode_tokens(self) -> int:
        return max(1, len(self.tokens) - 1)

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s


def timed_decode(engine, prompt: list[int], tokens: int, sync: Callable[[], None], seed: int = 3,
                 on_first_token: Callable[[], object] | None = None) -> DecodeRun:
    """Generate `tokens` tokens of `prompt` at temperature 1 (seeded, EOS ignored) and time the decode phase;
    `on_first_token` runs once the prefill's token is out, before the decode phase is timed (the scheduler's
    next step waits for it: it runs under the engine's step lock)."""
    from strata.runtime.generation.requests import GenRequest
    from strata.runtime.generation.sampler import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True)
    scheduler = engine.scheduler()
    if not scheduler.started:
        scheduler.start()
    sync()
    t0 = time.perf_counter()
    events = scheduler.submit(GenRequest(list(prompt), params), asynchronous=False).iter_events()
    out = [next(events).token_id]  # the prefill, and the first token sampled from its logits
    t1 = time.perf_counter()
    ttft = t1 - t0
    # the decode phase is timed from the first token's arrival: the step lock below is not fair, and a scheduler
    # stepping a small model back to back may hold it until the request ends (the stats are then taken late, the
    # time stays right)
    with engine.step_lock:
        before = engine.stats()
        if on_first_token is not None:
            on_first_token()
    out += [ev.token_id for ev in events if ev.token_id is not None]
    sync()
    decode_s = time.perf_counter() - t1
    return DecodeRun(out, ttft, decode_s, before, engine.stats())
