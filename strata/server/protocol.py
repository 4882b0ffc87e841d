"""The OpenAI wire format, request side: validated request models (their errors: strata.server.api_errors).

Requests are pydantic models with strict types for structural fields (a `"stream": "yes"` is a 400,
not a truthy string) and unknown fields ignored, as OpenAI and vLLM do. OpenAI fields strata does not implement
(logit_bias, penalties, best_of, suffix) are 400s unless neutral. Tools are checked in strata.server.tools.request.
Sampling fields are left untyped here and validated by `SamplingParams`, so the server and the Python API reject a
bad `temperature` with the same message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from strata.errors import RequestError
from strata.runtime.generation.grammar import ResponseFormat
from strata.runtime.generation.sampler import MAX_STOP_STRINGS, SamplingParams
from strata.server.api_errors import bad_request
from strata.server.tools.request import ToolRequest, check_tool_choice, check_tools, template_tool_calls

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)
MAX_N = 16  # sequences per prompt
MAX_CHOICES = 64  # sequences per request (n x prompts); the scheduler's queue bounds it further
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "response_format")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
def _documented(*schemas: dict) -> Any:
    """A field validated by hand (or by `SamplingParams`), documented in the OpenAPI schema as one of `schemas`
    or null: what the server accepts, so a schema-based client or fuzzer and the server agree."""
    return Annotated[Any, WithJsonSchema({"anyOf": [*schemas, {"type": "null"}]})]


_POSITIVE_INT = {"type": "integer", "minimum": 1}
_ZERO = {"type": "number", "minimum": 0, "maximum": 0}
_STOP = ({"type": "string", "minLength": 1},
         {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS})
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
# response_format: free text, any JSON object, or JSON valid under a JSON Schema (strata.runtime.generation.grammar)
_RESPONSE_FORMATS = (
    {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"enum": ["json_schema"]},
        "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
            "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}})
# strata_reproducible "required" samples only with a seed (or greedily)
_REPRODUCIBLE_NEEDS_SEED = {
    "if": {"properties": {"strata_reproducible": {"const": "required"}}, "required": ["strata_reproducible"]},
    "then": {"anyOf": [{"properties": {"seed": {"type": "integer"}}, "required": ["seed"]},
                       {"properties": {"temperature": {"const": 0}}, "required": ["temperature"]}]}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class GenerationRequest(_Request):
    """Fields shared by chat, completions and Anthropic messages (strata.server.messages_protocol)."""

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    # sampling: validated by SamplingParams (same messages as the Python API)
    max_tokens: _documented(_POSITIVE_INT) = None
    temperature: _documented({"type": "number", "minimum": 0, "maximum": 100}) = None
    top_p: _documented({"type": "number", "exclusiveMinimum": 0, "maximum": 1}) = None
    top_k: _documented({"type": "integer", "minimum": 0}) = None
    seed: _documented({"type": "integer"}) = None
    stop: _documented(*_STOP) = None
    stop_token_ids: _documented(_TOKEN_IDS) = None
    ignore_eos: _documented({"type": "boolean"}) = None
    # "required": served on the reproducible path (bit-identical alone or batched, slower); "off" or absent: batched
    strata_reproducible: _documented({"enum": ["required", "off"]}) = None
    # OpenAI fields strata does not implement: refused where they would change the output, never silently ignored
    # (their neutral values, which many clients always send, pass)
    logit_bias: _documented({"type": "object", "maxProperties": 0}) = None
    presence_penalty: _documented(_ZERO) = None
    frequency_penalty: _documented(_ZERO) = None
    response_format: _documented(*_RESPONSE_FORMATS) = None  # checked by ResponseFormat.parse

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: Any) -> Any:
        if v is not None and v != {}:
            raise ValueError("is not supported (no logit biasing); send {} or leave it out")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or v != 0):
            raise ValueError("is not supported (no repetition penalties); send 0 or leave it out")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Any) -> Any:
        try:
            return ResponseFormat.parse(v)  # None for {"type": "text"}
        except RequestError as e:
            raise ValueError(str(e).removeprefix("response_format ")) from None

    @field_validator("strata_reproducible")
    @classmethod
    def _check_reproducible(cls, v: Any) -> Any:
        if v is not None and not (isinstance(v, str) and v in ("required", "off")):
            raise ValueError('must be "required" (bit-identical tokens alone or batched) or "off"')
        return v

    @property
    def reproducible(self) -> bool:
        """Whether the sequences of this request run on the reproducible path."""
        return self.strata_reproducible == "required"

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    def sampling(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        """SamplingParams for one sequence (`max_tokens` already defaulted; sequence i of n gets seed + i)."""
        kwargs = {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}
        kwargs["max_tokens"] = max_tokens
        if "seed" in kwargs and isinstance(kwargs["seed"], int) and not isinstance(kwargs["seed"], bool):
            kwargs["seed"] += seed_offset
        try:
            return SamplingParams(**kwargs)
        except RequestError as e:
            first = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=first if first in SAMPLING_FIELDS else None) from None


class ContentPart(_Request):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["type", "text"]})
    type: Annotated[StrictStr, WithJsonSchema({"enum": ["text"]})]
    text: Annotated[StrictStr | None, WithJsonSchema({"type": "string"})] = None


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, reasoning_content, ...) reach the chat template."""

    model_config = ConfigDict(extra="allow")
    role: Annotated[StrictStr, WithJsonSchema({"enum": list(CHAT_ROLES)})]
    content: StrictStr | list[ContentPart] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"unknown role {v!r}; the roles are {', '.join(CHAT_ROLES)}")
        return v

    def for_template(self, index: int = 0) -> dict:
        """A plain dict, with content parts joined into one string (only text parts are supported) and tool
        calls' arguments as templates read them (`template_tool_calls`)."""
        d = self.model_dump(exclude_none=True)
        d.setdefault("content", "")  # no content (an assistant turn that called tools): templates read a string
        if "tool_calls" in d:
            d["tool_calls"] = template_tool_calls(d["tool_calls"], f"messages.{index}.tool_calls")
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text":
                    raise bad_request(f"content parts of type {part.type!r} are not supported; send text",
                                      param="messages")
                if part.text is None:
                    raise bad_request('a content part of type "text" needs its "text"', param="messages")
                texts.append(part.text)
            d["content"] = "".join(texts)
        return d


