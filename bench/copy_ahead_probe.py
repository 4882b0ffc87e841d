"""The copy-ahead kernel (strata.kernels.copy_ahead) alone: its read rate over PCIe from page-locked RAM into VRAM,
against the link's copy-engine rate in the same run.

Each timing replays a CUDA graph of `--calls` copies, each of a different set of experts of a 2 GB page-locked pool
(beyond any cache), for 1 and 2 staged experts of the bench model's shape (H 2048, I 768, bf16) and tails of 1 to
12 granules of 64 rows (a granule: 0.79 MB). Prints us a copy and GB/s; the copy engine's rate (one 64 MB
`copy_` from pinned RAM) is the reference.

    python bench/copy_ahead_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.gemv_probe import graph_us
from strata.kernels import copy_ahead as ca

H, INTER, GRAN = 2048, 768, 64
SLOT = 3 * H * INTER  # elements
SLOTS = 8  # the copy list's length (CopyAhead.MAX_SLOTS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=16)
    args = ap.parse_args()
    dev = torch.device("cuda")
    pool = torch.empty((2 << 30) // (2 * SLOT), SLOT, dtype=torch.bfloat16).pin_memory()  # ~2 GB of expert slots
    pool.view(torch.int16).random_()
    stage = torch.zeros(SLOTS, SLOT, dtype=torch.bfloat16, device=dev)
    typed = torch.zeros(1, dtype=torch.bfloat16, device=dev)
    n = pool.shape[0]
    out = {"experts_in_pool": n, "cases": []}
    big = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(big, device=dev)
    ce_us = graph_us(lambda i: dst.copy_(big, non_blocking=True), 4)
    out["copy_engine_GB_s"] = round(big.numel() / ce_us / 1e3, 1)
    for experts in (1, 2):
        for granules in (1, 2, 3, 4, 6, 12):
            a = granules * GRAN
            lists = []
            for i in range(args.calls):  # each call: `experts` different slots of the pool
                src = torch.zeros(SLOTS, dtype=torch.int64)
                dst_a = torch.zeros(SLOTS, dtype=torch.int64)
                rows = torch.zeros(SLOTS, dtype=torch.int32)
                for s in range(experts):
                    src[s] = pool[(i * experts + s) * 7 % n].data_ptr()
                    dst_a[s] = stage[s].data_ptr()
                    rows[s] = a
                lists.append((src.to(dev), dst_a.to(dev), rows.to(dev)))
            us = graph_us(lambda i, lists=lists: ca.copy_ahead(*lists[i], typed, INTER, H, 2 * INTER * H), args.calls)
            nbytes = experts * 3 * a * H * 2
            row = {"experts": experts, "granules": granules, "MB": round(nbytes / 1e6, 2), "us": round(us, 1),
                   "GB_s": round(nbytes / us / 1e3, 1)}
            out["cases"].append(row)
            print(json.dumps(row), flush=True)
    # the copy is right: staging slot 0 holds the last call's first expert (2 experts, 12 granules)
    off = ca.tail_offsets(12 * GRAN, INTER, H, 2 * INTER * H)
    want = pool[(args.calls - 1) * 2 * 7 % n][off].view(torch.int16)  # bits: the random pool holds NaNs
    out["last_copy_exact"] = bool(torch.equal(stage[0].cpu()[off].view(torch.int16), want))
    print("copy engine", out["copy_engine_GB_s"], "GB/s; last copy exact:", out["last_copy_exact"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "copy_ahead_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
