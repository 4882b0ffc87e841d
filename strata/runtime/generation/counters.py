"""What an engine has generated so far (`Engine.stats()`): requests, tokens and the seconds they took.

The engine's scheduler records every forward pass here, whoever asked for it: `Engine.generate`, `stream`,
`chat` and `score`, and the server's requests alike.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class GenerationCounters:
    """Totals since the engine loaded (or since `reset`); safe to update from several threads."""

    requests: int = 0  # admitted to a KV slot
    prompt_tokens: int = 0  # prompt tokens run through the model
    generated_tokens: int = 0  # tokens handed to callers (an EOS that ends a sequence is not one)
    decode_tokens: int = 0  # tokens computed by decode rows (one token each)
    prefill_seconds: float = 0.0  # passes without a decode row
    decode_seconds: float = 0.0  # passes with one (and the prompt chunks that shared them)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def admitted(self) -> None:
        """A request took a KV slot."""
        with self._lock:
            self.requests += 1

    def ran(self, prompt_tokens: int, decode_tokens: int, seconds: float) -> None:
        """A forward pass of `prompt_tokens` prompt tokens and `decode_tokens` decode rows took `seconds`."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.decode_tokens += decode_tokens
            if decode_tokens:
                self.decode_seconds += seconds
            else:
                self.prefill_seconds += seconds

    def emitted(self, tokens: int = 1) -> None:
        """Tokens handed to a caller."""
        with self._lock:
            self.generated_tokens += tokens

    def reset(self) -> None:
        """Start every total at zero again (the serving warm-up is not traffic)."""
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_"):
                    setattr(self, f.name, type(getattr(self, f.name))())

    def snapshot(self) -> dict:
        """The totals, with the prefill and decode rates (tokens per second; 0.0 before any)."""
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out["prefill_tokens_per_s"] = out["prompt_tokens"] / out["prefill_seconds"] if out["prefill_seconds"] else 0.0
        out["decode_tokens_per_s"] = out["decode_tokens"] / out["decode_seconds"] if out["decode_seconds"] else 0.0
        return out
