"""The caller's side of the scheduler: requests, the checks they pass before they queue, the events they produce, and
their handles.

`GenRequest` is one sequence to generate (or, `score=True`, a prompt to score); `Scheduler.submit` returns a
`RequestHandle` whose events (`TokenEvent`, the last one carrying `finish_reason`) arrive as the scheduler's
thread produces them, through an asyncio queue (submitted inside an event loop) or a plain one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from strata.errors import RequestError, StrataError
from strata.runtime.generation.sampler import SamplingParams

if TYPE_CHECKING:
    from strata.runtime.generation.grammar import Grammar

MAX_LOGPROBS = 20


class QueueFullError(StrataError):
    """The bounded request queue is full: retry later (HTTP 429)."""


@dataclass
class GenRequest:
    """One sequence to generate."""

    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None = None  # top-N alternatives per generated token (0..20); None: no log-probabilities
    prompt_logprobs: int | None = None  # log-probabilities of the prompt tokens (echo), + top-N
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    reproducible: bool = False  # bit-identical whatever else runs: a forward pass of its own (slower)
    # no generation: the last event's `scores` holds the log-probabilities of the next token at every prompt
    # position ([len(prompt_ids), vocab] float32 on the CPU; `Engine.score`), prefilled in a pass of its own
    score: bool = False
    # start from the longest prefix of the prompt another sequence's KV slot holds, and leave this one's for later
    # requests (strata.runtime.generation.prefix_cache); False: computed from scratch and not kept
    prefix_cache: bool = True
    # `params.response_format` compiled (strata.runtime.generation.grammar), attached when it is submitted
    grammar: Grammar | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("reproducible", "score", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not self.prompt_ids:
            raise RequestError("the prompt is empty; give at least one token")


@dataclass
class TokenEvent:
    """One step's output for one request (the last event carries `finish_reason`)."""

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # None | "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's usage.prompt_tokens_details)
    prompt_logprobs: list[float | None] | None = None  # first event only, when asked
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    error: str | None = None  # with finish_reason "abort": the fault that failed the step (the server reports it)
    exception: BaseException | None = None  # ... and the exception itself (`Engine` raises it to its caller)
    scores: torch.Tensor | None = None  # a score request's last event: float32 [len(prompt_ids), vocab] on the CPU


class RequestHandle:
    """The caller's side of a submitted request: its events, and cancellation."""

    def __init__(self, request: GenRequest, asynchronous: bool | None = None):
        """`asynchronous`: events through `events()` (True: the running event loop's), through `iter_events()`
        (False), or None: `events()` when created inside a running event loop."""
        self.request = request
        self.cancelled = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        if asynchronous is not False:
            try:
                self._loop = asyncio.get_running_loop()
                self._aq: asyncio.Queue = asyncio.Queue()
            except RuntimeError:
                if asynchronous:
                    raise
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def deliver(self, ev: TokenEvent) -> None:
        """(The scheduler's side.) Hand the caller its next event."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # the caller's loop is gone: nobody listens any more
                self.cancelled.set()
        else:
            self._q.put(ev)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Events as they come (submit from inside the event loop to use this)."""
        if self._loop is None:
            raise RuntimeError("submit() was called outside an event loop; use iter_events()")
        while True:
            ev = await self._aq.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def iter_events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Blocking iteration (submit from a plain thread to use this)."""
        while True:
            ev = self._q.get(timeout=timeout)
            yield ev
            if ev.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Stop generating; the sequence leaves the batch and frees its KV slot at the next step."""
        self.cancelled.set()


def check_request(engine, request: GenRequest) -> None:
    """Refuse `request` before it queues on `engine`'s scheduler (a `RequestError` naming the problem) when it
    overruns the context or holds ids outside the vocabulary; compile its response format's grammar (cached per
    schema) while the caller waits."""
    n, ctx = len(request.prompt_ids), engine.max_context
    if request.score and n > ctx:
        raise RequestError(f"context_length_exceeded: {n} tokens exceed the context of {ctx} tokens")
    if not request.score and (n >= ctx or n + request.params.max_tokens > ctx):
        raise RequestError(
            f"context_length_exceeded: the prompt ({n} tokens) plus max_tokens ({request.params.max_tokens}) "
            f"exceed the context of {ctx} tokens; shorten the prompt or lower max_tokens"
        )
    engine.check_token_ids(request.prompt_ids)
    if request.params.response_format is not None and request.grammar is None and not request.score:
        request.grammar = engine.compile_grammar(request.params.response_format)  # cached per schema
