"""Tokenizers shipped as a tiktoken BPE file (Kimi K2's `tiktoken.model` + `tokenization_kimi.py`), read without
running the repository's code.

transformers loads such a tokenizer only with `trust_remote_code` (the checkpoint's own `TikTokenTokenizer` class).
strata reads what that class reads, as data: the ranks file (one `base64(token bytes) rank` per line), the split
pattern `pat_str` and the count of reserved special ids from the module's source text (parsed with `ast`, never
imported), and the special tokens' names from tokenizer_config.json's `added_tokens_decoder`; then encodes and
decodes with `tiktoken` itself, as that class does: special tokens in the text always map to their ids, nothing
is added around the text, and text is cut where the class cuts it (400K characters; runs of 25K whitespace or
non-whitespace characters) before it is encoded.

`TiktokenBackend` offers the part of `tokenizers.Tokenizer`'s interface strata's `Tokenizer` uses, so one
`Tokenizer` serves both kinds; its `to_str()` is the equivalent tokenizer.json (byte-level BPE, merges derived
from the ranks as transformers' TikTokenConverter derives them) for the libraries that read a vocabulary from one
(xgrammar, the token bound).
"""

from __future__ import annotations

import ast
import base64
import json
import re
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

from strata.errors import CheckpointError, UnsupportedError

RANKS_FILE = "tiktoken.model"
TIKTOKEN_CLASS = "TikTokenTokenizer"  # tokenizer_config.json's tokenizer_class for Kimi's tokenizer
# Kimi K2's split pattern (tokenization_kimi.py's TikTokenTokenizer.pat_str), used when the module is not shipped
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])  # fmt: skip
KIMI_RESERVED_SPECIAL = 256  # TikTokenTokenizer.num_reserved_special_tokens; the class reserves 2 ids more
MAX_ENCODE_CHARS = 400_000  # tiktoken panics on longer texts: the class encodes them in pieces
MAX_RUN_CHARS = 25_000  # nor does it give tiktoken longer runs of whitespace or of non-whitespace


def is_tiktoken_dir(directory: Path, config: dict) -> bool:
    """Whether `directory` holds a tiktoken tokenizer strata reads (`tiktoken.model`, or a config naming Kimi's
    class, whose missing file `read_tiktoken` then names)."""
    return (directory / RANKS_FILE).is_file() or config.get("tokenizer_class") == TIKTOKEN_CLASS


@cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet tokenizer.json vocabularies are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(token: bytes) -> str:
    table = _byte_chars()
    return "".join(table[b] for b in token)


@dataclass(frozen=True)
class AddedToken:
    """A special token as `tokenizers.Tokenizer.get_added_tokens_decoder()` describes one."""

    content: str
    special: bool = True


class _Encoding:
    """What `tokenizers.Tokenizer.encode_batch` returns per text, as far as strata reads it."""

    def __init__(self, ids: list[int]):
        self.ids = ids


