"""Engines one after another in one process, the CPU kernel pool's workers pinned to cores or not, alternating.

    python bench/probes/pool_pinning.py --suite-json S.json --engines 12 [--tokens 256] [--repeats 2] [--out DIR]

S.json: a quick-suite run's results (`python -m bench run --suite quick --cases 'split/b25/skewed/p128x1'`), whose
first case gives the model and the engine config. Engine k runs with the pool pinned when k is odd
(`strata.kernels.cpu.experts.configure(cpus=...)`: worker t on the t-th of the process's CPUs taken one a physical
core first, from the end, so the first CPUs stay for the decoding thread and the copy threads) and unpinned when even
(`configure(cpus=[])`). Each engine: the suite's warm-up, then `--repeats` timed one-stream runs of `--prompt` +
`--tokens` tokens (bench.suite.strata_case.run_workload), while a sampler reads every thread's state and CPU
(/proc/self/task) every 20 ms: `shared` is the share of samples in which two running threads sat on one CPU, `worst`
the names of the threads most often sharing. After each engine closes: the threads left and those still busy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def cores_first() -> list[int]:
    """The CPUs this process may run on, one per physical core first, then their siblings."""
    seen, first, rest = set(), [], []
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
            core = (open(f"{base}/physical_package_id").read().strip(), open(f"{base}/core_id").read().strip())
        except OSError:
            core = ("?", str(cpu))
        (rest if core in seen else first).append(cpu)
        seen.add(core)
    return first + rest


def tasks() -> dict[str, tuple[str, int, int, str]]:
    """tid -> (state, cpu, utime + stime ticks, name) of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        out[tid] = (fields[0], int(fields[36]), int(fields[11]) + int(fields[12]), name)
    return out


class Sampler:
    """Every `period` s: which running threads share a CPU."""

    def __init__(self, period: float = 0.02):
        self.period, self.stop, self.samples, self.shared, self.names = period, threading.Event(), 0, 0, Counter()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        me = str(threading.get_native_id())
        while not self.stop.wait(self.period):
            running = [(cpu, name) for tid, (state, cpu, _, name) in tasks().items() if state == "R" and tid != me]
            by_cpu = Counter(cpu for cpu, _ in running)
            self.samples += 1
            doubled = [name for cpu, name in running if by_cpu[cpu] > 1]
            if doubled:
                self.shared += 1
                self.names.update(doubled)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def report(self) -> dict:
        return {"samples": self.samples, "shared": round(self.shared / max(1, self.samples), 3),
                "worst": self.names.most_common(4)}


def busy_threads(seconds: float = 1.0) -> dict:
    a = tasks()
    time.sleep(seconds)
    b = tasks()
    busy = {b[t][3]: b[t][2] - a[t][2] for t in b if t in a and b[t][2] - a[t][2] > 2}
    return {"threads": len(b), "busy_ticks_over_1s": busy}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite-json", required=True)
    p.add_argument("--engines", type=int, default=12)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--deadline", type=float, default=1e9, help="seconds after which no new engine starts")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)

    import torch

    from bench.suite.cases import Workload
    from bench.suite.strata_case import run_workload, wait_placed
    from strata import Engine
    from strata.kernels.cpu import experts as ce

    suite = json.loads(Path(args.suite_json).read_text())
    case = next(c for c in suite["cases"] if c.get("config"))
    model, cfg = suite["models"][case["routing"]]["path"], case["config"]
    order = cores_first()
    t_start = time.perf_counter()
    records = []
    print(json.dumps({"cpus": order, "default_threads": ce.default_threads()}), flush=True)
    print(json.dumps({"before": busy_threads()}), flush=True)
    for k in range(args.engines):
        if time.perf_counter() - t_start > args.deadline:
            break
        pinned = k % 2 == 1
        engine = Engine.from_pretrained(model, config=cfg, device="cuda")
        wait_placed(engine, 120)
        sched = engine.scheduler(max_batch=1, token_budget=8192)
        sched.start()
        vocab = engine.checkpoint.config.vocab_size
        run_workload(engine, sched, Workload(64, 1, 16), vocab, "cuda")  # warm-up (the mailbox pool starts here)
        n = run_workload(engine, sched, Workload(64, 1, 16), vocab, "cuda")["metrics"]["decode_state"]["cpu_threads"]
        if pinned:  # worker t on pool_cpus[t]; the caller (the mailbox worker thread) is left alone
            pool_cpus = order[len(order) - n:]
            ce.configure(cpus=pool_cpus)
        else:
            ce.configure(cpus=[])
        run_workload(engine, sched, Workload(64, 1, 16), vocab, "cuda")  # the pool rebuilt with that pinning
        runs = []
        with Sampler() as sampler:
            for _ in range(args.repeats):
                m = run_workload(engine, sched, Workload(args.prompt, 1, args.tokens), vocab, "cuda")["metrics"]
                runs.append({"tok_s": m["decode_tok_s"], "kernel_GB_s": (m.get("mailbox_window") or {}).get("kernel_GB_s")})
        sched.stop(drain=False, timeout=30)
        engine.close()
        del engine, sched
        gc.collect()
        torch.cuda.empty_cache()
        rec = {"engine": k, "pinned": pinned, "threads": n, "runs": runs, "sampler": sampler.report(),
               "after_close": busy_threads()}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    summary = {}
    for pinned in (False, True):
        rates = [r["tok_s"] for rec in records if rec["pinned"] == pinned for r in rec["runs"]]
        if rates:
            summary["pinned" if pinned else "unpinned"] = {"median": statistics.median(rates), "min": min(rates),
                                                         "max": max(rates), "n": len(rates)}
    out = {"command": " ".join(sys.argv), "cpus": order, "engines": records, "summary": summary}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "pool_pinning.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
