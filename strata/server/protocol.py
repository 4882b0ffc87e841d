"""The OpenAI wire format: request models (validated), error bodies, response pieces, reasoning split.

Requests are pydantic models with strict types for structural fields (a `"stream": "yes"` is a 400,
not a truthy string) and unknown fields ignored, as OpenAI and vLLM do. Sampling fields are left
untyped here and validated by `SamplingParams`, so the server and the Python API reject a bad
`temperature` with the same message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from strata.errors import RequestError
from strata.runtime.sampler import SamplingParams

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)
MAX_N = 16  # sequences per prompt
MAX_CHOICES = 64  # sequences per request (n x prompts); the scheduler's queue bounds it further
_TYPE_TAGS = {"str", "int", "bool", "float", "dict", "list", "none"}
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 in OpenAI's shape."""
    return APIError(400, message, "invalid_request_error", param, code)


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object; anything else (binary garbage, a bare list, bad UTF-8) is a 400."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first offending field."""
    err = e.errors()[0]
    # drop union-branch tags ("str", "list[ContentPart]") that pydantic puts in the location
    loc = [str(p) for p in err.get("loc", ()) if not ("[" in str(p) or str(p) in _TYPE_TAGS)]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")  # our own validators' ValueErrors
    got = f", got {err['input']!r}"[:120] if loc and "input" in err and err.get("type") != "missing" else ""
    return bad_request(f"{param + ': ' if param else ''}{msg}{got}", param=param)


def parse_request(model: type[BaseModel], data: dict) -> Any:
    """Validate `data` as `model`, turning pydantic's and strata's errors into 400s."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RequestError as e:
        raise bad_request(str(e)) from None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class _GenerationRequest(_Request):
    """Fields shared by chat and completions."""

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    # sampling: validated by SamplingParams (same messages as the Python API)
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    seed: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    # pass-through until the CPU numerics modes exist (reproducible CPU experts match the GPU bit for bit)
    strata_reproducible: Any = None

    @field_validator("strata_reproducible")
    @classmethod
    def _check_reproducible(cls, v: Any) -> Any:
        if not (v is None or isinstance(v, bool) or v in ("required", "preferred") and isinstance(v, str)):
            raise ValueError('must be true, false, "required" or "preferred"')
        return v

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    def sampling(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        """SamplingParams for one sequence (`max_tokens` already defaulted; sequence i of n gets seed + i)."""
        kwargs = {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}
        kwargs["max_tokens"] = max_tokens
        if "seed" in kwargs and isinstance(kwargs["seed"], int) and not isinstance(kwargs["seed"], bool):
            kwargs["seed"] += seed_offset
        try:
            return SamplingParams(**kwargs)
        except RequestError as e:
            first = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=first if first in SAMPLING_FIELDS else None) from None


class ContentPart(_Request):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, reasoning_content, ...) reach the chat template."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None

    def for_template(self) -> dict:
        """A plain dict, with content parts joined into one string (only text parts are supported)."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type {part.type!r} are not supported; send text",
                                      param="messages")
                texts.append(part.text)
            d["content"] = "".join(texts)
        return d


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Any = None  # the newer name of max_tokens; wins when both are given
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}, as vLLM

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    @model_validator(mode="after")
    def _newer_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Any  # a string, a list of strings, token ids, or a list of token-id lists: checked by prompts()
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: StrictStr | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Any) -> Any:
        if v:
            raise ValueError("is not supported (no fill-in-the-middle)")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one entry per prompt of a batch (text, or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(_is_int(t) for t in p):
                return [p]
            if all(isinstance(t, str) for t in p) or all(isinstance(x, list) and all(map(_is_int, x)) for x in p):
                return p
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                          "lists (non-empty)", param="prompt")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered with the template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's shape)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


# ---- responses --------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def context_error(prompt_tokens: int, max_tokens: int, context: int, param: str) -> APIError:
    """The 400 for prompt + max_tokens over the context, worded as OpenAI words it."""
    where = "messages" if param == "messages" else "prompt"
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion.", param=param, code="context_length_exceeded")


