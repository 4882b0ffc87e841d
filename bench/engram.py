"""Engram benchmark: decode tokens/s with the Engram tables in VRAM, pinned RAM, tmpfs and disk (and disk
with prefetch off), tables >= 10x the GPU row cache, Zipf-distributed n-gram traffic.

    python bench/engram.py --out results/engram [--table-rows 4000000] [--row-cache 256MiB] [--batch 8] [--steps 256]

Model: the `small` demo model with its Engram tables enlarged (2 layers; rows of 32 bf16 = 64 B;
8 heads per layer of about `--table-rows` rows each). Traffic: `--batch` sequences decode `--steps`
tokens each, one token per sequence per forward pass, the tokens drawn from a Zipf distribution
(exponent `--zipf`) over the vocabulary (teacher-forced, so every tier sees the same rows).
Writes engram.json under --out: per case tok/s, slowdown vs VRAM and the row store's statistics.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from strata import Engine
from strata.runtime import engram_demo
from strata.runtime.demo_model import write_demo_model
from strata.runtime.kv_cache import KVCache, StepBatch

CASES = [("gpu", True), ("pinned", True), ("tmpfs", True), ("disk", True), ("disk", False)]


def zipf_tokens(n: int, vocab: int, a: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(a, n), vocab) - 1
    return rng.permutation(vocab)[ranks]  # rank -> a fixed random token id


def run_case(model_dir: Path, tier: str, prefetch: bool, args, tokens: np.ndarray) -> dict:
    conf = {"engram": {"tier": tier, "row_cache": args.row_cache, "prefetch": prefetch},
            "tiers": {"disk": {"scrub": False}, "tmpfs": {"budget": "64GiB"}}, "prefetch": {"lookahead": 1}}
    t_load = time.perf_counter()
    with Engine.from_pretrained(model_dir, config=conf, device="cuda") as eng:
        load_s = time.perf_counter() - t_load
        model, b = eng.model, args.batch
        cache = KVCache(eng.checkpoint.config, b, args.warmup + args.steps + 8, eng.dtype, eng.device)
        stream = torch.from_numpy(tokens).view(b, -1)  # [batch, warmup + steps]

        def step(t: int) -> None:
            ids = stream[:, t].to(eng.device)
            model(ids, StepBatch(list(range(b)), [t] * b, [1] * b), cache)

        with torch.inference_mode():
            for t in range(args.warmup):  # fills the row cache and the expert tiers
                step(t)
            torch.cuda.synchronize()
            before = model.engram.stats()
            t0 = time.perf_counter()
            for t in range(args.warmup, args.warmup + args.steps):
                step(t)
                model.logits(torch.zeros(b, model.cfg.hidden_size, device=eng.device, dtype=eng.dtype))
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        after = model.engram.stats()
    delta = {k: after[k] - before[k] for k in ("lookups", "unique_rows", "bytes_read", "stall_s")}
    delta["hits"] = {k: v - before["hits"].get(k, 0) for k, v in after["hits"].items()}
    return {"tier": tier, "prefetch": prefetch, "tok_per_s": b * args.steps / dt, "seconds": dt, "load_s": load_s,
            "measured": delta, "totals": after}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", default=None, help="where to write the enlarged demo model (default: under --out)")
    p.add_argument("--table-rows", type=int, default=4_000_000, help="base rows per hash head (8 heads per layer)")
    p.add_argument("--row-cache", default="256MiB")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--zipf", type=float, default=1.1)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engram_demo._SIZES["small"] = ([1, 5], 4, 128, [args.table_rows, args.table_rows])  # enlarge the tables
    model_dir = Path(args.model_dir or out / f"demo-small-engram-{args.table_rows}")
    write_demo_model(model_dir, "small", progress=True)
    tokens = zipf_tokens(args.batch * (args.warmup + args.steps), 8192, args.zipf, seed=0)
    results = []
    for tier, prefetch in CASES:
        r = run_case(model_dir, tier, prefetch, args, tokens)
        print(f"{tier:7s} prefetch={prefetch!s:5s} {r['tok_per_s']:9.1f} tok/s  stall {r['measured']['stall_s']:.3f}s "
              f"hits {r['measured']['hits']}", flush=True)
        results.append(r)
    vram = results[0]["tok_per_s"]
    for r in results:
        r["slowdown_vs_vram"] = 1.0 - r["tok_per_s"] / vram
    table_bytes = results[0]["totals"]["table_bytes"]
    report = {"table_bytes": table_bytes, "row_cache": args.row_cache, "batch": args.batch, "steps": args.steps,
              "zipf": args.zipf, "device": torch.cuda.get_device_name(), "cases": results,
              "targets": {"pinned": 0.03, "tmpfs": 0.05, "disk": 0.15}}
    (out / "engram.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({f"{r['tier']}{'' if r['prefetch'] else '-noprefetch'}": round(r["slowdown_vs_vram"], 4)
                      for r in results}))


if __name__ == "__main__":
    main()
