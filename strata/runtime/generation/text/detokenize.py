"""Streaming helpers: incremental detokenisation and stop-string matching across token boundaries."""

from __future__ import annotations

from typing import Any

# How many prompt ids to decode as left context for the first generated token. A few are enough for every
# decoder we know of (Metaspace's leading-space handling, byte-fallback runs); vLLM uses 5 as well.
_PROMPT_CONTEXT = 5


class StreamDecoder:
    """Turn generated token ids into text one token at a time.

    Decoding each token on its own is wrong (a UTF-8 character can span tokens, SentencePiece decoders strip
    a leading space per call) and decoding the whole sequence every step is O(n^2). Like vLLM/TGI we decode a
    small window `ids[prefix_offset:]` and emit the part past `ids[prefix_offset:read_offset]`'s text, holding
    output back while the window ends in U+FFFD (an incomplete multi-byte character).

    Without prompt_ids, the concatenation of all push() results plus flush() equals
    `tokenizer.decode(generated_ids, skip_special_tokens)`. With prompt_ids the last few prompt ids are decoded
    as context, so the text is what the tokens read as after the prompt (same for byte-level BPE; for
    SentencePiece-style tokenizers the first token keeps its leading space).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # ids before this have been emitted
        self._prefix_text = self._decode(0, self.read_offset)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token_id))
        text = self._decode(self.prefix_offset, len(self.ids))
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        new = text[len(self._prefix_text) :]
        # Slide the window: the next decode starts at the ids just emitted, which end on a character boundary.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return new

    def flush(self) -> str:
        """Emit whatever is still held back (e.g. a trailing byte sequence that never became a character)."""
        text = self._decode(self.prefix_offset, len(self.ids))
        new = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = ""
        return new


class StopMatcher:
    """Find stop strings in streamed text that may arrive split across any number of pieces.

    feed() emits text as soon as it cannot be the start of a stop string, holds back a tail that could be,
    and on a match returns the text before the stop string with stopped=True. The stop string is never emitted.
    """

    def __init__(self, stop: list[str] | None):
        self.stop = [s for s in (stop or []) if s]
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None  # which stop string fired, for the response's finish details

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, stopped)."""
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        buf = self._buf + text
        # Earliest match wins; among stop strings starting at the same place, the longest one.
        best: tuple[int, int] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], -best[1])):
                best = (i, len(s))
        if best is not None:
            self.stopped, self._buf = True, ""
            self.matched = buf[best[0] : best[0] + best[1]]
            return buf[: best[0]], True
        hold = self._held_tail(buf)
        self._buf = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _held_tail(self, buf: str) -> int:
        # The longest suffix of buf that is a proper prefix of some stop string.
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """Release the held-back tail at the end of generation (it never completed a stop string)."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out
