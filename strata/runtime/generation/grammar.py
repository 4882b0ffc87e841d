"""Structured output: a JSON object, or JSON that validates against a schema, enforced token by token.

A request's `ResponseFormat` (OpenAI's `response_format`: `json_object`, or `json_schema` with its schema) is
compiled by the engine's `GrammarCompiler` into a `Grammar` over the model's vocabulary (xgrammar; compiled
grammars are kept per schema in a bounded LRU). Each sequence with a grammar holds a `GrammarMatcher` of its own:
before its token is sampled, the matcher's token bitmask sets every token the grammar cannot take next to -inf in
that sequence's logits row (greedy and sampled alike), the chosen token advances the matcher, and the sequence
ends ("stop") as soon as the grammar is complete, so the text parses and validates whenever the sequence ends
that way. Only `max_tokens`, the end of the context or a stop string can end it earlier ("length" / "stop" with
the JSON cut short).

The JSON is written on one line with ", " and ": " separators (no free whitespace: a model cannot stall in an
endless run of newlines, and the grammar ends at the closing brace). `strict` follows OpenAI: true allows no
properties the schema does not name (xgrammar's strict mode), false lets `additionalProperties` default to true.

    fmt = ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "person", "schema": {...}}})
    grammar = compiler.compile(fmt)          # cached per schema
    matcher = grammar.matcher()              # one per sequence
    rows = GrammarBatch()                    # one per scheduler: a step's rows masked together
    masked = rows.mask(logits, [matcher, None])   # [2, V]: row 0's refused tokens at -inf, row 1 as it was
    matcher.advance(token); matcher.done     # True once the JSON is complete
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from strata.errors import RequestError, UnsupportedError

if TYPE_CHECKING:
    from strata.runtime.generation.text.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept (least recently used dropped first)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
_SHAPES = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
           '{"name": ..., "schema": {...}, "strict": true}}')
# xgrammar's C++ errors begin with "[hh:mm:ss] /path/file.cc:123: "; the rest names the problem
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


class ResponseFormatError(RequestError):
    """A `response_format` the server cannot honour (a 400 naming `response_format`)."""

    param = "response_format"


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's output must be: any JSON object (`json_object`) or JSON valid under `schema`
    (`json_schema`, named `name`; `strict`: no properties beyond the schema's). Build it with `parse` (OpenAI's
    `response_format` dict) or `from_schema`."""

    type: str  # "json_object" | "json_schema"
    schema: dict | None = None
    name: str | None = None
    strict: bool = False

    @classmethod
    def parse(cls, value: Any) -> ResponseFormat | None:
        """OpenAI's `response_format` (a dict), a `ResponseFormat`, or None; {"type": "text"} and None give None
        (no constraint). A malformed value is a `ResponseFormatError` naming the problem."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise ResponseFormatError(f"response_format must be {_SHAPES}, got {value!r}"[:300])
        kind = value["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind != "json_schema":
            raise ResponseFormatError(f"response_format type {kind!r} is unknown; it is one of text, json_object, "
                                      "json_schema")
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ResponseFormatError('response_format json_schema must be an object: {"name": ..., "schema": {...}, '
                                      '"strict": true}')
        name, strict = spec.get("name"), spec.get("strict")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ResponseFormatError(f"response_format json_schema.name must be 1 to 64 letters, digits, _ or -, "
                                      f"got {name!r}"[:200])
        if strict is not None and not isinstance(strict, bool):
            raise ResponseFormatError(f"response_format json_schema.strict must be true or false, got {strict!r}")
        return cls.from_schema(spec.get("schema"), name, bool(strict))

    @classmethod
    def from_schema(cls, schema: Any, name: str = "response", strict: bool = True) -> ResponseFormat:
        """JSON valid under `schema` (a JSON Schema object)."""
        if not isinstance(schema, dict):
            raise ResponseFormatError(f"response_format json_schema.schema must be a JSON Schema object, got "
                                      f"{type(schema).__name__}; give one such as "
                                      '{"type": "object", "properties": {...}}')
        try:
            json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ResponseFormatError(f"response_format json_schema.schema is not JSON ({e})"[:300]) from None
        return cls("json_schema", schema, name, strict)

    def key(self) -> str:
        """A string equal for formats that compile to the same grammar (the property order counts: the JSON
        follows it)."""
        return json.dumps([self.type, self.schema, self.strict], separators=(",", ":"), ensure_ascii=False)


class Grammar:
    """A compiled response format, shared by every sequence that asks for it; `matcher()` gives one a state."""

    def __init__(self, compiled: Any, vocab_size: int, vocab_bits: VocabBits, fmt: ResponseFormat):
        self.compiled, self.vocab_size, self.format = compiled, vocab_size, fmt
        self.vocab_bits = vocab_bits

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, for one sequence."""
        return GrammarMatcher(self)


