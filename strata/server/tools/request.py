"""A chat request's tools: checking `tools` / `tool_choice` (and their older names `functions` / `function_call`),
and handing tool calls to chat templates in the form they read.

Templates of different families read a call's `arguments` differently: Qwen3's writes a mapping with `tojson`
(or a string as it is), GLM-4.5's iterates `arguments.items()`, DeepSeek's concatenates it to strings. So
arguments reach templates as `JsonArguments`, a dict that prints, and concatenates, as its JSON text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from strata.errors import RequestError

CHOICES = ("auto", "none", "required")
_NAME = re.compile(r"^[^\s<>\"'`]{1,256}$")  # names are written into markup by every format


class ToolRequestError(RequestError):
    """A bad `tools`, `tool_choice` or tool call in a message; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: `tools` in OpenAI's shape, `choice` ("auto", "none", "required" or
    "named"), the function `name` a named choice forces, and whether several calls may come at once."""

    tools: tuple[dict, ...] = ()
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether tools are rendered into the prompt and calls parsed from the output ("none": neither)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the request needs a call ("required" or a named function)."""
        return self.active and self.choice in ("required", "named")


def check_tools(tools: Any, functions: Any) -> list[dict]:
    """`tools` (or the older `functions`) as a list of OpenAI function tools; a ToolRequestError names the bad one."""
    if tools is not None and functions:
        raise ToolRequestError("give tools or the older functions, not both", "functions")
    param = "tools" if tools is not None else "functions"
    given = tools if tools is not None else functions
    if given is None:
        return []
    if not isinstance(given, list):
        raise ToolRequestError(f"{param} must be a list of tool definitions", param)
    out = []
    for i, tool in enumerate(given):
        where = f"{param}.{i}"
        if param == "functions":
            tool = {"type": "function", "function": tool}
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolRequestError(f'{where}: must be {{"type": "function", "function": {{"name": ..., "parameters": '
                                   "...}}; only function tools are supported", where)
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise ToolRequestError(f"{where}: the function needs a name (1-256 characters, no spaces, quotes or "
                                   f"angle brackets), got {fn.get('name')!r}"[:200], where)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolRequestError(f"{where}: parameters must be a JSON schema object", where)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolRequestError(f"{where}: description must be a string", where)
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ToolRequestError(f"{param}: the function {twice!r} is defined twice; give each tool a distinct name",
                               param)
    return out


def check_tool_choice(tool_choice: Any, function_call: Any, tools: list[dict],
                      parallel: Any = None) -> ToolRequest:
    """The request's `ToolRequest` from `tool_choice` (or the older `function_call`) and the checked tools."""
    param = "tool_choice" if tool_choice is not None else "function_call"
    choice = tool_choice if tool_choice is not None else function_call
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if param == "tool_choice" else choice
        name = (fn or {}).get("name") if isinstance(fn, dict) else choice.get("name")
        if not isinstance(name, str):
            shape = '{"type": "function", "function": {"name": ...}}' if param == "tool_choice" else '{"name": ...}'
            raise ToolRequestError(f"{param} must be \"auto\", \"none\", \"required\" or {shape}", param)
        choice = "named"
    elif not isinstance(choice, str) or choice not in CHOICES:
        raise ToolRequestError(f'{param} must be "auto", "none", "required" or a function to call, got '
                               f"{choice!r}"[:200], param)
    names = [t["function"]["name"] for t in tools]
    if choice in ("required", "named") and not tools:
        raise ToolRequestError(f"{param} {choice if choice != 'named' else repr(name)} needs tools; send the "
                               "tools the model may call", param)
    if name is not None and name not in names:
        raise ToolRequestError(f"{param} names the function {name!r}, which is not among the tools "
                               f"({', '.join(names)})"[:300], param)
    return ToolRequest(tuple(tools), choice, name, parallel is not False)


class JsonArguments(dict):
    """A call's arguments as chat templates read them: a mapping (`.items()`, `tojson`) whose text, and whose
    concatenation with a string, is its JSON."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: Any) -> Any:
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + str(self) if isinstance(other, str) else NotImplemented


def template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as templates read them: OpenAI's shape, arguments as `JsonArguments`
    (arguments that are not a JSON object stay the text they are)."""
    if not isinstance(calls, list):
        raise ToolRequestError(f"{where}: tool_calls must be a list of calls", where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolRequestError(f'{where}.{i}: a tool call must be {{"id": ..., "type": "function", "function": '
                                   '{"name": ..., "arguments": "{...}"}}', f"{where}.{i}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                parsed = None
            args = JsonArguments(parsed) if isinstance(parsed, dict) else args
        elif isinstance(args, dict):
            args = JsonArguments(args)
        else:
            raise ToolRequestError(f"{where}.{i}: arguments must be JSON text of an object", f"{where}.{i}")
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return out
