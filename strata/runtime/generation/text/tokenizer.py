"""Tokenizer: a Hugging Face `tokenizer.json` plus its `tokenizer_config.json` and chat template.

We use the `tokenizers` library directly instead of `transformers.AutoTokenizer`: it is the same Rust code
underneath and imports in milliseconds. The few behaviours transformers 5 layers on top (named special tokens
missing from the vocab get added, which special tokens the template sees, the jinja2 sandbox the template runs
in) are reproduced so encode/decode/apply_chat_template give identical results. Like transformers 5, BOS/EOS
insertion comes from tokenizer.json's post-processor; tokenizer_config's add_bos_token is not consulted.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from strata.errors import CheckpointError, RequestError, UnsupportedError
from strata.runtime.generation.text import chat_dsv4
from strata.runtime.generation.text.detokenize import StopMatcher, StreamDecoder
from strata.runtime.generation.text.tiktoken_vocab import RANKS_FILE, TiktokenBackend, is_tiktoken_dir, read_tiktoken
from strata.runtime.generation.text.token_bound import TokenBound, token_bound

__all__ = ["Tokenizer", "StreamDecoder", "StopMatcher", "load_tokenizer"]

# Files of a tokenizer strata cannot read without tokenizer.json (slow tokenizers' vocabularies, the config).
_OTHER_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json", "merges.txt",
                          "vocab.txt", RANKS_FILE)

# The named special tokens transformers passes into every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may arrive under; templates read the first one (gpt-oss reads "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatRenderer(Protocol):
    """A chat format written in Python, for checkpoints that ship one instead of a chat template."""

    def __call__(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


# Model types whose releases ship their chat format as Python code, not a template: used when the checkpoint
# has no template of its own (one it has wins, as for every other model).
BUILTIN_RENDERERS: dict[str, ChatRenderer] = {"deepseek_v4": chat_dsv4.render_chat}


def _model_type(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # no (readable) config: the checkpoint loader reports that, not the tokenizer
    return config.get("model_type") if isinstance(config, dict) else None


def _one_line(msg: object) -> str:
    return " ".join(str(msg).split())


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as plain strings or as serialised AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({_one_line(e)}); re-download the checkpoint") from e


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to mask assistant tokens; we only render it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    # Only the constructor and fromkeys: attribute access on the real `dict` type is a sandbox-escape vector.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Same guard as transformers: no underscore attributes, so templates cannot reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would corrupt prompts; transformers overrides it the same way.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses (chat templates are untrusted)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _normalize_messages(messages: Any) -> list[dict]:
    """Validate a message list and clean it the way transformers does before rendering."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be a {{'role': ..., 'content': ...}} dict, got {type(m).__name__}")
        if "role" not in m:
            raise RequestError(f"messages[{i}] has no 'role'; give every message a role such as 'user'")
        # OpenAI clients send content=None / tool_calls=None; templates handle a missing key but render "None".
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class Tokenizer:
    """Text <-> token ids and chat rendering for one checkpoint; build it with `Tokenizer.from_dir`."""

    def __init__(self, tok: _HFTokenizer | TiktokenBackend, config: dict, chat_templates: dict[str, str],
                 source: str = "<memory>", renderer: ChatRenderer | None = None):
        self._tok = tok
        self._renderer = renderer  # renders chats when there is no template (BUILTIN_RENDERERS)
        self.source = source
        self.special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL_TOKENS:
            if (s := _token_str(config.get(name))) is not None:
                self.special_tokens[name] = s
        # transformers adds named special tokens missing from the vocab; do the same so ids agree.
        missing = [s for s in self.special_tokens.values() if tok.token_to_id(s) is None]
        if missing:
            tok.add_special_tokens(missing)
        self._templates = chat_templates
        self._compiled: dict[str, jinja2.Template] = {}
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token", ""))
        self.pad_token_id: int | None = self.token_to_id(self.special_tokens.get("pad_token", ""))
        eos = self.token_to_id(self.special_tokens.get("eos_token", ""))
        self.eos_token_ids: set[int] = {eos} if eos is not None else set()
        # A model's embedding table is often padded past the tokenizer's vocab; ids can be sparse, so use max id.
        self.vocab_size: int = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        # Whether encode() prepends BOS. transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json
        # exists (converted checkpoints bake it into tokenizer.json's post-processor), so we read it off the result.
        self.add_bos_token: bool = self.bos_token_id is not None and self.encode("")[:1] == [self.bos_token_id]

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load a checkpoint's tokenizer.json, or a tiktoken tokenizer's files (Kimi's tiktoken.model: read as
        data by strata.runtime.generation.text.tiktoken_vocab, no repository code run), with tokenizer_config.json and
        chat_template.jinja (optional)."""
        d = Path(directory)
        path = d / "tokenizer.json"
        config_path = d / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path} must hold a JSON object; re-download the checkpoint")
        if not path.is_file() and is_tiktoken_dir(d, config):
            tok: _HFTokenizer | TiktokenBackend = read_tiktoken(d, config)
        elif not path.is_file():
            raise CheckpointError(
                f"{d} has no tokenizer.json (strata reads only the fast tokenizer's file); write one with transformers: "
                f"AutoTokenizer.from_pretrained('{d}').save_pretrained('{d}')"
            )
        else:
            try:
                tok = _HFTokenizer.from_file(str(path))
            except Exception as e:  # the Rust side raises plain Exception for any parse error
                raise CheckpointError(f"{path} could not be parsed ({_one_line(e)[:200]}); re-download it") from e
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):  # the multi-template form: [{"name": "default", "template": "..."}, ...]
            templates = {
                t["name"]: t["template"] for t in raw if isinstance(t, dict) and {"name", "template"} <= t.keys()
            }
        jinja_path = d / "chat_template.jinja"
        if jinja_path.is_file():  # newer checkpoints keep the template here; it wins over tokenizer_config's
            try:
                templates["default"] = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{jinja_path} could not be read ({_one_line(e)}); re-download it") from e
        renderer = None if templates else BUILTIN_RENDERERS.get(_model_type(d) or "")
        return cls(tok, config, templates, source=str(d), renderer=renderer)

    def add_eos_token_ids(self, ids: int | list[int] | None) -> None:
        """Also stop on these ids (config.json / generation_config.json `eos_token_id`, an int or a list)."""
        if ids is None:
            return
        for i in [ids] if isinstance(ids, int) else ids:
            self.eos_token_ids.add(int(i))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; added/special tokens written in the text (e.g. <|im_start|>) map to their ids."""
        if not isinstance(text, str):
            raise RequestError(f"prompt must be a string, got {type(text).__name__}")
        # encode_batch lets go of the GIL while it works (encode holds it), so a long text stalls no other thread
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def backend_json(self) -> str:
        """The tokenizer.json this tokenizer runs (the special tokens it added included), as a string: what
        another library reads the vocabulary from (xgrammar, for structured output)."""
        return self._tok.to_str()

    @cached_property
    def token_bound(self) -> TokenBound | None:
        """A lower bound on the tokens a text encodes to, known without encoding it (None: no such bound)."""
        return token_bound(json.loads(self._tok.to_str()))

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Ids -> text. Ids the tokenizer does not know (>= vocab_size) decode to nothing."""
        ids = [int(i) for i in ids]
        # tokenizers already drops unknown ids; filtering negatives avoids an OverflowError converting to u32.
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, s: str) -> int | None:
        """The id of one token string, or None if it is not in the vocabulary."""
        return self._tok.token_to_id(s) if s else None

    def id_to_token(self, i: int) -> str | None:
        """The token string for an id, or None for an unknown id."""
        return self._tok.id_to_token(i) if 0 <= i < self.vocab_size else None

    @cached_property
    def special_token_ids(self) -> set[int]:
        """Ids of all added tokens marked special (what skip_special_tokens drops)."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @property
    def has_chat_template(self) -> bool:
        """Whether chats can be rendered: a template, or a built-in renderer of the model type."""
        return bool(self._templates) or self._renderer is not None

    def _template(self, tools: Any) -> jinja2.Template:
        if not self._templates:
            raise UnsupportedError(
                f"checkpoint {self.source} has no chat template; send a raw prompt (completions/generate) instead"
            )
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        if name not in self._templates:
            name = next(iter(self._templates))
        if name not in self._compiled:
            try:
                self._compiled[name] = _compile_template(self._templates[name])
            except jinja2.TemplateSyntaxError as e:
                raise CheckpointError(
                    f"chat template {name!r} of {self.source} has a syntax error ({_one_line(e)}); fix or replace it"
                ) from e
        return self._compiled[name]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages to a prompt string exactly like transformers' apply_chat_template(tokenize=False).

        Extra kwargs (tools, documents, enable_thinking, ...) are visible to the template and override the
        special token names (bos_token, eos_token, ...) that are passed by default.
        """
        messages = _normalize_messages(messages)
        if not self._templates and self._renderer is not None:
            return self._renderer(messages, add_generation_prompt, **kwargs)
        kwargs.setdefault("tools", None)
        kwargs.setdefault("documents", None)
        template = self._template(kwargs["tools"])
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs}
            )
        except jinja2.TemplateError as e:  # includes raise_exception(...) and undefined attributes
            raise RequestError(f"the chat template rejected the messages: {_one_line(e)}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(
                f"the chat template failed on these messages ({type(e).__name__}: {_one_line(e)}); check their roles"
            ) from e


def load_tokenizer(directory: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory, or None when it has no tokenizer files at all (a model served by
    token ids alone). Tokenizer files without tokenizer.json are a `CheckpointError` (`Tokenizer.from_dir`)."""
    d = Path(directory)
    if not (d / "tokenizer.json").is_file() and not any((d / name).is_file() for name in _OTHER_TOKENIZER_FILES):
        return None
    return Tokenizer.from_dir(d)
