"""The OpenAI wire format, response side: usage, logprob rendering, the reasoning split, tool calls, chunk
formats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.server.tools.blocks import ToolCall
from strata.server.tools.calls import CallParsing


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenText:
    """Token ids -> the text shown for them in logprobs (memoised: the same ids come back every step); without
    a tokenizer, "token_id:N" (vLLM's spelling of a token it cannot show as text)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            s = self._cache[token_id] = text
        return s

    def chat_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict:
        """One element of a chat choice's `logprobs.content`."""
        s = self(token_id)
        alts = [{"token": self(i), "logprob": lp, "bytes": list(self(i).encode())} for i, lp in top or []]
        return {"token": s, "logprob": logprob, "bytes": list(s.encode()), "top_logprobs": alts}

    def top_dict(self, top: list[tuple[int, float]] | None) -> dict[str, float]:
        """A completions-style {token: logprob} of the alternatives (first occurrence wins on equal text)."""
        out: dict[str, float] = {}
        for i, lp in top or []:
            out.setdefault(self(i), lp)
        return out


class CompletionLogprobs:
    """Accumulates a completions choice's `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, text: TokenText, offset: int = 0):
        self.text, self.offset = text, offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
        s = self.text(token_id)
        self.tokens.append(s)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(s)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


class ReasoningSplitter:
    """Split streamed chat text into thinking (`reasoning_content`) and answer (`content`).

    Thinking is text the model opens with `<think>` (or starts in, when the chat template already put
    `<think>` at the end of the prompt) and closes with `</think>`. Tags may arrive split across deltas,
    so a tail that could be the start of a tag is held back until the next piece decides it.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        self.start, self.end = start, end
        self.state = "reasoning" if in_reasoning else "opening"  # opening -> reasoning -> content
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; return (reasoning delta, content delta)."""
        buf = self._buf + text
        self._buf = ""
        if self.state == "opening":
            head = buf.lstrip()
            if head.startswith(self.start):
                self.state, buf = "reasoning", head[len(self.start):]
            elif self.start.startswith(head):  # still could be "<think>" (or only whitespace so far)
                self._buf = buf
                return "", ""
            else:
                self.state = "content"
        if self.state == "content":
            return "", buf
        i = buf.find(self.end)
        if i >= 0:
            self.state = "content"
            return buf[:i], buf[i + len(self.end):]
        hold = next((k for k in range(min(len(buf), len(self.end) - 1), 0, -1) if self.end.startswith(buf[-k:])), 0)
        self._buf = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], ""

    def flush(self) -> tuple[str, str]:
        """Release what is held at the end of generation."""
        buf, self._buf = self._buf, ""
        return (buf, "") if self.state == "reasoning" else ("", buf)


# ---- rendering generated sequences -------------------------------------------------------------------


@dataclass
class Seq:
    """One submitted sequence of a request: choice `index`, its scheduler handle, and how it ended."""

    index: int
    prompt_ids: list[int]
    handle: Any
    timer: Any  # metrics.SequenceTimer
    tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of its prompt's, served from the prefix cache


def is_token(ev: Any) -> bool:
    """Whether a scheduler event carries a generated token (a final event may carry none)."""
    return ev.token_id is not None and ev.token_id >= 0


def _usage_of(seqs: list[Seq], n: int, completion: bool = True) -> dict:
    # a prompt sent once with n > 1 is counted once, as OpenAI does; a sequence the client left before its last
    # event has no finish counts, so its tokens are the ones it streamed
    prompt = sum(s.prompt_tokens or len(s.prompt_ids) for s in seqs if s.index % n == 0)
    cached = sum(s.cached_tokens for s in seqs if s.index % n == 0)
    return usage(prompt, sum(s.completion_tokens or s.tokens for s in seqs) if completion else 0, cached)


class ChatFormat:
    """Chat completion choices: content, reasoning_content (thinking), tool_calls and logprobs.content.

    With `calls` (a request with tools), the answer text after the thinking is parsed for the model's tool calls
    as it streams (strata.server.tools.calls): each call goes out as one `tool_calls` delta once complete, and a
    choice that made calls finishes with "tool_calls"."""

    def __init__(self, text: TokenText, logprobs: bool, think: bool, in_reasoning: bool, n: int = 1,
                 calls: CallParsing | None = None):
        self.text, self.logprobs, self.think, self.in_reasoning, self.n = text, logprobs, think, in_reasoning, n
        self.calls = calls
        self._state: dict[int, dict] = {}

    def _choice(self, s: Seq) -> dict:
        if s.index not in self._state:
            split = ReasoningSplitter(in_reasoning=self.in_reasoning) if self.think else None
            self._state[s.index] = {"split": split, "content": [], "reasoning": [], "logprobs": [],
                                    "parser": self.calls.stream() if self.calls else None, "started": False,
                                    "tool_calls": []}
        return self._state[s.index]

    def _parse_calls(self, c: dict, content: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """(content, reasoning, new calls) of this piece of answer text, through the choice's call parser."""
        parser = c["parser"]
        if not c["started"]:  # the forced start of a call, written into the prompt, begins the output
            c["started"], content = True, self.calls.prefix + content
        d = parser.feed(content)
        if final:
            d += parser.flush()
        calls = d.calls if self.calls.parallel else d.calls[:max(0, 1 - len(c["tool_calls"]))]
        c["tool_calls"] += calls
        return d.content, d.reasoning, calls

    def finish_reason(self, s: Seq, reason: str | None) -> str | None:
        """The choice's finish reason: "tool_calls" once it made calls (unless it failed)."""
        return "tool_calls" if reason in ("stop", "length") and self._choice(s)["tool_calls"] else reason

    def first_chunks(self, seqs: list[Seq]) -> list[dict]:
        return [{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for s in seqs]

    def on_event(self, s: Seq, ev: Any) -> dict | None:
        """Record one event; return its streaming choice delta (None when it adds nothing)."""
        c = self._choice(s)
        reasoning, content = c["split"].feed(ev.text or "") if c["split"] else ("", ev.text or "")
        if ev.finish_reason is not None and c["split"]:
            r, t = c["split"].flush()
            reasoning, content = reasoning + r, content + t
        calls: list[ToolCall] = []
        if c["parser"] is not None:
            content, more_reasoning, calls = self._parse_calls(c, content, ev.finish_reason is not None)
            reasoning += more_reasoning
        entries = []
        if self.logprobs and is_token(ev) and ev.logprob is not None:
            entries.append(self.text.chat_entry(ev.token_id, ev.logprob, ev.top_logprobs))
        c["reasoning"].append(reasoning)
        c["content"].append(content)
        c["logprobs"] += entries
        delta: dict[str, Any] = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if calls:
            first = len(c["tool_calls"]) - len(calls)
            delta["tool_calls"] = [call.openai(first + k) for k, call in enumerate(calls)]
        if not delta and not entries and ev.finish_reason is None:
            return None
        return {"index": s.index, "delta": delta, "logprobs": {"content": entries} if entries else None,
                "finish_reason": self.finish_reason(s, ev.finish_reason)}

    def choices(self, seqs: list[Seq]) -> list[dict]:
        out = []
        for s in sorted(seqs, key=lambda s: s.index):
            c = self._choice(s)
            content = "".join(c["content"])
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if c["tool_calls"] else "")}
            if any(c["reasoning"]):
                message["reasoning_content"] = "".join(c["reasoning"])
            if c["tool_calls"]:
                message["tool_calls"] = [call.openai() for call in c["tool_calls"]]
            out.append({"index": s.index, "message": message,
                        "logprobs": {"content": c["logprobs"]} if self.logprobs else None,
                        "finish_reason": self.finish_reason(s, s.finish_reason)})
        return out

    def usage(self, seqs: list[Seq]) -> dict:
        return _usage_of(seqs, self.n)


