"""One stream's decode rate of a demo architecture, its decode steps captured in CUDA graphs against the same steps
run eagerly, with every expert in memory and tiered (a GPU budget of a fraction of the experts' bytes).

    python -m bench.arch_decode --arch gpt_oss --size small --out DIR [--budget 0.25] [--tokens 128] [--experts F]

Writes the demo model (`strata demo-model --arch ARCH --size SIZE`, its experts as the release ships them: MXFP4 for
gpt-oss, bf16 for the others; `--experts` another format) under DIR, then for each placement
(memory, tiered) and graph mode (captured, eager) loads an engine, warms it with one short generation and times
the decode phase of a 128-token prompt (`bench.decode_timing`: prefill apart, sampling at temperature 1, seeded,
EOS ignored). The cases alternate over `--repeat` rounds; each case's median is kept. Writes DIR/arch_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def case_config(placement: str, graphs: bool, budget_bytes: int | None) -> dict:
    """The engine config of one case: experts in memory or tiered with `budget_bytes` of GPU slots; graphs on/off."""
    cfg: dict = {"runtime": {"max_context": 1024, "experts": "memory" if placement == "memory" else "tiered"},
                 "debug": {"cuda_graphs": graphs}}
    if placement == "tiered":
        cfg["tiers"] = {"gpu": {"budget": str(budget_bytes)}}
    return cfg


def run_case(model_dir: Path, cfg: dict, tokens: int, device: str) -> dict:
    """Load an engine for one case, warm it, and time one stream's decode: tok/s, captures, decode mode."""
    import torch

    from bench.decode_timing import timed_decode
    from strata import Engine

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with Engine.from_pretrained(str(model_dir), device=device, config=cfg) as engine:
        engine.wait_settled()
        prompt = list(range(3, 131))
        engine.generate(prompt[:16], max_tokens=16, temperature=0.0)  # the kernels' first calls, the graphs' capture
        run = timed_decode(engine, prompt, tokens, sync)
        graphs = engine.model.graphs
        return {"tok_s": run.tok_s, "ttft_s": run.ttft_s, "decode_s": run.decode_s, "tokens": len(run.tokens),
                "captures": graphs.captures if graphs is not None else 0,
                "decode": engine.plan.decode if engine.plan is not None else "experts in memory"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="gpt_oss")
    p.add_argument("--size", default="small", choices=["tiny", "small", "bench"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--budget", type=float, default=0.25, help="tiered: GPU budget, a fraction of the experts' bytes")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default=None)
    p.add_argument("--experts", default=None, help="the demo's expert format (default: the release's)")
    args = p.parse_args(argv)
    experts = args.experts or ("mxfp4" if args.arch == "gpt_oss" else "bf16")

    import torch

    from strata.config import StrataConfig
    from strata.runtime.demo.model import write_demo_model
    from strata.runtime.plan.planner import plan_for

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = write_demo_model(out / f"{args.arch}-{args.size}-{experts}", args.size, args.layers, arch=args.arch,
                                 experts=experts, progress=False)
    planned = plan_for(model_dir, StrataConfig())
    expert_bytes = planned.expert_bytes * planned.experts_per_layer * planned.moe_layers
    budget = int(args.budget * expert_bytes)
    cases = [(pl, g) for pl in ("memory", "tiered") for g in (True, False)]
    runs: dict[str, list[dict]] = {f"{pl}/{'graphs' if g else 'eager'}": [] for pl, g in cases}
    load = {"start": os.getloadavg()}
    for i in range(args.repeat):
        for pl, g in (cases if i % 2 == 0 else cases[::-1]):
            runs[f"{pl}/{'graphs' if g else 'eager'}"].append(
                run_case(model_dir, case_config(pl, g, budget), args.tokens, args.device))
    load["end"] = os.getloadavg()
    median = {k: statistics.median(r["tok_s"] for r in rs) for k, rs in runs.items()}
    result = {
        "bench": "arch_decode", "arch": args.arch, "size": args.size, "layers": args.layers, "experts": experts,
        "commit": args.commit or _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "machine": platform.processor() or platform.machine(), "load_avg": load, "budget_fraction": args.budget,
        "budget_bytes": budget, "expert_bytes": expert_bytes, "tokens": args.tokens, "repeat": args.repeat,
        "median_tok_s": median,
        "graphs_over_eager": {pl: median[f"{pl}/graphs"] / median[f"{pl}/eager"] for pl in ("memory", "tiered")},
        "runs": runs,
    }
    (out / "arch_decode.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_tok_s", "graphs_over_eager")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
