"""Record a model's routing (every MoE layer's expert ids, prompt and decode) for replay on any machine.

    python bench/tools/route_trace.py --model DIR --out FILE.json [--prompt 128] [--tokens 256] [--device cuda]

The model runs with its experts in memory (no tiers), sampling at temperature 1 as the suite does, from the benchmark suite's prompt for a
`--prompt`-token, one-stream workload, so the trace is the routing the suite's skewed cases see. The trace
(`{"num_experts", "prefill": {layer: [ids...]}, "decode": {layer: [[ids of token t]...]}}`) replays
through the tier policy with `bench/tools/promote_sim.py --trace FILE` on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench.suite` when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from bench.suite.cases import Workload
    from bench.suite.strata_case import prompts_for
    from strata import Engine
    from strata.runtime.model.moe import MoEBlock

    conf = {"runtime": {"experts": "memory", "max_context": args.prompt + args.tokens + 8}}
    calls: dict[int, list] = {}
    with Engine.from_pretrained(args.model, device=args.device, config=conf) as eng:
        for i, layer in enumerate(eng.model.layers):
            if isinstance(layer.mlp, MoEBlock):
                def hook(_mod, _inp, out, i=i):
                    calls.setdefault(i, []).append(out[1].tolist())
                layer.mlp.gate.register_forward_hook(hook)
        prompt = prompts_for(Workload(args.prompt, 1, args.tokens), eng.checkpoint.config.vocab_size)[0]
        eng.generate(prompt, max_tokens=args.tokens, temperature=1.0, seed=1000, stop_token_ids=[])  # as the suite samples
        n_experts = eng.checkpoint.config.num_experts
        n_layers = eng.checkpoint.config.num_layers
    # the prompt is the first call of each layer (possibly in chunks: every call with more than one row)
    prefill = {i: [e for c in cs if len(c) > 1 for row in c for e in row] for i, cs in calls.items()}
    decode = {i: [c[0] for c in cs if len(c) == 1] for i, cs in calls.items()}
    trace = {"model": str(args.model), "num_experts": n_experts, "num_layers": n_layers, "prompt": args.prompt,
             "tokens": args.tokens, "prefill": prefill, "decode": decode}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(trace))
    print(f"{len(decode)} MoE layers, {len(next(iter(decode.values())))} decode steps -> {args.out}")


if __name__ == "__main__":
    main()
