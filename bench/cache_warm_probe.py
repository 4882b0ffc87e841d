"""Would reading a layer's predicted cold experts into the CPU's caches ahead of time speed up the CPU kernel?

    python bench/cache_warm_probe.py --out DIR [--threads 12] [--experts 1,2]

With next-layer prediction, the CPU worker could read layer l+1's predicted cold experts while the GPU runs
layer l+1's attention (the worker idles then), so the kernel would find them in L2/L3 when their activations
arrive. That only pays if the caches hold a layer's cold experts (9.4 MB each at Qwen3-30B-A3B's shape) and
the kernel runs faster from them. Per call of `n` experts (one token, 8-expert layer shape), best of the
rounds, distinct experts from a 4 GiB pool every call:
  cold     the kernel on experts not read recently (from RAM);
  again    the same experts a second time, right after the first call (as warm as they get);
  touched  the experts read first on the kernel's own pool (`read_sweep`, other threads than compute each
           row), then the kernel (timed alone).
Also records `lscpu`'s cache sizes. Writes cache_warm.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_experts import machine, make_pool  # noqa: E402
from strata.kernels import cpu_experts as ce  # noqa: E402

H, INTER = 2048, 768


def kernel_s(x, experts, idx, w, out, threads) -> float:
    t0 = time.perf_counter()
    ce.cpu_experts_forward(x, experts, [idx] * len(experts), [w] * len(experts), out=out, threads=threads)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--experts", default="1,2")
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    experts, blobs = make_pool(H, INTER, 4 << 30)
    x = torch.randn(1, H) * 0.5
    idx, w = torch.zeros(1, dtype=torch.int64), torch.ones(1)
    out = torch.zeros(1, H)
    per = blobs[0].numel() * 2
    rec = {"machine": machine(), "backend": ce.backend(), "threads": args.threads, "expert_MB": round(per / 1e6, 2),
           "lscpu": subprocess.run("lscpu | grep -i cache", shell=True, capture_output=True, text=True).stdout}
    cursor = 0
    for n in (int(v) for v in args.experts.split(",")):
        times = {"cold": [], "again": [], "touched": []}
        for _ in range(args.calls):
            group = [experts[(cursor + i) % len(experts)] for i in range(n)]
            cursor += n
            times["cold"].append(kernel_s(x, group, idx, w, out, args.threads))
            times["again"].append(kernel_s(x, group, idx, w, out, args.threads))
            group = [experts[(cursor + i) % len(experts)] for i in range(n)]
            cursor += n
            ce.read_sweep([blobs[(cursor - n + i) % len(blobs)] for i in range(n)], args.threads)
            times["touched"].append(kernel_s(x, group, idx, w, out, args.threads))
        row = {"experts": n}
        for k, v in times.items():
            v.sort()
            med = v[len(v) // 2]
            row[f"{k}_us"] = round(med * 1e6, 1)
            row[f"{k}_GBps"] = round(n * per / med / 1e9, 1)
        print(json.dumps(row), flush=True)
        rec.setdefault("rows", []).append(row)
    print(rec["lscpu"])
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "cache_warm.json").write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
