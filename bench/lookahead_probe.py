"""How well does applying layer l+d's router to the hidden state leaving layer l predict layer l+d's experts?

    python bench/lookahead_probe.py --model DIR --out DIR [--prompt 128] [--tokens 64] [--distances 1,2]

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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
    from bench.suite.strata_case import prompts_for
    from strata import Engine
    from strata.runtime.moe import MoEBlock
    from strata.runtime.tiered_moe import router_predictors

    distances = [int(d) for d in args.distances.split(",")]
    conf = {"runtime": {"experts": "memory", "cuda_graphs": False, "max_context": args.prompt + args.tokens + 8}}
    actual: dict[int, list[torch.Tensor]] = {}  # layer -> ids [k] of each decode step
    predicted: dict[tuple[int, int], list[torch.Tensor]] = {}  # (layer, d) -> ids [k] predicted d layers ahead
    with Engine.from_pretrained(args.model, device=args.device, config=conf) as eng:
        model = eng.model
        predictors = router_predictors(model)
        moe = sorted(predictors)
        predicting = [False]  # the predictors call the same router modules: their calls are not the layer's own
        for i in moe:
            def gate_hook(_mod, _inp, out, i=i):
                if out[1].shape[0] == 1 and not predicting[0]:  # decode steps only
                    actual.setdefault(i, []).append(out[1][0].cpu())
            model.layers[i].mlp.gate.register_forward_hook(gate_hook)

        def after_layer(i: int, hidden: torch.Tensor) -> None:
            if hidden.shape[0] != 1:
                return
            predicting[0] = True
            for d in distances:
                j = i + d
                if j in predictors:
                    predicted.setdefault((j, d), []).append(predictors[j](hidden)[0].cpu())
            predicting[0] = False

        model.after_layer = after_layer
        assert all(isinstance(model.layers[i].mlp, MoEBlock) for i in moe)
        prompt = prompts_for(Workload(args.prompt, 1, args.tokens), eng.checkpoint.config.vocab_size)[0]
        eng.generate(prompt, max_tokens=args.tokens, temperature=1.0, seed=1000, stop_token_ids=[])
        experts = eng.checkpoint.config.num_experts
    rows = []
    for d in distances:
        hit = n = cold_hit = cold_n = 0
        for j in moe:
            preds, acts = predicted.get((j, d), []), actual.get(j, [])
            if not preds:
                continue
            acts = acts[-len(preds):]  # the prompt's last token predicts its first decode step: align the ends
            counts = torch.bincount(torch.cat(acts), minlength=experts)
            hot = set(counts.argsort(descending=True)[: experts // 4].tolist())
            for p, a in zip(preds, acts, strict=True):
                pset = set(p.tolist())
                for e in a.tolist():
                    n += 1
                    hit += e in pset
                    if e not in hot:
                        cold_n += 1
                        cold_hit += e in pset
        rows.append({"distance": d, "lookups": n, "recall": round(hit / max(1, n), 4),
                     "cold_lookups": cold_n, "cold_recall": round(cold_hit / max(1, cold_n), 4)})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "lookahead.json").write_text(json.dumps({"model": args.model, "prompt": args.prompt,
                                                           "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
