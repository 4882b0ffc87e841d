"""Where a short prompt's prefill goes at a 25% GPU budget: host time by phase of each MoE layer, the CPU
share's kernel time, and what lies outside the layers.

    python bench/probes/prefill_phases.py --model DIR [--prompt 128 192 512] [--rounds 4] [--sample S] [--label L]
                                            [--out DIR]

A turn of an agent's conversation served from the prefix cache computes its ~150-200 new tokens only, yet at a 25%
budget those tokens route to nearly every expert of every layer, so its first token waits on the cold experts: the
cost model's split sends some to the CPU kernel and copies the rest. The engine is built as the suite's split cases
build one (`runtime.prefill_chunk = 8192`, prefix cache off, a batch of 8, `--budget` bytes of experts on the GPU).
Each prompt is prefilled `--rounds` times after a warm-up; the probe wraps the engine's methods with wall-clock timers
(their results unchanged) and prints, per prompt, the median first-token time, each phase's median sum over the
layers, and the cost model's rates as the prompts left them:

- `route`: `group_by_expert` (syncs with the GPU: the attention and router before it, and the layer before);
- `split`: the cost model's plan; `ship`: the CPU share's tokens copied to the host and the share started;
- `gpu`: the GPU share (`_tier_forward`: staging the copies, issuing its GEMMs); `join`: waiting on the CPU share;
- `cpu_start`: a share run by the Python worker (`cpu_forward`): from the layer starting to prepare it to the worker
  taking it up (`ship` included; the GIL); `cpu`: the CPU kernel's own seconds (what the cost model observes);
- `moe`: every MoE layer's `_batch_forward`; `attn`: the attention modules; `layers`: the model's layers, embedding
  and final norm; `pass`: the scheduler's forward pass (the LM head and sampling too); `other`: the rest of the
  request (the scheduler's admission, the prefix cache's books, the first token's delivery).

`--sample S` also samples every other thread's innermost Python frame each S seconds during the timed prefills and
prints the most frequent per thread: what the tier manager's and the scheduler's threads run beside the prefill.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PHASES = ("route", "split", "ship", "gpu", "join", "cpu_start", "cpu", "moe", "attn", "layers", "pass", "other")


class PhaseClock:
    """Seconds by phase for one prefill, from wrapped methods (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sums: dict[str, float] = defaultdict(float)
        self.submitted: list[float] = []  # when each CPU share was started, in order

    def add(self, phase: str, seconds: float) -> None:
        with self.lock:
            self.sums[phase] += seconds

    def reset(self) -> None:
        with self.lock:
            self.sums.clear()
            self.submitted.clear()


def timed(clock: PhaseClock, phase: str, fn):
    """`fn` with its wall-clock seconds added to `phase`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.add(phase, time.perf_counter() - t0)
    return wrapper


def instrument(clock: PhaseClock) -> None:
    """Wrap the prefill's phases (class attributes: every layer's instance)."""
    from strata.runtime.generation import scheduler
    from strata.runtime.model.attention import GQAAttention
    from strata.runtime.model.transformer import MoETransformer
    from strata.runtime.offload import cost_model, tiered_moe
    from strata.runtime.offload.cpu_compute import CpuShare
    from strata.runtime.offload.expert_compute import ExpertCompute
    from strata.runtime.offload.tiered_moe import TieredExperts

    tiered_moe.group_by_expert = timed(clock, "route", tiered_moe.group_by_expert)
    TieredExperts._plan_split = timed(clock, "split", TieredExperts._plan_split)
    TieredExperts._tier_forward = timed(clock, "gpu", TieredExperts._tier_forward)
    TieredExperts._batch_forward = timed(clock, "moe", TieredExperts._batch_forward)
    GQAAttention.forward = timed(clock, "attn", GQAAttention.forward)
    MoETransformer.run_layers = timed(clock, "layers", MoETransformer.run_layers)
    scheduler.run_pass = timed(clock, "pass", scheduler.run_pass)
    CpuShare.wait = timed(clock, "join", CpuShare.wait)
    ship = TieredExperts._start_cpu_share

    def start_cpu_share(self, *args, **kwargs):
        t0 = time.perf_counter()
        with clock.lock:  # before the call: a Python worker may take the share up before it returns
            clock.submitted.append(t0)
        try:
            return ship(self, *args, **kwargs)
        finally:
            clock.add("ship", time.perf_counter() - t0)
    TieredExperts._start_cpu_share = start_cpu_share
    forward = ExpertCompute.cpu_forward

    def cpu_forward(self, *args, **kwargs):  # the Python worker's path: how long the share waited to start
        t0 = time.perf_counter()
        with clock.lock:
            waited = t0 - clock.submitted[-1] if clock.submitted else 0.0
        clock.add("cpu_start", waited)
        return forward(self, *args, **kwargs)
    ExpertCompute.cpu_forward = cpu_forward
    observe = cost_model.Rates.observe_cpu

    def observe_cpu(self, nbytes: int, seconds: float) -> None:  # the kernel's own seconds, either path
        clock.add("cpu", seconds)
        observe(self, nbytes, seconds)
    cost_model.Rates.observe_cpu = observe_cpu


class StackSampler:
    """Every `interval` seconds while `on`, the innermost frame of each other thread (its file's last two parts, line
    and function), counted by thread name: which Python code holds the GIL, or waits, beside the prefill's thread."""

    def __init__(self, interval: float) -> None:
        self.interval, self.on = interval, threading.Event()
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        threading.Thread(target=self._run, name="stack-sampler", daemon=True).start()

    def _run(self) -> None:
        me = threading.get_ident()
        while True:
            self.on.wait()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                code = frame.f_code
                where = "/".join(Path(code.co_filename).parts[-2:])
                self.counts[names.get(ident, str(ident))][f"{where}:{frame.f_lineno} {code.co_name}"] += 1
            time.sleep(self.interval)

    def top(self, n: int = 8) -> dict[str, list[tuple[str, int]]]:
        return {name: sorted(c.items(), key=lambda kv: -kv[1])[:n] for name, c in self.counts.items()}


