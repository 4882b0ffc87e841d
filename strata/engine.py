"""`Engine`: the public Python API — load a checkpoint, generate, stream, chat, score.

    from strata import Engine
    engine = Engine.from_pretrained("path/to/checkpoint")   # None: the embedded demo model
    out = engine.generate("Hello", max_tokens=32)
    out.text, out.token_ids, out.finish_reason

The engine owns the model, the tokenizer and one preallocated KV cache; calls are serialised by a
lock (the server's scheduler batches requests on top of the same runtime).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata.config import StrataConfig, load_config
from strata.errors import ConfigError, RequestError, StrataError
from strata.runtime.checkpoint import Checkpoint
from strata.runtime.generate import generate_tokens, prefill
from strata.runtime.kv_cache import KVCache
from strata.runtime.loader import load_model
from strata.runtime.sampler import SamplingParams, make_generator
from strata.runtime.tokenizer import StopMatcher, StreamDecoder, Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; a CUDA request without CUDA is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise StrataError(f"device {device!r} requested but no CUDA GPU is available; use --device cpu")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise StrataError(f"device {device!r} does not exist: this host has {torch.cuda.device_count()} GPU(s)")
    elif device != "cpu":
        raise ConfigError(f"device {device!r} is invalid; use auto, cpu, cuda or cuda:N")
    return torch.device(device)


class Engine:
    """A loaded model ready to generate. Build it with `Engine.from_pretrained`."""

    def __init__(self, checkpoint: Checkpoint, tokenizer: Tokenizer, config: StrataConfig, device: torch.device, dtype: torch.dtype, progress: bool = False):
        self.checkpoint, self.tokenizer, self.config = checkpoint, tokenizer, config
        self.device, self.dtype = device, dtype
        self.model = load_model(checkpoint, dtype, device, progress=progress)
        cfg = checkpoint.config
        self.max_context = min(config.runtime.max_context, cfg.max_position_embeddings)
        self.cache = KVCache(cfg, num_slots=1, max_len=self.max_context, dtype=dtype, device=device)
        self.eos_token_ids = set(checkpoint.eos_token_ids) | set(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._counters = _Counters()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike | None = None,
        config: str | os.PathLike | dict | StrataConfig | None = None,
        device: str = "auto",
        progress: bool = False,
    ) -> Engine:
        """Load a Hugging Face MoE checkpoint directory (None: the embedded demo model, built on first use).

        `config` is a TOML path, a dict of sections, or None for the defaults; `device` overrides
        `runtime.device` unless it is "auto".
        """
        cfg = load_config(config)
        if path is None:
            from strata.runtime.demo_model import ensure_default_model

            path = ensure_default_model(progress=progress)
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        dev = resolve_device(device if device != "auto" else cfg.runtime.device)
        if cfg.runtime.dtype == "auto":
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        else:
            dtype = _DTYPES[cfg.runtime.dtype]
        checkpoint = Checkpoint.open(Path(path))
        tokenizer = Tokenizer.from_dir(checkpoint.directory)
        return cls(checkpoint, tokenizer, cfg, dev, dtype, progress=progress)

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None) -> GenerationOutput:
        """Generate a completion of `prompt` (text, or token ids) and return it whole."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=stop, stop_token_ids=stop_token_ids or [])
        result = GenerationOutput("", [], "length")
        result.text = "".join(self._run(prompt, params, result))
        return result

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop: str | list[str] | None = None,
               stop_token_ids: list[int] | None = None) -> Iterator[str]:
        """Like `generate`, but yield text pieces as tokens are produced."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=stop, stop_token_ids=stop_token_ids or [])
        yield from self._run(prompt, params, GenerationOutput("", [], "length"))

    def chat(self, messages: list[dict], **kwargs) -> GenerationOutput:
        """Apply the checkpoint's chat template to `messages` and generate the assistant's reply."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(ids, **kwargs)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Log-probabilities of the next token at every position: float32 [len(ids), vocab] on CPU."""
        ids = self._check_ids(token_ids)
        if len(ids) > self.max_context:
            raise RequestError(f"{len(ids)} tokens exceed the context of {self.max_context}; raise runtime.max_context")
        with self._lock:
            t = torch.tensor(ids, dtype=torch.long, device=self.device)
            return prefill(self.model, self.cache, 0, t, self.config.runtime.prefill_chunk, all_logits=True).float().cpu()

    def stats(self) -> dict:
        """A snapshot of engine statistics (cheap; later the tier manager's figures join it)."""
        c = self._counters
        return {
            "model": str(self.checkpoint.directory),
            "model_type": self.checkpoint.config.model_type,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_context": self.max_context,
            "requests": c.requests,
            "prompt_tokens": c.prompt_tokens,
            "generated_tokens": c.generated_tokens,
            "prefill_tokens_per_s": c.prompt_tokens / c.prefill_seconds if c.prefill_seconds else 0.0,
            "decode_tokens_per_s": c.generated_tokens / c.decode_seconds if c.decode_seconds else 0.0,
        }

    # ---- internals --------------------------------------------------------------------------
    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        vocab = self.checkpoint.config.vocab_size
        try:
            ids = [int(t) for t in token_ids]
        except (TypeError, ValueError):
            raise RequestError("prompt token ids must be integers") from None
        if not ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._check_ids(self.tokenizer.encode(prompt))
        return self._check_ids(prompt)

    def _run(self, prompt: str | Sequence[int], params: SamplingParams, result: GenerationOutput) -> Iterator[str]:
        """Generate under the lock, yielding text pieces and filling `result` as it goes."""
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
        with self._lock:
            self._counters.requests += 1
            t0 = time.perf_counter()
            t_first = None
            tokens = generate_tokens(self.model, self.cache, ids, params, eos, self.config.runtime.prefill_chunk,
                                     self.device, generator)
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
            c.prefill_seconds += (t_first or t_end) - t0
            c.decode_seconds += t_end - (t_first or t_end)
