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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import StrataError

_EMA = 0.5  # weight of the newest decode-only step time in the base estimate


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
        extra = max(seconds - (self.base_s or 0.0), 0.0) / n_prompt
        # costs rise with the position in the context, so a full chunk's sample replaces the estimate; a small
        # tail chunk is a noisy one (the base's jitter over few tokens) and only moves it by its size
        w = min(1.0, n_prompt / max(self.allow, 1))
        self.per_token_s = extra if self.per_token_s is None else w * extra + (1 - w) * self.per_token_s
        self._resize()

    def _resize(self) -> None:
        if not self.enabled:
            return
        spare = self.headroom * self.gap_target - (self.base_s or 0.0)
        if spare <= 0:  # decode steps alone take the whole target: prompts get the minimum
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
                "prefill_token_s": self.per_token_s}