class GrammarMatcher:
    """One sequence's place in its grammar, with the bitmask of the tokens it may take next (`bitmask`)."""

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr

        self.grammar = grammar
        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)  # int32 [1, ceil(V/32)] on the CPU
        # numpy views made once: a step's host work is a few microseconds a row, of which making views was half
        self._bits = self._bitmask.numpy()[0]
        self._vocab = grammar.vocab_bits
        self._scratch = np.empty_like(self._bits)
        self._text = TEXT_START  # where the text's bytes stand (mid-character after a UTF-8 lead byte, in an escape)
        self.done = False  # complete: nothing but a stop token may follow
        self._fill()

    @property
    def bitmask(self) -> np.ndarray:
        """int32 [ceil(V/32)]: bit t % 32 of word t // 32 set where token t may come next (a view, not a copy)."""
        return self._bits

    def advance(self, token: int) -> bool:
        """Take `token` (sampled under its mask); False when the grammar refuses it (the sequence cannot go on)."""
        if not self._matcher.accept_token(int(token)):
            return False
        self._text = int(self._vocab.after[self._text, token])
        self._fill()
        return True

    def _fill(self) -> None:
        """The bitmask for the next token, and whether the grammar is done (only stop tokens may follow)."""
        if self._matcher.is_terminated():  # a stop token was taken
            self.done = True
            return
        self._matcher.fill_next_token_bitmask(self._bitmask)
        # xgrammar lets a JSON string hold raw control characters (U+0000-U+001F but CR and LF), which JSON
        # forbids (RFC 8259: they are escaped), byte sequences UTF-8 forbids (surrogates, overlong forms), which
        # decode to U+FFFD each byte, and \u escapes of surrogates: no such token is taken (no other place needs a
        # control character: the JSON has no free whitespace)
        grammar_bits = self._bits.copy() if self._text != TEXT_START else None
        np.bitwise_and(self._bits, self._vocab.allowed[self._text], out=self._bits)
        self.done = not np.bitwise_and(self._bits, self._vocab.non_stop, out=self._scratch).any()
        if self.done and grammar_bits is not None:
            # mid-character or mid-escape no JSON can end: a vocabulary without the single bytes allowed here (every
            # byte-level and byte-fallback vocabulary has them all) is left to the grammar alone
            np.bitwise_and(grammar_bits, self._vocab.allowed[TEXT_START], out=self._bits)
            self.done = False


class GrammarBatch:
    """A step's rows with grammars, masked together: one host-to-device copy and one launch on a GPU, where a row at
    a time took 0.11 ms a row (an H100 host, 8 streams: 0.37 ms the step against 0.89). One per scheduler: it keeps
    the page-locked staging buffer the mask's copy reads, which the next step rewrites only after this step's tokens
    were read back (so after the copy ran). The matchers advance one by one (`GrammarMatcher.advance`): xgrammar's
    batched, multi-threaded fill took 1.26 ms for 8 streams of a 4K vocabulary on that host, against 0.38 ms in
    turn."""

    def __init__(self):
        self._host: torch.Tensor | None = None  # int32 [rows, words] page-locked
        self._device: torch.Tensor | None = None  # int32 [rows, words] on the logits' device

    def mask(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None], in_place: bool = False) -> torch.Tensor:
        """logits [B, V] -> fp32 [B, V] where each row i whose `matchers[i]` is not None has every token that
        matcher refuses next at -inf: a copy (the model's rows are kept for log-probabilities) unless `in_place`
        (fp32 logits masked where they lie), or `logits.float()` itself when no row has a grammar."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits.float()
        out = logits if in_place and logits.dtype == torch.float32 else logits.to(torch.float32, copy=True)
        vocab = matchers[rows[0]].grammar.vocab_size
        if out.device.type == "cpu":
            # the bits unpacked to bools [G, V] (token t: bit t % 32 of word t // 32, little-endian words): a median
            # 0.11 ms a row of a 152K vocabulary where xgrammar's CPU kernel took 0.65 ms (2 cores of an AMD EPYC)
            words = np.stack([matchers[i].bitmask for i in rows])
            bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            out[rows, :vocab] = out[rows, :vocab].masked_fill(~torch.from_numpy(bits.view(np.bool_)), -math.inf)
            return out
        import xgrammar as xgr

        host, device = self._buffers(len(matchers), len(matchers[rows[0]].bitmask), out.device)
        staged = host.numpy()
        staged.fill(-1)  # every token allowed in the rows without a grammar
        for i in rows:
            staged[i] = matchers[i].bitmask
        device.copy_(host, non_blocking=True)
        xgr.apply_token_bitmask_inplace(out, device, vocab_size=vocab)
        return out

    def _buffers(self, rows: int, words: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The staging buffer [rows, words] (page-locked) and its device copy, grown when a step needs more."""
        if self._host is None or self._host.shape[0] < rows or self._host.shape[1] != words \
                or self._device.device != device:
            # made as normal tensors even inside the forward pass's inference mode (they outlive it)
            with torch.inference_mode(False):
                self._host = torch.empty(rows, words, dtype=torch.int32).pin_memory()
                self._device = torch.empty(rows, words, dtype=torch.int32, device=device)
        return self._host[:rows], self._device[:rows]


