"""`Engine`: the public Python API — load a checkpoint, generate, stream, chat, score.

    from strata import Engine
    engine = Engine.from_pretrained("path/to/checkpoint")   # None: the embedded demo model
    out = engine.generate("Hello", max_tokens=32)
    out.text, out.token_ids, out.finish_reason

The engine owns the model, the tokenizer and one preallocated KV cache; calls are serialised by a
lock (the server's scheduler batches requests on top of the same runtime).
"""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata.config import StrataConfig, load_config
from strata.errors import CheckpointError, RequestError
from strata.runtime.build import LoadedModel, build_model
from strata.runtime.generate import generate_tokens, prefill
from strata.runtime.kv_cache import KVCache
from strata.runtime.overlap import overlap_on
from strata.runtime.prefill_chunk import resolve_prefill_chunk, score_chunk
from strata.runtime.sampler import SamplingParams, make_generator
from strata.runtime.scheduler import Scheduler
from strata.runtime.tokenizer import StopMatcher, StreamDecoder, Tokenizer


@dataclass
class GenerationOutput:
    """The result of `Engine.generate` / `Engine.chat`."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens or context full)
    prompt_tokens: int = 0


@dataclass
class _Counters:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens after each request's first (that one comes from the prefill's logits)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _release(compute, tiers, model) -> None:
    """What `Engine.close` frees: the CPU worker, the tier manager's threads and memory, the Engram row store."""
    if (close_mailbox := getattr(compute, "close_mailbox", None)) is not None:
        close_mailbox()  # the CPU worker of one-graph decode steps reads the pinned pool freed below
    if tiers is not None:
        tiers.close()
    rows = getattr(getattr(model, "engram", None), "source", None)  # the Engram row store's readers
    if rows is not None and hasattr(rows, "close"):
        rows.close()
    # from_pretrained froze the loaded objects; let the collector reclaim this engine's cycles (unfreezing is
    # process-wide: another open engine's objects are scanned again too, as before its freeze). At exit (an engine
    # never closed) this matters too: frozen objects are never freed, and extensions that check for leaks when
    # they unload (Triton's nanobind) then print hundreds of lines of "leaked instance" after the CLI's output
    gc.unfreeze()


