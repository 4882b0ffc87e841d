"""`Engine`: the public Python API — load a checkpoint, generate, stream, chat, score.

    from strata import Engine
    engine = Engine.from_pretrained("path/to/checkpoint")   # None: the embedded demo model
    out = engine.generate("Hello", max_tokens=32)
    out.text, out.token_ids, out.finish_reason

Every call runs on the engine's scheduler (`engine.scheduler()`, strata.runtime.generation.scheduler), the continuous-batching
loop the server runs on too: calls from several threads, and several streams open on one thread, share its steps,
as many at once as it has KV slots (`planner.max_batch`, which the planner sizes the KV cache for); the rest wait
their turn. A checkpoint without tokenizer files loads with `engine.tokenizer = None`: prompts are then token ids,
and the outputs carry `token_ids` (their text stays empty).
"""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from strata.config import StrataConfig, load_config
from strata.errors import RequestError, StrataError
from strata.kernels.cpu.library import release_openmp_workers
from strata.outputs import GenerationOutput, TextStream, request_failure
from strata.runtime.generation.counters import GenerationCounters
from strata.runtime.generation.grammar import Grammar, GrammarCompiler, ResponseFormat
from strata.runtime.generation.overlap import overlap_on
from strata.runtime.generation.prefill_chunk import resolve_prefill_chunk, score_chunk
from strata.runtime.generation.requests import GenRequest
from strata.runtime.generation.sampler import SamplingParams
from strata.runtime.generation.scheduler import Scheduler
from strata.runtime.generation.text.tokenizer import Tokenizer, load_tokenizer
from strata.runtime.offload.executor import ExpertExecutor
from strata.runtime.plan.build import LoadedModel, build_model
from strata.runtime.plan.card import close_loaded
from strata.runtime.plan.checkpoints.store_cache import model_path

DEFAULT_MAX_QUEUE = 64  # requests the engine's scheduler holds waiting for a KV slot


def _release(compute: ExpertExecutor | None, tiers, model) -> None:
    """What `Engine.close` frees: the CPU worker, the tier manager's threads and memory, the Engram row store."""
    close_loaded(compute, tiers, model)
    # from_pretrained froze the loaded objects; let the collector reclaim this engine's cycles (unfreezing is
    # process-wide: another open engine's objects are scanned again too, as before its freeze). At exit (an engine
    # never closed) this matters too: frozen objects are never freed, and extensions that check for leaks when
    # they unload (Triton's nanobind) then print hundreds of lines of "leaked instance" after the CLI's output
    gc.unfreeze()


