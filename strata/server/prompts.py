"""From a validated request to queued sequences: the tokenizer's presence, the context bound checked before
tokenizing, max_tokens defaults, and submitting every sequence of a request at once (or none)."""

from __future__ import annotations

import asyncio
from typing import Any

from strata.errors import ConfigError, RequestError, StrataError
from strata.runtime.generation.scheduler import GenRequest, QueueFullError
from strata.server.api_errors import APIError, bad_request, context_error
from strata.server.render import Seq


def check_max_tokens_default(value: int | None) -> int | None:
    """`--max-tokens-default`: None (a chat request without max_tokens fills the context) or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"--max-tokens-default must be an integer >= 1, got {value!r}")
    return value


def require_tokenizer(engine: Any, param: str) -> Any:
    """The engine's tokenizer, or a 400 saying the model has none (token-id completions still work)."""
    tok = engine.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer (no tokenizer.json in its directory): send the prompt as "
                          "token ids to /v1/completions", param=param, code="no_tokenizer")
    return tok


def refuse_past_context(engine: Any, text: str, param: str, max_tokens: Any) -> None:
    """Refuse, without tokenizing it, a text that provably needs more tokens than the context holds (with
    at least one generated token, or `max_tokens` when it is a valid count): the tokenizer's `token_bound`
    never counts more tokens than encoding gives, so nothing that could fit is refused here."""
    bound = getattr(engine.tokenizer, "token_bound", None)
    context = engine.max_context
    if bound is None or len(text) * 4 <= bound.most_bytes(context):  # UTF-8 has at most 4 bytes a character
        return
    out = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 else 1
    at_least = bound.at_least(text)
    if at_least + out > context:
        where = "messages" if param == "messages" else "prompt"
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, the {where} alone is at least "
            f"{at_least} tokens long ({len(text)} characters; no token of this model covers more than "
            f"{bound.max_bytes_per_token} bytes), with {out} more in the completion. Please reduce the length of "
            f"the {where}.", param=param, code="context_length_exceeded")


async def compile_grammar(st: Any, req: Any) -> None:
    """Compile the request's response_format on a worker thread (xgrammar takes 0.7-2 s on a new schema), so that
    `submit` finds it in the engine's cache and the event loop keeps every other stream going meanwhile. A bad
    format is left for `submit`, which answers it as always."""
    if getattr(req, "response_format", None) is None or st.engine.grammars is None:
        return
    try:
        fmt = req.sampling(1).response_format
        if fmt is not None:
            await asyncio.to_thread(st.engine.compile_grammar, fmt)
    except (StrataError, APIError):
        pass


def submit(st: Any, req: Any, prompts: list[list[int]], param: str, default_max: int | None,
           logprobs: int | None, prompt_logprobs: int | None) -> list[Seq]:
    """Validate every prompt, then queue n sequences per prompt, all at once or none.

    A request without max_tokens gets `default_max`, never more than the room its prompt leaves (None: all of
    it, OpenAI's meaning for chat). A request with more sequences than the queue holds can never be served:
    a 400 naming the limit, where a full queue is a 429 to retry."""
    context = st.engine.max_context
    for key, value in st.sampling_defaults.items():
        if getattr(req, key) is None:
            setattr(req, key, value)
    if req.temperature is None:
        req.temperature = 1.0  # OpenAI's default when neither the request nor the checkpoint says
    jobs = []
    for ids in prompts:
        if not ids:
            raise bad_request(f"the {param} encode to no tokens; give a non-empty prompt", param=param)
        check_token_ids(st.engine, ids, param)
        room = context - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else max(1, min(default_max or room, room))
        params = [req.sampling(max_tokens, seed_offset=j) for j in range(req.n)]  # validates max_tokens first
        if len(ids) + params[0].max_tokens > context:
            raise context_error(len(ids), params[0].max_tokens, context, param)
        if req.reproducible and params[0].temperature > 0 and params[0].seed is None:
            raise bad_request('strata_reproducible "required" with sampling (temperature > 0) needs a seed; '
                              "give one, or set temperature to 0", param="seed")
        if params[0].stop and st.engine.tokenizer is None:
            raise bad_request("stop strings need a tokenizer, which this model lacks; use stop_token_ids",
                              param="stop", code="no_tokenizer")
        jobs += [(ids, sp) for sp in params]
    limit = st.scheduler.max_queue
    if len(jobs) > limit:
        raise bad_request(f"this request asks for {len(jobs)} sequences ({len(prompts)} prompt(s) x n={req.n}) but "
                          f"the server queues at most {limit} (--max-queue), so it can never be served; send fewer "
                          "prompts or a smaller n", param="n", code="too_many_sequences")
    requests = [GenRequest(prompt_ids=ids, params=params, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                           reproducible=req.reproducible) for ids, params in jobs]
    try:
        handles = st.scheduler.submit_together(requests)
    except StrataError as e:
        if isinstance(e, RequestError | QueueFullError):
            raise
        raise APIError(503, str(e), "service_unavailable", code="shutting_down") from None  # stopping
    return [Seq(index, ids, handle, st.metrics.sequence())
            for index, ((ids, _), handle) in enumerate(zip(jobs, handles, strict=True))]


def check_token_ids(engine: Any, ids: list[int], param: str) -> None:
    """A 400 naming the first id outside the model's vocabulary."""
    vocab = engine.checkpoint.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)