def copies(engine) -> int:
    """Experts copied from pinned RAM to the GPU so far."""
    return engine.stats()["tiers"]["paths"].get("pinned->gpu", {}).get("objects", 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the suite's 12-layer bench model (or any tiered checkpoint)")
    p.add_argument("--budget", type=int, default=3_623_878_656, help="bytes of experts on the GPU")
    p.add_argument("--prompt", type=int, nargs="+", default=[128, 192, 512])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--sample", type=float, default=0.0,
                   help="sample every thread's innermost frame this often (seconds) during the timed prefills")
    p.add_argument("--runtime", default="{}", help="JSON: [runtime] settings over the suite's, e.g. "
                   "'{\"prefill_keeps_resident\": true}'")
    p.add_argument("--debug", default="{}", help="JSON: [debug] settings, e.g. '{\"cuda_graphs\": false}'")
    p.add_argument("--no-cudnn-attention", action="store_true", help="SDPA without its cuDNN backend")
    p.add_argument("--ahead-pairs", type=int, default=None,
                   help="stage the next layer ahead from this many token-expert pairs an expert "
                   "(tiered_prefill.AHEAD_PAIRS_PER_EXPERT; 0: every prompt)")
    p.add_argument("--label", default="", help="a suffix of the JSON's name (prefill_phases-LABEL.json)")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)

    import torch

    from bench.provenance import commit
    from bench.suite.cases import Workload
    from bench.suite.strata_case import prompts_for
    from strata import Engine
    from strata.runtime.offload import tiered_prefill

    if args.ahead_pairs is not None:
        tiered_prefill.AHEAD_PAIRS_PER_EXPERT = args.ahead_pairs
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    clock = PhaseClock()
    instrument(clock)
    sampler = StackSampler(args.sample) if args.sample > 0 else None
    config = {"runtime": {"max_context": 8272, "prefill_chunk": 8192, "prefix_cache": False},
              "tiers": {"gpu": {"budget": str(args.budget)}}, "planner": {"max_batch": 8}}
    config["runtime"].update(json.loads(args.runtime))
    config["debug"] = json.loads(args.debug)
    engine = Engine.from_pretrained(args.model, config=config, device="cuda")
    engine.wait_settled()
    vocab = engine.checkpoint.config.vocab_size
    results = {}
    try:
        for n in args.prompt:
            prompt = prompts_for(Workload(n, 1, 1), vocab)[0]
            engine.generate(prompt, max_tokens=8, temperature=0.0)  # warm-up: kernels, allocator, rates
            rounds: list[dict] = []
            for _ in range(args.rounds):
                c0, k0 = engine.stats()["cpu_experts_computed"], copies(engine)
                torch.cuda.synchronize()
                clock.reset()
                if sampler is not None:
                    sampler.on.set()
                t0 = time.perf_counter()
                engine.generate(prompt, max_tokens=1, temperature=0.0)
                torch.cuda.synchronize()
                total = time.perf_counter() - t0
                if sampler is not None:
                    sampler.on.clear()
                sums = dict(clock.sums)
                sums["other"] = total - sums.get("pass", 0.0)  # outside the forward pass: the scheduler
                rounds.append({"total": total, "cpu_experts": engine.stats()["cpu_experts_computed"] - c0,
                               "copies": copies(engine) - k0,
                               **{ph: sums.get(ph, 0.0) for ph in PHASES}})
            med = {key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]}
            r = engine.executor.rates
            learned = {"cpu_GB_s": round(r.cpu_bytes_per_s / 1e9, 1), "pcie_GB_s": round(r.pcie_bytes_per_s / 1e9, 1),
                       "copy_host_us": round(r.copy_host_s * 1e6, 1), "stage_fixed_us": round(r.stage_fixed_s * 1e6, 1)}
            results[n] = {"median": med, "rounds": rounds, "rates": learned}
            print(json.dumps({"label": args.label, "prompt": n, **med, **learned}), flush=True)
    finally:
        engine.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"commit": commit(), "command": " ".join(["python", "bench/probes/prefill_phases.py", *(argv or sys.argv[1:])]),
              "gpu": torch.cuda.get_device_name(), "config": config, "results": results,
              "stacks": sampler.top(12) if sampler is not None else None}
    if sampler is not None:
        for name, top in record["stacks"].items():
            print(name, json.dumps(top), flush=True)
    (out / f"prefill_phases{'-' + args.label if args.label else ''}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