class Engine:
    """A loaded model ready to generate. Build it with `Engine.from_pretrained`."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer | None, config: StrataConfig,
                 source: Path | None = None):
        self.checkpoint, self.tokenizer, self.config = loaded.checkpoint, tokenizer, config
        self.source = source or loaded.checkpoint.directory  # what was loaded: the checkpoint, not its store
        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.plan, self.tiers, self._compute = loaded.plan, loaded.manager, loaded.compute
        self.max_context = loaded.max_context
        # prompt tokens a prefill pass takes (runtime.prefill_chunk, "auto" resolved): the plan's, which `strata plan`
        # printed; resolved here when there is none (every expert in memory, or several cards)
        self.prefill_chunk = self.plan.prefill_chunk if self.plan is not None else resolve_prefill_chunk(
            config.runtime.prefill_chunk, self.checkpoint.config, self.device, config.planner.activation_reserve_bytes,
            self.max_context)
        # prompt tokens a pass of `score` takes: it keeps every position's logits too
        self.score_chunk = score_chunk(self.prefill_chunk, self.checkpoint.config.vocab_size,
                                       config.planner.activation_reserve_bytes)
        self.eos_token_ids = set(self.checkpoint.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else set())
        # [debug] overlap_decode resolved: each decode step queued before the host reads the token it is fed
        self.overlap_decode = overlap_on(config.debug.overlap_decode, self.device, len(config.runtime.devices))
        self.step_lock = threading.Lock()  # held while a forward pass runs: every scheduler of this engine takes it
        self.counters = GenerationCounters()  # what `stats()` reports; every scheduler of this engine records here
        # response formats compiled over the tokenizer (xgrammar, imported on first use), cached per schema
        self.grammars = GrammarCompiler(tokenizer, self.checkpoint.config.vocab_size, self.eos_token_ids) \
            if tokenizer is not None else None
        self._scheduler: Scheduler | None = None  # made on first use (`scheduler()`)
        self._scheduler_lock = threading.Lock()
        # an engine dropped or still open at exit is released then: before the interpreter kills the tier manager's
        # daemon threads, which inside a torch call aborts the process ("terminate called without an active exception")
        self._release = weakref.finalize(self, _release, self._compute, self.tiers, self.model)

    @property
    def executor(self) -> ExpertExecutor | None:
        """The tiered expert executor (strata.runtime.offload.executor: its rates, counters, prefetcher and one-graph
        decode's worker), for tools and benchmarks; None when every expert is in memory (`runtime.experts`)."""
        return self._compute

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike | None = None,
        config: str | os.PathLike | dict | StrataConfig | None = None,
        device: str = "auto",
        progress: bool = False,
    ) -> Engine:
        """Load a Hugging Face MoE checkpoint directory or a strata store (None: the embedded demo model).

        `config` is a TOML path, a dict of sections, or None for the defaults; `device` overrides
        `runtime.device` unless it is "auto". With tiered experts (the default) a checkpoint is packed
        into a store on first use (under `tiers.disk.path`) and the planner places its experts; a
        layout that cannot fit is refused here, before anything is loaded. A directory without tokenizer
        files loads with `tokenizer = None` (token-id prompts only).
        """
        cfg = load_config(config)
        if device != "auto":
            cfg.runtime.device = device
            cfg.runtime.__post_init__()
        if path is None:
            from strata.runtime.demo.model import ensure_default_model

            path = ensure_default_model(progress=progress)
        path = model_path(path)
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        loaded = build_model(path, cfg, progress=progress)
        try:
            tokenizer = load_tokenizer(loaded.checkpoint.directory)  # a store's copies follow its checkpoint's files
            engine = cls(loaded, tokenizer, cfg, source=path)
        except BaseException:  # a bad tokenizer file: the tiers' threads and memory are freed, not leaked
            _release(loaded.compute, loaded.manager, loaded.model)
            raise
        # Loading leaves hundreds of thousands of long-lived objects (store index, checksums, modules);
        # freezing them keeps Python's full collections, which would rescan them all, off the decode path.
        gc.collect()
        gc.freeze()
        # the model runs on the scheduler's thread: the OpenMP workers loading made here would slow every op there
        release_openmp_workers()
        return engine

    def scheduler(self, max_batch: int | None = None, token_budget: int | None = None, max_queue: int | None = None,
                  decode_gap_target: float | None = None) -> Scheduler:
        """The engine's continuous-batching scheduler: the one loop `generate`, `stream`, `chat`, `score` and the
        server run on, with the engine's KV cache (`max_batch` slots). Made on first use, with `planner.max_batch`
        slots (what the planner sized the KV cache for), a token budget of `runtime.prefill_chunk` and a queue of
        64; the arguments change those (None keeps a setting), which needs it idle. `decode_gap_target` (seconds;
        None: `runtime.decode_gap_target`) bounds a step's time while sequences decode by shrinking the prompt
        chunks that share it; 0 lets chunks fill `token_budget`. Start it (`start()`) to serve submitted requests
        (the engine's own calls start it)."""
        with self._scheduler_lock:
            if self._scheduler is None:
                batch = self.config.planner.max_batch if max_batch is None else max_batch
                self._scheduler = Scheduler(
                    self, max_batch=batch,
                    token_budget=max(self.prefill_chunk, batch) if token_budget is None else token_budget,
                    max_queue=DEFAULT_MAX_QUEUE if max_queue is None else max_queue,
                    decode_gap_target=decode_gap_target)
                release_openmp_workers()  # its buffers were filled here; the model runs on its own thread
            else:
                self._scheduler.configure(max_batch, token_budget, max_queue, decode_gap_target)
            return self._scheduler

    def close(self) -> None:
        """Cancel what the scheduler runs, stop the tier manager's threads and free its memory (the engine is
        unusable afterwards). Engines still open when the interpreter exits are closed then."""
        if self._scheduler is not None:
            self._scheduler.stop(drain=False)
        self._release()  # once: later calls do nothing
        self.tiers = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None, reproducible: bool = False,
                 response_format: ResponseFormat | dict | None = None) -> GenerationOutput:
        """Generate a completion of `prompt` (text, or token ids) and return it whole.

        Generation ends at an EOS or stop token (not emitted), a stop string (cut off), `max_tokens`, or the
        end of the context. `response_format` (OpenAI's dict, e.g. {"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}}}, or a `ResponseFormat`) holds the output to JSON (valid under the schema),
        ending it when the JSON is complete. `reproducible=True` computes the request in a forward pass of its own,
        with cold experts on the exact path (the GPU, or the CPU's reference math) instead of the fast CPU kernel; the
        tokens then equal those of a reproducible request served by the server bit for bit, whatever else runs.
        """
        with self.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                         stop=stop, stop_token_ids=stop_token_ids, reproducible=reproducible,
                         response_format=response_format) as pieces:
            for _ in pieces:
                pass
            return pieces.output

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None,
               stop_token_ids: list[int] | None = None, reproducible: bool = False,
               response_format: ResponseFormat | dict | None = None) -> TextStream:
        """Like `generate`, but return at once a `TextStream` of text pieces as tokens are produced (the request
        is queued now; it runs beside every other one, whether its pieces are read or not)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=stop, stop_token_ids=stop_token_ids or [], response_format=response_format)
        if not isinstance(reproducible, bool):
            raise RequestError(f"reproducible must be True or False, got {reproducible!r}")
        if params.stop and self.tokenizer is None:
            raise RequestError(self._no_tokenizer("stop strings need one; give stop_token_ids instead"))
        ids = self._encode_prompt(prompt)
        if len(ids) >= self.max_context:
            raise RequestError(
                f"prompt of {len(ids)} tokens leaves no room in the context of {self.max_context} tokens; "
                "shorten it or raise runtime.max_context"
            )
        params.max_tokens = min(params.max_tokens, self.max_context - len(ids))  # the context's end ends it
        sched = self._started_scheduler()
        handle = sched.submit(GenRequest(ids, params, reproducible=reproducible), asynchronous=False)
        return TextStream(sched, handle, GenerationOutput("", [], "length", prompt_tokens=len(ids)))

    def chat(self, messages: list[dict], **kwargs) -> GenerationOutput:
        """Apply the checkpoint's chat template to `messages` and generate the assistant's reply.

        Keyword arguments are those of `generate` (`reproducible=True` included)."""
        return self.generate(self.chat_prompt(messages), **kwargs)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The token ids of `messages` rendered by the checkpoint's chat template, ready for the assistant's reply."""
        if self.tokenizer is None:
            raise RequestError(self._no_tokenizer("chat needs one to apply its template"))
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Log-probabilities of the next token at every position: float32 [len(ids), vocab] on CPU.

        It runs on the scheduler like any request (in forward passes of its own, `score_chunk` tokens each)."""
        ids = self.check_token_ids(token_ids)
        if len(ids) > self.max_context:
            raise RequestError(f"{len(ids)} tokens exceed the context of {self.max_context}; raise runtime.max_context")
        sched = self._started_scheduler()
        handle = sched.submit(GenRequest(ids, SamplingParams(max_tokens=1), score=True), asynchronous=False)
        try:
            for ev in handle.iter_events():
                if ev.finish_reason == "abort":
                    raise request_failure(ev)
                if ev.scores is not None:
                    return ev.scores
        finally:
            sched.cancel(handle)  # nothing when it finished; a caller interrupted while it waits withdraws it
        raise StrataError("a score request ended without its scores")

    def compile_grammar(self, response_format: ResponseFormat) -> Grammar:
        """`response_format` compiled over this model's tokenizer (cached per schema): what the scheduler holds a
        request's tokens to. A schema that cannot be compiled is a `RequestError` naming the problem."""
        if self.grammars is None:
            raise RequestError(self._no_tokenizer("response_format needs one to build its grammar"))
        return self.grammars.compile(response_format)

    def wait_settled(self, timeout: float = 600.0) -> bool:
        """Block until the tiers' background start-up placement (and any prefetch) is done; False on
        timeout. For benchmarks: requests are served while the tiers fill, only slower."""
        return self.tiers.wait_settled(timeout) if self.tiers is not None else True

    def stats(self) -> dict:
        """A snapshot of engine statistics (cheap): what it generated, and the tiers' and expert compute's figures."""
        c = self.counters.snapshot()
        tiers = self.tiers.stats() if self.tiers is not None else None
        return {
            "experts": "tiered" if self.tiers is not None else "memory",
            "tiers": tiers,
            "engram": self.model.engram.stats() if getattr(self.model, "engram", None) is not None else None,
            "cpu_experts_computed": self._compute.cpu_experts if self._compute is not None else 0,
            "cpu_bytes_per_s": self._compute.rates.cpu_bytes_per_s if self._compute is not None else 0.0,
            "cold_path_host_seconds": dict(self._compute.host_seconds) if self._compute is not None else {},
            "promotions": self._compute.promotions if self._compute is not None else 0,
            "one_graph_decode": self._compute.mailbox_stats() if self._compute is not None else None,
            "model": str(self.checkpoint.directory),
            "model_type": self.checkpoint.config.model_type,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_context": self.max_context,
            "requests": c["requests"],
            "prompt_tokens": c["prompt_tokens"],
            "generated_tokens": c["generated_tokens"],
            "prefill_tokens_per_s": c["prefill_tokens_per_s"],
            "decode_tokens_per_s": c["decode_tokens_per_s"],
            "decode_tokens": c["decode_tokens"],
            "decode_seconds": c["decode_seconds"],
        }

    def reset_stats(self) -> None:
        """Start the request and token counts of `stats()` at zero again (e.g. after a warm-up)."""
        self.counters.reset()

    @contextlib.contextmanager
    def numerics(self, reproducible: bool) -> Iterator[None]:
        """Around a forward pass of reproducible requests: the tiered expert compute takes its exact path (its
        setting is restored after). The scheduler holds `step_lock` meanwhile."""
        compute = self._compute
        was = compute.reproducible if compute is not None else False
        if compute is not None:
            compute.reproducible = reproducible or was
        try:
            yield
        finally:
            if compute is not None:
                compute.reproducible = was

    def check_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """`token_ids` as a list of ints within the vocabulary; `RequestError` naming what is wrong otherwise."""
        vocab = self.checkpoint.config.vocab_size
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
            raise RequestError(f"a prompt is a string or a list of token ids, got {type(token_ids).__name__}")
        try:
            ids = [operator.index(t) for t in token_ids]  # ints (numpy's, 0-d tensors' too), never a float cut down
        except TypeError:
            raise RequestError("prompt token ids must be integers") from None
        if not ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    # ---- internals --------------------------------------------------------------------------
    def _started_scheduler(self) -> Scheduler:
        sched = self.scheduler()
        if not sched.started:  # first use, or stopped by a server shutting down: the engine's calls still run
            sched.start()
        return sched

    def _no_tokenizer(self, what: str) -> str:
        return (f"the model at {self.source} has no tokenizer (tokenizer.json): {what}, or copy the model's "
                f"tokenizer.json and tokenizer_config.json into {self.source}")

    def _encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(self._no_tokenizer("give the prompt as token ids"))
            return self.check_token_ids(self.tokenizer.encode(prompt))
        return self.check_token_ids(prompt)
