"""The server's OpenAPI schema (GET /openapi.json): the request models of strata.server.protocol and the
response models below, which describe what the routes answer (a test checks real answers against them).

The routes read their bodies by hand (so that every bad field is an OpenAI-shaped 400, not FastAPI's 422),
so the schema is put together here rather than from the route signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from strata.server.guard import OPEN_PATHS
from strata.server.messages_protocol import CountTokensRequest, MessagesRequest, is_messages_path
from strata.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, whatever its status."""

    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache (runtime.prefix_cache)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of an object")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the model only called tools")
    reasoning_content: str | None = Field(None, description="the thinking text, for models that think")
    tool_calls: list[ToolCall] | None = Field(None, description="the calls the model made (finish_reason tool_calls)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    """POST /v1/chat/completions without stream (with stream: `chat.completion.chunk` events, then [DONE])."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="the generated ids, for a model without a tokenizer")


class Completion(BaseModel):
    """POST /v1/completions without stream (with stream: `text_completion` events, then [DONE])."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the Messages API, whatever its status."""

    type: Literal["error"]
    error: AnthropicErrorBody


class ContentBlock(BaseModel):
    type: Literal["text", "thinking", "tool_use"]
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None


class MessageUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens computed (the rest came from the prefix cache)")
    output_tokens: int
    cache_read_input_tokens: int = Field(0, description="prompt tokens served from the prefix cache")


class Message(BaseModel):
    """POST /v1/messages without stream (with stream: Anthropic's events, message_start to message_stop)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    type: Literal["model"] = Field(description="Anthropic's shape")
    display_name: str
    created_at: str = Field(description="RFC 3339")


class ModelList(BaseModel):
    """OpenAI's list of models, with the fields of Anthropic's (has_more, first_id, last_id)."""

    object: Literal["list"]
    data: list[ModelCard]
    has_more: bool
    first_id: str
    last_id: str


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    damaged: list[list[int]] | None = Field(None, description="[layer, expert] of experts that failed their checksum")
    message: str | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None


class DetokenizeResponse(BaseModel):
    prompt: str


_ERRORS = {400: "a bad request (the message names the field)", 401: "a missing or wrong API key",
           404: "an unknown model", 413: "a body over 32 MiB", 415: "a body that is not JSON",
           429: "the queue is full: retry after Retry-After seconds", 500: "a fault in the server",
           503: "the model is loading, or the server is shutting down"}
_GENERATION = (400, 404, 413, 415, 429, 500, 503)
# path -> (method, request model, 200 model, 200 media types, error statuses)
ROUTES: dict[str, tuple[str, type[BaseModel] | None, type[BaseModel] | None, tuple[str, ...], tuple[int, ...]]] = {
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletion, ("application/json", "text/event-stream"),
                             _GENERATION),
    "/v1/completions": ("post", CompletionRequest, Completion, ("application/json", "text/event-stream"), _GENERATION),
    "/v1/models": ("get", None, ModelList, ("application/json",), (503,)),
    "/health": ("get", None, Health, ("application/json",), (503,)),
    "/metrics": ("get", None, None, ("text/plain",), ()),
    "/tokenize": ("post", TokenizeRequest, TokenizeResponse, ("application/json",), (400, 404, 413, 415, 500, 503)),
    "/detokenize": ("post", DetokenizeRequest, DetokenizeResponse, ("application/json",),
                    (400, 404, 413, 415, 500, 503)),
    "/v1/strata/stats": ("get", None, None, ("application/json",), (503,)),
    "/v1/strata/residency": ("get", None, None, ("application/json",), (503,)),
    "/v1/strata/history": ("get", None, None, ("application/json",), (400, 503)),
    "/v1/embeddings": ("post", None, None, (), (404,)),
    "/v1/messages": ("post", MessagesRequest, Message, ("application/json", "text/event-stream"), _GENERATION),
    "/v1/messages/count_tokens": ("post", CountTokensRequest, TokenCount, ("application/json",),
                                  (400, 404, 413, 415, 500, 503)),
}


def install_openapi(app: FastAPI, model_name: str, api_key: bool, vocab_size: Callable[[], int | None]) -> None:
    """Serve the schema at /openapi.json: each route's request body and answers, `model` limited to
    `model_name`, token ids below `vocab_size()` once the model is loaded (None before), and the bearer key on
    every path but /health when `api_key`."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        vocab = vocab_size()
        out = _build(app, model_name, api_key, vocab)
        if vocab is not None:  # final once loaded
            app.openapi_schema = out
        return out

    app.openapi = schema  # type: ignore[method-assign]


def _build(app: FastAPI, model_name: str, api_key: bool, vocab: int | None) -> dict[str, Any]:
    out = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components: dict[str, Any] = out.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel], mode: Literal["validation", "serialization"]) -> dict:
        spec = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
        components.update(spec.pop("$defs", {}))
        components[model.__name__] = spec
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    openai_error = {"application/json": {"schema": ref(ErrorResponse, "serialization")}}
    anthropic_error = {"application/json": {"schema": ref(AnthropicErrorResponse, "serialization")}}
    for path, (method, request, response, media, errors) in ROUTES.items():
        error = anthropic_error if is_messages_path(path) else openai_error
        op = out["paths"].get(path, {}).get(method)
        if op is None:
            continue
        if request is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(request,
                                                                                                  "validation")}}}
        body = ref(response, "serialization") if response is not None else {"type": "object"}
        # an SSE stream's events are the JSON chunks (OpenAPI 3.1 has no schema for events): left undescribed
        ok = {m: {"schema": body} if m == "application/json" else {} for m in media}
        statuses = sorted({*errors, 400, *((401,) if api_key and path not in OPEN_PATHS else ())})  # 400: bad Host
        responses: dict[str, Any] = {"200": {"description": "success", "content": ok}} if media else {}
        for status in statuses:
            responses[str(status)] = {"description": _ERRORS.get(status, "an error"), "content": error}
        if status_429 := responses.get("429"):
            status_429["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        op["responses"] = responses
        if api_key and path not in OPEN_PATHS:
            op["security"] = [{"bearer": []}, {"x_api_key": []}]  # either header
    for model in (ChatCompletionRequest, CompletionRequest, MessagesRequest, CountTokensRequest):
        components[model.__name__]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    if vocab is not None:
        ids = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
        components["DetokenizeRequest"]["properties"]["tokens"]["items"] = ids
        for variant in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            items = variant.get("items", {})
            if items.get("type") == "integer":
                variant["items"] = ids
            elif items.get("type") == "array":
                items["items"] = ids
    if api_key:
        out["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return out
