"""What `Engine`'s generation calls return: `GenerationOutput` (a whole result) and `TextStream` (text pieces as
tokens are generated), and the error a request that ended in "abort" raises."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.errors import StrataError

if TYPE_CHECKING:
    from strata.runtime.generation.requests import RequestHandle, TokenEvent
    from strata.runtime.generation.scheduler import Scheduler


@dataclass
class GenerationOutput:
    """The result of `Engine.generate` / `Engine.chat`."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens or context full)
    prompt_tokens: int = 0


class TextStream(Iterator[str]):
    """What `Engine.stream` returns: an iterator of text pieces as tokens are generated. `output` fills as they
    come (`output.token_ids`: the result of a model without a tokenizer, whose text stays empty); its `text` and
    `finish_reason` are final once the iteration ends. Closing the stream (`close()`, leaving a `with` block, a
    `break` out of a for loop over it, or dropping it) cancels its request at once."""

    def __init__(self, scheduler: Scheduler, handle: RequestHandle, output: GenerationOutput):
        self._done = False
        self.output = output
        self._scheduler, self._handle = scheduler, handle
        self._events = handle.iter_events()
        self._pieces: list[str] = []

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        while not self._done:
            try:
                ev = next(self._events)
            except BaseException:  # e.g. KeyboardInterrupt while waiting: nobody reads the rest
                self.close()
                raise
            if ev.finish_reason == "abort":
                self._done = True
                raise request_failure(ev)
            if ev.token_id is not None:
                self.output.token_ids.append(ev.token_id)
            if ev.finish_reason is not None:
                self._done = True
                self.output.finish_reason = ev.finish_reason
            if ev.text:
                self._pieces.append(ev.text)
            if self._done:
                self.output.text = "".join(self._pieces)
            if ev.text:
                return ev.text
        raise StopIteration

    def close(self) -> None:
        """Stop generating: the request leaves the queue now, or the batch (freeing its KV slot) at the next step."""
        if not self._done:
            self._done = True
            self._scheduler.cancel(self._handle)

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def request_failure(ev: TokenEvent) -> BaseException:
    """What a request that ended in "abort" raises: the exception that failed its step, else a `StrataError`."""
    if ev.exception is not None:
        return ev.exception
    return StrataError(f"the request was cancelled{': ' + ev.error if ev.error else ''} (the engine's scheduler "
                       "was stopped, or the engine closed)")
