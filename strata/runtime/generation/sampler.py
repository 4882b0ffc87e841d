"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p); a response format's grammar
masks the logits first (strata.runtime.generation.grammar.GrammarBatch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.errors import RequestError
from strata.runtime.generation.grammar import ResponseFormat

MAX_STOP_STRINGS = 16


def _is_int(x: object) -> bool:
    # bool is an int subclass, but max_tokens=True is a client bug, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick tokens for one request; validated on construction (bad values raise RequestError)."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # JSON output (OpenAI's response_format dict, or a ResponseFormat; {"type": "text"} or None: free text)
    response_format: ResponseFormat | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or not 0 <= self.temperature <= 100:
            raise RequestError(f"temperature must be a number in [0, 100] (0 = greedy), got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not _is_number(self.top_p) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an integer or null, got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise RequestError("stop_token_ids must be a list of integers >= 0")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        self.response_format = ResponseFormat.parse(self.response_format)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` (or a fresh nondeterministic seed when None)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # manual_seed rejects negatives and > 64 bits
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of logits [B, V]; returns int64 ids [B]. Same seed + same logits => same ids. A token
    at -inf (one a grammar refuses: `GrammarBatch.mask`) is never picked."""
    logits = logits.float()
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # Mask by rank rather than by kth value, so ties at the boundary cannot let more than k tokens through.
        idx = logits.topk(params.top_k, dim=-1).indices
        logits = torch.full_like(logits, -math.inf).scatter(-1, idx, logits.gather(-1, idx))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always survives.
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop[..., 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    # one draw by the exponential race, argmax(p / q) with q ~ Exp(1): what torch.multinomial does for a single
    # sample, without its validity check, which reads a device value back and so waits for the queued work
    # (overlapped decode queues the next step before the host reads this token). Taken in logs, argmax(logits -
    # log q) (the Gumbel-max trick): the same distribution without the softmax, which over one row of a 152K
    # vocabulary ran as a single 39-us block on the H200, the longest kernel of a decode step's sampling
    # (`bench/serial_phase.py`, code 104a6ba). q is kept above 0, where the CPU's exponential may (rarely) land;
    # a masked token (-inf) stays -inf.
    q = torch.empty_like(logits).exponential_(generator=generator).clamp_min_(torch.finfo(logits.dtype).tiny)
    return (logits - q.log_()).argmax(dim=-1)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dimension (for logprobs in responses)."""
    return torch.log_softmax(logits.float(), dim=-1)
