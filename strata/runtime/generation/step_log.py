"""The scheduler's record of its steps: how many, their tokens, and the last 512 for benchmarks and diagnosis."""

from __future__ import annotations

import threading
import time
from collections import deque


class StepLog:
    """Counts every finished step and keeps the recent ones; safe to read from other threads."""

    def __init__(self, keep: int = 512):
        self._lock = threading.Lock()
        self._recent: deque[dict] = deque(maxlen=keep)
        self.steps = 0
        self.tokens = 0  # decode and prompt tokens of all steps

    def record(self, seconds: float, decode: int, prompt: int, passes: int, allowance: int) -> None:
        """A step of `decode` decode tokens and `prompt` prompt tokens in `passes` forward passes took `seconds`;
        `allowance`: the prompt tokens the pacer gave it."""
        with self._lock:
            self.steps += 1
            self.tokens += decode + prompt
            self._recent.append({"t": time.time(), "seconds": seconds, "decode": decode, "prompt": prompt,
                                 "passes": passes, "allowance": allowance})

    def recent(self) -> list[dict]:
        """The last steps, oldest first: wall-clock end `t` (time.time()), `seconds`, `decode` and `prompt` tokens,
        forward `passes`, and the prompt `allowance` the pacer gave."""
        with self._lock:
            return list(self._recent)

    def snapshot(self) -> dict:
        with self._lock:
            return {"steps": self.steps, "mean_tokens_per_step": self.tokens / self.steps if self.steps else 0.0}