class GrammarCompiler:
    """Compiles response formats over one model's tokenizer (xgrammar), keeping the last `cache_size` grammars.

    xgrammar is imported, and its view of the vocabulary built, on the first compile. `vocab_size` is the model's
    (its logits' width, often padded past the tokenizer's ids: those padding ids are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: set[int],
                 cache_size: int = MAX_CACHED_GRAMMARS):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._vocab_bits: VocabBits | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for tests and stats

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The grammar of `fmt` (from the cache when the same format was compiled lately). A schema xgrammar
        cannot compile, or one no JSON value satisfies, is a `ResponseFormatError`."""
        key = fmt.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._xgrammar_compiler()
        try:  # outside the lock: a long schema does not hold up requests for cached ones
            if fmt.type == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            else:
                compiled = compiler.compile_json_schema(json.dumps(fmt.schema), any_whitespace=False,
                                                        strict_mode=fmt.strict)
        except (RuntimeError, ValueError, TypeError) as e:
            detail = " ".join(_CPP_PREFIX.sub("", str(e)).split())[:300]
            raise ResponseFormatError(f"response_format json_schema.schema cannot be compiled: {detail}; fix the "
                                      "schema") from None
        grammar = Grammar(compiled, self.vocab_size, self._vocab_bits, fmt)
        if grammar.matcher().done:  # nothing but a stop token at the start: e.g. {"anyOf": []}
            raise ResponseFormatError("response_format json_schema.schema admits no JSON value; fix the schema")
        with self._lock:
            self.compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def cached(self) -> int:
        """How many compiled grammars the cache holds."""
        with self._lock:
            return len(self._cache)

    def _xgrammar_compiler(self) -> Any:
        """(Holding the lock.) xgrammar's compiler over this tokenizer, made on first use."""
        if self._compiler is None:
            try:
                import xgrammar as xgr
                from tokenizers import Tokenizer as HFTokenizer
                from transformers import PreTrainedTokenizerFast
            except ImportError as e:
                raise UnsupportedError(f"structured output needs xgrammar ({e}); pip install xgrammar") from None
            # xgrammar reads the vocabulary and its encoding (byte-level, byte fallback) off a fast tokenizer;
            # a copy, so nothing it sets reaches the tokenizer strata encodes with
            fast = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(self.tokenizer.backend_json()))
            info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            # xgrammar's own cache is off: this class bounds what is kept
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            self._vocab_bits = VocabBits.of(info.decoded_vocab, self.vocab_size, set(info.stop_token_ids))
        return self._compiler


# A JSON text read a byte at a time, for what its strings may hold: UTF-8 (RFC 3629) and no \u escape of a surrogate
# (a lone one is not Unicode: Python's json reads it, pydantic's and most strict parsers refuse it; a pair spells what
# raw UTF-8 spells anyway). State 0 lies between characters, 1-7 wait for a UTF-8 character's continuation bytes
# (some with a narrower range for the first one), 8-13 are inside an escape, 14 is ill-formed for good. A backslash
# appears in JSON only inside strings, so the rest of the text passes through state 0.
TEXT_START, TEXT_STATES, TEXT_BAD = 0, 14, 14
_ESC, _U1, _G3, _G2, _G1, _D2 = 8, 9, 10, 11, 12, 13  # after \, \u, 3/2/1 hex digits to go, \uD


