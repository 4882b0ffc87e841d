"""The OpenAI-compatible HTTP API, served through the batching scheduler.

    app = create_app(engine, scheduler, "demo")      # or create_app(None, None, "demo") while loading,
    app.state.strata.attach(engine, scheduler)       # then attach: /health turns from 503 to 200

Every request becomes one `GenRequest` per sequence (n per prompt); their events are merged and
rendered as OpenAI chat / text completions, whole or as SSE chunks. Errors are OpenAI-shaped; a
client that goes away has its sequences cancelled, so they leave the batch within a step.
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
from strata.errors import RequestError, StrataError
from strata.runtime.scheduler import GenRequest, QueueFullError
from strata.server.dashboard import mount_dashboard
from strata.server.metrics import ServerMetrics
from strata.server.protocol import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    context_error,
    parse_json_body,
    parse_request,
)
from strata.server.render import ChatFormat, CompletionFormat, Seq, TokenText
from strata.server.streaming import cancel, respond, to_api_error

MAX_BODY_BYTES = 32 << 20  # a longer body is refused before it is read into memory
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
THINK_TAGS = ("<think>", "</think>")


class ServerState:
    """What the routes serve: loading (no engine yet) until `attach`, then ready."""

    def __init__(self, model_name: str, engine: Any = None, scheduler: Any = None):
        self.model_name = model_name
        self.engine: Any = None
        self.scheduler: Any = None
        self.load_error: str | None = None  # set when loading failed (the server is shutting down)
        self.warming_up = False  # the model is loaded and runs its warm-up (strata.runtime.warmup) before ready
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.live)
        if engine is not None:
            self.attach(engine, scheduler)

    def attach(self, engine: Any, scheduler: Any) -> None:
        """Start serving `engine` through `scheduler` (already started)."""
        tok = engine.tokenizer
        self.token_text = TokenText(tok)
        self.sampling_defaults = _sampling_defaults(Path(engine.checkpoint.directory))
        self.think = all(tok.token_to_id(t) is not None for t in THINK_TAGS)
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

    def require_ready(self) -> None:
        if not self.ready:
            phase = "the server is warming up (every decode batch size once)" if self.warming_up else \
                "the model is still loading"
            raise APIError(503, self.load_error or f"{phase}; retry when GET /health returns 200",
                           "service_unavailable", code="model_loading")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "invalid_request_error", "model", "model_not_found")


def create_app(engine: Any, scheduler: Any, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` through `scheduler` as `model_name` (both None: loading)."""
    app = FastAPI(title="strata", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    st = app.state.strata = ServerState(model_name, engine, scheduler)

    def route(method: str, path: str, handler: Callable[[Request, ServerState], Awaitable[Response]]) -> None:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request, st)
            except Exception as e:  # every failure becomes an OpenAI error; real faults are logged
                return error_response(st, to_api_error(e))

        endpoint.__name__ = handler.__name__
        app.add_api_route(path, endpoint, methods=[method])

    route("POST", "/v1/chat/completions", _chat)
    route("POST", "/v1/completions", _completions)
    route("GET", "/v1/models", _models)
    route("GET", "/health", _health)
    route("GET", "/metrics", _metrics)
    route("POST", "/tokenize", _tokenize)
    route("POST", "/detokenize", _detokenize)
    route("GET", "/v1/strata/stats", _stats)
    mount_dashboard(app, lambda: st.engine if st.ready else None, lambda: st.scheduler)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:  # unknown route, bad method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(st, APIError(exc.status_code, str(exc.detail), kind))

    return app


def error_response(st: ServerState, e: APIError) -> JSONResponse:
    st.metrics.request_errors.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)


# ---- routes --------------------------------------------------------------------------------------------


async def _health(request: Request, st: ServerState) -> Response:
    st.require_ready()
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request, st: ServerState) -> Response:
    return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _models(request: Request, st: ServerState) -> Response:
    st.require_ready()
    card = {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "strata",
            "root": str(st.engine.checkpoint.directory), "max_model_len": st.engine.max_context}
    return JSONResponse({"object": "list", "data": [card]})


async def _stats(request: Request, st: ServerState) -> Response:
    st.require_ready()
    # the engine's figures at the top level with the scheduler's beside them (the dashboard reads this shape)
    out = {**st.engine.stats(), "scheduler": st.scheduler.stats(), "served_model": st.model_name}
    if request.query_params.get("steps") in ("1", "true"):  # the last steps' times and sizes (benchmarks, diagnosis)
        out["recent_steps"] = st.scheduler.recent_steps()
    return JSONResponse(out)


async def _tokenize(request: Request, st: ServerState) -> Response:
    st.require_ready()
    req = parse_request(TokenizeRequest, await _read_json(request))
    st.check_model(req.model)
    tok = st.engine.tokenizer
    if req.messages is not None:
        text = tok.apply_chat_template([m.for_template() for m in req.messages],
                                       add_generation_prompt=req.add_generation_prompt)
        add_special = bool(req.add_special_tokens)  # the template already wrote BOS where the model wants it
    else:
        text, add_special = req.prompt, req.add_special_tokens is not False
    ids = tok.encode(text, add_special_tokens=add_special)
    strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": st.engine.max_context, "tokens": ids, "token_strs": strs})


