"""GPU hit rate of split decode's tier policy on a real routing trace, replayed on the CPU (no GPU needed).

    python bench/tools/promote_sim.py [--skew 1.0] [--fraction 0.4] [--tokens 256] [--prompt-repeat 1] [--out DIR]

The `small` demo model with routing skew in its weights (`--skew`, as `strata demo-model --route-skew`)
decodes `--tokens` tokens after a 128-token prompt, all in memory, and every router's choices are
recorded. The trace is then replayed through a TierManager whose GPU tier is simulated in RAM and holds
`--fraction` of the experts (the rest in pinned RAM), the way a split decode step drives it on a GPU box
where the cost model gives every cold expert to the CPU (as measured on the H200: ~0 PCIe bytes per token):
placement fills the tier in the store's hot order, the prompt's experts are staged for prefill, then at
each decode layer the resident experts are hits (`note_hits`) and the cold ones misses computed on the CPU
(`note_gpu_misses`). Policies compared on the same trace:
  no-promote  the GPU tier changes only through placement and prefill (policy.promote = false)
  promote     a cold expert used over twice as often as the victim is copied in the background, one per
              layer and step (policy.promote = true; `ExpertCompute.promote_one`), and the prompt's tokens per
              expert count in the GPU tier's history (`TierManager.note_uses`, called by prefill)
  promote-unweighted   the same without the prompt's counts (a staged expert counts once per chunk)
  oracle      the experts most used over the decode trace itself, placed up front (an upper bound)
Writes promote_sim.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch


def record_trace(model_dir: Path, tokens: int, seed: int = 0) -> tuple[dict[int, list], dict[int, list], int]:
    """(prompt routing, decode routing, experts per layer): routing maps layer -> the prompt's expert ids /
    one list of expert ids per decoded token."""
    from strata import Engine
    from strata.runtime.model.moe import MoEBlock

    eng = Engine.from_pretrained(model_dir, device="cpu", config={"runtime": {"experts": "memory", "max_context": 1024}})
    calls: dict[int, list] = {}
    for i, layer in enumerate(eng.model.layers):
        if isinstance(layer.mlp, MoEBlock):
            def hook(_mod, _inp, out, i=i):
                calls.setdefault(i, []).append(out[1].tolist())
            layer.mlp.gate.register_forward_hook(hook)
    vocab = eng.checkpoint.config.vocab_size
    prompt = [(17 + 31 * j) % vocab for j in range(128)]
    eng.generate(prompt, max_tokens=tokens, temperature=1.0, seed=seed, stop_token_ids=[])
    prefill = {i: [e for row in c[0] for e in row] for i, c in calls.items()}  # the prompt: one call per layer
    decode = {i: [row[0] for row in c[1:]] for i, c in calls.items()}  # one call per decoded token
    return prefill, decode, eng.checkpoint.config.num_experts


def key_store(tmp: Path, layers: int, experts: int, top_k: int, first_moe: int = 0) -> Path:
    """A store with `experts` tiny experts in each of the MoE layers first_moe..layers-1: the `tiny` demo model's
    shape with those counts (the tier policy sees keys and counts, not weights)."""
    from strata.runtime.demo import model as demo_model
    from strata.runtime.demo.configs import BASE_CONFIGS
    from strata.runtime.plan.checkpoints.convert import convert_checkpoint

    cfg = BASE_CONFIGS["tiny"]
    BASE_CONFIGS["tiny"] = {**cfg, "num_hidden_layers": layers, "first_k_dense_replace": first_moe,
                            "n_routed_experts": experts, "num_experts_per_tok": top_k, "n_group": 1, "topk_group": 1}
    try:
        model = demo_model.write_demo_model(tmp / "model", "tiny", engram=False, progress=False)
    finally:
        BASE_CONFIGS["tiny"] = cfg
    return convert_checkpoint(model, tmp / "store", progress=False)


def load_trace(path: Path, tmp: Path) -> tuple[dict[int, list], dict[int, list], int, Path]:
    """A recorded trace and a store with the same (layer, expert) keys to replay it on (`key_store`)."""
    trace = json.loads(path.read_text())
    prefill = {int(k): v for k, v in trace["prefill"].items()}
    decode = {int(k): v for k, v in trace["decode"].items()}
    k = len(next(iter(decode.values()))[0])
    return prefill, decode, trace["num_experts"], key_store(tmp, trace["num_layers"], trace["num_experts"], k, min(decode))


def replay(store_dir: Path, prefill: dict, decode: dict, fraction: float, mode: str) -> dict:
    from strata.runtime.plan.build import hot_order
    from strata.tiers.manager import TierBudgets, TierManager
    from strata.tiers.store.store import ExpertStore

    store = ExpertStore.open(store_dir)
    keys = store.keys()
    slots = max(1, int(len(keys) * fraction))
    m = TierManager(store, TierBudgets(gpu_slots=slots, pinned_slots=len(keys)), gpu_device=torch.device("cpu"),
                    io_threads=2)
    try:
        m.release(m.acquire(list(keys), "cpu"))  # every expert in pinned RAM (as on the bench box)
        if mode == "oracle":
            use = Counter((layer, e) for layer, steps in decode.items() for ids in steps for e in ids)
            order = [k for k, _ in use.most_common()] + [k for k in hot_order(store) if k not in use]
        else:
            order = hot_order(store)
        m.prefetch(order[:slots], "gpu", warm=True)  # start-up placement
        m.wait_settled(60)
        if mode != "oracle":
            for layer, ids in sorted(prefill.items()):  # prefill stages the prompt's experts, layer by layer
                want = sorted(set(ids))
                if mode != "promote-unweighted":  # the prompt's tokens per expert reach the GPU tier's history
                    m.note_uses(layer, Counter(ids))
                for i in range(0, len(want), m.max_acquire("gpu")):
                    m.release_staged(m.stage_gpu(layer, want[i : i + m.max_acquire("gpu")]))
        hits = lookups = promoted = 0
        steps = len(next(iter(decode.values())))
        late = [0, 0, 0]  # the second half's hits, lookups, promotions (after the policy has warmed up)
        for t in range(steps):
            if t == steps // 2:
                late = [-hits, -lookups, -promoted]
            for layer in sorted(decode):
                ids = set(decode[layer][t])
                resident = m.resident_experts(layer, "gpu")
                hit, cold = ids & resident, ids - resident
                m.note_hits(layer, sorted(hit))
                m.note_gpu_misses(layer, sorted(cold))
                hits, lookups = hits + len(hit), lookups + len(ids)
                if mode.startswith("promote") and cold:  # as ExpertCompute.promote_one
                    keep = m.worth_caching(layer, sorted(cold))
                    if keep:
                        score = m.gpu_scores(layer, keep)
                        m.promote((layer, max(keep, key=score.__getitem__)))
                        promoted += 1
            m.wait_settled(60)  # a background copy lands within a layer's time on a GPU box
        late = [late[0] + hits, late[1] + lookups, late[2] + promoted]
        return {"mode": mode, "gpu_slots": slots, "experts": len(keys), "hit_rate": round(hits / lookups, 4),
                "promotions": promoted, "second_half_hit_rate": round(late[0] / late[1], 4),
                "second_half_promotions_per_layer_step": round(late[2] / (len(decode) * (steps - steps // 2)), 3)}
    finally:
        m.close()
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skew", default="1.0")
    ap.add_argument("--fraction", type=float, default=0.4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--prompt-repeat", type=int, default=1,
                    help="replay the prompt's routing this many times in one prefill chunk (a long prompt: 64 x 128 "
                    "tokens = the suite's 8K case)")
    ap.add_argument("--trace", default=None, help="replay a routing trace recorded by bench/tools/route_trace.py (e.g. "
                    "the bench model's on the GPU box) instead of recording the small model's here")
    args = ap.parse_args()
    from strata.runtime.demo.model import write_demo_model
    from strata.runtime.plan.checkpoints.convert import convert_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        if args.trace:
            prefill, decode, n_experts, store = load_trace(Path(args.trace), Path(tmp))
        else:
            skew = args.skew if args.skew == "uniform" else float(args.skew)
            model = write_demo_model(Path(tmp) / "model", "small", engram=False, route_skew=skew, progress=False)
            store = convert_checkpoint(model, Path(tmp) / "store", progress=False)
            prefill, decode, n_experts = record_trace(model, args.tokens)
        prefill = {layer: ids * args.prompt_repeat for layer, ids in prefill.items()}
        use = Counter((layer, e) for layer, steps in decode.items() for ids in steps for e in ids)
        per_layer_top = []
        for steps in decode.values():
            c = Counter(e for ids in steps for e in ids)
            n = sum(c.values())
            top = sum(v for _, v in c.most_common(int(n_experts * args.fraction)))
            per_layer_top.append(top / n)
        result = {"skew": args.skew, "trace": args.trace, "fraction": args.fraction, "tokens": args.tokens,
                  "top_fraction_share": round(sum(per_layer_top) / len(per_layer_top), 4),
                  "distinct_experts_used": len(use),
                  "cases": [replay(store, prefill, decode, args.fraction, mode) for mode in ("no-promote", "promote-unweighted", "promote", "oracle")]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "promote_sim.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
