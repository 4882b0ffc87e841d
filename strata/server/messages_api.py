"""Anthropic's Messages API, response side: POST /v1/messages (whole, or streamed as Anthropic's SSE events) and
POST /v1/messages/count_tokens.

A message is generated as a chat completion (strata.server.chat, one sequence) and its choice is rewritten as
Anthropic content blocks: the model's thinking as a `thinking` block, its answer as a `text` block, each call
as a `tool_use` block; finish reasons become `stop_reason` (end_turn, max_tokens, stop_sequence, tool_use).
Streamed, each block is `content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`)
and `content_block_stop`, between `message_start` and `message_delta` + `message_stop`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from strata.server.api_errors import parse_request
from strata.server.chat import render_chat
from strata.server.guard import record_usage
from strata.server.messages_protocol import CountTokensRequest, MessagesRequest, chat_messages, error_body
from strata.server.prompts import compile_grammar, submit
from strata.server.render import ChatFormat, Seq, is_token
from strata.server.streaming import cancel, event_stream, merged_events, to_api_error, track, whole


async def create_message(request: Request, st: Any, body: dict) -> Response:
    """POST /v1/messages: `body` answered as an Anthropic message, whole or streamed."""
    req = parse_request(MessagesRequest, body)
    st.check_model(req.model)
    prompt = await render_chat(st, chat_messages(req), req.tool_request, True, req.template_kwargs(), req.max_tokens)
    await compile_grammar(st, req)
    seqs = submit(st, req, [prompt.ids], "messages", None, logprobs=None, prompt_logprobs=None)
    fmt = MessageFormat(ChatFormat(st.token_text, False, st.think, prompt.in_reasoning, 1, prompt.calls),
                        st.engine.tokenizer, req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else [])
    record_usage(request.scope, lambda: fmt.chat.usage(seqs))
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": st.model_name}
    if req.stream:
        return event_stream(_events(head, seqs, fmt))
    return await whole(request, seqs, fmt.on_event, lambda: fmt.message(head, seqs))


async def count_tokens(request: Request, st: Any, body: dict) -> Response:
    """POST /v1/messages/count_tokens: the prompt's tokens, tools and system included."""
    req = parse_request(CountTokensRequest, body)
    st.check_model(req.model)
    prompt = await render_chat(st, chat_messages(req), req.tool_request, True, req.template_kwargs(), None)
    return JSONResponse({"input_tokens": len(prompt.ids)})


class MessageFormat:
    """One sequence's events as an Anthropic message, through the chat choice they make (`chat`)."""

    def __init__(self, chat: ChatFormat, tokenizer: Any, stop_sequences: list[str]):
        self.chat, self.tokenizer, self.stop_sequences = chat, tokenizer, stop_sequences
        self.ids: list[int] = []  # generated, to tell which stop sequence ended the message

    def on_event(self, s: Seq, ev: Any) -> dict | None:
        """Record one event; return its chat choice delta (None when it adds nothing)."""
        if is_token(ev):
            self.ids.append(ev.token_id)
        return self.chat.on_event(s, ev)

    def stop_reason(self, s: Seq) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished sequence."""
        reason = self.chat.finish_reason(s, s.finish_reason)
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        if self.stop_sequences and self.ids:
            # the generated text holds a stop sequence only when one ended it: the first to occur did
            text = self.tokenizer.decode(self.ids)
            hits = [(text.find(seq), len(seq), seq) for seq in self.stop_sequences if seq in text]
            if hits:
                return "stop_sequence", min(hits)[2]
        return "end_turn", None

    def usage(self, seqs: list[Seq]) -> dict:
        """Anthropic's usage: prompt tokens the prefix cache served are `cache_read_input_tokens`, the rest
        `input_tokens` (their sum is the prompt)."""
        u = self.chat.usage(seqs)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                "cache_read_input_tokens": cached}

    def message(self, head: dict, seqs: list[Seq]) -> dict:
        """The whole message."""
        msg = self.chat.choices(seqs)[0]["message"]
        content: list[dict] = []
        if msg.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls", []):
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        reason, sequence = self.stop_reason(seqs[0])
        return {**head, "content": content or [{"type": "text", "text": ""}], "stop_reason": reason,
                "stop_sequence": sequence, "usage": self.usage(seqs)}


class BlockEvents:
    """Chat choice deltas as Anthropic's content block events: a block opens when its kind of output starts
    and closes when another kind (or the end) comes; a call is a whole tool_use block at once."""

    _TEXT = (("thinking", "reasoning_content", "thinking_delta"), ("text", "content", "text_delta"))

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def feed(self, delta: dict) -> list[str]:
        out: list[str] = []
        for kind, key, delta_type in self._TEXT:
            text = delta.get(key)
            if not text:
                continue
            if self.open != kind:
                start = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
                out += self._start(start, kind)
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": delta_type, kind: text}}))
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            out += self._start({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}, "tool_use")
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}}))
            out += self.close()
        return out

    def close(self) -> list[str]:
        """Close the open block, if any."""
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict, kind: str) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]


def sse(event: str, data: dict) -> str:
    """One server-sent event, named as Anthropic names them."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(head: dict, seqs: list[Seq], fmt: MessageFormat) -> AsyncIterator[str]:
    s = seqs[0]
    start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": len(s.prompt_ids), "output_tokens": 0}}
    yield sse("message_start", {"type": "message_start", "message": start})
    blocks = BlockEvents()
    try:
        async for seq, ev in merged_events(seqs):
            track(seq, ev)
            piece = fmt.on_event(seq, ev)
            if piece is not None:
                for event in blocks.feed(piece["delta"]):
                    yield event
        for event in blocks.close():
            yield event
        reason, sequence = fmt.stop_reason(s)
        yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": fmt.usage(seqs)})
        yield sse("message_stop", {"type": "message_stop"})
    except Exception as e:  # headers are sent: the failure is an error event, as Anthropic streams one
        yield sse("error", error_body(to_api_error(e)))
    finally:
        cancel(seqs)
