"""gpt-oss's output (the harmony format) parsed as it streams: its messages' channels become reasoning, content
and tool calls.

After the generation prompt (`...<|start|>assistant`) the model writes messages such as

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message's header runs to `<|message|>`; its body to `<|end|>`, `<|call|>`, `<|return|>` or the next `<|start|>`
(`<|call|>` and `<|return|>` are stop tokens, so the text usually just ends). The `analysis` channel is reasoning; a
header naming a recipient (`to=functions.NAME`) makes the body a call; every other body (`final`, commentary to
nobody) is content. Output that does not begin with a header is plain content.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyStream:
    """Feed the output piece by piece; each call returns a `Delta` (strata.server.tools.calls) of what it completes.

    `make_call(name, body)` turns a recipient's name and a call's body into a `ToolCall`, or None when the body
    does not parse (the message is then returned as text); `new_delta()` makes an empty `Delta`."""

    def __init__(self, make_call: Callable[[str, str], Any], new_delta: Callable[[], Any]):
        self.make_call, self.new_delta = make_call, new_delta
        self.state = "start"  # start -> header -> body -> start ...; or plain (not harmony at all)
        self.buf = ""
        self.kind = "content"  # the body's: content | reasoning | call
        self.header = ""
        self.recipient = ""
        self.calls = 0  # calls given out so far

    def feed(self, text: str) -> Any:
        """Add a piece of output; return what it completes."""
        out = self.new_delta()
        self.buf += text
        while True:
            if self.state == "plain":
                out.content += self.buf
                self.buf = ""
                return out
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(CHANNEL) or head.startswith(START):
                    self.state, self.buf = "header", head.removeprefix(START)
                    continue
                if not head or CHANNEL.startswith(head) or START.startswith(head):
                    return out  # could still become a header
                self.state = "plain"
                continue
            if self.state == "header":
                i = self.buf.find(MESSAGE)
                if i < 0:
                    return out
                self._open(self.buf[:i])
                self.buf, self.state = self.buf[i + len(MESSAGE):], "body"
                continue
            end, marker = min(((self.buf.find(m), m) for m in BODY_ENDS if m in self.buf), default=(-1, ""))
            if end < 0:
                if self.kind != "call":  # text goes out now, but a tail that could begin a marker
                    keep = max(partial_suffix(self.buf, m) for m in BODY_ENDS)
                    self._text(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._close(out, self.buf[:end])
            self.buf = self.buf[end + len(marker):]
            self.state = "header" if marker == START else "start"

    def flush(self) -> Any:
        """The end of the output: an open body is closed (a call whose `<|call|>` was the stop token)."""
        out = self.new_delta()
        buf, self.buf = self.buf, ""
        if self.state == "body":
            self._close(out, buf)
        elif self.state == "header":  # a header no body followed: shown as written
            out.content += buf
        elif self.state == "plain" or not self.calls:
            out.content += buf
        self.state = "start"
        return out

    def _open(self, header: str) -> None:
        m = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self.recipient = m[1].removeprefix("functions.") if m else ""
        if self.recipient:
            self.kind = "call"
        elif channel is not None and channel[1] == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"
        self.header = header

    def _text(self, out: Any, text: str) -> None:
        if self.kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: Any, body: str) -> None:
        if self.kind != "call":
            self._text(out, body)
            return
        call = self.make_call(self.recipient, body)
        if call is None:  # the message as written
            out.content += self.header + MESSAGE + body
        else:
            self.calls += 1
            out.calls.append(call)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker` (held back while streaming)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