class TiktokenBackend:
    """A tiktoken `Encoding` behind the `tokenizers.Tokenizer` methods strata's `Tokenizer` calls."""

    def __init__(self, ranks: dict[bytes, int], pat_str: str, specials: dict[int, AddedToken], name: str):
        self.ranks, self.pat_str, self.name = ranks, pat_str, name
        self.specials = dict(specials)
        self._build()

    def _build(self) -> None:
        try:
            import tiktoken
        except ImportError:
            raise UnsupportedError(f"{self.name}: reading a tiktoken tokenizer needs the tiktoken package: "
                                   "pip install tiktoken") from None
        try:
            self.encoding = tiktoken.Encoding(self.name, pat_str=self.pat_str, mergeable_ranks=self.ranks,
                                              special_tokens={t.content: i for i, t in self.specials.items()})
        except ValueError as e:  # a pattern tiktoken's regex engine rejects
            raise CheckpointError(f"{self.name}: tiktoken rejects the tokenizer ({' '.join(str(e).split())[:200]}); "
                                  "re-download its files") from None
        self.by_id: dict[int, str] = {rank: _byte_level(token) for token, rank in self.ranks.items()}
        self.by_id.update((i, t.content) for i, t in self.specials.items())
        self.by_token: dict[str, int] = {s: i for i, s in self.by_id.items()}
        self.__dict__.pop("_json", None)

    # --- the tokenizers.Tokenizer interface strata's Tokenizer uses -------------------------------------------
    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[_Encoding]:
        """Each text's ids; special tokens written in the text map to their ids, nothing is added (Kimi's
        `encode`). `add_special_tokens` has nothing to add."""
        return [_Encoding([i for piece in _pieces(text) for i in self.encoding.encode(piece, allowed_special="all")])
                for text in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text (invalid UTF-8 as U+FFFD); unknown ids are dropped, special ones too when asked."""
        keep = [i for i in ids if i in self.by_id and not (skip_special_tokens and self._special(i))]
        return self.encoding.decode(keep)

    def token_to_id(self, token: str) -> int | None:
        return self.by_token.get(token)

    def id_to_token(self, i: int) -> str | None:
        return self.by_id.get(i)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {s: i for i, s in self.by_id.items() if with_added_tokens or i not in self.specials}

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self.specials)

    def add_special_tokens(self, tokens: list[str]) -> int:
        """Give each token not in the vocabulary the next free id, as a special token; returns how many."""
        new = [t for t in dict.fromkeys(tokens) if t not in self.by_token]
        top = max(self.by_id, default=-1)
        self.specials.update((top + 1 + n, AddedToken(t)) for n, t in enumerate(new))
        if new:
            self._build()
        return len(new)

    def to_str(self) -> str:
        """The equivalent tokenizer.json: byte-level BPE over the ranks, the split pattern, the special tokens."""
        return self._json

    # --------------------------------------------------------------------------------------------------------
    def _special(self, i: int) -> bool:
        token = self.specials.get(i)
        return token is not None and token.special

    @cached_property
    def _json(self) -> str:
        vocab = {_byte_level(token): rank for token, rank in self.ranks.items()}
        spec = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": t.content, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": t.special} for i, t in sorted(self.specials.items())],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.pat_str}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": _merges(self.ranks)},
        }  # fmt: skip
        return json.dumps(spec, ensure_ascii=False)


def _merges(ranks: dict[bytes, int]) -> list[list[str]]:
    """The BPE merges that rebuild each multi-byte token from two shorter ones, ordered by the rank they make (ties
    by the parts' ranks): transformers' TikTokenConverter's derivation."""
    out = []
    for token, rank in ranks.items():
        parts = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        out += sorted(((ranks[a], ranks[b], rank, a, b) for a, b in parts), key=lambda m: (m[0], m[1]))
    out.sort(key=lambda m: m[2])
    return [[_byte_level(a), _byte_level(b)] for *_, a, b in out]


def _pieces(text: str) -> list[str]:
    """`text` cut as Kimi's TikTokenTokenizer.encode cuts it: 400K-character chunks, each split wherever a run of
    whitespace or of non-whitespace would pass 25K characters."""
    out = []
    for at in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[at : at + MAX_ENCODE_CHARS]
        run, space, start = 0, chunk[0].isspace() if chunk else False, 0
        for i, ch in enumerate(chunk):
            now = ch.isspace()
            if space ^ now:
                run, space = 1, now
            else:
                run += 1
                if run > MAX_RUN_CHARS:
                    out.append(chunk[start:i])
                    start, run = i, 1
        out.append(chunk[start:])
    return out or [""]


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token bytes) rank` per line; a malformed line is a one-line error."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}); re-download it") from None
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise CheckpointError(f"{path}:{n}: not a `base64-token rank` line; the file is corrupt, re-download "
                                  "it") from None
    if not ranks:
        raise CheckpointError(f"{path}: holds no tokens; re-download it")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: its ranks are not 0..{len(ranks) - 1} each once; re-download it")
    return ranks


def _module_settings(path: Path) -> tuple[str | None, int | None]:
    """(pat_str, num_reserved_special_tokens) assigned in the tokenizer module's source: read with `ast`, not run.
    pat_str is a string literal or `"sep".join([literals])`; either is None where not assigned so."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        raise CheckpointError(f"{path}: cannot be read as Python source ({' '.join(str(e).split())}); "
                              "re-download it") from None
    pat, reserved = None, None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name, value = node.targets[0].id, node.value
        if name == "pat_str":
            pat = _literal_pattern(value)
        elif name == "num_reserved_special_tokens" and isinstance(value, ast.Constant) and type(value.value) is int:
            reserved = value.value
    return pat, reserved


def _literal_pattern(value: ast.expr) -> str | None:
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join"
            and isinstance(value.func.value, ast.Constant) and isinstance(value.func.value.value, str)
            and len(value.args) == 1 and isinstance(value.args[0], (ast.List, ast.Tuple))
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.args[0].elts)):
        return value.func.value.value.join(e.value for e in value.args[0].elts)
    return None


def _module_file(directory: Path, config: dict) -> Path:
    """The tokenizer module tokenizer_config.json's auto_map names (`tokenization_kimi.TikTokenTokenizer`)."""
    ref = (config.get("auto_map") or {}).get("AutoTokenizer") if isinstance(config.get("auto_map"), dict) else None
    ref = ref[0] if isinstance(ref, list) and ref else ref
    module = ref.split(".")[0] if isinstance(ref, str) and "." in ref else "tokenization_kimi"
    return directory / f"{module}.py"


def read_tiktoken(directory: Path, config: dict) -> TiktokenBackend:
    """The tiktoken tokenizer of `directory`: ranks from tiktoken.model, the split pattern and reserved ids from the
    tokenizer module's source (Kimi K2's when the module is not shipped), special tokens from `config`
    (tokenizer_config.json). A missing or malformed file is a one-line `CheckpointError` naming it."""
    path = directory / RANKS_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: tokenizer_config.json names {config.get('tokenizer_class')} but "
                              f"{RANKS_FILE} (its vocabulary) is missing; download it beside the config")
    ranks = read_ranks(path)
    pat, reserved = KIMI_PAT_STR, KIMI_RESERVED_SPECIAL
    module = _module_file(directory, config)
    if module.is_file():
        found_pat, found_reserved = _module_settings(module)
        if found_pat is None:
            raise CheckpointError(f"{module}: no pat_str (the split pattern) assigned as a string literal or a join "
                                  "of literals; strata reads it without running the module")
        pat, reserved = found_pat, found_reserved if found_reserved is not None else reserved
    named = _added_tokens(config, directory)
    base = len(ranks)
    # the class's special ids: base .. base + reserved + 1, named by added_tokens_decoder, else reserved names
    specials = {i: named.get(i, AddedToken(f"<|reserved_token_{i}|>")) for i in range(base, base + reserved + 2)}
    return TiktokenBackend(ranks, pat, specials, str(path))


def _added_tokens(config: dict, directory: Path) -> dict[int, AddedToken]:
    raw = config.get("added_tokens_decoder") or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{directory / 'tokenizer_config.json'}: added_tokens_decoder is not an object; "
                              "re-download it")
    out = {}
    for key, value in raw.items():
        content = value.get("content") if isinstance(value, dict) else value
        if not (re.fullmatch(r"\d+", str(key)) and isinstance(content, str)):
            raise CheckpointError(f"{directory / 'tokenizer_config.json'}: added_tokens_decoder[{key!r}] is not an "
                                  "id with a content string; re-download it")
        special = value.get("special", True) if isinstance(value, dict) else True
        out[int(key)] = AddedToken(content, bool(special))
    return out
