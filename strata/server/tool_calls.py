"""The model's tool-call output, parsed into calls: one parser per format of the model families strata runs.

    fmt = tool_format("qwen3_moe", tokenizer)          # or by name: TOOL_FORMATS["hermes"]
    parsed = parse_output(fmt, text, tools)             # content, reasoning, calls of a whole output
    stream = fmt.stream(tools); stream.feed(piece) ...; stream.flush()   # the same, delta by delta

Formats (what the model writes after its generation prompt):

- `hermes` (Qwen3, Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and
  Qwen3-Coder's `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`.
- `deepseek` (DeepSeek-V3, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}
  \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`, and V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
- `deepseek_v4` (DeepSeek-V4): DSML, `<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="K"
  string="true">V</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n</｜DSML｜tool_calls>`; `string="false"` values are JSON.
- `glm45` (GLM-4.5, 4.6): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`.
- `minimax_m2` (MiniMax-M2, M2.1): `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>
  \\n</invoke>\\n</minimax:tool_call>`, several invokes a block.
- `kimi_k2` (Kimi K2, K2.5): `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
  {...}<|tool_call_end|>...<|tool_calls_section_end|>`; the call's id is `functions.NAME:IDX`, as Kimi's chat
  template writes it back.
- `harmony` (gpt-oss): channels; `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
  is a call, the `analysis` channel is reasoning, `final` (and commentary to nobody) is content.

A block that does not parse (bad JSON, a cut-off call) is returned as text: a model's malformed call never
fails a request. Every parser is a pure function of the text and the request's tool schemas.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from strata.server.tool_harmony import HarmonyStream, partial_suffix


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


class HermesFormat(BlockFormat):
    """Qwen3, Qwen2.5, Hermes: a JSON object in <tool_call> tags (Qwen3-Coder: <function=...> XML in them)."""

    name, start, end = "hermes", "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def parse_block(self, body: str, types: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        text = body.strip()
        if text.startswith("<function="):  # Qwen3-Coder's XML form
            m = self._FUNCTION.match(text)
            if m is None:
                return None
            name = m[1].strip()
            params = {k.strip(): typed_value(v, types.get(name, {}).get(k.strip()))
                      for k, v in self._PARAMETER.findall(m[2])}
            return [ToolCall(name, json.dumps(params, ensure_ascii=False))]
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = arguments_json(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else [ToolCall(obj["name"], args)]

    def forced_prefix(self, name: str | None) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ' if name else '<tool_call>\n{"name": "'


class Glm45Format(BlockFormat):
    """GLM-4.5 / 4.6: the name, then <arg_key>/<arg_value> pairs, in <tool_call> tags."""

    name, start, end = "glm45", "<tool_call>", "</tool_call>"
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse_block(self, body: str, types: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        head, _, rest = body.partition("<arg_key>")
        name = head.strip()
        if not name or "\n" in name or "<" in name:
            return None
        rest = "<arg_key>" + rest if rest else ""
        args = {k.strip(): typed_value(v, types.get(name, {}).get(k.strip())) for k, v in self._ARG.findall(rest)}
        if self._ARG.sub("", rest).strip():  # text that is no complete key/value pair: not a call
            return None
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]

    def forced_prefix(self, name: str | None) -> str:
        return f"<tool_call>{name}\n" if name else "<tool_call>"


class DeepSeekFormat(BlockFormat):
    """DeepSeek-V3 / R1 (type, name and fenced JSON per call) and V3.1 (name and JSON), in a calls section."""

    name, start, end = "deepseek", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _FENCED = re.compile(r"([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*$", re.DOTALL)

    def parse_block(self, body: str, types: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        calls = []
        pieces = body.split(self.CALL_BEGIN)
        if pieces[0].strip():
            return None
        for piece in pieces[1:]:
            call, _, after = piece.partition(self.CALL_END)
            if after.strip():
                return None
            left, sep, right = call.partition(self.SEP)
            if not sep:
                return None
            fenced = self._FENCED.match(right.strip())
            if left.strip() == "function" and fenced:  # V3: type, then the name and a fenced JSON object
                name, args = fenced[1].strip(), arguments_json(fenced[2])
            else:  # V3.1: the name, then the JSON object
                name, args = left.strip(), arguments_json(right.strip())
            if not name or args is None:
                return None
            calls.append(ToolCall(name, args))
        return calls or None

    def forced_prefix(self, name: str | None) -> str:
        return self.start + self.CALL_BEGIN  # the name's place differs between V3 and V3.1: the model writes it


class DsmlFormat(BlockFormat):
    """DeepSeek-V4's DSML: <｜DSML｜invoke name="NAME"> elements of <｜DSML｜parameter name="K" string="true|false">V
    </｜DSML｜parameter> in a <｜DSML｜tool_calls> block. As DeepSeek's reference decoder reads them: a value marked
    string="true" is the text as written, one marked "false" is JSON (text that is not JSON, a repeated parameter
    or anything between the elements makes the block text). The schemas are not needed: the markup types."""

    TOKEN = "｜DSML｜"
    name, start, end = "deepseek_v4", f"<{TOKEN}tool_calls>", f"</{TOKEN}tool_calls>"
    _INVOKE = re.compile(f'<{TOKEN}invoke name="([^"]*)">(.*?)</{TOKEN}invoke>', re.DOTALL)
    _PARAMETER = re.compile(f'<{TOKEN}parameter name="([^"]*)" string="(true|false)">(.*?)</{TOKEN}parameter>',
                            re.DOTALL)

    def parse_block(self, body: str, types: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        if self._INVOKE.sub("", body).strip():
            return None
        calls = []
        for m in self._INVOKE.finditer(body):
            name, inner = m[1], m[2]
            if not name or self._PARAMETER.sub("", inner).strip():
                return None
            args: dict[str, Any] = {}
            for key, is_str, raw in self._PARAMETER.findall(inner):
                if key in args:
                    return None
                if is_str == "true":
                    args[key] = raw
                    continue
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls or None

    def forced_prefix(self, name: str | None) -> str:
        # V4 writes a call block after a blank line, as its chat encoding renders one
        invoke = f'<{self.TOKEN}invoke name="' + (f'{name}">\n' if name else "")
        return f"\n\n{self.start}\n{invoke}"


class MiniMaxFormat(BlockFormat):
    """MiniMax-M2: <invoke name="NAME"> elements of <parameter name="K">V</parameter> in <minimax:tool_call> tags.
    Values are text, stripped and typed by the tool's schema; a name may be quoted or not (MiniMax's own parser
    takes both)."""

    name, start, end = "minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>"
    _NAME = r"""name=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))\s*>"""
    _INVOKE = re.compile(r"<invoke " + _NAME + r"(.*?)</invoke>", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter " + _NAME + r"(.*?)</parameter>", re.DOTALL)

    def parse_block(self, body: str, types: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        if self._INVOKE.sub("", body).strip():  # text that is no complete invoke: not a call
            return None
        calls = []
        for m in self._INVOKE.finditer(body):
            name, inner = next(g for g in m.groups()[:3] if g is not None).strip(), m[4]
            if not name or self._PARAMETER.sub("", inner).strip():
                return None
            args = {}
            for p in self._PARAMETER.finditer(inner):
                key = next(g for g in p.groups()[:3] if g is not None).strip()
                args[key] = typed_value(p[4].strip(), types.get(name, {}).get(key))
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls or None

    def forced_prefix(self, name: str | None) -> str:
        return f'{self.start}\n<invoke name="{name}">\n' if name else f'{self.start}\n<invoke name="'


class KimiFormat(BlockFormat):
    """Kimi K2: calls named by id (`functions.NAME:IDX`, or `NAME:IDX`), their JSON arguments after a marker, in a
    calls section. The id is kept as the call's: Kimi's template renders a call back by it."""

    name, start, end = "kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    _ID = re.compile(r"(?:functions\.)?([^\s:<>]+):\d+")

    def parse_block(self, body: str, types: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        pieces = body.split(self.CALL_BEGIN)
        if pieces[0].strip():
            return None
        calls = []
        for piece in pieces[1:]:
            call, _, after = piece.partition(self.CALL_END)
            ident, sep, raw = call.partition(self.ARGS)
            m = self._ID.fullmatch(ident.strip())
            args = arguments_json(raw.strip()) if sep and m else None
            if after.strip() or args is None:
                return None
            calls.append(ToolCall(m[1], args, id=ident.strip()))
        return calls or None

    def forced_prefix(self, name: str | None) -> str:
        return self.start + self.CALL_BEGIN + (f"functions.{name}:0{self.ARGS}" if name else "functions.")


class HarmonyFormat:
    """gpt-oss's channels (strata.server.tool_harmony)."""

    name = "harmony"

    def stream(self, tools: list[dict] | None = None) -> HarmonyStream:
        """A parser for one output (harmony's calls carry JSON: the schemas are not needed)."""
        return HarmonyStream(_harmony_call, Delta)

    def forced_prefix(self, name: str | None) -> str:
        recipient = f"functions.{name} <|constrain|>json<|message|>" if name else "functions."
        return "<|channel|>commentary to=" + recipient


