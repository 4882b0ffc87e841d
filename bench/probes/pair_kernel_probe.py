"""Sweep the decode pair kernels' launch configurations (strata.kernels.gpu.experts.grouped) at the bench model's
shapes.

    python bench/probes/pair_kernel_probe.py --out DIR [--tokens 1,4,8]

The pair kernels compute a decode step's resident experts: one gate/up launch and one down launch for every
(token, expert) pair. In the all-in-VRAM layer they take ~27 of ~65 us (torch.profiler's kernel
table on the H200: gate/up at 2.65 TB/s). For N tokens (N x 8 pairs, each token's experts distinct, drawn from 128), each kernel is
timed alone in a CUDA graph of 16 launches over different experts (1.2 GB of slab cycled, beyond the L2), for
the shipped configuration (`grouped.PAIR_CONFIGS`) and a sweep of (block, block, warps, stages); gate/up is swept
with down at the shipped one and vice versa. Prints us a launch and TB/s (weight bytes of the pairs / time) and
writes pair_kernels.json. Every configuration's outputs are checked against the shipped one's (rounding only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.*` when run as a script
from bench.probes.gemv_probe import graph_us  # noqa: E402
from strata.kernels.gpu.experts import grouped  # noqa: E402

H, INTER, E, K = 2048, 768, 128, 8
CALLS = 16
GATE_UP = list(itertools.product((2, 4, 8), (512, 1024, 2048), (2, 4), (2, 3)))
DOWN = list(itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4), (2, 3)))


def gate_up(x, gu, slot_of, ids, used, h, cfg):
    bi, bh, w, s = cfg
    grouped._gate_up_kernel[(ids.numel(), triton.cdiv(INTER, bi))](
        x, gu, slot_of, ids, ids, used, h, ids, H, INTER, K, x.stride(0), gu.stride(0), gu.stride(1), h.stride(0),
        BLOCK_I=bi, BLOCK_H=bh, HAS_ROWS=False, ADDR=False, FIRST=False, PDL=False, num_warps=w, num_stages=s)


def down(h, dn, used, y, cfg):
    bo, bi, w, s = cfg
    p = used.numel()
    grouped._down_kernel[(p, triton.cdiv(H, bo))](
        h, dn, used, used, y, used, used, 0, H, INTER, h.stride(0), dn.stride(0), dn.stride(1), y.stride(0),
        BLOCK_O=bo, BLOCK_I=bi, HAS_ROWS=False, ADDR=False, FIRST=False, PDL=False, num_warps=w, num_stages=s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,4,8")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    gu = (torch.randn(E, 2 * INTER, H, device=dev) * 0.02).to(torch.bfloat16)
    dn = (torch.randn(E, H, INTER, device=dev) * 0.02).to(torch.bfloat16)
    slot_of = torch.arange(E, dtype=torch.int32, device=dev)
    gu_bytes, dn_bytes = 2 * INTER * H * 2, H * INTER * 2
    report = {"device": torch.cuda.get_device_name(), "shipped": grouped.PAIR_CONFIGS, "rows": []}
    for n in (int(t) for t in args.tokens.split(",")):
        p = n * K
        shipped_gu, shipped_dn = grouped.pair_config(p)
        x = torch.randn(n, H, device=dev).to(torch.bfloat16)
        ids = [torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(n)]).reshape(-1) for _ in range(CALLS)]
        used = [torch.empty(p, dtype=torch.int32, device=dev) for _ in range(CALLS)]
        h = [torch.empty(p, INTER, dtype=torch.float32, device=dev) for _ in range(CALLS)]
        y = [torch.empty(p, H, dtype=torch.float32, device=dev) for _ in range(CALLS)]
        for i in range(CALLS):
            gate_up(x, gu, slot_of, ids[i], used[i], h[i], shipped_gu)
        h_ref = [t.clone() for t in h]
        for i in range(CALLS):
            down(h_ref[i], dn, used[i], y[i], shipped_dn)
        y_ref = [t.clone() for t in y]
        for kind, configs, shipped in (("gate_up", GATE_UP, shipped_gu), ("down", DOWN, shipped_dn)):
            rows = []
            for cfg in [shipped] + [c for c in configs if c != shipped]:
                if kind == "gate_up":
                    fns = [partial(gate_up, x, gu, slot_of, ids[i], used[i], h[i], cfg) for i in range(CALLS)]
                    ref, out, nbytes = h_ref, h, p * gu_bytes
                else:
                    fns = [partial(down, h_ref[i], dn, used[i], y[i], cfg) for i in range(CALLS)]
                    ref, out, nbytes = y_ref, y, p * dn_bytes
                try:
                    us = graph_us(lambda i, fns=fns: fns[i](), CALLS)
                except Exception as e:  # noqa: BLE001 - a configuration Triton cannot build: skip it
                    print(f"{kind} {cfg}: {type(e).__name__}")
                    continue
                err = max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(out, ref, strict=True))
                rows.append({"config": list(cfg), "us": round(us, 2), "TBps": round(nbytes / us / 1e6, 3),
                             "rel_err": err})
            best = min(rows, key=lambda r: r["us"])
            rec = {"tokens": n, "pairs": p, "kernel": kind, "shipped": rows[0], "best": best,
                   "top5": sorted(rows, key=lambda r: r["us"])[:5], "all": rows}
            report["rows"].append(rec)
            print(json.dumps({k: rec[k] for k in ("tokens", "kernel", "shipped", "best")}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pair_kernels.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
