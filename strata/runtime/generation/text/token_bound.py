"""A lower bound on how many tokens a text encodes to, known without tokenizing it.

Tokenizing a prompt far past the context costs seconds and gigabytes (a 30 MiB prompt: half a minute and
3 GB) only to refuse it. For a tokenizer whose every step keeps each byte of the text inside some token,
no token covers more than L bytes of the (normalized) text, where L is the longest vocabulary entry, so a
text of B bytes needs at least ceil(B / L) tokens. That holds for BPE models that cover every byte (a
byte-level alphabet, or byte fallback): their pre-tokenizers only split or map bytes, never drop them.
Steps that can fold many bytes into one token or none (WordPiece's and Unigram's unknown token, fused
unknowns, whitespace-removing splitters, stripping normalizers, added tokens that swallow neighbouring
spaces, truncation) make the bound unknown: `token_bound` returns None and the text is tokenized.

    bound = token_bound(json.loads(tokenizers_tokenizer.to_str()))
    bound.at_least(text)        # never more than len(tokenizer.encode(text))
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

# pre-tokenizers that only split the text or map its bytes (ByteLevel: byte -> one alphabet character;
# Metaspace: " " -> "\u2581", longer in UTF-8); a "removed" split behaviour drops text and is not listed
_SPLITTING = {"ByteLevel", "Split", "Digits", "Punctuation", "Metaspace", "UnicodeScripts"}
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}


@dataclass(frozen=True)
class TokenBound:
    """`at_least(text)`: a count of tokens `text` encodes to at least (without special tokens)."""

    max_bytes_per_token: int
    normalize: Callable[[str], str] | None = None  # the tokenizer's normalizer where it may shorten the text

    def at_least(self, text: str) -> int:
        if self.normalize is not None:
            text = self.normalize(text)
        size = len(text.encode("utf-8", "surrogatepass"))
        return -(-size // self.max_bytes_per_token)

    def most_bytes(self, tokens: int) -> int:
        """The longest normalized text (UTF-8 bytes) that can fit in `tokens` tokens."""
        return tokens * self.max_bytes_per_token


def token_bound(spec: dict) -> TokenBound | None:
    """The bound for a Hugging Face tokenizer.json (parsed), or None where its steps allow no such bound."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation"):
        return None
    normalize = _normalizer(spec.get("normalizer"))
    if normalize is False:
        return None
    pre = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
    if pre is None or not all(p.get("type") in _SPLITTING and str(p.get("behavior", "")).lower() != "removed"
                              for p in pre):
        return None
    vocab = model.get("vocab") or {}
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    if byte_level:
        covered = all(ch in vocab for ch in _byte_alphabet())
        longest = max((len(t) for t in vocab), default=0)  # one alphabet character per byte
    else:
        covered = bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)
    if not covered:  # an unknown character would be dropped or fused into one unknown token
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):  # such a token also takes the spaces beside it
        return None
    longest = max([longest, *(len(str(a.get("content", "")).encode("utf-8", "surrogatepass")) for a in added)])
    return TokenBound(longest, normalize or None) if longest > 0 else None


def _normalizer(spec: dict | None) -> Callable[[str], str] | None | bool:
    """A function giving the normalized text where normalizing may shorten it, None where it never does,
    False where it is not known. Prepend and replacements by a text at least as long only lengthen."""
    steps = _flatten(spec, "normalizers")
    if steps is None:
        return False
    forms = []
    for step in steps:
        kind = step.get("type")
        if kind in _UNICODE_FORMS:
            forms.append(kind)
        elif kind == "Prepend":
            continue
        elif kind == "Replace":
            pattern = step.get("pattern") or {}
            if "String" not in pattern or len(str(step.get("content", "")).encode()) < len(
                    str(pattern["String"]).encode()):
                return False
        else:
            return False
    if not forms:
        return None

    def normalize(text: str) -> str:
        for form in forms:
            text = unicodedata.normalize(form, text)
        return text

    return normalize


def _flatten(spec: dict | None, key: str) -> list[dict] | None:
    """The steps of a (possibly nested) Sequence, [] for none, None for a malformed spec."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return None
    if spec.get("type") != "Sequence":
        return [spec]
    out: list[dict] = []
    for step in spec.get(key) or []:
        inner = _flatten(step, key)
        if inner is None:
            return None
        out += inner
    return out


@cache
def _byte_alphabet() -> frozenset[str]:
    """GPT-2's byte-to-character map: the 256 characters a ByteLevel pre-tokenizer writes bytes as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return frozenset(chars)
