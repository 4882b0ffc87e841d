"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p); a response format's grammar
masks the logits first (strata.runtime.generation.grammar.GrammarBatch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of logits [B, V] -> int64 ids [B]: the first of equal maxima, NaN above every number,
    as `torch.argmax`. Float32 CPU logits go through numpy, whose argmax over a 152K vocabulary takes ~10 us on one
    core where torch's takes ~220 (a CPU decode step's sampling: docs/benchmarks.md, "CPU-only hosts on an AMX Xeon")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of logits [B, V]; returns int64 ids [B]. Same seed + same logits => same ids. A token
    at -inf (one a grammar refuses: `GrammarBatch.mask`) is never picked."""
    logits = logits.float()
    if params.temperature == 0.0:
        return greedy(logits)
    return _draw(_filtered(logits, params), generator)


def sample_rows(logits: torch.Tensor, samplers: list[tuple[SamplingParams, torch.Generator | None]],
                rows: list[int] | None = None) -> torch.Tensor:
    """Row `rows[j]` of logits [B, V] (default: every row) sampled with `samplers[j]` (its params and generator):
    int64 ids [len(rows)], each the token `sample` picks for that row alone with that generator, bit for bit.

    Rows of equal filtering (temperature, top-k, top-p) share their launches, and each generator draws the noise
    of its own row only, as `sample` would: a step of 8 streams launches ~10 kernels where a row at a time took ~50,
    host time that overlapped decode has only while the GPU runs the step before."""
    rows = list(range(logits.shape[0])) if rows is None else rows
    if len(rows) == 1:
        return sample(logits[rows[0] : rows[0] + 1], *samplers[0])
    logits = logits.float()
    groups: dict[tuple, list[int]] = {}
    for j, (params, _) in enumerate(samplers):
        key = (0.0, 0, 1.0) if params.greedy else (params.temperature, params.top_k, params.top_p)
        groups.setdefault(key, []).append(j)
    picked = []
    for (temperature, _, _), members in groups.items():
        at = rows if len(members) == len(rows) else [rows[j] for j in members]
        part = logits[at[0] : at[-1] + 1] if at == list(range(at[0], at[-1] + 1)) else logits[at]  # [n, V]
        if temperature == 0.0:
            picked.append(greedy(part))
        else:
            params = samplers[members[0]][0]
            picked.append(_draw(_filtered(part, params), [samplers[j][1] for j in members]))
    if len(groups) == 1:
        return picked[0]
    at = [0] * len(rows)  # where each row's token sits in the groups' concatenation
    for k, j in enumerate(j for members in groups.values() for j in members):
        at[j] = k
    return torch.cat(picked)[at]


def _filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits [n, V] over the temperature, with the tokens top-k and top-p drop at -inf (row by row)."""
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
    return logits


def _draw(logits: torch.Tensor, generators: torch.Generator | None | list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of filtered logits [n, V], drawn from softmax(logits) with the rows' generators: one
    generator for every row in one draw, or, given a list, row i's with `generators[i]` alone (as that row sampled by
    itself draws). A masked token (-inf) is never picked. Float32 CPU rows take the inverse CDF (`_draw_host`), any
    other the exponential race (`_draw_race`)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return _draw_host(logits, generators)
    return _draw_race(logits, generators)


def _draw_race(logits: torch.Tensor, generators: torch.Generator | None | list[torch.Generator | None]) -> torch.Tensor:
    """`_draw` by the exponential race, argmax(p / q) with q ~ Exp(1): what torch.multinomial does for a single
    sample, without its validity check, which reads a device value back and so waits for the queued work (overlapped
    decode queues the next step before the host reads this token). Taken in logs, argmax(logits - log q) (the
    Gumbel-max trick): the same distribution without the softmax, which over one row of a 152K vocabulary ran as a
    single 39-us block on the H200, the longest kernel of a decode step's sampling (`bench/tools/serial_phase.py`,
    code 104a6ba). q [n, V] comes from one generator in one draw, or row i's from `generators[i]` ([1, V]). q is kept
    above 0, where the CPU's exponential may (rarely) land; a masked token (-inf) stays -inf."""
    if isinstance(generators, list) and len(generators) > 1:
        q = torch.cat([torch.empty((1, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
                       .exponential_(generator=g) for g in generators])
    else:
        g = generators[0] if isinstance(generators, list) else generators
        q = torch.empty_like(logits).exponential_(generator=g)
    q.clamp_min_(torch.finfo(logits.dtype).tiny)
    return greedy(logits - q.log_())


BLOCK = 1024  # `inverse_cdf`'s vocabulary blocks: their sums found first, then one block's running sum


def inverse_cdf(row: np.ndarray, top: float, u: float) -> int:
    """The token of float32 logits row [V] (its finite maximum `top`) at which the running sum of
    w = exp(row - top) first exceeds u * sum(w), for u in [0, 1): tokens at -inf have w = 0 and are never picked."""
    w = np.exp(row - top)  # [V] float32, 0 where masked
    v = len(w)
    full = v - v % BLOCK
    sums = w[:full].reshape(-1, BLOCK).sum(axis=1)
    if full < v:
        sums = np.append(sums, w[full:].sum())
    ends = np.cumsum(sums, dtype=np.float64)  # [blocks] the running sum at each block's end
    target = u * ends[-1]
    b = min(int(np.searchsorted(ends, target, side="right")), len(ends) - 1)
    while sums[b] == 0:  # target rounded onto the total, past the last block's live tokens
        b -= 1
    start = b * BLOCK
    inside = np.cumsum(w[start : start + BLOCK], dtype=np.float64)
    j = int(np.searchsorted(inside, target - (ends[b - 1] if b else 0.0), side="right"))
    if j >= len(inside):  # the block's float32 sum fell short of its float64 running sum: its last live token
        j = int(np.flatnonzero(w[start : start + BLOCK])[-1])
    return start + j


def _draw_host(logits: torch.Tensor, generators: torch.Generator | None | list[torch.Generator | None]) -> torch.Tensor:
    """`_draw` on the host by the inverse CDF (`inverse_cdf`): one uniform a row from its generator. The exponential
    race draws V exponentials a row, 2.8 ms for a 152K vocabulary on one core of the development machine (~6% of the
    8-layer bench model's CPU decode step); this takes ~0.17 ms. A row holding a NaN, or with no finite maximum,
    picks as `greedy` (the race's pick there)."""
    n = logits.shape[0]
    if isinstance(generators, list) and len(generators) > 1:
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators]).numpy()
    else:
        g = generators[0] if isinstance(generators, list) else generators
        u = torch.rand(n, dtype=torch.float64, generator=g).numpy()
    x = logits.numpy()
    picks = np.empty(n, dtype=np.int64)
    for i in range(n):
        top = x[i].max()  # NaN if the row holds one
        picks[i] = inverse_cdf(x[i], top, float(u[i])) if np.isfinite(top) else int(greedy(logits[i : i + 1])[0])
    return torch.from_numpy(picks)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dimension (for logprobs in responses)."""
    return torch.log_softmax(logits.float(), dim=-1)
