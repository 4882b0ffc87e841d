"""One request while it holds a KV slot: what it has prefilled and sampled, and the rules that end it.

Every generation runs through the scheduler (`Engine.generate`, `stream`, `chat` and the server's requests), so
this is the one place where an EOS or stop token, a stop string, `max_tokens` or the end of the context ends a
sequence, and where its text is decoded token by token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.errors import StrataError
from strata.runtime.generation.grammar import GrammarMatcher
from strata.runtime.generation.logprobs import PromptLogprobs, token_logprob
from strata.runtime.generation.requests import GenRequest, RequestHandle, TokenEvent
from strata.runtime.generation.sampler import make_generator
from strata.runtime.generation.text.detokenize import StopMatcher, StreamDecoder


@dataclass
class Sequence:
    """A request's state in its KV slot. A model without a tokenizer has no `decoder`: its text stays empty."""

    handle: RequestHandle
    slot: int
    generator: torch.Generator
    decoder: StreamDecoder | None
    stopper: StopMatcher
    eos: set[int]  # ids that end it unemitted: the model's EOS and the request's stop tokens (none with ignore_eos)
    prefilled: int = 0  # prompt tokens already in the cache
    cached: int = 0  # ... of which the prefix cache served (not computed for this request)
    written: int = 0  # cache positions holding this sequence's rows: prompt prefilled, then tokens fed
    ring_at: int = -1  # the position the slot's Engram rings are current at (-1: a step ran ahead of the host)
    tokens: list[int] = field(default_factory=list)  # generated so far
    next_input: int | None = None  # sampled, not yet fed
    prompt_lp: PromptLogprobs | None = None  # each prompt token's, when the request asks for them
    scores: list[torch.Tensor] = field(default_factory=list)  # a score request's log-probabilities, chunk by chunk
    grammar: GrammarMatcher | None = None  # its response format's place (made from the request's grammar)

    def __post_init__(self) -> None:
        if self.grammar is None and self.req.grammar is not None:
            self.grammar = self.req.grammar.matcher()

    @classmethod
    def begin(cls, handle: RequestHandle, tokenizer, eos_token_ids: set[int], device: torch.device) -> Sequence:
        """A submitted request's sequence before it has a slot (`slot` -1): its generator (seeded by the request),
        its text decoder (None without a `tokenizer`), stop strings, and the ids that end it (the model's
        `eos_token_ids` and the request's stop tokens, none with ignore_eos)."""
        p = handle.request.params
        eos = set() if p.ignore_eos else eos_token_ids | set(p.stop_token_ids)
        decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        return cls(handle, -1, make_generator(p.seed, device), decoder, StopMatcher(p.stop), eos)

    @property
    def req(self) -> GenRequest:
        return self.handle.request

    def cached_ids(self) -> list[int]:
        """The ids whose rows this sequence's slot holds, position by position (the prefix cache's view)."""
        n, prompt = self.written, self.req.prompt_ids
        return prompt[:n] if n <= len(prompt) else prompt + self.tokens[: n - len(prompt)]

    def samples(self, inp: list[int]) -> bool:
        """Whether this sequence's row of a pass fed `inp` yields a token: a decode token, or its prompt's last
        chunk (never for a score request)."""
        if self.req.score:
            return False
        return self.next_input is not None or self.prefilled + len(inp) >= len(self.req.prompt_ids)

    def may_sample(self, ahead: int, max_context: int) -> bool:
        """Whether it is still sampling `ahead` tokens from now before `max_tokens` or the context ends it."""
        done = len(self.tokens) + ahead
        return done <= self.req.params.max_tokens and len(self.req.prompt_ids) + done <= max_context

    def accept(self, token: int, logits: torch.Tensor | None, max_context: int) -> TokenEvent:
        """The event for `token`, sampled for this sequence (logits [1, V]: needed when the request asks for
        logprobs); its `finish_reason` is set when the token ends the sequence (an EOS is not emitted)."""
        r = self.req
        first = not self.tokens and self.next_input is None
        if self.grammar is not None and not self.grammar.advance(token):  # sampled under its mask: never
            return self.finish("abort", first, StrataError(f"the response format's grammar refused token {token}"))
        if token in self.eos:
            return self.finish("stop", first=first)
        self.tokens.append(token)
        self.next_input = token
        lp, top = None, None
        if r.logprobs is not None:
            lp, top = token_logprob(logits[0], token, r.logprobs)
        text, stopped = self.stopper.feed(self.decoder.push(token) if self.decoder is not None else "")
        n_prompt = len(r.prompt_ids)
        ev = TokenEvent(r.request_id, token, text, lp, top, prompt_tokens=n_prompt, completion_tokens=len(self.tokens),
                        cached_tokens=self.cached)
        if first:
            self._attach_prompt_logprobs(ev)
        if stopped:
            ev.finish_reason = "stop"
        elif self.grammar is not None and self.grammar.done:  # the JSON is complete
            ev.text += self.flush()
            ev.finish_reason = "stop"
        elif not self.may_sample(1, max_context):
            ev.text += self.flush()
            ev.finish_reason = "length"
        return ev

    def finish(self, reason: str, first: bool = False, error: BaseException | None = None) -> TokenEvent:
        """The last event of a sequence ended by `reason` ("stop": the held-back text comes with it; "abort",
        with the `error` that failed its step if one did)."""
        r = self.req
        text = self.flush() if reason == "stop" else ""
        ev = TokenEvent(r.request_id, None, text, finish_reason=reason, prompt_tokens=len(r.prompt_ids),
                        completion_tokens=len(self.tokens), cached_tokens=self.cached,
                        error=str(error) if error is not None else None, exception=error)
        if first:
            self._attach_prompt_logprobs(ev)
        if r.score and reason == "stop":
            ev.scores = torch.cat(self.scores)
        return ev

    def flush(self) -> str:
        """The text still held back: an incomplete character, or a tail that could have begun a stop string."""
        text, stopped = self.stopper.feed(self.decoder.flush() if self.decoder is not None else "")
        return text if stopped else text + self.stopper.flush()

    def _attach_prompt_logprobs(self, ev: TokenEvent) -> None:
        if self.prompt_lp is not None:
            ev.prompt_logprobs, ev.prompt_top_logprobs = self.prompt_lp.values, self.prompt_lp.top


def plan_pass(seqs: list[Sequence], prompt_budget: int) -> list[tuple[Sequence, list[int], int]]:
    """(seq, input ids, start position) for one forward pass of `seqs`: every decode token, then prompt chunks in
    arrival order within `prompt_budget` tokens (each from where its prompt's cached or computed part ends)."""
    plan = [(s, [s.next_input], len(s.req.prompt_ids) + len(s.tokens) - 1) for s in seqs if s.next_input is not None]
    for seq in seqs:
        remaining = len(seq.req.prompt_ids) - seq.prefilled
        if seq.next_input is None and remaining > 0 and prompt_budget > 0:
            n = min(remaining, prompt_budget)
            plan.append((seq, seq.req.prompt_ids[seq.prefilled : seq.prefilled + n], seq.prefilled))
            prompt_budget -= n
    return plan
