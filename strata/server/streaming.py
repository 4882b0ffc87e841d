"""Turning a request's sequences into its HTTP answer: OpenAI errors, merged token events, SSE streams that
stop (and free their sequences) as soon as the client goes away, and the non-streaming body."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from strata.errors import RequestError, StrataError, UnsupportedError
from strata.runtime.generation.scheduler import QueueFullError
from strata.server.api_errors import APIError, bad_request
from strata.server.render import Seq, is_token

log = logging.getLogger("strata.server")
RETRY_AFTER_S = "1"  # a full queue drains as sequences finish; a second is a fair first wait


def to_api_error(e: BaseException) -> APIError:
    """Map an exception to its OpenAI error; anything not caused by the client is logged with a traceback."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, RequestError | UnsupportedError):
        return bad_request(str(e), getattr(e, "param", None), getattr(e, "code", None))
    if isinstance(e, ClientDisconnect):
        return APIError(499, "the client closed the connection", "client_closed")
    log.error("request failed", exc_info=e)
    message = str(e) if isinstance(e, StrataError) else f"internal error ({type(e).__name__}); see the server log"
    return APIError(500, message, "internal_error", code="internal_error")


async def respond(request: Request, head: dict, req: Any, seqs: list[Seq], fmt: Any) -> Response:
    """The response to a chat or completions request: an SSE stream, or one JSON body once every sequence is done."""
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return event_stream(_sse(head, seqs, fmt, usage))
    return await whole(request, seqs, fmt.on_event,
                       lambda: {**head, "choices": fmt.choices(seqs), "usage": fmt.usage(seqs)})


def event_stream(body: AsyncIterator[str]) -> Response:
    """An SSE response sending `body`'s strings as they come (closed, so its `finally` runs, when the client goes)."""
    return EventStream(body, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def whole(request: Request, seqs: list[Seq], on_event: Callable[[Seq, Any], Any],
                answer: Callable[[], dict]) -> Response:
    """The non-streaming answer: every event of `seqs` through `on_event`, then `answer()` as JSON; a 499 as soon
    as the client goes away (its sequences are cancelled then, not after max_tokens)."""

    async def collect() -> dict:
        async for s, ev in merged_events(seqs):
            track(s, ev)
            on_event(s, ev)
        return answer()

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: free its sequences now, not after max_tokens
            return Response(status_code=499)
        return JSONResponse(work.result())
    finally:
        work.cancel()
        gone.cancel()
        cancel(seqs)


def cancel(seqs: list[Seq]) -> None:
    """Cancel the sequences still generating (their KV slots are freed at the next step)."""
    for s in seqs:
        if s.finish_reason is None:
            s.handle.cancel()


async def merged_events(seqs: list[Seq]) -> AsyncIterator[tuple[Seq, Any]]:
    """Every sequence's events, merged in arrival order; a failing sequence raises here."""
    if len(seqs) == 1:
        async for ev in seqs[0].handle.events():
            _raise_failed(ev)
            yield seqs[0], ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(s: Seq) -> None:
        try:
            async for ev in s.handle.events():
                _raise_failed(ev)
                queue.put_nowait((s, ev, None))
        except Exception as e:
            queue.put_nowait((s, None, e))
        queue.put_nowait((s, None, None))

    tasks = [asyncio.create_task(pump(s)) for s in seqs]
    try:
        left = len(seqs)
        while left:
            s, ev, err = await queue.get()
            if err is not None:
                raise err
            if ev is None:
                left -= 1
            else:
                yield s, ev
    finally:
        for t in tasks:
            t.cancel()


def _raise_failed(ev: Any) -> None:
    """A sequence the scheduler aborted because its step failed: an error (500, or in-stream), not an empty answer."""
    if getattr(ev, "error", None) is not None:
        raise StrataError(f"generation failed: {ev.error}")


def track(s: Seq, ev: Any) -> None:
    """Count a sequence's token and, on its last event, its finish (the metrics' timer, the usage counts)."""
    if is_token(ev):
        s.timer.token()
        s.tokens += 1
    if ev.finish_reason is not None:
        s.finish_reason = ev.finish_reason
        s.prompt_tokens = ev.prompt_tokens or len(s.prompt_ids)
        s.completion_tokens = ev.completion_tokens or s.tokens
        s.cached_tokens = ev.cached_tokens
        s.timer.finish(ev.finish_reason, s.prompt_tokens, s.completion_tokens)


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body is already read, so the next message is the disconnect)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def _sse(head: dict, seqs: list[Seq], fmt: Any, include_usage: bool) -> AsyncIterator[str]:
    chunk_head = {**head, "object": head["object"] + ".chunk"} if head["object"] == "chat.completion" else head
    tail = {"usage": None} if include_usage else {}

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        for piece in fmt.first_chunks(seqs):
            yield sse({**chunk_head, "choices": [piece], **tail})
        async for s, ev in merged_events(seqs):
            track(s, ev)
            piece = fmt.on_event(s, ev)
            if piece is not None:
                yield sse({**chunk_head, "choices": [piece], **tail})
        if include_usage:
            yield sse({**chunk_head, "choices": [], "usage": fmt.usage(seqs)})
    except Exception as e:  # headers are sent: report the failure in the stream, as vLLM does
        yield sse(to_api_error(e).body())
    finally:
        cancel(seqs)
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A StreamingResponse that also watches for the client going away while no token is being sent.

    Starlette only notices a disconnect on the next write (ASGI spec 2.4); we stop at once, and close the
    body iterator so its `finally` cancels the sequences.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
            failed = stream.exception() if stream.done() and not stream.cancelled() else None
            if failed is not None and not isinstance(failed, OSError):  # OSError: the client left mid-write
                raise failed
        finally:
            for t in (stream, watch):
                t.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            await self.body_iterator.aclose()

