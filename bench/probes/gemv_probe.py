"""The decode GEMV (strata.kernels.gpu.decode_gemv) against cuBLAS's F.linear on a decode step's projections.

Each timing replays a CUDA graph of `--calls` calls (so launch gaps are a graph's, as in decode), rotating over
enough weight copies that every call reads its weights from HBM, not from the 50 MB L2. Prints us a call and
the weight read rate for F.linear, the shipped config, and (with --sweep) every tile config, best first.

    python bench/probes/gemv_probe.py --out DIR [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from strata.kernels.gpu import decode_gemv

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048), "dense_up": (12288, 2048)}


def graph_us(fn, calls: int) -> float:
    """Mean us a call of `fn(i)` for i in range(calls), replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def probe(name: str, ws: list[torch.Tensor], calls: int, sweep: bool) -> dict:
    """One shape at one row of x (decode_gemv.MAX_ROWS; more rows go to F.linear): the GEMV's agreement with
    F.linear, both timed, and (sweep) every tile config."""
    m, k = ws[0].shape
    mb = m * k * 2 / 1e6  # MB / us = TB/s
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref, got = F.linear(x, ws[0]), decode_gemv.linear(x, ws[0])
    rec = {"shape": name, "m": m, "k": k, "MB": round(mb, 2),
           "max_abs_diff": (got.float() - ref.float()).abs().max().item(),
           "differing": round((got != ref).float().mean().item(), 4)}
    t = graph_us(lambda i: F.linear(x, ws[i % len(ws)]), calls)
    rec["cublas_us"], rec["cublas_TBps"] = round(t, 2), round(mb / t, 3)
    t = graph_us(lambda i: decode_gemv.linear(x, ws[i % len(ws)]), calls)
    rec["gemv_cfg"], rec["gemv_us"], rec["gemv_TBps"] = list(decode_gemv.config(m, k)), round(t, 2), round(mb / t, 3)
    if sweep:
        grid = ((1, 2, 4, 8, 16), (256, 512, 1024), (2, 4, 8), (1, 2, 3))
        timed, errors = [], 0
        for c in itertools.product(*grid):
            if c[0] * c[1] > 16384 or c[1] > k:
                continue
            try:
                t = graph_us(lambda i, c=c: decode_gemv.linear(x, ws[i % len(ws)], cfg=c), calls)
            except Exception:  # noqa: BLE001 - a config Triton cannot build is counted and skipped
                errors += 1
                continue
            timed.append({"cfg": list(c), "us": round(t, 2), "TBps": round(mb / t, 3)})
        rec["sweep_best"], rec["sweep_errors"] = sorted(timed, key=lambda r: r["us"])[:6], errors
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    results = []
    for name, (m, k) in SHAPES.items():
        copies = max(4, int(400e6 // (m * k * 2)))  # > 8x the L2 a graph round
        ws = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        rec = probe(name, ws, args.calls, args.sweep)
        results.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "sweep_best"}),
              "best:", rec.get("sweep_best", [])[:3], flush=True)
    with open(os.path.join(args.out, "gemv_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "calls": args.calls, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
