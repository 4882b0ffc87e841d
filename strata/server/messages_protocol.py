"""Anthropic's Messages API, request side: the request model, its conversation as the chat messages a template
reads, its tools as OpenAI's, and Anthropic-shaped error bodies.

A Messages request is served as the chat completion it amounts to: `system` becomes a system message, a user
turn's `tool_result` blocks become `tool` messages (before its text), an assistant turn's `tool_use` blocks its
`tool_calls` and its `thinking` blocks its reasoning; `stop_sequences` are `stop`, `tool_choice` any / tool /
none are "required" / a named function / "none", and `thinking` enabled or disabled is the template's
`enable_thinking`. `temperature`, `top_p` and `top_k` are taken as chat takes them (the Python SDK sends them
through `extra_body`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, StrictStr, WithJsonSchema, model_validator

from strata.server.api_errors import APIError, bad_request
from strata.server.protocol import GenerationRequest
from strata.server.tools.request import ToolRequest, check_tool_choice, check_tools, template_tool_calls

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
_BLOCK = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}


def is_messages_path(path: str | None) -> bool:
    """Whether a path belongs to the Messages API (its errors are Anthropic-shaped)."""
    return path in MESSAGES_PATHS


def error_body(e: APIError) -> dict:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class MessagesRequest(GenerationRequest):
    """POST /v1/messages (and /v1/messages/count_tokens, which needs no max_tokens)."""

    _tools: ToolRequest = PrivateAttr(default_factory=ToolRequest)
    max_tokens: Annotated[Any, WithJsonSchema({"type": "integer", "minimum": 1})]
    messages: list[Annotated[dict, WithJsonSchema({"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}}})]] = Field(min_length=1)
    system: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]})] = None
    stop_sequences: Annotated[Any, WithJsonSchema({"type": "array", "items": {"type": "string", "minLength": 1}})] = None
    tools: Annotated[Any, WithJsonSchema({"type": "array", "items": {"type": "object", "required": ["name"]}})] = None
    tool_choice: Annotated[Any, WithJsonSchema({"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"}}})] = None
    thinking: Annotated[Any, WithJsonSchema({"type": "object", "required": ["type"],
                                             "properties": {"type": {"type": "string"}}})] = None
    metadata: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _stop_sequences(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stop_sequences") is not None:
            return {**data, "stop": data["stop_sequences"]}
        return data

    @model_validator(mode="after")
    def _check_tools(self) -> MessagesRequest:
        if self.n != 1:
            raise bad_request("n is not part of the Messages API: a message is one answer; leave it out", param="n")
        self._tools = anthropic_tools(self.tools, self.tool_choice)
        return self

    @property
    def tool_request(self) -> ToolRequest:
        return self._tools

    def template_kwargs(self) -> dict[str, Any]:
        """`thinking` as the template's `enable_thinking`: "enabled" true, "disabled" false; absent or another type
        ("adaptive"): the template's default."""
        kind = self.thinking.get("type") if isinstance(self.thinking, dict) else None
        if self.thinking is not None and not isinstance(kind, str):
            raise bad_request('thinking must be an object with a type, e.g. {"type": "enabled", "budget_tokens": '
                              '2048} or {"type": "disabled"}', param="thinking")
        return {"enable_thinking": kind == "enabled"} if kind in ("enabled", "disabled") else {}


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens."""

    max_tokens: Annotated[Any, WithJsonSchema({"type": "integer", "minimum": 1})] = None
    model: StrictStr


def anthropic_tools(tools: Any, tool_choice: Any) -> ToolRequest:
    """Anthropic's `tools` ({name, description, input_schema}) and `tool_choice` as a `ToolRequest`."""
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools must be a list of {name, description, input_schema}", param="tools")
    converted = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise bad_request(f"tools.{i}: must be an object with name and input_schema", param=f"tools.{i}")
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"tools.{i}: the Anthropic-defined tool type {tool['type']!r} is not supported; define "
                              "the tool with name, description and input_schema", param=f"tools.{i}")
        fn = {"name": tool.get("name"), "description": tool.get("description"),
              "parameters": tool.get("input_schema")}
        converted.append({"type": "function", "function": fn})
    checked = check_tools(converted if tools is not None else None, None)
    choice: Any = None
    parallel = None
    if tool_choice is not None:
        kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
        mapping = {"auto": "auto", "any": "required", "none": "none"}
        if kind == "tool":
            choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
        elif kind in mapping:
            choice = mapping[kind]
        else:
            raise bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} '
                              'or {"type": "none"}', param="tool_choice")
        if tool_choice.get("disable_parallel_tool_use"):
            parallel = False
    return check_tool_choice(choice, None, checked, parallel)


def chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation as template-ready chat messages (see the module docstring)."""
    out: list[dict] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system, "system", ("text",))})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be \"user\" or \"assistant\", got {role!r}"[:200],
                              param=f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content: must be a string or a list of content blocks", param=f"{where}.content")
        if role == "user":
            out += _user_turn(content, where)
        else:
            out.append(_assistant_turn(content, where))
    return out


def _user_turn(blocks: list, where: str) -> list[dict]:
    out, texts = [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}.content.{j}")
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.content.{j}.tool_use_id: the id of the tool_use this answers is needed",
                                  param=f"{where}.content.{j}.tool_use_id")
            result = _text(block.get("content", ""), f"{where}.content.{j}.content", ("text",))
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind == "text":
            texts.append(_text([block], f"{where}.content.{j}", ("text",)))
        else:
            raise _unsupported(kind, f"{where}.content.{j}")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list, where: str) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text([block], at, ("text",)))
        elif kind == "thinking":
            thinking.append(block.get("thinking") or "")
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{at}: a tool_use block needs an id, a name and an input object", param=at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        else:
            raise _unsupported(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = template_tool_calls(calls, f"{where}.content")
    return message


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where}: a content block must be an object with a type", param=where)
    return block["type"]


def _text(value: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or the joined text of a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where}: must be a string or a list of text blocks", param=where)
    parts = []
    for j, block in enumerate(value):
        kind = _kind(block, f"{where}.{j}")
        if kind not in kinds:
            raise _unsupported(kind, f"{where}.{j}")
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{where}.{j}: a text block needs its text", param=f"{where}.{j}")
        parts.append(block["text"])
    return "\n".join(parts)


def _unsupported(kind: str, where: str) -> APIError:
    return bad_request(f"{where}: content blocks of type {kind!r} are not supported; send text, tool_use and "
                       "tool_result blocks", param=where)
