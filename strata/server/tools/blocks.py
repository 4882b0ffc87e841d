"""The pieces every tool-call format is built of (strata.server.tools.calls holds the formats): a parsed call, what a
piece of output adds, the argument helpers, and the block formats' base with its streaming parser.

A block format's calls sit between a start and an end marker, plain text around them; `BlockStream` gives the text
out at once and each block as its calls once it closes (as text, when it does not parse)."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from strata.server.tools.harmony import partial_suffix


def new_call_id() -> str:
    """An id for one tool call (OpenAI's `call_` prefix; Anthropic's answers use the same ids)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict:
        """The call in OpenAI's shape (`index` set: a streamed delta's element)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class Delta:
    """What a piece of output adds: answer text, thinking text, and the calls completed in it."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: Delta) -> Delta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        return self


def arguments_json(value: Any) -> str | None:
    """The JSON text of a call's arguments (an object, or a string holding one); None when they are not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def param_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: its JSON-schema type}} of the request's tools, to type the values of formats
    that write each argument as text (GLM, Qwen3-Coder)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = {k: (v or {}).get("type") for k, v in (props or {}).items() if isinstance(v, dict)}
    return out


def typed_value(raw: str, schema_type: Any) -> Any:
    """A textual argument value: kept as text when its schema says string (or names no type and it is not
    JSON), else the JSON value it spells."""
    if schema_type == "string" or (isinstance(schema_type, list) and "string" in schema_type):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class BlockFormat(ABC):
    """A format whose calls sit between a start and an end marker, with plain text around them."""

    name = ""
    start = ""
    end = ""

    @abstractmethod
    def parse_block(self, body: str, types: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        """The calls of the text between the markers; None when it does not parse."""

    @abstractmethod
    def forced_prefix(self, name: str | None) -> str:
        """Text that, appended to the prompt, makes the model write a call (of `name`, when given)."""

    def stream(self, tools: list[dict] | None = None) -> BlockStream:
        """A parser for one output, typing textual arguments by `tools`' schemas."""
        return BlockStream(self, param_types(tools))


class BlockStream:
    """A `BlockFormat`'s output parsed as it streams: text goes out at once, except a tail that could begin
    the start marker and whitespace that could precede a call (both held until the next piece decides); a
    block goes out as its calls once its end marker arrives (or as text, when it does not parse). Whitespace
    before a call, and at the end of an output that made one, is dropped."""

    def __init__(self, fmt: BlockFormat, types: dict[str, dict[str, Any]]):
        self.fmt, self.types = fmt, types
        self.buf = ""
        self.in_block = False
        self.lead = ""  # the whitespace before the open block: dropped if it is a call, kept if it is text
        self.calls = 0  # calls given out so far

    def feed(self, text: str) -> Delta:
        """Add a piece of output; return what it completes."""
        out = Delta()
        self.buf += text
        while True:
            if self.in_block:
                j = self.buf.find(self.fmt.end)
                if j < 0:
                    return out
                out += self._block(self.buf[:j], closed=True)
                self.buf, self.in_block = self.buf[j + len(self.fmt.end):], False
                continue
            i = self.buf.find(self.fmt.start)
            if i >= 0:
                before = self.buf[:i].rstrip()  # the whitespace before a call is no part of the answer
                out.content += before
                self.lead = self.buf[len(before):i]
                self.buf, self.in_block = self.buf[i + len(self.fmt.start):], True
                continue
            keep = partial_suffix(self.buf, self.fmt.start)
            ready = self.buf[:len(self.buf) - keep]
            stripped = ready.rstrip()
            out.content += stripped  # trailing whitespace waits: it may stand before a call
            self.buf = ready[len(stripped):] + self.buf[len(ready):]
            return out

    def flush(self) -> Delta:
        """The end of the output: an unclosed block is parsed as it is (a call whose end marker the stop token
        replaced), held text goes out (whitespace only when no call was made)."""
        buf, self.buf = self.buf, ""
        if self.in_block:
            self.in_block = False
            return self._block(buf, closed=False)
        return Delta(content="" if self.calls and not buf.strip() else buf)

    def _block(self, body: str, closed: bool) -> Delta:
        calls = self.fmt.parse_block(body, self.types)
        if calls is None:
            return Delta(content=self.lead + self.fmt.start + body + (self.fmt.end if closed else ""))
        self.calls += len(calls)
        return Delta(calls=calls)
