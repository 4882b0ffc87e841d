"""Prefill pacing: how many prompt tokens one scheduler step may carry while other sequences decode.

Every decoding sequence waits for the whole step its next token is computed in, prompt chunks
included, so the gap between two of its tokens is the step's time. With sequences decoding (decode
pressure) the pacer sizes the prompt tokens of a step from measured step times, so a step stays
under `gap_target` seconds:

    step seconds ~= base + per_token * prompt_tokens
    base:      an average of recent decode-only step times (the step's fixed cost, per-layer overhead)
    per_token: seconds per prompt token on top of the base, from the latest step that carried prompts
    allowance: (headroom * gap_target - base) / per_token, within [min_chunk, token_budget]

The cost of a prompt token grows with its position (attention reads the whole prefix), so the
estimate is replaced after every full chunk and the headroom absorbs the rise from one chunk to the
next; the allowance grows at most 2x a step, and one slow step shrinks the next chunk at once. Without decoding sequences prompts take the
whole token budget (throughput and time to first token are all that matter then).

A tiered model adds a fixed cost to any step that carries a prompt: a chunk of a few dozen tokens already routes to
nearly every expert of every layer, so the cold ones cross PCIe or run on the CPU whatever the chunk's size. Where
that fixed part alone exceeds the target, no chunk keeps it, and small chunks only multiply the slow steps (8
prompts of 128 tokens in 32-token chunks: 32 steps of ~0.7 s each on a 48-layer model at a 25% GPU budget). So the
pacer fits `extra = fixed + per_token * prompt_tokens` over its recent prompt steps (one chunk twice the size is
tried when it has seen a single size and that step's prompt part alone took more than the target), and where the
fixed part exceeds the spare time it takes chunks of `fixed / per_token` tokens: the per-token part equals the fixed
part, so a step takes at most about twice the least any prompt step can, in far fewer of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from strata.errors import StrataError

_EMA = 0.5  # weight of the newest decode-only step time in the base estimate
_FIT_STEPS = 8  # recent prompt steps the fixed + per-token fit reads


@dataclass
class PrefillPacer:
    """Sizes prompt chunks under decode pressure from observed step times (all times in seconds)."""

    token_budget: int  # tokens per step, decode + prompt, when nobody's gap is at stake
    gap_target: float = 0.5  # seconds a step may take while sequences decode; 0 turns pacing off
    min_chunk: int = 32  # prompt tokens a step carries at least, so prefill always progresses
    headroom: float = 0.85  # aim below the target: step times vary from step to step
    idle_budget: int = 0  # prompt tokens a step may carry when nothing decodes (at least token_budget)
    base_s: float | None = field(default=None, init=False)  # decode-only step seconds (EMA)
    per_token_s: float | None = field(default=None, init=False)  # seconds per prompt token above the base
    allow: int = field(default=0, init=False)  # prompt tokens per step under decode pressure
    fixed_s: float | None = field(default=None, init=False)  # a prompt step's fixed seconds, in that regime
    _steps: deque = field(default_factory=lambda: deque(maxlen=_FIT_STEPS), init=False, repr=False)  # (n, extra s)

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.min_chunk < 1 or self.gap_target < 0 or not 0 < self.headroom <= 1:
            raise StrataError("PrefillPacer needs token_budget >= 1, min_chunk >= 1, gap_target >= 0, 0 < headroom <= 1")
        self.allow = min(self.min_chunk, self.token_budget)  # no measurement yet: start small, grow 2x a step

    @property
    def enabled(self) -> bool:
        return self.gap_target > 0

    def allowance(self, n_decode: int) -> int:
        """Prompt tokens the next step may carry when `n_decode` sequences decode in it (>= 0)."""
        if n_decode == 0:  # nobody waits on this step: prompts take the larger idle budget (fewer, bigger chunks)
            return max(self.token_budget, self.idle_budget)
        room = max(self.token_budget - n_decode, 0)
        if not self.enabled:
            return room
        return min(max(self.allow, self.min_chunk), room)

    def observe(self, n_decode: int, n_prompt: int, seconds: float) -> None:
        """Record one finished step: how many decode and prompt tokens it carried and how long it took."""
        if seconds < 0 or n_decode < 0 or n_prompt < 0:
            return
        if n_prompt == 0:
            if n_decode:
                self.base_s = seconds if self.base_s is None else _EMA * seconds + (1 - _EMA) * self.base_s
            return
        # the decode-only cost is the best estimate of a step's fixed part; without one, charge it all to
        # the prompt tokens (an overestimate per token: chunks start small and grow)
        extra = max(seconds - (self.base_s or 0.0), 0.0)
        self._steps.append((n_prompt, extra))
        # costs rise with the position in the context, so a full chunk's sample replaces the estimate; a small
        # tail chunk is a noisy one (the base's jitter over few tokens) and only moves it by its size
        w = min(1.0, n_prompt / max(self.allow, 1))
        per = extra / n_prompt
        self.per_token_s = per if self.per_token_s is None else w * per + (1 - w) * self.per_token_s
        self._resize()

    def _fit(self) -> tuple[float, float] | None:
        """(fixed s, s per token) of `extra = fixed + per_token * n` over the recent prompt steps, None until they
        have two sizes; Theil-Sen (the median of the pairwise slopes, then of the intercepts), so that one step
        slowed by something else (a collection, another process) does not set the regime."""
        steps = list(self._steps)
        slopes = sorted((e2 - e1) / (n2 - n1) for i, (n1, e1) in enumerate(steps) for n2, e2 in steps[i + 1:]
                        if n2 != n1)
        if not slopes:
            return None
        slope = max(_median(slopes), 0.0)
        return max(_median(sorted(e - slope * n for n, e in steps)), 0.0), slope

    def _resize(self) -> None:
        if not self.enabled:
            return
        spare = self.headroom * self.gap_target - (self.base_s or 0.0)
        # every recent prompt step's prompt part alone took more than the target: the fixed-cost regime's signature
        # (one slow step among cheap ones is something else)
        over = all(e > self.headroom * self.gap_target for _, e in self._steps)
        fit = self._fit() if over else None
        self.fixed_s = fit[0] if fit else None
        if fit and fit[0] > max(spare, 0.0):  # a prompt's fixed cost alone breaks the target: fewer, larger chunks
            want = int(fit[0] / fit[1]) if fit[1] > 0 else self.token_budget
        elif over and not fit:  # one size seen, over the target: try twice that size to tell fixed from per-token
            want = 2 * self.allow
        elif spare <= 0:  # decode steps alone take the whole target: prompts get the minimum
            want = 0
        elif self.per_token_s is None or self.per_token_s <= 0:  # prompt tokens cost nothing measurable yet
            want = 2 * self.allow
        else:
            want = int(spare / self.per_token_s)
        self.allow = max(min(want, 2 * self.allow, self.token_budget), min(self.min_chunk, self.token_budget))

    def snapshot(self) -> dict:
        """The pacer's state for statistics."""
        return {"decode_gap_target_s": self.gap_target, "prefill_allowance": self.allow,
                "decode_step_s": round(self.base_s, 6) if self.base_s is not None else None,
                "prefill_token_s": self.per_token_s, "prefill_fixed_s": self.fixed_s}


def _median(sorted_values: list[float]) -> float:
    k = len(sorted_values)
    return (sorted_values[(k - 1) // 2] + sorted_values[k // 2]) / 2