class TokenText:
    """Token ids -> the text shown for them in logprobs (memoised: the same ids come back every step)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
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


def is_token(ev: Any) -> bool:
    """Whether a scheduler event carries a generated token (a final event may carry none)."""
    return ev.token_id is not None and ev.token_id >= 0


def _usage_of(seqs: list[Seq], n: int, completion: bool = True) -> dict:
    # a prompt sent once with n > 1 is counted once, as OpenAI does
    prompt = sum(s.prompt_tokens or len(s.prompt_ids) for s in seqs if s.index % n == 0)
    return usage(prompt, sum(s.completion_tokens for s in seqs) if completion else 0)


class ChatFormat:
    """Chat completion choices: content, reasoning_content (thinking) and logprobs.content."""

    def __init__(self, text: TokenText, logprobs: bool, think: bool, in_reasoning: bool, n: int = 1):
        self.text, self.logprobs, self.think, self.in_reasoning, self.n = text, logprobs, think, in_reasoning, n
        self._state: dict[int, dict] = {}

    def _choice(self, s: Seq) -> dict:
        if s.index not in self._state:
            split = ReasoningSplitter(in_reasoning=self.in_reasoning) if self.think else None
            self._state[s.index] = {"split": split, "content": [], "reasoning": [], "logprobs": []}
        return self._state[s.index]

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
        entries = []
        if self.logprobs and is_token(ev) and ev.logprob is not None:
            entries.append(self.text.chat_entry(ev.token_id, ev.logprob, ev.top_logprobs))
        c["reasoning"].append(reasoning)
        c["content"].append(content)
        c["logprobs"] += entries
        delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if not delta and not entries and ev.finish_reason is None:
            return None
        return {"index": s.index, "delta": delta, "logprobs": {"content": entries} if entries else None,
                "finish_reason": ev.finish_reason}

    def choices(self, seqs: list[Seq]) -> list[dict]:
        out = []
        for s in sorted(seqs, key=lambda s: s.index):
            c = self._choice(s)
            message = {"role": "assistant", "content": "".join(c["content"])}
            if any(c["reasoning"]):
                message["reasoning_content"] = "".join(c["reasoning"])
            out.append({"index": s.index, "message": message,
                        "logprobs": {"content": c["logprobs"]} if self.logprobs else None,
                        "finish_reason": s.finish_reason})
        return out

    def usage(self, seqs: list[Seq]) -> dict:
        return _usage_of(seqs, self.n)


class CompletionFormat:
    """Text completion choices: text (with the prompt first under `echo`) and the legacy logprobs object."""

    def __init__(self, text: TokenText, logprobs: int | None, echo: bool, score_only: bool, prompt_texts: list[str],
                 n: int):
        self.text, self.logprobs, self.echo, self.score_only = text, logprobs, echo, score_only
        self.prompt_texts, self.n = prompt_texts, n
        self._state: dict[int, dict] = {}

    def _choice(self, s: Seq) -> dict:
        if s.index not in self._state:
            self._state[s.index] = {"text": [], "lp": CompletionLogprobs(self.text), "started": False}
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
        if not self.score_only:
            text += ev.text or ""
            if self.logprobs is not None and is_token(ev):
                lp.add(ev.token_id, ev.logprob, self.text.top_dict(ev.top_logprobs))
        c["text"].append(text)
        reason = ev.finish_reason
        if reason is not None and self.score_only:
            reason = "length"
        if not text and len(lp.tokens) == mark and reason is None:
            return None
        piece = None
        if self.logprobs is not None:
            piece = {k: v[mark:] for k, v in lp.as_dict().items()}
        return {"index": s.index, "text": text, "logprobs": piece, "finish_reason": reason}

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
            out.append({"index": s.index, "text": "".join(c["text"]),
                        "logprobs": c["lp"].as_dict() if self.logprobs is not None else None,
                        "finish_reason": "length" if self.score_only else s.finish_reason})
        return out

    def usage(self, seqs: list[Seq]) -> dict:
        return _usage_of(seqs, self.n, completion=not self.score_only)
