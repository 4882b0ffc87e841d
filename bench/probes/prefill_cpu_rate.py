"""Whether a prompt's CPU share is sized right: prefill at a 25% GPU budget with the cost model's CPU rates as the
engine learned them, and reset to a decode step's (so the CPU takes more of the cold experts), rounds alternated.

    python bench/probes/prefill_cpu_rate.py --model DIR [--prompt 128 512] [--rounds 4] [--variants ...] [--out DIR]

The engine is built as the suite's split cases build one (`runtime.prefill_chunk = 8192`, prefix cache off, a batch
of 8, `--budget` bytes of experts on the GPU). Before each timed prefill the executor's rates
(`engine.executor.rates`, strata.runtime.offload.cost_model.Rates) are left as learned ("shipped"), or reset to
`cpu_bytes_per_s` = `--decode-rate` and `cpu_flops` = 1, 2 or 4 TFLOP/s ("reset-1e12", ...): the CPU byte rate the
prompts themselves observe (~19 GB/s on an H100 host for 512 tokens, against ~130 in decode) is what keeps their
many-token experts on the copy path. "ahead": the rates as learned, and every prompt stages its next layer's experts
ahead (`tiered_prefill.AHEAD_PAIRS_PER_EXPERT` 0 for that prefill, where the shipped 64 pairs an expert leaves prompts
under 1,024 tokens to the cost model's split). Reports each variant's median seconds to the first token and the cold
experts the CPU computed per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = ("shipped", "reset-1e12", "reset-2e12", "reset-4e12", "ahead")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the suite's 12-layer bench model (or any tiered checkpoint)")
    p.add_argument("--budget", type=int, default=3_623_878_656, help="bytes of experts on the GPU")
    p.add_argument("--prompt", type=int, nargs="+", default=[128, 512])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--decode-rate", type=float, default=130e9, help="the reset CPU byte rate (bytes/s)")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)

    import torch

    from bench.provenance import commit
    from bench.suite.cases import Workload
    from bench.suite.strata_case import prompts_for
    from strata import Engine
    from strata.runtime.offload import tiered_prefill

    config = {"runtime": {"max_context": 8272, "prefill_chunk": 8192, "prefix_cache": False},
              "tiers": {"gpu": {"budget": str(args.budget)}}, "planner": {"max_batch": 8}}
    engine = Engine.from_pretrained(args.model, config=config, device="cuda")
    engine.wait_settled()
    rates, vocab = engine.executor.rates, engine.checkpoint.config.vocab_size
    shipped_flops = rates.cpu_flops
    seconds: dict[int, dict[str, list[float]]] = {}
    cpu_experts: dict[int, dict[str, list[int]]] = {}
    learned: dict[int, float] = {}
    try:
        for n in args.prompt:
            prompt = prompts_for(Workload(n, 1, 1), vocab)[0]
            engine.generate(prompt, max_tokens=8, temperature=0.0)  # warm-up: kernels, allocator, rates
            seconds[n], cpu_experts[n] = {v: [] for v in args.variants}, {v: [] for v in args.variants}
            for r in range(args.rounds):
                for v in args.variants if r % 2 == 0 else args.variants[::-1]:
                    if v.startswith("reset"):
                        rates.cpu_bytes_per_s, rates.cpu_flops = args.decode_rate, float(v.split("-")[1])
                    else:  # the byte rate as the prompts before left it (a reset's fades within one prompt's layers)
                        rates.cpu_flops = shipped_flops
                    shipped_pairs = tiered_prefill.AHEAD_PAIRS_PER_EXPERT
                    tiered_prefill.AHEAD_PAIRS_PER_EXPERT = 0 if v == "ahead" else shipped_pairs
                    c0 = engine.stats()["cpu_experts_computed"]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    engine.generate(prompt, max_tokens=1, temperature=0.0)
                    torch.cuda.synchronize()
                    tiered_prefill.AHEAD_PAIRS_PER_EXPERT = shipped_pairs
                    seconds[n][v].append(round(time.perf_counter() - t0, 4))
                    cpu_experts[n][v].append(engine.stats()["cpu_experts_computed"] - c0)
                    if v == "shipped":
                        learned[n] = rates.cpu_bytes_per_s
            med = {v: statistics.median(s) for v, s in seconds[n].items()}
            print(json.dumps({"prompt": n, "median_s": med, "learned_cpu_GB_s": round(learned[n] / 1e9, 1),
                              "cpu_experts": {v: statistics.median(c) for v, c in cpu_experts[n].items()}}), flush=True)
    finally:
        engine.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"commit": commit(), "command": " ".join(["python", "bench/probes/prefill_cpu_rate.py", *(argv or sys.argv[1:])]),
              "gpu": torch.cuda.get_device_name(), "config": config, "seconds": seconds, "cpu_experts": cpu_experts,
              "learned_cpu_bytes_per_s": learned}
    (out / "prefill_cpu_rate.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
