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
from dataclasses import dataclass
from typing import Any

from strata.server.tools.blocks import BlockFormat, BlockStream, Delta, ToolCall, arguments_json, typed_value
from strata.server.tools.harmony import HarmonyStream


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
    """gpt-oss's channels (strata.server.tools.harmony)."""

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