async def _detokenize(request: Request, st: ServerState) -> Response:
    st.require_ready()
    req = parse_request(DetokenizeRequest, await _read_json(request))
    st.check_model(req.model)
    _check_ids(st, req.tokens, "tokens")
    return JSONResponse({"prompt": st.engine.tokenizer.decode(req.tokens)})


async def _chat(request: Request, st: ServerState) -> Response:
    st.require_ready()
    req = parse_request(ChatCompletionRequest, await _read_json(request))
    st.check_model(req.model)
    tok = st.engine.tokenizer
    messages = [m.for_template() for m in req.messages]
    extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in ("messages", "add_generation_prompt")}
    # off the event loop: a huge prompt must not stall the streams of others
    text = await asyncio.to_thread(tok.apply_chat_template, messages, req.add_generation_prompt, **extra)
    ids = await asyncio.to_thread(tok.encode, text, False)
    seqs = _submit(st, req, [ids], "messages", None, logprobs=req.num_logprobs, prompt_logprobs=None)
    in_reasoning = st.think and text.rstrip().endswith(THINK_TAGS[0])  # the template opened the thinking block
    fmt = ChatFormat(st.token_text, bool(req.logprobs), st.think, in_reasoning, req.n)
    return await respond(request, _head(st, "chatcmpl", "chat.completion"), req, seqs, fmt)


async def _completions(request: Request, st: ServerState) -> Response:
    st.require_ready()
    req = parse_request(CompletionRequest, await _read_json(request))
    st.check_model(req.model)
    tok = st.engine.tokenizer
    texts = req.prompts()
    if len(texts) * req.n > MAX_CHOICES:
        raise bad_request(f"{len(texts)} prompts x n={req.n} sequences; at most {MAX_CHOICES} per request", param="n")
    prompts = await asyncio.to_thread(lambda: [tok.encode(p) if isinstance(p, str) else list(p) for p in texts])
    # echo with max_tokens 0 scores the prompt only (lm-eval style): run one token and drop it
    score_only = req.echo and isinstance(req.max_tokens, int) and not isinstance(req.max_tokens, bool) \
        and req.max_tokens == 0
    if score_only:
        req.max_tokens = 1
    seqs = _submit(st, req, prompts, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs=req.logprobs,
                   prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
    texts = [tok.decode(p) if req.echo else "" for p in prompts]
    fmt = CompletionFormat(st.token_text, req.logprobs, req.echo, score_only, texts, req.n)
    return await respond(request, _head(st, "cmpl", "text_completion"), req, seqs, fmt)


# ---- request plumbing ----------------------------------------------------------------------------------


async def _read_json(request: Request) -> dict:
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", "invalid_request_error")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", "invalid_request_error")
        chunks.append(chunk)
    return parse_json_body(b"".join(chunks))


def _check_ids(st: ServerState, ids: list[int], param: str) -> None:
    vocab = st.engine.checkpoint.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def _sampling_defaults(directory: Path) -> dict:
    """The checkpoint's recommended temperature / top_p / top_k (generation_config.json), as vLLM applies them."""
    try:
        cfg = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict) or cfg.get("do_sample") is False:
        return {}
    return {k: cfg[k] for k in ("temperature", "top_p", "top_k") if isinstance(cfg.get(k), int | float)}


def _submit(st: ServerState, req: Any, prompts: list[list[int]], param: str, default_max: int | None,
            logprobs: int | None, prompt_logprobs: int | None) -> list[Seq]:
    """Validate every prompt, then queue n sequences per prompt; all or none are submitted."""
    context = st.engine.max_context
    for key, value in st.sampling_defaults.items():
        if getattr(req, key) is None:
            setattr(req, key, value)
    if req.temperature is None:
        req.temperature = 1.0  # OpenAI's default when neither the request nor the checkpoint says
    jobs = []
    for p, ids in enumerate(prompts):
        if not ids:
            raise bad_request(f"the {param} encode to no tokens; give a non-empty prompt", param=param)
        _check_ids(st, ids, param)
        room = context - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else max(1, min(default_max or room, room))
        params = [req.sampling(max_tokens, seed_offset=j) for j in range(req.n)]  # validates max_tokens first
        if len(ids) + params[0].max_tokens > context:
            raise context_error(len(ids), params[0].max_tokens, context, param)
        if req.reproducible and params[0].temperature > 0 and params[0].seed is None:
            raise bad_request('strata_reproducible "required" with sampling (temperature > 0) needs a seed; '
                              "give one, or set temperature to 0", param="seed")
        jobs += [(p * req.n + j, ids, sp) for j, sp in enumerate(params)]
    seqs: list[Seq] = []
    try:
        for index, ids, params in jobs:
            gen = GenRequest(prompt_ids=ids, params=params, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             reproducible=req.reproducible)
            seqs.append(Seq(index, ids, st.scheduler.submit(gen), st.metrics.sequence()))
    except BaseException as e:
        cancel(seqs)
        if isinstance(e, StrataError) and not isinstance(e, RequestError | QueueFullError):
            raise APIError(503, str(e), "service_unavailable", code="shutting_down") from None  # stopping
        raise
    return seqs


def _head(st: ServerState, prefix: str, kind: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": st.model_name, "system_fingerprint": st.fingerprint}