_TOOL_NAME = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[^\\s<>\"'`]{1,256}$"}},
              "required": ["name"]}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        **_TOOL_NAME["properties"], "description": {"type": "string"}, "parameters": {"type": "object"}}}}}
_NAMED_CHOICE = {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"enum": ["function"]}, "function": _TOOL_NAME}}


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    _tools: ToolRequest = PrivateAttr(default_factory=ToolRequest)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _documented(_POSITIVE_INT) = None  # the newer name of max_tokens; wins when both given
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}, as vLLM
    # OpenAI's reasoning effort (DeepSeek-V4's "max" too), the chat template's `reasoning_effort` (gpt-oss's harmony
    # "Reasoning:" line, DeepSeek-V4's effort); a template that does not read it ignores it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # tools and the choice among them: checked together by `tool_request` (strata.server.tools.request)
    tools: _documented({"type": "array", "items": _TOOL}) = None
    functions: _documented({"type": "array", "items": _TOOL["properties"]["function"]}) = None  # older tools
    tool_choice: _documented({"enum": ["auto", "none", "required"]}, _NAMED_CHOICE) = None
    function_call: _documented({"enum": ["auto", "none"]}, _TOOL_NAME) = None  # the older tool_choice
    parallel_tool_calls: _documented({"type": "boolean"}) = None
    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": [_REPRODUCIBLE_NEEDS_SEED]})

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        tools = check_tools(self.tools, self.functions)
        self._tools = check_tool_choice(self.tool_choice, self.function_call, tools, self.parallel_tool_calls)
        return self

    @property
    def tool_request(self) -> ToolRequest:
        """The checked tools and what the request asks of them."""
        return self._tools

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given beside the messages and tools: `reasoning_effort`, then
        `chat_template_kwargs` (which win where both name a key)."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**effort, **(self.chat_template_kwargs or {})}

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    @model_validator(mode="after")
    def _newer_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    # a string, a list of strings, token ids, or a list of token-id lists: checked by prompts()
    prompt: Annotated[Any, WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {**_TOKEN_IDS, "minItems": 1},
        {"type": "array", "items": {**_TOKEN_IDS, "minItems": 1}, "minItems": 1}]})]
    # max_tokens 0 scores the prompt only, with echo
    max_tokens: _documented({"type": "integer", "minimum": 0}) = None
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Annotated[StrictStr | None, WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0},
                                                                  {"type": "null"}]})] = None
    best_of: _documented({"type": "integer", "minimum": 1, "maximum": MAX_N}) = None
    # in the schema: best_of, when given, equals n
    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": [_REPRODUCIBLE_NEEDS_SEED, {
        "if": {"properties": {"best_of": {"type": "integer"}}, "required": ["best_of"]},
        "then": {"anyOf": [{"properties": {"best_of": {"const": 1}, "n": {"const": 1}}},
                           *({"properties": {"best_of": {"const": k}, "n": {"const": k}}, "required": ["n"]}
                             for k in range(2, MAX_N + 1))]}}]})

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("is not supported beyond n (every sequence generated is returned); leave it out")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Any) -> Any:
        if v:
            raise ValueError("is not supported (no fill-in-the-middle)")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one entry per prompt of a batch (text, or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(_is_int(t) for t in p):
                return [p]
            if all(isinstance(t, str) for t in p) or all(isinstance(x, list) and all(map(_is_int, x)) for x in p):
                return p
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                          "lists (non-empty)", param="prompt")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered with the template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    tools: _documented({"type": "array", "items": _TOOL}) = None  # rendered with the messages, as chat does
    # in the schema: exactly one of prompt and messages (null counts as absent)
    model_config = ConfigDict(extra="ignore", json_schema_extra={"anyOf": [
        {"properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array", "minItems": 1}, "prompt": {"type": "null"}},
         "required": ["messages"]}]})

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        self.tools = check_tools(self.tools, None) or None
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's shape)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


# ---- responses --------------------------------------------------------------------------------------
