"""The strata side of bench/cpu/cpu_vs_llamacpp.py: one model measured through the engine's scheduler on the CPU.

    python bench/cpu/strata_cpu_side.py --model STORE --threads 2 --plan PLAN.json [--reference OUT.npy]

Runs in a process of its own (never beside llama.cpp). The engine is strata as shipped on a CPU-only host
(`Engine.from_pretrained(device="cpu")`, tiered experts computed by the CPU kernel), with `runtime.threads` and
`[debug] cpu_threads` set to --threads and `planner.max_batch` to the plan's most streams. PLAN.json (written by
cpu_vs_llamacpp.py) says what to measure, as bench/cpu/llamacpp_side.py measures llama.cpp:

- `prefill`: each prompt is one request of one token, timed from its submission to its first token;
- `decode`: (streams, prompt, tokens): the streams' requests are submitted at once (continuous batching: one
  forward pass decodes every stream's next token, one CPU kernel call per MoE layer computes every stream's
  experts); the decode rate is the tokens produced after the last stream's first token over the time since then.

Every request samples at the plan's temperature (1: the default; 0: greedy) with a fixed seed and ignores EOS, as
the llama.cpp side does; sampled, routing follows the weights' profile instead of settling into a greedy loop.
With --reference the process instead writes the float32 reference's log-probabilities at every position of the
plan's `logits` prompt (`runtime.dtype = "float32"`, experts by the reference math) to OUT.npy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def engine_config(threads: int, streams: int, context: int, dtype: str, reference: bool) -> dict:
    """The engine's configuration: the defaults, with the thread counts and the batch the workloads need."""
    cfg = {"runtime": {"device": "cpu", "threads": threads, "max_context": context},
           "planner": {"max_batch": streams}, "debug": {"cpu_threads": threads}}
    if dtype != "auto":
        cfg["runtime"]["dtype"] = dtype
    if reference:  # float32 everywhere: the dense weights upcast, the experts by the reference math
        cfg["runtime"]["dtype"] = "float32"
        cfg["debug"]["cpu_kernel"] = "torch"
    return cfg


TEMPERATURE = [1.0]  # the plan's, set by main


def _submit(scheduler, prompt: list[int], tokens: int, seed: int):
    from strata.runtime.generation.requests import GenRequest
    from strata.runtime.generation.sampler import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=TEMPERATURE[0], seed=seed, ignore_eos=True)
    return scheduler.submit(GenRequest(list(prompt), params), asynchronous=False)


def prefill(scheduler, prompt: list[int], seed: int) -> float:
    """Seconds from submitting `prompt` to its first token."""
    t0 = time.perf_counter()
    for ev in _submit(scheduler, prompt, 1, seed).iter_events():
        if ev.token_id is not None:
            return time.perf_counter() - t0
    raise RuntimeError("the prefill request ended without a token")


def streams(scheduler, prompts: list[list[int]], tokens: int, seed: int) -> dict:
    """Decode `tokens` tokens for every prompt at once; the decode phase's aggregate rate."""
    stamps: list[list[float]] = [[] for _ in prompts]
    started, lock, mid = [0], threading.Lock(), {}
    handles = []

    def collect(i: int) -> None:
        for ev in handles[i].iter_events(timeout=3600):
            if ev.token_id is None:
                continue
            stamps[i].append(time.perf_counter())
            if len(stamps[i]) == 1:
                with lock:
                    started[0] += 1
                    if started[0] == len(prompts):  # every stream is decoding
                        mid["t"] = time.perf_counter()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)  # the consumer threads take each token's timestamp promptly
    threads = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(len(prompts))]
    t0 = time.perf_counter()
    try:
        for i, (t, p) in enumerate(zip(threads, prompts, strict=True)):
            handles.append(_submit(scheduler, p, tokens, seed + i))
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    t_end = time.perf_counter()
    if any(len(s) != tokens for s in stamps):
        raise RuntimeError(f"streams produced {[len(s) for s in stamps]} tokens; expected {tokens} each")
    window = sum(1 for s in stamps for x in s if x > mid["t"])
    return {"streams": len(prompts), "prompt": len(prompts[0]), "tokens": tokens, "prefill_s": mid["t"] - t0,
            "decode_s": t_end - mid["t"], "decode_tok_s": window / (t_end - mid["t"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="strata store (or checkpoint) directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plan", required=True, help="JSON: logits, prefill, decode, warmup (see the docstring)")
    p.add_argument("--dtype", default="auto", help='runtime.dtype ("auto": the default)')
    p.add_argument("--reference", default=None, help="write the float32 reference log-probabilities here and stop")
    args = p.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    TEMPERATURE[0] = plan.get("temperature", 1.0)

    import numpy as np
    import torch

    from strata import Engine

    most = max([len(d["prompts"]) for d in plan.get("decode", [])] + [1])
    cfg = engine_config(args.threads, most, plan["n_ctx_per_seq"], args.dtype, args.reference is not None)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, config=cfg, device="cpu")
    engine.wait_settled()
    load_s = time.perf_counter() - t0
    if args.reference is not None:
        np.save(args.reference, engine.score(plan["logits"]["ids"]).numpy())
        engine.close()
        return 0
    from strata.kernels.cpu import experts as ce

    scheduler = engine.scheduler()
    if not scheduler.started:
        scheduler.start()
    result: dict = {"engine": "strata", "dtype": engine.stats()["dtype"], "threads": args.threads,
                    "torch_threads": torch.get_num_threads(), "cpu_kernel": ce.backend(), "load_s": round(load_s, 2),
                    "config": cfg}
    if plan.get("warmup"):  # as llama.cpp's side: a prompt over (nearly) every expert, then every batch size
        prefill(scheduler, plan["warmup"], seed=7)
        for d in plan.get("decode", []):
            streams(scheduler, [plan["warmup"][: len(p)] for p in d["prompts"]], 4, seed=7)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    result["prefill"] = [{"prompt": len(ids), "seconds": s, "tok_s": len(ids) / s}
                         for ids in plan.get("prefill", []) for s in [prefill(scheduler, ids, seed=11)]]
    result["decode"] = [streams(scheduler, d["prompts"], d["tokens"], seed=1000) for d in plan.get("decode", [])]
    # weights read back from disk while timed (page cache evicted): the round measures the disk, not the engine
    result["major_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    engine.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
