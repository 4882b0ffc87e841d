"""A long prompt on a DeepSeek-V4 demo model on the CPU: chunked prefill speed and the KV cache's memory against the
planner's prediction.

    python bench/deepseek_v4_prefill.py [--model DIR] [--tokens 16384] [--out FILE]

Writes the `small` DeepSeek-V4 demo model (strata demo-model --arch deepseek_v4 --size small, ~440 MB) into --model
when it is not there, loads it with the default configuration on the CPU (tiered experts, runtime.dtype "auto": the
checkpoint's bf16) and `runtime.max_context` = --tokens + 64, then:

- KV memory: the plan's `kv_bytes` (`strata plan` prints it, with its growth per 1K tokens) against the engine's
  KV cache (sliding-window rings, compressed entries, compressor rings; strata.runtime.model.deepseek_v4.cache): its
  byte count, and the resident memory the same cache takes in a child process: allocated twice there, the second
  copy measured (the first fills the heap's holes, so the second grows the process by what it touches);
- prefill: one --tokens-token prompt generating one token, in `runtime.prefill_chunk` chunks (512 on the CPU), its
  tok/s from the engine's counters, and how far the resident memory rose above its level before the prompt (the
  chunks' activations: the KV cache is allocated and every expert placed in RAM before), sampled every 10 ms.

Prints the figures as JSON (and writes them to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss() -> int:
    """The process's resident memory now, bytes."""
    import psutil

    return psutil.Process().memory_info().rss


_CACHE_RSS = """
import json, sys, psutil, torch
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.deepseek_v4.cache import DeepseekV4Cache
cfg = Checkpoint.open(sys.argv[1]).config
before = psutil.Process().memory_info().rss
args = (cfg, int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4]), "cpu")
first = DeepseekV4Cache(*args)  # fills the holes the imports left in the heap: the second copy grows the process
before = psutil.Process().memory_info().rss
cache = DeepseekV4Cache(*args)
print(json.dumps({"rss": psutil.Process().memory_info().rss - before, "nbytes": cache.nbytes}))
"""


def cache_rss(model: Path, slots: int, context: int, dtype: str) -> dict:
    """The resident memory a DeepSeek-V4 KV cache of `slots` x `context` takes, allocated in a child process."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _CACHE_RSS, str(model), str(slots), str(context), dtype], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class PeakRss:
    """The highest resident memory seen every 10 ms while in the `with` block."""

    def __enter__(self) -> PeakRss:
        import threading

        self.peak, self._stop, self.samples = rss(), threading.Event(), []
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            now = rss()
            self.samples.append((time.perf_counter(), now))
            self.peak = max(self.peak, now)

    def quarters(self, base: int) -> list[int]:
        """The highest rise above `base` in each quarter of the block's time (does it grow with the context?)."""
        t0, t1 = self.samples[0][0], self.samples[-1][0]
        out = [0, 0, 0, 0]
        for t, r in self.samples:
            q = min(3, int(4 * (t - t0) / max(t1 - t0, 1e-9)))
            out[q] = max(out[q], r - base)
        return out

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path.home() / ".cache" / "strata" / "bench" / "deepseek_v4-small"),
                   help="the small DeepSeek-V4 demo model's directory (written when missing)")
    p.add_argument("--tokens", type=int, default=16384, help="prompt tokens")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    args = p.parse_args(argv)

    import torch

    from strata import Engine
    from strata.runtime.demo.model import write_demo_model

    model = write_demo_model(args.model, size="small", arch="deepseek_v4", progress=True)
    context = args.tokens + 64
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, device="cpu", config={"runtime": {"max_context": context,
                                                                            "prefix_cache": False}})
    load_s = time.perf_counter() - t0
    engine.tiers.wait_settled()  # every expert placed in RAM before the memory is watched
    plan = engine.plan
    cache = engine.scheduler().cache
    dtype = str(engine.dtype).removeprefix("torch.")
    alone = cache_rss(model, cache.num_slots, cache.max_len, dtype)
    vocab = engine.checkpoint.config.vocab_size
    prompt = [(7919 * i + 13) % (vocab - 3) + 3 for i in range(args.tokens)]
    stats0 = engine.counters.snapshot()  # the scheduler's own timers of every forward pass
    before = rss()
    t0 = time.perf_counter()
    with PeakRss() as peak:
        out = engine.generate(prompt, max_tokens=1, temperature=0.0, stop_token_ids=[])
    wall = time.perf_counter() - t0
    stats1 = engine.counters.snapshot()
    prefill_tokens = stats1["prompt_tokens"] - stats0["prompt_tokens"]
    prefill_s = stats1["prefill_seconds"] - stats0["prefill_seconds"]
    result = {
        "model": str(model), "tokens": args.tokens, "max_context": engine.max_context,
        "dtype": dtype, "prefill_chunk": engine.prefill_chunk, "kv_slots": cache.num_slots,
        "plan_kv_bytes": plan.kv_bytes, "plan_kv_bytes_per_1k": plan.kv_bytes_per_1k, "cache_nbytes": cache.nbytes,
        "cache_rss_bytes": alone["rss"], "cache_rss_over_plan": alone["rss"] / plan.kv_bytes,
        "prefill_rss_rise_bytes": peak.peak - before, "prefill_rss_rise_by_quarter": peak.quarters(before),
        "prefill_tokens": prefill_tokens, "prefill_s": prefill_s, "prefill_tok_s": prefill_tokens / prefill_s,
        "wall_s": wall, "generated": len(out.token_ids), "load_s": load_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
    }
    engine.close()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
