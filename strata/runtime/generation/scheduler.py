"""Continuous batching with chunked prefill: the one generation loop, which every request runs on.

`Engine.generate`, `stream`, `chat` and `score` submit to the engine's scheduler (`Engine.scheduler()`), as the
server does, so their requests share its steps: streams on several threads, or several on one thread consumed in
turn, decode together, and the engine's KV cache is this scheduler's `max_batch` slots (what the planner sized).

A background thread runs steps while there is work (and exits when there is none, so an idle engine holds no
thread). It is no daemon: it often drops the last reference to its engine, and a daemon thread freeing tensors while
the interpreter exits is stopped inside torch, which aborts the process. At exit every scheduler stops (what runs is
cancelled) and the interpreter waits for its thread to end. Each step takes, within a token budget, one decode token
from every running sequence plus prompt chunks of sequences still prefilling, runs them as one flat `StepBatch`
through the model, samples each sequence's next token with its own generator (strata.runtime.generation.passes),
and streams events back. New requests join at the next step; finished or cancelled ones leave at once and free their
KV-cache slot, whose rows stay there for later prompts that share their prefix (strata.runtime.generation.prefix_cache:
a newcomer starts where the longest shared prefix of any slot, finished or running, ends; `runtime.prefix_cache`). A
long prompt is prefilled in chunks interleaved with the decode steps of the running sequences; while any sequence
decodes, a `PrefillPacer` sizes those chunks from measured step times so every decoding user's gap between two tokens
stays under `runtime.decode_gap_target` seconds.
Every forward pass runs under the engine's `step_lock`, so other schedulers of the same engine (tests, benchmarks)
never race this one.

With `[debug] overlap_decode` (on CUDA by default), a step of decode tokens only is queued before the host
reads the tokens it is fed: its inputs are the last step's tokens, sampled on the device, and the host emits
those while the GPU runs it (strata.runtime.generation.overlap, .decode_chain). Steps chain so while the running set stays the same and
nobody waits for a free slot; anything else (a newcomer, a prompt chunk, logprobs, a reproducible request, a
sequence one token from its limit) lands the step in flight first and plans as before.

Reproducible requests (`GenRequest.reproducible`) never share a forward pass: each runs in a batch
of its own, prompt chunks of the fixed `runtime.prefill_chunk` size whatever the load, with the
tiered expert compute on its reproducible path (cold experts on the GPU or the reference math), so
its tokens are bit-identical alone and inside any mix of other requests. Score requests (`GenRequest.score`)
also prefill in passes of their own, in chunks of `Engine.score_chunk` tokens, keeping every position's
log-probabilities.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

import torch

from strata.errors import StrataError
from strata.runtime.generation.decode_chain import DecodeChain, InFlight
from strata.runtime.generation.grammar import GrammarBatch
from strata.runtime.generation.pacing import PrefillPacer
from strata.runtime.generation.passes import Pass, plan_step, run_pass
from strata.runtime.generation.prefix_cache import kv_slots
from strata.runtime.generation.requests import (  # noqa: F401 - re-exported: the public names live here too
    MAX_LOGPROBS,
    GenRequest,
    QueueFullError,
    RequestHandle,
    TokenEvent,
    check_request,
)
from strata.runtime.generation.sequence import Sequence
from strata.runtime.generation.step_log import StepLog
from strata.runtime.model.kv_cache import KVCache

log = logging.getLogger("strata")

_running_schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # those that started a step thread


def _stop_at_exit() -> None:
    """Cancel what every scheduler runs, before the interpreter joins their (non-daemon) step threads at exit."""
    for scheduler in list(_running_schedulers):
        scheduler.stop(drain=False, timeout=30)


threading._register_atexit(_stop_at_exit)  # runs before non-daemon threads are joined (as concurrent.futures' does)


class Scheduler:
    """Runs an engine's model for many requests at once on a background thread.

    `Engine.scheduler()` gives the engine's own (the one its generate/stream/chat/score use); one built here
    directly has a KV cache of its own and shares only the engine's step lock and statistics."""

    def __init__(self, engine, max_batch: int = 8, token_budget: int = 2048, max_queue: int = 64,
                 decode_gap_target: float | None = None, prefill_chunk_min: int | None = None):
        # held weakly (the step thread holds it while it runs): an engine its user dropped is released, as
        # before it had a scheduler, instead of living on in a cycle with the scheduler it owns
        self._engine = weakref.ref(engine)
        self.repro_chunk = engine.prefill_chunk  # reproducible prompts: the fixed runtime.prefill_chunk, whatever the load
        self.score_chunk = engine.score_chunk  # score requests keep every position's logits: smaller chunks
        self.step_log = StepLog()  # every step counted, the recent ones kept
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[Sequence] = []
        self._cv = threading.Condition()
        self._started = False
        self._stop = False
        self._drain = True
        self._thread: threading.Thread | None = None
        self.overlap = engine.overlap_decode  # [debug] overlap_decode, resolved
        # the card this scheduler's thread runs on: "cuda" without an index means the creating thread's current card
        self._card = engine.device if engine.device.type != "cuda" or engine.device.index is not None else \
            torch.device("cuda", torch.cuda.current_device())
        self._chain = DecodeChain()  # the decode step in flight (overlapped decode)
        self._grammars = GrammarBatch()  # a step's rows with response formats, masked together
        self.cache: KVCache | None = None
        self._settings: tuple = (0, None, None, None, None)  # what `configure` takes, in its order
        rt = engine.config.runtime
        self.configure(max_batch, token_budget, max_queue,
                       rt.decode_gap_target if decode_gap_target is None else decode_gap_target,
                       rt.prefill_chunk_min if prefill_chunk_min is None else prefill_chunk_min)

    def configure(self, max_batch: int | None = None, token_budget: int | None = None, max_queue: int | None = None,
                  decode_gap_target: float | None = None, prefill_chunk_min: int | None = None) -> None:
        """Change the scheduler's sizes (None keeps one): `max_batch` KV slots (a new KV cache when it changes),
        `token_budget` tokens a step, `max_queue` requests waiting, the pacer's `decode_gap_target` (seconds; 0
        lets chunks fill the budget) and `prefill_chunk_min`. A change needs the scheduler idle."""
        given = (max_batch, token_budget, max_queue, decode_gap_target, prefill_chunk_min)
        with self._cv:
            new = tuple(old if g is None else g for g, old in zip(given, self._settings, strict=True))
            if new == self._settings:
                return
            batch, budget, queue_len, gap, chunk_min = new
            if batch < 1 or budget < batch or queue_len < 1:
                raise StrataError("scheduler needs max_batch >= 1, token_budget >= max_batch and max_queue >= 1")
            if gap < 0 or chunk_min < 1:
                raise StrataError("scheduler needs decode_gap_target >= 0 (seconds) and prefill_chunk_min >= 1")
            if self._waiting or self._running:
                raise StrataError(f"the scheduler has {len(self._running) + len(self._waiting)} request(s) in flight; "
                                  "change its sizes while it is idle")
            # a step nobody decodes in carries up to runtime.prefill_chunk prompt tokens (the chunk the planner
            # sized the activations for), so a long prompt alone prefills in as few chunks as that allows, each cold
            # expert crossing PCIe once per chunk; steps with decoding sequences keep to the budget and the pacer
            self.pacer = PrefillPacer(budget, gap, chunk_min, idle_budget=self.engine.prefill_chunk)
            if batch != self._settings[0]:
                self._chain.pending, self.cache = None, None  # the old slots are freed before the new ones are taken
                self.cache, self.prefix = kv_slots(self.engine, batch, self.repro_chunk)
            self._settings = new
            self.max_batch, self.token_budget, self.max_queue = batch, budget, queue_len

    # ---- caller side ------------------------------------------------------------------------
    @property
    def engine(self):
        """The engine whose model this scheduler runs."""
        engine = self._engine()
        if engine is None:
            raise StrataError("this scheduler's engine was dropped; keep a reference to the engine while it serves")
        return engine

    @property
    def chained_steps(self) -> int:
        """Overlapped decode: steps queued behind one whose tokens were not read yet."""
        return self._chain.chained_steps

    @property
    def started(self) -> bool:
        """Whether it takes requests off the queue (`start()` was called, `stop()` not since)."""
        return self._started and not self._stop

    def start(self) -> None:
        """Take requests off the queue from now on (a thread runs steps whenever there are any)."""
        with self._cv:
            self._started, self._stop = True, False
            self._wake()

    def stop(self, drain: bool = True, timeout: float | None = 60) -> None:
        """Finish (drain) or cancel everything in flight, then stop taking requests until `start()`; requests
        still queued on a scheduler that was never started are cancelled."""
        with self._cv:
            self._stop, self._drain = True, drain
            thread = self._thread
            if thread is None:
                self._abort_waiting()
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._cv:
            self._started = False

    def submit(self, request: GenRequest, asynchronous: bool | None = None) -> RequestHandle:
        """Queue a request; `QueueFullError` when the bounded queue is full. `asynchronous`: see `RequestHandle`."""
        return self.submit_together([request], asynchronous)[0]

    def submit_together(self, requests: list[GenRequest], asynchronous: bool | None = None) -> list[RequestHandle]:
        """Queue `requests` at once, so the step that admits the first admits them all (as KV slots allow): all
        are checked first, and all or none are queued (`QueueFullError` when the queue lacks room for them all)."""
        for request in requests:
            check_request(self.engine, request)
        handles = [RequestHandle(r, asynchronous) for r in requests]
        with self._cv:
            if self._stop:
                raise StrataError("the scheduler is shutting down")
            if len(self._waiting) + len(handles) > self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._waiting.extend(handles)
            self._wake()
        return handles

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request: one still queued ends (with an "abort" event) now, a running one leaves the batch and
        frees its KV slot at the next step."""
        handle.cancel()
        with self._cv:
            if handle in self._waiting:
                self._waiting.remove(handle)
                handle.deliver(TokenEvent(handle.request.request_id, None, "", finish_reason="abort"))

    def stats(self) -> dict:
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._waiting), "kv_slots_free": self.prefix.free,
                    "max_batch": self.max_batch, "token_budget": self.token_budget, **self.step_log.snapshot(),
                    "reproducible_running": sum(1 for s in self._running if s.req.reproducible),
                    "overlap_decode": self.overlap, "chained_steps": self.chained_steps,
                    "prefix_cache": self.prefix.stats(), **self.pacer.snapshot()}

    def recent_steps(self) -> list[dict]:
        """The last steps (up to 512): see `StepLog.recent`."""
        return self.step_log.recent()

    # ---- the step loop ------------------------------------------------------------------------
    def _wake(self) -> None:
        """(Holding `_cv`.) Start the step thread if requests wait and none runs."""
        if self._started and not self._stop and self._thread is None and (self._waiting or self._running):
            self._thread = threading.Thread(target=self._run, name="strata-scheduler")
            _running_schedulers.add(self)
            self._thread.start()

    def _abort_waiting(self, error: BaseException | None = None) -> None:
        while self._waiting:
            h = self._waiting.popleft()
            h.deliver(TokenEvent(h.request.request_id, None, "", finish_reason="abort",
                                 error=str(error) if error is not None else None, exception=error))

    def _run(self) -> None:
        try:
            engine = self.engine  # alive while this thread has requests to run
            if engine.device.type == "cuda":  # this thread's streams, events and graphs on the engine's card
                torch.cuda.set_device(self._card)
            while self._next_step():
                pass
        except BaseException as e:  # noqa: BLE001 - outside a step (admission): nothing may wait forever
            log.exception("scheduler failed")
            with self._cv:
                self._chain.pending = None
                for seq in list(self._running):
                    self._finish(seq, "abort", error=e)
                self._abort_waiting(e)
        finally:
            with self._cv:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _next_step(self) -> bool:
        """Admit, drop the cancelled, run one step; False (the thread ends) when nothing is left or stop says so."""
        with self._cv:
            if (not self._waiting and not self._running) or (self._stop and not self._drain):
                self._chain.pending = None  # its sequences are aborted below; the device finishes it on its own
                for seq in list(self._running):
                    self._finish(seq, "abort")
                self._abort_waiting()
                self._thread = None  # decided under the lock: a request queued from now on starts a new thread
                return False
            self._admit()
        self._drop_cancelled()
        if self._running:
            try:
                with self.engine.step_lock:
                    self._step()
            except Exception as e:  # a real fault: fail the batch's requests, keep serving others
                log.exception("scheduler step failed")
                self._chain.pending = None
                for seq in list(self._running):
                    self._finish(seq, "abort", error=e)
        return True

    def _admit(self) -> None:
        e = self.engine
        while self._waiting and self.prefix.free:
            h = self._waiting.popleft()
            if h.cancelled.is_set():
                h.deliver(TokenEvent(h.request.request_id, None, "", finish_reason="abort"))
                continue
            r = h.request
            e.counters.admitted()
            seq = Sequence.begin(h, e.tokenizer, e.eos_token_ids, e.device)
            # score and prompt-logprobs requests need every prompt position's logits: they compute the whole prompt
            reuse = r.prefix_cache and not r.score and r.prompt_logprobs is None
            grant = self.prefix.admit(seq, r.prompt_ids, r.reproducible, reuse)
            seq.slot = grant.slot
            seq.prefilled = seq.cached = seq.written = grant.hit
            self._running.append(seq)
            # the prompt's Engram rows, fetched now (a score request reads them as its passes reach each layer: it
            # prefills at once, in passes of its own)
            if getattr(e.model, "engram", None) is not None and not r.score:
                e.model.engram.prefetch(r.prompt_ids)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.handle.cancelled.is_set()]:
            self._finish(seq, "abort")

    def _step(self) -> None:
        """One step: a forward pass over the shared batch, then one per reproducible or score sequence.

        Every decoding sequence gets one token per step; prompt chunks of the shared batch fill what the
        pacer allows (when nobody decodes, the larger of the token budget and `runtime.prefill_chunk`),
        reproducible prompts advance by the fixed `runtime.prefill_chunk`, score prompts by `score_chunk`.
        """
        t0, chain, ctx = time.perf_counter(), self._chain, self.engine.max_context
        if chain.pending is not None:
            p, chain.pending = chain.pending, None
            chain.finish(p, self._grammars)
            if chain.chains(p, self._running, bool(self._waiting and self.prefix.free), ctx):
                # the next step goes first, fed p's tokens on the device; p's are read meanwhile
                chain.pending = chain.launch(self.engine.model, self.cache, p.seqs, [st + 1 for st in p.starts],
                                             p.step.tokens)
                chain.chained_steps += 1
            self._land(p)
            if chain.pending is not None or not self._running:
                return
            t0 = time.perf_counter()
        step = plan_step(self._running, self.pacer, self.repro_chunk, self.score_chunk)
        shared = step.shared
        if self.overlap and not step.solo and shared and all(s.next_input is not None and chain.overlaps(s, 1, ctx)
                                                             for s, _, _ in shared):
            ids = torch.tensor([s.next_input for s, _, _ in shared], dtype=torch.long, device=self.engine.device)
            chain.pending = chain.launch(self.engine.model, self.cache, [s for s, _, _ in shared],
                                         [st for _, _, st in shared], ids)
            return
        n_prompt, passes = 0, 0
        for plan, reproducible in [(shared, False), *step.solo]:
            if plan:
                n_prompt += sum(len(inp) for s, inp, _ in plan if s.next_input is None)
                passes += 1
                self._forward(plan, reproducible)
        if not passes:
            return
        self._record_step(time.perf_counter() - t0, step.n_decode, n_prompt, passes, step.allow)  # sampling included

    def _record_step(self, dt: float, n_decode: int, n_prompt: int, passes: int, allow: int) -> None:
        """A finished step, `dt` seconds (the gap a decoding user sees): the pacer's sample and the step log."""
        self.pacer.observe(n_decode, n_prompt, dt)
        self.step_log.record(dt, n_decode, n_prompt, passes, allow)

    def _forward(self, plan: Pass, reproducible: bool) -> None:
        """Run `plan` as one pass (reproducible: the expert compute's exact path), then emit its sampled tokens."""
        t0 = time.perf_counter()
        tokens, logits = run_pass(self.engine, self.cache, self._grammars, plan, reproducible)
        n_tokens = sum(len(inp) for _, inp, _ in plan)
        n_decode = sum(1 for s, _, _ in plan if s.next_input is not None)
        self.engine.counters.ran(n_tokens - n_decode, n_decode, time.perf_counter() - t0)
        self.prefix.count_computed(n_tokens - n_decode)
        for i, (seq, inp, start) in enumerate(plan):
            seq.written = seq.ring_at = start + len(inp)
            if seq.next_input is None:  # a prompt chunk
                seq.prefilled += len(inp)
                self.prefix.after_prompt_pass(seq.slot, seq.written, reproducible)
                if seq.req.score and seq.prefilled == len(seq.req.prompt_ids):
                    self._finish(seq, "stop")
            if i in tokens:
                self._accept(seq, tokens[i], logits[i : i + 1])

    def _land(self, p: InFlight) -> None:
        """Read the overlapped step `p`'s tokens and emit those of the sequences still running."""
        live, dt = self._chain.land(p, self._running)
        self.engine.counters.ran(0, len(live), dt)
        for seq, token in live:
            self._accept(seq, token, None)
        self._record_step(dt, len(live), 0, 1, 0)

    # ---- emitting ---------------------------------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, logits: torch.Tensor | None) -> None:
        """Emit `token`, sampled for `seq`; a token that ends the sequence frees its slot first."""
        ev = seq.accept(token, logits, self.engine.max_context)
        if ev.token_id is not None:
            self.engine.counters.emitted()
        if ev.finish_reason is not None:
            self._release(seq)
        seq.handle.deliver(ev)

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        ev = seq.finish(reason, error=error)
        self._release(seq, keep=error is None)
        seq.handle.deliver(ev)

    def _release(self, seq: Sequence, keep: bool = True) -> None:
        """Free `seq`'s slot; `keep`: its rows stay there for later prompts (not those of a failed step)."""
        if seq in self._running:
            self._running.remove(seq)
            keep = keep and seq.req.prefix_cache
            with self._cv:
                self.prefix.release(seq.slot, seq.cached_ids() if keep else None, seq.ring_at == seq.written)
