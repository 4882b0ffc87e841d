"""Warm-up before serving: every decode batch size runs once before the first request does.

A decode step of B sequences replays a CUDA graph captured on the step's first use of that (B, KV bucket) shape,
and on a fresh install its kernels are JIT-built then too: hundreds of milliseconds to seconds that every user
in that step waits for, again at each new batch size. `warm_up` runs those first uses before the server says it
is ready: `max_batch` short requests, submitted together so they share their prefill pass, where request i asks
for `max_batch + 1 - i` tokens. The first token of each comes from the prefill; then one request finishes after
every decode step, so the steps decode max_batch, max_batch - 1, ..., 1 sequences, each size once, at the
smallest KV bucket. Then one short prompt alone (greedy): a prefill of a few tokens takes the decode's pair kernels
rather than the grouped ones, with its own kernel builds (on the H200, the first request after a warm-up without it
took 1.0 s against 0.16 s for the next). Then one prompt alone for each larger KV bucket up to `WARM_CONTEXT`
tokens, decoding once there: the attention kernels are built per bucket, and a longer prompt's prefill chunk is
warmed on the way (a batch of several sequences at those buckets is still captured on first use, its kernels built).
The prompt lengths are not multiples of 16, like most prompts: Triton builds a kernel again for sizes divisible by 16.
Each prompt is a prefix of the next, so they bypass the prefix cache: every one is prefilled whole, as warmed.

The warm-up goes through the scheduler like any request (the same admission, overlap, sampling and graph paths),
so what it warms is what users hit. Its requests are not traffic: the engine's request and token counters are
reset after it. The tiers see its lookups like any request's (their statistics keep them, and the GPU tier's
policy counts them: a few decode steps and ~4K prompt tokens, whose experts a prompt stages through the GPU tier;
before any traffic the tier holds the start-up placement's guess, in layer order, so little is lost).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from strata.errors import StrataError
from strata.runtime.generation.requests import GenRequest
from strata.runtime.generation.sampler import SamplingParams
from strata.runtime.model.kv_cache import kv_bucket

PROMPT_TOKENS = 13  # each warm-up prompt; short, so the decode steps stay in the smallest KV bucket
ALONE_TOKENS = 11  # the prompt prefilled alone (at most 16 tokens: the pair kernels' prefill)
WARM_CONTEXT = 4096  # KV buckets up to this many positions are decoded once (the default runtime.max_context)


@dataclass
class WarmupReport:
    """What `warm_up` ran."""

    seconds: float
    batch_sizes: list[int]  # decode batch sizes of its steps, in order (max_batch..1, then 1 a prompt alone)
    buckets: list[int]  # the KV buckets its decode steps attended over (by its requests' lengths)
    captures: int  # decode-step CUDA graphs captured during it (0 where there are none: the CPU, eager modes)

    def describe(self) -> str:
        return (f"warmed up in {self.seconds:.1f} s: decode batch sizes {_span(self.batch_sizes)}, KV buckets "
                f"{_span(self.buckets)}, {self.captures} CUDA graph{'s' if self.captures != 1 else ''} captured")


def _span(values: list[int]) -> str:
    v = sorted(set(values))
    return f"{v[0]}-{v[-1]}" if len(v) > 1 else (str(v[0]) if v else "none")


def warmup_on(setting: bool | str, device) -> bool:
    """runtime.warmup resolved: "auto" means on CUDA, where decode steps are captured as graphs on first use."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def warmup_requests(max_batch: int, vocab_size: int, max_context: int) -> list[list[GenRequest]]:
    """The warm-up's rounds of requests, each round submitted together once the last one finished. First: prompts
    of `PROMPT_TOKENS` fixed ids (fewer if the context is short), request i generating max_batch + 1 - i tokens
    (within the context), sampled with a fixed seed, EOS ignored. Then one `ALONE_TOKENS`-token prompt, greedy, and
    one prompt a larger KV bucket up to `WARM_CONTEXT`, each generating 2 tokens (one decode step)."""
    n = max(1, min(PROMPT_TOKENS, max_context - max_batch - 1))
    prompt = [(1 + 7 * j) % vocab_size for j in range(n)]
    batch = [GenRequest(list(prompt), SamplingParams(max_tokens=max(1, min(max_batch + 1 - i, max_context - n)),
                                                     temperature=1.0, top_p=0.95, seed=i, ignore_eos=True),
                        request_id=f"warmup-{i}", prefix_cache=False)
             for i in range(max_batch)]
    rounds = [batch]
    lengths = [min(ALONE_TOKENS, max_context - 2)]
    bucket = kv_bucket(0, max_context) * 2  # the smallest bucket's successor: 512
    while bucket <= min(max_context, WARM_CONTEXT) and bucket // 2 + 7 <= max_context:
        lengths.append(bucket // 2 + 5)  # decodes at position bucket/2 + 5: in (bucket/2, bucket]
        bucket *= 2
    for n in lengths:
        rounds.append([GenRequest([(3 + 5 * j) % vocab_size for j in range(n)],
                                  SamplingParams(max_tokens=2, ignore_eos=True), request_id=f"warmup-alone-{n}",
                                  prefix_cache=False)])
    return rounds


def warm_up(scheduler, timeout: float = 600.0) -> WarmupReport:
    """Run the warm-up through `scheduler` (started here if it is not yet) and wait for it; raise `StrataError`
    when a warm-up request fails or it takes longer than `timeout` seconds. Call it before taking traffic: other
    requests queued meanwhile would change the batch sizes it steps through (they are served all the same)."""
    engine = scheduler.engine
    n = min(scheduler.max_batch, scheduler.max_queue)  # all queued at once, so the queue's bound caps the sizes
    requests = warmup_requests(n, engine.checkpoint.config.vocab_size, engine.max_context)
    buckets = sorted({kv_bucket(len(r.prompt_ids) + i, engine.max_context)
                      for round_ in requests for r in round_ for i in range(r.params.max_tokens - 1)})
    graphs = getattr(engine.model, "graphs", None)
    captures0 = graphs.captures if graphs is not None else 0
    steps0 = scheduler.stats()["steps"]
    t0 = time.perf_counter()
    deadline = t0 + timeout
    scheduler.start()  # a round queued together is admitted together, whether the scheduler runs already or not
    for round_ in requests:
        handles = scheduler.submit_together(round_)
        for h in handles:
            try:
                for ev in h.iter_events(timeout=max(0.0, deadline - time.perf_counter())):
                    if ev.finish_reason == "abort":
                        raise StrataError(f"the warm-up failed: {ev.error or 'its request was aborted'}; "
                                          "set runtime.warmup = false to start without it")
            except queue.Empty:
                for other in handles:
                    other.cancel()
                raise StrataError(f"the warm-up took longer than {timeout:.0f} s; set runtime.warmup = false "
                                  "to start without it") from None
    seconds = time.perf_counter() - t0
    with engine.step_lock:  # the scheduler steps under this lock: the step that finished the last request is logged
        steps = scheduler.stats()["steps"] - steps0
        engine.reset_stats()  # the warm-up is not traffic: requests and tokens start at zero
    recent = scheduler.recent_steps()[-steps:] if steps > 0 else []
    sizes = [s["decode"] for s in recent if s["decode"] and not s["prompt"]]
    return WarmupReport(seconds, sizes, buckets, (graphs.captures if graphs is not None else 0) - captures0)