class Engine:
    """A loaded model ready to generate. Build it with `Engine.from_pretrained`."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: StrataConfig):
        self.checkpoint, self.tokenizer, self.config = loaded.checkpoint, tokenizer, config
        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.plan, self.tiers, self._compute = loaded.plan, loaded.manager, loaded.compute
        self.max_context = loaded.max_context
        # prompt tokens a prefill pass takes (runtime.prefill_chunk, "auto" resolved): the plan's, which `strata plan`
        # printed; resolved here when there is none (every expert in memory, or several cards)
        self.prefill_chunk = self.plan.prefill_chunk if self.plan is not None else resolve_prefill_chunk(
            config.runtime.prefill_chunk, self.checkpoint.config, self.device, config.planner.activation_reserve_bytes,
            self.max_context)
        self.cache = KVCache(self.checkpoint.config, num_slots=1, max_len=self.max_context, dtype=self.dtype,
                             device=self.device)
        self.eos_token_ids = set(self.checkpoint.eos_token_ids) | set(tokenizer.eos_token_ids)
        # [debug] overlap_decode resolved: each decode step queued before the host reads the token it is fed
        self.overlap_decode = overlap_on(config.debug.overlap_decode, self.device, len(config.runtime.devices))
        self._lock = threading.Lock()
        self._counters = _Counters()
        # an engine dropped or still open at exit is released then: before the interpreter kills the tier manager's
        # daemon threads, which inside a torch call aborts the process ("terminate called without an active exception")
        self._release = weakref.finalize(self, _release, self._compute, self.tiers, self.model)

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
        layout that cannot fit is refused here, before anything is loaded.
        """
        cfg = load_config(config)
        if device != "auto":
            cfg.runtime.device = device
            cfg.runtime.__post_init__()
        if path is None:
            from strata.runtime.demo_model import ensure_default_model

            path = ensure_default_model(progress=progress)
        path = Path(path).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint or store directory")
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        loaded = build_model(path, cfg, progress=progress)
        tokenizer = Tokenizer.from_dir(loaded.checkpoint.directory)
        engine = cls(loaded, tokenizer, cfg)
        # Loading leaves hundreds of thousands of long-lived objects (store index, checksums, modules);
        # freezing them keeps Python's full collections, which would rescan them all, off the decode path.
        gc.collect()
        gc.freeze()
        return engine

    def scheduler(self, max_batch: int = 8, token_budget: int = 2048, max_queue: int = 64,
                  decode_gap_target: float | None = None) -> Scheduler:
        """A continuous-batching scheduler over this engine's model (with its own KV cache of `max_batch` slots).

        `decode_gap_target` (seconds; None: `runtime.decode_gap_target`) bounds a step's time while
        sequences decode by shrinking the prompt chunks that share it; 0 lets chunks fill `token_budget`.
        """
        return Scheduler(self, max_batch=max_batch, token_budget=token_budget, max_queue=max_queue,
                         decode_gap_target=decode_gap_target)

    def close(self) -> None:
        """Stop the tier manager's threads and free its memory (the engine is unusable afterwards). Engines still
        open when the interpreter exits are closed then."""
        self._release()  # once: later calls do nothing
        self.tiers = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None, reproducible: bool = False) -> GenerationOutput:
        """Generate a completion of `prompt` (text, or token ids) and return it whole.

        `reproducible=True` computes cold experts on the exact path (the GPU, or the CPU's reference math)
        instead of the fast CPU kernel; the tokens then equal those of a reproducible request served by
        `engine.scheduler()` bit for bit, whatever else that scheduler runs.
        """
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=stop, stop_token_ids=stop_token_ids or [])
        result = GenerationOutput("", [], "length")
        result.text = "".join(self._run(prompt, params, result, reproducible))
        return result

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None,
               stop_token_ids: list[int] | None = None, reproducible: bool = False) -> Iterator[str]:
        """Like `generate`, but yield text pieces as tokens are produced."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=stop, stop_token_ids=stop_token_ids or [])
        yield from self._run(prompt, params, GenerationOutput("", [], "length"), reproducible)

    def chat(self, messages: list[dict], **kwargs) -> GenerationOutput:
        """Apply the checkpoint's chat template to `messages` and generate the assistant's reply.

        Keyword arguments are those of `generate` (`reproducible=True` included)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(ids, **kwargs)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Log-probabilities of the next token at every position: float32 [len(ids), vocab] on CPU."""
        ids = self.check_token_ids(token_ids)
        if len(ids) > self.max_context:
            raise RequestError(f"{len(ids)} tokens exceed the context of {self.max_context}; raise runtime.max_context")
        with self._lock:
            t = torch.tensor(ids, dtype=torch.long, device=self.device)
            chunk = score_chunk(self.prefill_chunk, self.checkpoint.config.vocab_size,
                                self.config.planner.activation_reserve_bytes)  # every position's logits kept
            return prefill(self.model, self.cache, 0, t, chunk, all_logits=True).float().cpu()

    def wait_settled(self, timeout: float = 600.0) -> bool:
        """Block until the tiers' background start-up placement (and any prefetch) is done; False on
        timeout. For benchmarks: requests are served while the tiers fill, only slower."""
        return self.tiers.wait_settled(timeout) if self.tiers is not None else True

    def stats(self) -> dict:
        """A snapshot of engine statistics (cheap; later the tier manager's figures join it)."""
        c = self._counters
        tiers = self.tiers.stats() if self.tiers is not None else None
        return {
            "experts": "tiered" if self.tiers is not None else "memory",
            "tiers": tiers,
            "engram": self.model.engram.stats() if getattr(self.model, "engram", None) is not None else None,
            "cpu_experts_computed": self._compute.cpu_experts if self._compute is not None else 0,
            "cpu_bytes_per_s": self._compute.rates.cpu_bytes_per_s if self._compute is not None else 0.0,
            "cold_path_host_seconds": dict(self._compute.host_seconds) if self._compute is not None else {},
            "promotions": self._compute.promotions if self._compute is not None else 0,
            "one_graph_decode": self._compute.mailbox_stats() if hasattr(self._compute, "mailbox_stats") else None,
            "model": str(self.checkpoint.directory),
            "model_type": self.checkpoint.config.model_type,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_context": self.max_context,
            "requests": c.requests,
            "prompt_tokens": c.prompt_tokens,
            "generated_tokens": c.generated_tokens,
            "prefill_tokens_per_s": c.prompt_tokens / c.prefill_seconds if c.prefill_seconds else 0.0,
            "decode_tokens_per_s": c.decode_tokens / c.decode_seconds if c.decode_seconds else 0.0,
            "decode_tokens": c.decode_tokens,
            "decode_seconds": c.decode_seconds,
        }

    # ---- internals --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _numerics(self, reproducible: bool) -> Iterator[None]:
        """While generating a reproducible request: the tiered expert compute takes its exact path."""
        compute = self._compute
        was = getattr(compute, "reproducible", False)
        if compute is not None:
            compute.reproducible = reproducible or was
        try:
            yield
        finally:
            if compute is not None:
                compute.reproducible = was

    def check_token_ids(self, token_ids: Sequence[int]) -> list[int]:
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

    def _encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.check_token_ids(self.tokenizer.encode(prompt))
        return self.check_token_ids(prompt)

    def _run(self, prompt: str | Sequence[int], params: SamplingParams, result: GenerationOutput,
             reproducible: bool = False) -> Iterator[str]:
        """Generate under the lock, yielding text pieces and filling `result` as it goes."""
        if not isinstance(reproducible, bool):
            raise RequestError(f"reproducible must be True or False, got {reproducible!r}")
        ids = self._encode_prompt(prompt)
        if len(ids) >= self.max_context:
            raise RequestError(
                f"prompt of {len(ids)} tokens leaves no room in the context of {self.max_context} tokens; "
                "shorten it or raise runtime.max_context"
            )
        result.prompt_tokens = len(ids)
        eos = set() if params.ignore_eos else self.eos_token_ids | set(params.stop_token_ids)
        decoder, stopper = StreamDecoder(self.tokenizer), StopMatcher(params.stop)
        generator = make_generator(params.seed, self.device)
        with self._lock, self._numerics(reproducible):
            self._counters.requests += 1
            t0 = time.perf_counter()
            t_first = None
            tokens = generate_tokens(self.model, self.cache, ids, params, eos, self.prefill_chunk,
                                     self.device, generator, overlap=self.overlap_decode)
            stopped = False
            for token in tokens:
                if t_first is None:
                    t_first = time.perf_counter()
                result.token_ids.append(token)
                text, stopped = stopper.feed(decoder.push(token))
                if text:
                    yield text
                if stopped:
                    break
            tokens.close()
            if not stopped:
                text, stopped = stopper.feed(decoder.flush())
                if text:
                    yield text
                if not stopped:
                    tail = stopper.flush()
                    if tail:
                        yield tail
            n = len(result.token_ids)
            hit_limit = n >= params.max_tokens or len(ids) + n >= self.max_context
            result.finish_reason = "stop" if stopped or not hit_limit else "length"
            t_end = time.perf_counter()
            c = self._counters
            c.prompt_tokens += len(ids)
            c.generated_tokens += n
            c.decode_tokens += max(0, n - 1)
            c.prefill_seconds += (t_first or t_end) - t0
            c.decode_seconds += t_end - (t_first or t_end)
