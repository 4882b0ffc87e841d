"""How well does applying layer l+d's router to the hidden state leaving layer l predict layer l+d's experts?

    python bench/probes/lookahead_probe.py --model DIR --out DIR [--prompt 128] [--tokens 64] [--distances 1,2]

strata's lookahead prefetcher (`strata.tiers.prefetch`) predicts with exactly this (`router_predictors`). The
model decodes with its experts in memory (no graphs, so the per-layer hook runs every step), sampling at
temperature 1 from the suite's prompt. For each distance d, over decode steps and MoE layers:
  recall       share of the experts a layer used that the prediction made d layers earlier named;
  cold recall  the same over lookups of experts outside the layer's 25% most used (what a 25% GPU budget
               would leave cold at best), the ones a prediction has to bring up;
  top-k is compared as sets (the prediction names k experts per token). Writes lookahead.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--distances", default="1,2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from bench.suite.cases import Workload
    from bench.suite.routing import lookahead_recall, record_lookahead
    from bench.suite.strata_case import prompts_for
    from strata import Engine

    distances = tuple(int(d) for d in args.distances.split(","))
    conf = {"runtime": {"experts": "memory", "max_context": args.prompt + args.tokens + 8},
            "debug": {"cuda_graphs": False}}
    with Engine.from_pretrained(args.model, device=args.device, config=conf) as eng:
        prompt = prompts_for(Workload(args.prompt, 1, args.tokens), eng.checkpoint.config.vocab_size)[0]
        with record_lookahead(eng.model, distances, rows=1) as rec:  # decode steps only
            eng.generate(prompt, max_tokens=args.tokens, temperature=1.0, seed=1000, stop_token_ids=[])
        experts = eng.checkpoint.config.num_experts
    rows = []
    for d in distances:
        rows.append(lookahead_recall(rec, experts, d))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "lookahead.json").write_text(json.dumps({"model": args.model, "prompt": args.prompt,
                                                           "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
