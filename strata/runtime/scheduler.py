"""Continuous batching with chunked prefill: many requests share every forward pass.

One background thread runs steps. Each step takes, within a token budget, one decode token from
every running sequence plus prompt chunks of sequences still prefilling, runs them as one flat
`StepBatch` through the model, samples each sequence's next token with its own generator, and
streams events back. New requests join at the next step; finished or cancelled ones leave at once
and free their KV-cache slot. A long prompt is prefilled in chunks interleaved with the decode steps
of the running sequences; while any sequence decodes, a `PrefillPacer` sizes those chunks from
measured step times so every decoding user's gap between two tokens stays under
`runtime.decode_gap_target` seconds.

With `runtime.overlap_decode` (on CUDA by default), a step of decode tokens only is queued before the host
reads the tokens it is fed: its inputs are the last step's tokens, sampled on the device, and the host emits
those while the GPU runs it (strata.runtime.overlap). Steps chain so while the running set stays the same and
nobody waits for a free slot; anything else (a newcomer, a prompt chunk, logprobs, a reproducible request, a
sequence one token from its limit) lands the step in flight first and plans as before.

Reproducible requests (`GenRequest.reproducible`) never share a forward pass: each runs in a batch
of its own, prompt chunks of the fixed `runtime.prefill_chunk` size whatever the load, with the
tiered expert compute on its reproducible path (cold experts on the GPU or the reference math), so
its tokens are bit-identical alone, inside any mix of other requests, and to `Engine.generate`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from strata.errors import RequestError, StrataError
from strata.runtime.detokenize import StopMatcher, StreamDecoder
from strata.runtime.kv_cache import KVCache, StepBatch
from strata.runtime.logprobs import PromptLogprobs, token_logprob
from strata.runtime.overlap import QueuedStep, queue_decode
from strata.runtime.pacing import PrefillPacer
from strata.runtime.requests import (  # noqa: F401 - re-exported: the public names live here too
    MAX_LOGPROBS,
    GenRequest,
    QueueFullError,
    RequestHandle,
    TokenEvent,
)
from strata.runtime.sampler import make_generator, sample


@dataclass
class _Seq:
    handle: RequestHandle
    slot: int
    generator: torch.Generator
    decoder: StreamDecoder
    stopper: StopMatcher
    eos: set[int]
    prefilled: int = 0  # prompt tokens already in the cache
    tokens: list[int] = field(default_factory=list)  # generated so far
    next_input: int | None = None  # sampled, not yet fed
    prompt_lp: PromptLogprobs | None = None  # each prompt token's, when the request asks for them

    @property
    def req(self) -> GenRequest:
        return self.handle.request


def _samples(seq: _Seq, inp: list[int]) -> bool:
    """Whether `seq`'s row of a pass fed `inp` yields a token: a decode token, or its prompt's last chunk."""
    return seq.next_input is not None or seq.prefilled + len(inp) >= len(seq.req.prompt_ids)


@dataclass
class _InFlight:
    """A decode-only step of `seqs` queued on the device whose sampled tokens the host has not read yet."""

    seqs: list[_Seq]
    starts: list[int]  # the position each sequence's input token was fed at
    step: QueuedStep


class Scheduler:
    """Runs an engine's model for many requests at once on a background thread."""

    def __init__(self, engine, max_batch: int = 8, token_budget: int = 2048, max_queue: int = 64,
                 decode_gap_target: float | None = None, prefill_chunk_min: int | None = None):
        if max_batch < 1 or token_budget < max_batch or max_queue < 1:
            raise StrataError("scheduler needs max_batch >= 1, token_budget >= max_batch and max_queue >= 1")
        self.engine, self.max_batch, self.token_budget, self.max_queue = engine, max_batch, token_budget, max_queue
        rt = engine.config.runtime
        gap = rt.decode_gap_target if decode_gap_target is None else decode_gap_target
        chunk_min = rt.prefill_chunk_min if prefill_chunk_min is None else prefill_chunk_min
        if gap < 0 or chunk_min < 1:
            raise StrataError("scheduler needs decode_gap_target >= 0 (seconds) and prefill_chunk_min >= 1")
        # a step nobody decodes in carries up to runtime.prefill_chunk prompt tokens (what Engine.generate's
        # prefill takes per pass), so a long prompt alone prefills in as few chunks as there, each cold expert
        # crossing PCIe once per chunk; steps with decoding sequences keep to the token budget and the pacer
        self.pacer = PrefillPacer(token_budget, gap, chunk_min, idle_budget=engine.prefill_chunk)
        self.repro_chunk = engine.prefill_chunk  # reproducible prompts: Engine.generate's chunking, whatever the load
        self._step_log: deque[dict] = deque(maxlen=512)  # recent steps, for benchmarks and diagnosis
        self.cache = KVCache(engine.checkpoint.config, max_batch, engine.max_context, engine.dtype, engine.device)
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[_Seq] = []
        self._free = list(range(max_batch - 1, -1, -1))
        self._cv = threading.Condition()
        self._stop = False
        self._drain = True
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._step_tokens = 0
        self.overlap = engine.overlap_decode  # runtime.overlap_decode, resolved
        self._pending: _InFlight | None = None  # the decode step in flight (overlapped decode)
        self._landed_at = 0.0  # perf_counter() when the last in-flight step's tokens were read
        self.chained_steps = 0  # steps queued behind one whose tokens were not read yet

    # ---- caller side ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="strata-scheduler", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = 60) -> None:
        """Finish (drain) or cancel everything in flight, then stop the thread."""
        with self._cv:
            self._stop, self._drain = True, drain
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: GenRequest) -> RequestHandle:
        """Queue a request; `QueueFullError` when the bounded queue is full."""
        return self.submit_together([request])[0]

    def submit_together(self, requests: list[GenRequest]) -> list[RequestHandle]:
        """Queue `requests` at once, so the step that admits the first admits them all (as KV slots allow): all
        are checked first, and all or none are queued (`QueueFullError` when the queue lacks room for them all)."""
        for request in requests:
            self._check(request)
        handles = [RequestHandle(r) for r in requests]
        with self._cv:
            if self._stop:
                raise StrataError("the scheduler is shutting down")
            if len(self._waiting) + len(handles) > self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._waiting.extend(handles)
            self._cv.notify()
        return handles

    def _check(self, request: GenRequest) -> None:
        need = len(request.prompt_ids) + request.params.max_tokens
        ctx = self.engine.max_context
        if len(request.prompt_ids) >= ctx or need > ctx:
            raise RequestError(
                f"context_length_exceeded: the prompt ({len(request.prompt_ids)} tokens) plus max_tokens "
                f"({request.params.max_tokens}) exceed the context of {ctx} tokens; shorten the prompt or lower max_tokens"
            )
        self.engine.check_token_ids(request.prompt_ids)

    def stats(self) -> dict:
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._waiting), "kv_slots_free": len(self._free),
                    "max_batch": self.max_batch, "token_budget": self.token_budget, "steps": self._steps,
                    "mean_tokens_per_step": self._step_tokens / self._steps if self._steps else 0.0,
                    "reproducible_running": sum(1 for s in self._running if s.req.reproducible),
                    "overlap_decode": self.overlap, "chained_steps": self.chained_steps,
                    **self.pacer.snapshot()}

    def recent_steps(self) -> list[dict]:
        """The last steps (up to 512): wall-clock end `t` (time.time()), `seconds`, `decode` and `prompt`
        tokens, forward `passes`, and the prompt `allowance` the pacer gave."""
        with self._cv:
            return list(self._step_log)

    # ---- the step loop ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop and (not self._drain or (not self._waiting and not self._running)):
                    self._pending = None  # its sequences are aborted below; the device finishes it on its own
                    for seq in self._running:
                        self._finish(seq, "abort")
                    while self._waiting:
                        self._waiting.popleft()._push(TokenEvent("", None, "", finish_reason="abort"))
                    return
                self._admit()
            self._drop_cancelled()
            if self._running:
                try:
                    with self.engine._lock:
                        self._step()
                except Exception as e:  # a real fault: fail the batch's requests, keep serving others
                    import logging

                    logging.getLogger("strata").exception("scheduler step failed")
                    self._pending = None
                    for seq in list(self._running):
                        self._finish(seq, "abort", error=str(e))

    def _admit(self) -> None:
        while self._waiting and self._free:
            h = self._waiting.popleft()
            if h.cancelled.is_set():
                h._push(TokenEvent(h.request.request_id, None, "", finish_reason="abort"))
                continue
            r, tok = h.request, self.engine.tokenizer
            eos = set() if r.params.ignore_eos else self.engine.eos_token_ids | set(r.params.stop_token_ids)
            self.engine._counters.requests += 1
            self._running.append(_Seq(h, self._free.pop(), make_generator(r.params.seed, self.engine.device),
                                      StreamDecoder(tok), StopMatcher(r.params.stop), eos))
            if getattr(self.engine.model, "engram", None) is not None:  # the prompt's Engram rows, fetched now
                self.engine.model.engram.prefetch(r.prompt_ids)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.handle.cancelled.is_set()]:
            self._finish(seq, "abort")

    def _step(self) -> None:
        """One step: a forward pass over the shared batch, then one per reproducible sequence.

        Every decoding sequence gets one token per step; prompt chunks of the shared batch fill what the
        pacer allows (when nobody decodes, the larger of the token budget and `runtime.prefill_chunk`),
        reproducible prompts advance by the fixed `runtime.prefill_chunk`.
        """
        t0 = time.perf_counter()
        if self._pending is not None:
            p, self._pending = self._pending, None
            if self._chains(p):  # the next step goes first, fed p's tokens on the device; p's are read meanwhile
                self._pending = self._launch(p.seqs, [st + 1 for st in p.starts], p.step.tokens)
                self.chained_steps += 1
            self._land(p)
            if self._pending is not None or not self._running:
                return
            t0 = time.perf_counter()
        solo = [self._plan([s], self.repro_chunk) for s in self._running if s.req.reproducible]
        n_decode = sum(1 for s in self._running if s.next_input is not None)
        solo_prompt = sum(len(inp) for plan in solo for s, inp, _ in plan if s.next_input is None)
        allow = self.pacer.allowance(n_decode)
        if n_decode and self.pacer.enabled:  # reproducible chunks count against the step's allowance
            allow = max(allow - solo_prompt, min(self.pacer.min_chunk, allow))
        shared = self._plan([s for s in self._running if not s.req.reproducible], allow)
        if self.overlap and not solo and shared and all(s.next_input is not None and self._overlaps(s, 1)
                                                        for s, _, _ in shared):
            self._pending = self._launch([s for s, _, _ in shared], [st for _, _, st in shared], None)
            return
        n_prompt, passes = 0, 0
        for plan, reproducible in [(shared, False)] + [(p, True) for p in solo]:
            if plan:
                n_prompt += sum(len(inp) for s, inp, _ in plan if s.next_input is None)
                passes += 1
                self._forward(plan, reproducible)
        if not passes:
            return
        self._record_step(time.perf_counter() - t0, n_decode, n_prompt, passes, allow)  # sampling included

    def _record_step(self, dt: float, n_decode: int, n_prompt: int, passes: int, allow: int) -> None:
        """A finished step, `dt` seconds (the gap a decoding user sees): the pacer's sample and the step log."""
        self.pacer.observe(n_decode, n_prompt, dt)
        with self._cv:
            self._steps += 1
            self._step_tokens += n_decode + n_prompt
            self._step_log.append({"t": time.time(), "seconds": dt, "decode": n_decode, "prompt": n_prompt,
                                   "passes": passes, "allowance": allow})

    def _plan(self, seqs: list[_Seq], prompt_budget: int) -> list[tuple[_Seq, list[int], int]]:
        """(seq, input ids, start position) for one forward pass: every decode token, then prompt chunks in
        arrival order within `prompt_budget` tokens."""
        plan = [(s, [s.next_input], len(s.req.prompt_ids) + len(s.tokens) - 1) for s in seqs if s.next_input is not None]
        for seq in seqs:
            remaining = len(seq.req.prompt_ids) - seq.prefilled
            if seq.next_input is None and remaining > 0 and prompt_budget > 0:
                n = min(remaining, prompt_budget)
                plan.append((seq, seq.req.prompt_ids[seq.prefilled : seq.prefilled + n], seq.prefilled))
                prompt_budget -= n
        return plan

    def _forward(self, plan: list[tuple[_Seq, list[int], int]], reproducible: bool) -> None:
        """Run `plan` as one flat batch, sample, and emit (reproducible: the expert compute's exact path)."""
        t0 = time.perf_counter()
        ids = torch.tensor([t for _, inp, _ in plan for t in inp], dtype=torch.long, device=self.engine.device)
        batch = StepBatch([s.slot for s, _, _ in plan], [st for _, _, st in plan], [len(inp) for _, inp, _ in plan])
        compute = self.engine._compute
        was = getattr(compute, "reproducible", False)
        if compute is not None:
            compute.reproducible = reproducible or was
        try:
            with torch.inference_mode():
                hidden = self.engine.model(ids, batch, self.cache)
                rows = batch.last_token_rows()
                logits = self.engine.model.logits(hidden[rows])  # [B, V] fp32
                for i, (seq, inp, start) in enumerate(plan):
                    if seq.next_input is None and seq.req.prompt_logprobs is not None:
                        off = batch.offsets[i]
                        if seq.prompt_lp is None:
                            seq.prompt_lp = PromptLogprobs(seq.req.prompt_logprobs)
                        seq.prompt_lp.feed(seq.req.prompt_ids, self.engine.model.logits(hidden[off : off + len(inp)]),
                                           start, len(inp))
                # every row that yields a token is sampled on the device first, each with its own generator (so the
                # order is free), and read back once: one wait for the GPU a step, not one a sequence
                rows_out = [i for i, (seq, inp, _) in enumerate(plan) if _samples(seq, inp)]
                drawn = [sample(logits[i : i + 1], plan[i][0].req.params, plan[i][0].generator) for i in rows_out]
                if (graphs := self.engine.model.graphs) is not None:
                    graphs.step_queued()  # all of the step is queued (sampling too): its books run while the GPU works
                tokens = dict(zip(rows_out, torch.cat(drawn).tolist() if drawn else [], strict=True))
        finally:
            if compute is not None:
                compute.reproducible = was
        # the engine's counters (engine.stats(), the dashboard) see batched traffic too
        c, dt = self.engine._counters, time.perf_counter() - t0
        n_decode = sum(1 for s, _, _ in plan if s.next_input is not None)
        c.generated_tokens += n_decode
        c.decode_tokens += n_decode
        c.prompt_tokens += len(ids) - n_decode
        if n_decode:
            c.decode_seconds += dt
        else:
            c.prefill_seconds += dt
        for i, (seq, inp, _) in enumerate(plan):
            if seq.next_input is None:  # a prompt chunk
                seq.prefilled += len(inp)
            if i in tokens:
                self._accept(seq, tokens[i], logits[i : i + 1])

    # ---- overlapped decode (runtime.overlap_decode) ---------------------------------------------------
    def _overlaps(self, seq: _Seq, ahead: int) -> bool:
        """Whether `seq` may decode in a step whose tokens are read later: not reproducible, no logprobs (those
        need the logits on the host), and still sampling `ahead` tokens from now before its limits."""
        r = seq.req
        done = len(seq.tokens) + ahead
        return (not r.reproducible and r.logprobs is None and done <= r.params.max_tokens
                and len(r.prompt_ids) + done <= self.engine.max_context)

    def _chains(self, p: _InFlight) -> bool:
        """Whether the next step may be queued behind `p` before its tokens are read: the running set is still
        `p`'s (none finished, cancelled, prefilling or admitted), nobody waits for a free slot, and every
        sequence samples at least two more tokens (p's and the next one's)."""
        if self._waiting and self._free:
            return False
        run = self._running
        return (len(run) == len(p.seqs) and all(a is b for a, b in zip(run, p.seqs, strict=True))
                and all(self._overlaps(s, 2) for s in run))

    def _launch(self, seqs: list[_Seq], starts: list[int], tokens: torch.Tensor | None) -> _InFlight:
        """Queue a decode step of `seqs` (inputs: `tokens` [B] on the device, else each `next_input`) and the
        sampling of its tokens, and start reading them back; returns without waiting for the device."""
        dev = self.engine.device
        ids = tokens if tokens is not None else torch.tensor([s.next_input for s in seqs], dtype=torch.long, device=dev)
        step = queue_decode(self.engine.model, self.cache, [s.slot for s in seqs], starts, ids,
                            [(s.req.params, s.generator) for s in seqs])
        return _InFlight(seqs, starts, step)

    def _land(self, p: _InFlight) -> None:
        """Read `p`'s tokens and emit them; sequences that finished or were cancelled meanwhile are skipped."""
        tokens = p.step.read.tolist()
        now = time.perf_counter()
        dt = now - max(p.step.queued, self._landed_at)
        self._landed_at = now
        live = [(seq, tok) for seq, tok in zip(p.seqs, tokens, strict=True) if any(seq is s for s in self._running)]
        c = self.engine._counters
        c.generated_tokens += len(live)
        c.decode_tokens += len(live)
        c.decode_seconds += dt
        for seq, token in live:
            self._accept(seq, token, None)
        self._record_step(dt, len(live), 0, 1, 0)

    def _accept(self, seq: _Seq, token: int, logits: torch.Tensor | None) -> None:
        """Emit `token`, sampled for `seq` (logits [1, V]: needed when the request asks for logprobs), or finish."""
        r = seq.req
        first = not seq.tokens and seq.next_input is None
        if token in seq.eos:
            self._finish(seq, "stop", first=first)
            return
        seq.tokens.append(token)
        seq.next_input = token
        lp, top = None, None
        if r.logprobs is not None:
            lp, top = token_logprob(logits[0], token, r.logprobs)
        text, stopped = seq.stopper.feed(seq.decoder.push(token))
        n_prompt = len(r.prompt_ids)
        ev = TokenEvent(r.request_id, token, text, lp, top, prompt_tokens=n_prompt, completion_tokens=len(seq.tokens))
        if first:
            self._attach_prompt_logprobs(seq, ev)
        if stopped:
            ev.finish_reason = "stop"
            self._release(seq)
        elif len(seq.tokens) >= r.params.max_tokens or n_prompt + len(seq.tokens) >= self.engine.max_context:
            ev.text += self._flush(seq)
            ev.finish_reason = "length"
            self._release(seq)
        seq.handle._push(ev)

    def _flush(self, seq: _Seq) -> str:
        text, stopped = seq.stopper.feed(seq.decoder.flush())
        return text if stopped else text + seq.stopper.flush()

    def _attach_prompt_logprobs(self, seq: _Seq, ev: TokenEvent) -> None:
        if seq.prompt_lp is not None:
            ev.prompt_logprobs, ev.prompt_top_logprobs = seq.prompt_lp.values, seq.prompt_lp.top

    def _finish(self, seq: _Seq, reason: str, first: bool = False, error: str | None = None) -> None:
        r = seq.req
        text = self._flush(seq) if reason == "stop" else ""
        ev = TokenEvent(r.request_id, None, text, finish_reason=reason, prompt_tokens=len(r.prompt_ids),
                        completion_tokens=len(seq.tokens), error=error)
        if first:
            self._attach_prompt_logprobs(seq, ev)
        self._release(seq)
        seq.handle._push(ev)

    def _release(self, seq: _Seq) -> None:
        if seq in self._running:
            self._running.remove(seq)
            with self._cv:
                self._free.append(seq.slot)

