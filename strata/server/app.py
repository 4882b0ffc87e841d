"""The OpenAI-compatible HTTP API (and Anthropic's Messages API), served through the batching scheduler.

    app = create_app(engine, scheduler, "demo")      # or create_app(None, None, "demo") while loading,
    app.state.strata.attach(engine, scheduler)       # then attach: /health turns from 503 to 200

Every request becomes one `GenRequest` per sequence (n per prompt); their events are merged and
rendered as OpenAI chat / text completions (or Anthropic messages: strata.server.messages_api), whole or as SSE
chunks. Errors are OpenAI-shaped (Anthropic-shaped under /v1/messages); a client that goes away has its sequences cancelled, so they leave the batch within a step. Requests pass
the `Guard` first (Host check, API key, access log); POST bodies must be JSON. A text prompt that provably
cannot fit the context is refused before it is tokenized (`TokenBound`), and tokenizing runs off the event
loop without the GIL. The schema of every route is at /openapi.json (strata.server.openapi).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata import __version__
from strata.errors import ConfigError
from strata.server.api_errors import APIError, bad_request, parse_json_body, parse_request
from strata.server.chat import THINK_TAGS, render_chat, renders_tools, template_call_text
from strata.server.dashboard import mount_dashboard
from strata.server.guard import Guard, HostRule, record_usage
from strata.server.memory import LARGE_BODY_BYTES, release_memory_soon
from strata.server.messages_api import count_tokens, create_message
from strata.server.messages_protocol import error_body, is_messages_path
from strata.server.metrics import ServerMetrics
from strata.server.openapi import install_openapi
from strata.server.prompts import (
    check_max_tokens_default,
    check_token_ids,
    compile_grammar,
    refuse_past_context,
    require_tokenizer,
    submit,
)
from strata.server.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from strata.server.render import ChatFormat, CompletionFormat, TokenText
from strata.server.streaming import respond, to_api_error
from strata.server.tools.calls import TOOL_FORMATS, tool_format

MAX_BODY_BYTES = 32 << 20  # a longer body is refused before it is read into memory
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
JSON_TYPES = ("application/json",)  # and any application/...+json


class ServerState:
    """What the routes serve: loading (no engine yet) until `attach`, then ready."""

    def __init__(self, model_name: str, engine: Any = None, scheduler: Any = None,
                 max_tokens_default: int | None = None, tool_parser: str = "auto"):
        self.model_name = model_name
        self.max_tokens_default = check_max_tokens_default(max_tokens_default)
        if tool_parser != "auto" and tool_parser not in TOOL_FORMATS:
            raise ConfigError(f"--tool-call-parser {tool_parser!r} is unknown; use auto, {', '.join(TOOL_FORMATS)}")
        self.tool_parser = tool_parser
        self.template_renders_tools = False  # whether the chat template writes tools into the prompt (set by attach)
        self.engine: Any = None
        self.scheduler: Any = None
        self.load_error: str | None = None  # set when loading failed (the server is shutting down)
        self.warming_up = False  # the model is loaded and runs its warm-up (strata.runtime.generation.warmup) before ready
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.live)
        if engine is not None:
            self.attach(engine, scheduler)

    def attach(self, engine: Any, scheduler: Any) -> None:
        """Start serving `engine` through `scheduler` (already started)."""
        tok = engine.tokenizer  # None: a checkpoint without tokenizer files (token-id prompts only)
        self.token_text = TokenText(tok)
        self.sampling_defaults = _sampling_defaults(Path(engine.checkpoint.directory))
        self.think = tok is not None and all(tok.token_to_id(t) is not None for t in THINK_TAGS)
        self.template_renders_tools = renders_tools(tok)
        self.tool_format = tool_format(engine.checkpoint.config.model_type, tok, self.tool_parser,
                                       template_call_text(tok))
        # what decides bit-for-bit results: version, device, dtype, and the CPU numerics mode where there is one
        numerics = getattr(engine.config.runtime, "cpu_numerics", None)
        self.fingerprint = "-".join(str(x) for x in ("strata", __version__, engine.device,
                                                     str(engine.dtype).removeprefix("torch."), numerics) if x)
        self.engine, self.scheduler = engine, scheduler  # last: `ready` flips only once all of the above is set

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    def live(self) -> tuple[Any, Any] | None:
        return (self.engine, self.scheduler) if self.ready else None

    def not_ready(self) -> APIError:
        """The 503 answered while the model loads or warms up."""
        phase = "the server is warming up (every decode batch size once)" if self.warming_up else \
            "the model is still loading"
        return APIError(503, self.load_error or f"{phase}; retry when GET /health returns 200",
                        "service_unavailable", code="model_loading")

    def require_ready(self) -> None:
        if not self.ready:
            raise self.not_ready()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "invalid_request_error", "model", "model_not_found")

    def damaged(self) -> list[list[int]]:
        """[layer, expert] of every expert whose checksum failed since start (each once, in order)."""
        tiers = self.engine.stats().get("tiers") or {}
        return sorted({tuple(k) for k in tiers.get("damaged") or []})


def create_app(engine: Any, scheduler: Any, model_name: str, *, hosts: HostRule | None = None,
               api_key: str | None = None, max_tokens_default: int | None = None,
               tool_parser: str = "auto") -> FastAPI:
    """The FastAPI app serving `engine` through `scheduler` as `model_name` (both None: loading).

    `hosts`: the Host headers answered (None: any; `strata serve` passes the rule for its bind address);
    `api_key`: required as `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every path but /health;
    `max_tokens_default`: caps what a chat request without max_tokens may generate (else: the rest of the
    context); `tool_parser`: the format of the model's tool calls ("auto": from its vocabulary and type)."""
    app = FastAPI(title="strata", version=__version__, docs_url=None, redoc_url=None,
                  description="An OpenAI-compatible completions server for Mixture-of-Experts models, which also "
                              "speaks Anthropic's Messages API.")
    st = app.state.strata = ServerState(model_name, engine, scheduler, max_tokens_default, tool_parser)

    def route(method: str, path: str, handler: Callable[[Request, ServerState], Awaitable[Response]]) -> None:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request, st)
            except Exception as e:  # every failure becomes an OpenAI (or Anthropic) error; real faults are logged
                return error_response(st, to_api_error(e), path)

        endpoint.__name__ = handler.__name__
        app.add_api_route(path, endpoint, methods=[method], summary=(handler.__doc__ or "").split("\n")[0])

    route("POST", "/v1/chat/completions", _chat)
    route("POST", "/v1/completions", _completions)
    route("GET", "/v1/models", _models)
    route("GET", "/health", _health)
    route("GET", "/metrics", _metrics)
    route("POST", "/tokenize", _tokenize)
    route("POST", "/detokenize", _detokenize)
    route("GET", "/v1/strata/stats", _stats)
    route("POST", "/v1/embeddings", _embeddings)
    route("POST", "/v1/messages", _messages)
    route("POST", "/v1/messages/count_tokens", _count_tokens)
    mount_dashboard(app, lambda: st.engine if st.ready else None, lambda: st.scheduler)
    install_openapi(app, model_name, api_key is not None,
                    lambda: st.engine.checkpoint.config.vocab_size if st.ready else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:  # unknown route, bad method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; use {exc.headers.get('Allow', '')}"
        return error_response(st, APIError(exc.status_code, message, kind, headers=exc.headers), request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:  # a fault outside every route
        return error_response(st, to_api_error(exc), request.url.path)

    app.add_middleware(Guard, hosts=hosts, api_key=api_key, on_error=st.metrics.count_error)
    return app


def error_response(st: ServerState, e: APIError, path: str | None = None) -> JSONResponse:
    """An error answered in OpenAI's shape, or Anthropic's on the Messages API's paths; counted in /metrics."""
    st.metrics.count_error(e)
    return JSONResponse(error_body(e) if is_messages_path(path) else e.body(), status_code=e.status,
                        headers=e.headers)


# ---- routes --------------------------------------------------------------------------------------------


async def _health(request: Request, st: ServerState) -> Response:
    """Liveness: 200 once serving ("degraded" when experts failed their checksum), 503 while starting."""
    if not st.ready:  # a probe during start-up is expected, not a request error
        e = st.not_ready()
        return JSONResponse(e.body(), status_code=e.status)
    damaged = st.damaged()
    if damaged:
        return JSONResponse({"status": "degraded", "damaged": damaged,
                             "message": f"{len(damaged)} expert(s) failed their checksum; requests that route to "
                                        "them fail: run `strata verify` on the store and rebuild it"})
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request, st: ServerState) -> Response:
    """Prometheus metrics."""
    return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _models(request: Request, st: ServerState) -> Response:
    """The served model (in OpenAI's shape, with the fields of Anthropic's beside them)."""
    st.require_ready()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.created))
    card = {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "strata",
            "root": st.model_name, "max_model_len": st.engine.max_context,
            "type": "model", "display_name": st.model_name, "created_at": created}
    return JSONResponse({"object": "list", "data": [card], "has_more": False, "first_id": st.model_name,
                         "last_id": st.model_name})


async def _stats(request: Request, st: ServerState) -> Response:
    """The engine's and the scheduler's figures (what the dashboard draws)."""
    st.require_ready()
    # the engine's figures at the top level with the scheduler's beside them (the dashboard reads this shape)
    out = {**st.engine.stats(), "scheduler": st.scheduler.stats(), "served_model": st.model_name}
    if request.query_params.get("steps") in ("1", "true"):  # the last steps' times and sizes (benchmarks, diagnosis)
        out["recent_steps"] = st.scheduler.recent_steps()
    return JSONResponse(out)


async def _embeddings(request: Request, st: ServerState) -> Response:
    """Not served: strata serves completions only."""
    raise APIError(404, "strata serves completions only (/v1/chat/completions, /v1/completions); it has no "
                        "embeddings endpoint", "invalid_request_error", code="unsupported_endpoint")


async def _tokenize(request: Request, st: ServerState) -> Response:
    """A prompt or chat messages as token ids (vLLM's shape)."""
    st.require_ready()
    req = parse_request(TokenizeRequest, await _read_json(request))
    st.check_model(req.model)
    tok = require_tokenizer(st.engine, "messages" if req.messages is not None else "prompt")
    if req.messages is not None:
        messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        text = await asyncio.to_thread(tok.apply_chat_template, messages, req.add_generation_prompt, tools=req.tools)
        add_special = bool(req.add_special_tokens)  # the template already wrote BOS where the model wants it
    else:
        text, add_special = req.prompt, req.add_special_tokens is not False
    refuse_past_context(st.engine, text, "messages" if req.messages is not None else "prompt", 0)
    ids = await asyncio.to_thread(tok.encode, text, add_special)
    strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": st.engine.max_context, "tokens": ids, "token_strs": strs})


async def _detokenize(request: Request, st: ServerState) -> Response:
    """Token ids as text."""
    st.require_ready()
    req = parse_request(DetokenizeRequest, await _read_json(request))
    st.check_model(req.model)
    tok = require_tokenizer(st.engine, "tokens")
    check_token_ids(st.engine, req.tokens, "tokens")
    return JSONResponse({"prompt": tok.decode(req.tokens)})


async def _chat(request: Request, st: ServerState) -> Response:
    """A chat completion, whole or streamed (SSE)."""
    st.require_ready()
    req = parse_request(ChatCompletionRequest, await _read_json(request))
    st.check_model(req.model)
    messages = [m.for_template(i) for i, m in enumerate(req.messages)]
    prompt = await render_chat(st, messages, req.tool_request, req.add_generation_prompt,
                               req.template_kwargs(), req.max_tokens)
    await compile_grammar(st, req)
    seqs = submit(st, req, [prompt.ids], "messages", st.max_tokens_default, logprobs=req.num_logprobs,
                  prompt_logprobs=None)
    fmt = ChatFormat(st.token_text, bool(req.logprobs), st.think, prompt.in_reasoning, req.n, prompt.calls)
    record_usage(request.scope, lambda: fmt.usage(seqs))
    return await respond(request, _head(st, "chatcmpl", "chat.completion"), req, seqs, fmt)


async def _messages(request: Request, st: ServerState) -> Response:
    """An Anthropic message (the Messages API), whole or streamed (SSE events)."""
    st.require_ready()
    return await create_message(request, st, await _read_json(request))


async def _count_tokens(request: Request, st: ServerState) -> Response:
    """The tokens of an Anthropic Messages request's prompt."""
    st.require_ready()
    return await count_tokens(request, st, await _read_json(request))


async def _completions(request: Request, st: ServerState) -> Response:
    """A text completion of a prompt (text or token ids), whole or streamed (SSE)."""
    st.require_ready()
    req = parse_request(CompletionRequest, await _read_json(request))
    st.check_model(req.model)
    tok = st.engine.tokenizer
    texts = req.prompts()
    if len(texts) * req.n > MAX_CHOICES:
        raise bad_request(f"{len(texts)} prompts x n={req.n} sequences; at most {MAX_CHOICES} per request", param="n")
    if any(isinstance(p, str) for p in texts) or req.stop:
        require_tokenizer(st.engine, "prompt" if any(isinstance(p, str) for p in texts) else "stop")
    for p in texts:
        if isinstance(p, str):
            refuse_past_context(st.engine, p, "prompt", req.max_tokens)
    prompts = await asyncio.to_thread(lambda: [tok.encode(p) if isinstance(p, str) else list(p) for p in texts])
    # echo with max_tokens 0 scores the prompt only (lm-eval style): run one token and drop it
    score_only = req.echo and isinstance(req.max_tokens, int) and not isinstance(req.max_tokens, bool) \
        and req.max_tokens == 0
    if score_only:
        req.max_tokens = 1
    await compile_grammar(st, req)
    seqs = submit(st, req, prompts, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs=req.logprobs,
                  prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
    texts = [tok.decode(p) if req.echo and tok is not None else "" for p in prompts]
    fmt = CompletionFormat(st.token_text, req.logprobs, req.echo, score_only, texts, req.n, token_ids=tok is None)
    record_usage(request.scope, lambda: fmt.usage(seqs))
    return await respond(request, _head(st, "cmpl", "text_completion"), req, seqs, fmt)


# ---- request plumbing ----------------------------------------------------------------------------------


async def _read_json(request: Request) -> dict:
    """The body as a JSON object: JSON content types only (a web page's form or text/plain post is refused
    before anything is read), at most MAX_BODY_BYTES, read without trusting Content-Length alone."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not (media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))):
        raise APIError(415, f"the request body must be JSON sent as Content-Type: application/json, "
                            f"got {media or 'no Content-Type'}", "invalid_request_error", code="unsupported_media_type")
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", "invalid_request_error")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", "invalid_request_error")
        chunks.append(chunk)
    if total >= LARGE_BODY_BYTES:  # once answered, hand the memory its parsing and tokenizing took back
        release_memory_soon(request.scope)
    return parse_json_body(b"".join(chunks))


def _sampling_defaults(directory: Path) -> dict:
    """The checkpoint's recommended temperature / top_p / top_k (generation_config.json), as vLLM applies them."""
    try:
        cfg = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict) or cfg.get("do_sample") is False:
        return {}
    return {k: cfg[k] for k in ("temperature", "top_p", "top_k") if isinstance(cfg.get(k), int | float)}


def _head(st: ServerState, prefix: str, kind: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": st.model_name, "system_fingerprint": st.fingerprint}
