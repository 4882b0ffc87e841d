"""Decode on tiers: the `bench` demo model (Qwen3-30B-A3B shape) with a fraction of its experts in VRAM.

    python bench/hotpath.py --model DIR [--gpu-fraction 0.25] [--tokens 32] [--out DIR]

Cases, all in this one run on the same weights (the store is built once, on first use):
  ceiling   every expert in VRAM (runtime.experts = "memory")
  split     GPU budget = fraction of the expert bytes, the rest in pinned RAM; cold experts split
            between the CPU kernel and PCIe copies by the cost model (cpu_numerics = "fork")
  copy      the same budget, cold experts always copied (cpu_numerics = "gpu")
  cpu       GPU budget 0: every routed expert computed on the CPU from RAM
Each reports decode tok/s (one stream, 128-token prompt), GPU hit rate, bytes over PCIe per token,
CPU-computed experts per token, stall seconds per token, and the roofline for that hit rate:
time per token >= cold bytes per token / (PCIe + CPU rates), with the rates of LIMITS.md
(55 GB/s PCIe + 70 GB/s CPU). Writes hotpath.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

PCIE, CPU = 55e9, 70e9


def run_case(model: str, name: str, cfg: dict, tokens: int, device: str = "cuda") -> dict:
    from strata import Engine

    engine = Engine.from_pretrained(model, config=cfg, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    prompt = [100 + i for i in range(128)]
    engine.generate(prompt, max_tokens=4)  # warm-up: placement, kernels, the CPU kernel's build
    if engine.tiers is not None:
        time.sleep(2)  # let initial placement land
    before = engine.stats()
    sync()
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_tokens=tokens, stop_token_ids=[])
    sync()
    dt = time.perf_counter() - t0
    after = engine.stats()
    n = max(1, len(out.token_ids))
    res = {"case": name, "tokens": len(out.token_ids), "seconds": round(dt, 3), "tok_s": round(n / dt, 2)}
    t0s, t1s = before["tiers"], after["tiers"]
    if t1s is not None:
        lookups = t1s["lookups"] - t0s["lookups"]
        gpu_hits = t1s["tiers"].get("gpu", {}).get("hits", 0) - t0s["tiers"].get("gpu", {}).get("hits", 0)
        pcie = t1s["paths"].get("pinned->gpu", {}).get("bytes", 0) - t0s["paths"].get("pinned->gpu", {}).get("bytes", 0)
        cpu_exp = after["cpu_experts_computed"] - before["cpu_experts_computed"]
        slot = engine.tiers.store.payload_bytes
        cold_bytes = (lookups - gpu_hits) * slot / n
        roof_s = cold_bytes / (PCIE + CPU) if name == "split" else cold_bytes / (PCIE if name == "copy" else CPU)
        res.update(gpu_hit_rate=round(gpu_hits / lookups, 3) if lookups else None,
                   pcie_bytes_per_token=int(pcie / n), cpu_experts_per_token=round(cpu_exp / n, 1),
                   stall_s_per_token=round((t1s["stall_seconds"] - t0s["stall_seconds"]) / n, 4),
                   roofline_tok_s=round(1 / roof_s, 1) if roof_s else None,
                   fraction_of_roofline=round((n / dt) * roof_s, 3) if roof_s else None,
                   cpu_GB_s=round(after["cpu_bytes_per_s"] / 1e9, 1))
    engine.close()
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(res, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=".")
    ap.add_argument("--cache", default="/dev/shm/strata-cache")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run)")
    args = ap.parse_args()
    from strata.runtime.inspect import summarize_checkpoint

    s = summarize_checkpoint(args.model)
    budget = int(s.bytes_by_role["experts"] * args.gpu_fraction)
    disk = {"path": args.cache, "scrub": False}
    tiered = {"tiers": {"gpu": {"budget": str(budget)}, "disk": disk}, "runtime": {"max_context": 1024}}
    cases = [
        ("ceiling", {"runtime": {"experts": "memory", "max_context": 1024}}),
        ("split", tiered),
        ("copy", {**tiered, "runtime": {"max_context": 1024, "cpu_numerics": "gpu"}}),
        ("cpu", {"tiers": {"gpu": {"budget": "0"}, "disk": disk}, "runtime": {"max_context": 1024}}),
    ]
    result = {"model": args.model, "gpu_fraction": args.gpu_fraction, "expert_bytes": s.bytes_by_role["experts"],
              "gpu_budget_bytes": budget, "cases": []}
    for name, cfg in cases:
        try:
            result["cases"].append(run_case(args.model, name, cfg, args.tokens, args.device))
        except Exception as e:  # noqa: BLE001 - record and go on to the next case
            result["cases"].append({"case": name, "error": f"{type(e).__name__}: {e}"})
            print(name, "failed:", e, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hotpath.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