def _text_table() -> np.ndarray:
    """uint8 [15, 256]: the state after each byte from each state."""
    t = np.full((TEXT_STATES + 1, 256), TEXT_BAD, dtype=np.uint8)
    t[0, 0x00:0x80] = 0
    t[0, ord("\\")] = _ESC
    t[0, 0xC2:0xE0] = 1  # two-byte lead (C0, C1 would be overlong)
    t[0, 0xE0], t[0, 0xE1:0xED], t[0, 0xED], t[0, 0xEE:0xF0] = 3, 2, 4, 2
    t[0, 0xF0], t[0, 0xF1:0xF4], t[0, 0xF4] = 6, 5, 7  # F5-FF: past U+10FFFF
    t[1, 0x80:0xC0] = 0
    t[2, 0x80:0xC0] = 1
    t[3, 0xA0:0xC0] = 1  # after E0: no overlong three-byte form
    t[4, 0x80:0xA0] = 1  # after ED: no surrogate (U+D800-U+DFFF)
    t[5, 0x80:0xC0] = 2
    t[6, 0x90:0xC0] = 2  # after F0: no overlong four-byte form
    t[7, 0x80:0x90] = 2  # after F4: nothing past U+10FFFF

    def to(state: int, chars: str, nxt: int) -> None:
        t[state, [ord(c) for c in chars]] = nxt

    hexdigits = "0123456789abcdefABCDEF"
    to(_ESC, '"\\/bfnrt', 0)
    to(_ESC, "u", _U1)
    to(_U1, hexdigits, _G3)
    to(_U1, "dD", _D2)
    to(_G3, hexdigits, _G2)
    to(_G2, hexdigits, _G1)
    to(_G1, hexdigits, 0)
    to(_D2, "01234567", _G2)  # \uD800-\uDFFF refused
    return t


def text_after(vocab: list[bytes], stop_token_ids: set[int]) -> np.ndarray:
    """uint8 [14, V]: the state after token t's bytes from state s (`TEXT_BAD`: the bytes are ill-formed there); a
    stop token, whose text is not output, leaves the state as it was."""
    table = _text_table()
    lengths = np.fromiter(map(len, vocab), dtype=np.int64, count=len(vocab))
    order = np.argsort(-lengths, kind="stable")  # longest first: column j is read by a prefix of the rows
    padded = np.zeros((len(vocab), max(int(lengths.max(initial=0)), 1)), dtype=np.uint8)
    for row, t in enumerate(order.tolist()):
        padded[row, : lengths[t]] = np.frombuffer(vocab[t], dtype=np.uint8)
    state = np.repeat(np.arange(TEXT_STATES, dtype=np.uint8)[:, None], len(vocab), axis=1)  # [14, V] by `order`
    for j, rows in enumerate(np.searchsorted(-lengths[order], -np.arange(padded.shape[1]), side="left").tolist()):
        state[:, :rows] = table[state[:, :rows], padded[None, :rows, j]]
    after = np.empty_like(state)
    after[:, order] = state
    stops = [t for t in stop_token_ids if 0 <= t < len(vocab)]
    after[:, stops] = np.arange(TEXT_STATES, dtype=np.uint8)[:, None]
    return after


@dataclass(frozen=True)
class VocabBits:
    """What a vocabulary's bytes allow, in xgrammar's bitmask layout, made once per compiler: `allowed[s]` the
    tokens that may follow text state s (well-formed from there and without a control character), `non_stop`
    every token but the stop tokens, `after[s, t]` the state after token t."""

    allowed: np.ndarray  # int32 [14, ceil(V/32)]
    non_stop: np.ndarray  # int32 [ceil(V/32)]
    after: np.ndarray  # uint8 [14, V]

    @classmethod
    def of(cls, vocab: list[bytes], vocab_size: int, stop_token_ids: set[int]) -> VocabBits:
        """The bits of `vocab` (each token's bytes; ids past it, up to `vocab_size`, are padding)."""
        vocab = list(vocab[:vocab_size]) + [b""] * max(0, vocab_size - len(vocab))
        after = text_after(vocab, stop_token_ids)
        control = {t for t, b in enumerate(vocab) if t not in stop_token_ids and any(c < 0x20 for c in b)}
        allowed = np.stack([token_bits(vocab_size, control | set(np.flatnonzero(after[s] == TEXT_BAD).tolist()))
                            for s in range(TEXT_STATES)])
        return cls(allowed, token_bits(vocab_size, stop_token_ids), after)


def token_bits(vocab_size: int, excluded: Iterable[int]) -> np.ndarray:
    """int32 [ceil(vocab_size / 32)] in xgrammar's bitmask layout (token t: bit t % 32 of word t // 32) with the bit
    of every token set but those of `excluded`."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    bits[:vocab_size] = True
    bits[[t for t in excluded if 0 <= t < vocab_size]] = False
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