class CompletionFormat:
    """Text completion choices: text (with the prompt first under `echo`) and the legacy logprobs object."""

    def __init__(self, text: TokenText, logprobs: int | None, echo: bool, score_only: bool, prompt_texts: list[str],
                 n: int, token_ids: bool = False):
        """`token_ids`: each choice (and streamed piece) also lists its generated ids, for a model without a
        tokenizer, whose text is empty."""
        self.text, self.logprobs, self.echo, self.score_only = text, logprobs, echo, score_only
        self.prompt_texts, self.n, self.token_ids = prompt_texts, n, token_ids
        self._state: dict[int, dict] = {}

    def _choice(self, s: Seq) -> dict:
        if s.index not in self._state:
            self._state[s.index] = {"text": [], "lp": CompletionLogprobs(self.text), "started": False, "ids": []}
        return self._state[s.index]

    def first_chunks(self, seqs: list[Seq]) -> list[dict]:
        return []  # the echoed prompt goes out with the first event, which brings its logprobs

    def on_event(self, s: Seq, ev: Any) -> dict | None:
        c = self._choice(s)
        text, lp = "", c["lp"]
        mark = len(lp.tokens)
        if not c["started"]:
            c["started"] = True
            if self.echo:
                text = self.prompt_texts[s.index // self.n]
                if self.logprobs is not None:
                    self._add_prompt(lp, s.prompt_ids, ev)
        new_ids = []
        if not self.score_only:
            text += ev.text or ""
            if self.logprobs is not None and is_token(ev):
                lp.add(ev.token_id, ev.logprob, self.text.top_dict(ev.top_logprobs))
            if is_token(ev):
                new_ids.append(ev.token_id)
        c["text"].append(text)
        c["ids"] += new_ids
        reason = ev.finish_reason
        if reason is not None and self.score_only:
            reason = "length"
        if not text and len(lp.tokens) == mark and reason is None and not (self.token_ids and new_ids):
            return None
        piece = None
        if self.logprobs is not None:
            piece = {k: v[mark:] for k, v in lp.as_dict().items()}
        out = {"index": s.index, "text": text, "logprobs": piece, "finish_reason": reason}
        if self.token_ids:
            out["token_ids"] = new_ids
        return out

    def _add_prompt(self, lp: CompletionLogprobs, ids: list[int], ev: Any) -> None:
        values = ev.prompt_logprobs or [None] * len(ids)
        tops = getattr(ev, "prompt_top_logprobs", None)
        for i, (token, value) in enumerate(zip(ids, values, strict=False)):
            if value is None:
                top = None
            elif tops is not None and tops[i] is not None:
                top = {self.text(token): value, **self.text.top_dict(tops[i])}
            else:
                top = {self.text(token): value}
            lp.add(token, value, top)

    def choices(self, seqs: list[Seq]) -> list[dict]:
        out = []
        for s in sorted(seqs, key=lambda s: s.index):
            c = self._choice(s)
            choice = {"index": s.index, "text": "".join(c["text"]),
                      "logprobs": c["lp"].as_dict() if self.logprobs is not None else None,
                      "finish_reason": "length" if self.score_only else s.finish_reason}
            if self.token_ids:
                choice["token_ids"] = c["ids"]
            out.append(choice)
        return out

    def usage(self, seqs: list[Seq]) -> dict:
        return _usage_of(seqs, self.n, completion=not self.score_only)
