"""Copy-engine copies of an expert's tail (its last intermediate rows) from page-locked RAM into VRAM: the rate a
host-issued copy-ahead would get, against one contiguous copy of the same bytes in the same run.

An expert of the bench model's shape (H 2048, I 768, bf16) sits in its page-locked slot as gate_up [2I, H] then
down [H, I]: the tail of a rows is two contiguous runs (gate's and up's last a rows, a * H elements each) and a
[H, a] column block of down (H runs of 2a bytes at a pitch of 2I bytes): one 2-D copy (cudaMemcpy2DAsync).
For tails of 1 to 6 granules of 64 rows and 1 or 2 experts: us per tail set (CUDA events around `--reps` sets, each
from a different expert of a 2 GB pool), the host's us to issue them, and GB/s; then the down block alone.

    python bench/dma_tail_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import cupy as cp
import torch

H, INTER, GRAN = 2048, 768, 64
SLOT = 3 * H * INTER  # elements of one expert
H2D = 1  # cudaMemcpyHostToDevice


def tail_copies(src: int, dst: int, a: int, down: bool = True, runs: bool = True) -> None:
    """Issue one expert's tail of `a` rows on the current stream: two contiguous runs and one 2-D copy."""
    stream = cp.cuda.get_current_stream().ptr
    run = a * H * 2
    if runs:
        for start in ((INTER - a) * H * 2, (2 * INTER - a) * H * 2):
            cp.cuda.runtime.memcpyAsync(dst + start, src + start, run, H2D, stream)
    if down:
        off = 2 * INTER * H * 2 + (INTER - a) * 2
        cp.cuda.runtime.memcpy2DAsync(dst + off, INTER * 2, src + off, INTER * 2, a * 2, H, H2D, stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    pool = torch.empty((2 << 30) // (2 * SLOT), SLOT, dtype=torch.bfloat16).pin_memory()
    pool.view(torch.int16).random_()
    n = pool.shape[0]
    stage = torch.zeros(2, SLOT, dtype=torch.bfloat16, device="cuda")
    s = cp.cuda.Stream(non_blocking=True)
    out = {"cases": []}
    big = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(big, device="cuda")

    def timed(fn) -> tuple[float, float]:
        with s:
            fn(0)  # warm
            s.synchronize()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            t0 = time.perf_counter()
            for i in range(args.reps):
                fn(i)
            host = (time.perf_counter() - t0) / args.reps * 1e6
            e1.record(s)
            e1.synchronize()
            return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / args.reps, host

    us, _ = timed(lambda i: cp.cuda.runtime.memcpyAsync(dst.data_ptr(), big.data_ptr(), big.numel(), H2D, s.ptr))
    out["contiguous_64MB_GB_s"] = round(big.numel() / us / 1e3, 1)
    for experts in (1, 2):
        for granules in (1, 2, 3, 4, 6):
            a = granules * GRAN
            for kind, down, runs in (("tail", True, True), ("runs", False, True), ("down2d", True, False)):
                def fn(i, a=a, down=down, runs=runs, experts=experts):
                    for e in range(experts):
                        tail_copies(pool[(i * experts + e) * 7 % n].data_ptr(), stage[e].data_ptr(), a, down, runs)
                us, host = timed(fn)
                nbytes = experts * a * H * 2 * ((2 if runs else 0) + (1 if down else 0))
                row = {"experts": experts, "granules": granules, "kind": kind, "MB": round(nbytes / 1e6, 2),
                       "us": round(us, 1), "host_us": round(host, 1), "GB_s": round(nbytes / us / 1e3, 1)}
                out["cases"].append(row)
                print(json.dumps(row), flush=True)
    # the check: a tail copied this way equals the slot's tail
    a = 2 * GRAN
    stage.zero_()
    torch.cuda.synchronize()  # (torch's stream, not `s`: the zeros first)
    with s:
        tail_copies(pool[3].data_ptr(), stage[0].data_ptr(), a)
    s.synchronize()
    slot = pool[3].to("cuda")
    gu = slot[: 2 * INTER * H].view(2 * INTER, H)
    dn = slot[2 * INTER * H:].view(H, INTER)
    sg = stage[0][: 2 * INTER * H].view(2 * INTER, H)
    sd = stage[0][2 * INTER * H:].view(H, INTER)
    ok = bool(torch.equal(sg[INTER - a: INTER], gu[INTER - a: INTER]) and torch.equal(sg[2 * INTER - a:], gu[2 * INTER - a:])
              and torch.equal(sd[:, INTER - a:], dn[:, INTER - a:]) and not sd[:, : INTER - a].any())
    out["tail_equal"] = ok
    print(json.dumps({"contiguous_64MB_GB_s": out["contiguous_64MB_GB_s"], "tail_equal": ok}))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dma_tail_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