def _harmony_call(name: str, body: str) -> ToolCall | None:
    args = arguments_json(body.strip())
    return ToolCall(name, args) if args is not None and name else None


ToolFormat = BlockFormat | HarmonyFormat
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Glm45Format(), DeepSeekFormat(),
                                                           DsmlFormat(), MiniMaxFormat(), KimiFormat(),
                                                           HarmonyFormat())}
# the format a model type writes, when its vocabulary does not say (`tool_format`)
_MODEL_TYPES = (("gpt_oss", "harmony"), ("deepseek_v4", "deepseek_v4"), ("deepseek", "deepseek"), ("kimi", "kimi_k2"),
                ("glm4", "glm45"), ("minimax_m2", "minimax_m2"), ("qwen", "hermes"))


def tool_format(model_type: str | None, tokenizer: Any, name: str = "auto",
                template_call: str | None = None) -> ToolFormat:
    """The format of a model's calls: `name` when not "auto"; else the markers its chat template writes for a
    call (`template_call`: the text of an assistant turn holding one), then the special tokens its vocabulary
    has (each family's tokenizer adds its markers), then its model type; `hermes` when none says."""
    if name != "auto":
        return TOOL_FORMATS[name]
    for marker, fmt in ((DsmlFormat.start, "deepseek_v4"), (DeepSeekFormat.CALL_BEGIN, "deepseek"),
                        (KimiFormat.CALL_BEGIN, "kimi_k2"), ("to=functions.", "harmony"), ("<arg_key>", "glm45"),
                        (MiniMaxFormat.start, "minimax_m2"), ("<tool_call>", "hermes")):
        if template_call is not None and marker in template_call:
            return TOOL_FORMATS[fmt]

    def has(token: str) -> bool:
        return tokenizer is not None and tokenizer.token_to_id(token) is not None

    if has(DeepSeekFormat.start):
        return TOOL_FORMATS["deepseek"]
    if has(KimiFormat.start):
        return TOOL_FORMATS["kimi_k2"]
    if has("<|channel|>") and has("<|message|>"):
        return TOOL_FORMATS["harmony"]
    if has("<arg_key>"):
        return TOOL_FORMATS["glm45"]
    if has(MiniMaxFormat.start):
        return TOOL_FORMATS["minimax_m2"]
    if not has("<tool_call>"):
        kind = (model_type or "").lower()
        for prefix, fmt in _MODEL_TYPES:
            if kind.startswith(prefix):
                return TOOL_FORMATS[fmt]
    return TOOL_FORMATS["hermes"]


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


def parse_output(fmt: ToolFormat, text: str, tools: list[dict] | None = None) -> Delta:
    """A whole output's content, reasoning (harmony's analysis channel) and calls: what streaming it gives."""
    stream = fmt.stream(tools)
    out = stream.feed(text)
    out += stream.flush()
    return out


@dataclass(frozen=True)
class CallParsing:
    """How a chat request's output is read for calls: the model's `fmt`, the request's `tools` (their schemas type
    textual arguments), the `prefix` written into the prompt to force a call (it starts the output), and whether
    more than one call is kept (`parallel`)."""

    fmt: ToolFormat
    tools: tuple[dict, ...] = ()
    prefix: str = ""
    parallel: bool = True

    def stream(self) -> BlockStream | HarmonyStream:
        """A fresh parser for one sequence's output."""
        return self.fmt.stream(list(self.tools))
