"""Where the CPU expert kernel's time goes on one decode layer's share, by phase, and what its scheduling knobs do.

    python bench/cpu/cpu_kernel_trace.py [--threads 12] [--calls 200] [--gap-us 80]
                                         [--knobs "claim_ahead=0,down_split=0;claim_ahead=4,down_split=1"] [--warm]
                                         [--own MB [--read-knobs "warm_streams=1;warm_streams=4"]] [--out DIR]

The mailbox worker calls the kernel once per MoE layer with ~80 us of GPU work between calls (skewed routing,
25% budget: ~1.6 cold experts a layer, ~60% of each computed here). Fitting the kernel's time against the bytes
it reads leaves ~30 us a call that no byte explains (measured in decode on the H200 machine). This
calls the kernel the way the worker does (experts by address, the CPU's leading rows of split experts, a spin
of --gap-us between calls, fresh experts every call so nothing is cached) for shares from a quarter expert to
four, with the kernel's phase trace on (`strata.kernels.cpu.experts.trace`), once per knob set
(`cpu_experts.tune`), and prints per share: us a call, GB/s, and the phases: set-up, the last thread's arrival,
gate/up, a thread's mean wait at the barrier, down, a thread's mean idle time at the end. Then the least-squares
line of time against bytes per knob set: its intercept is the fixed cost. Writes cpu_kernel_trace.json.
Runs on any x86-64 machine (no GPU); the figures that matter are the GPU box's.
"""

from __future__ import annotations

import argparse
import array
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script
from strata.kernels.cpu import experts as ce  # noqa: E402
from strata.kernels.cpu.tuning import parse_knobs  # noqa: E402

HIDDEN, INTER = 2048, 768  # the bench model's expert (Qwen3-30B-A3B): 9.4 MB in bf16
# (experts, fraction of the intermediate rows computed here, packed): a split expert's rows are the leading part
# of each down row (strided reads); "packed" lays the same bytes out as a smaller expert (contiguous down rows),
# what a store layout with down's split part contiguous would read
SHARES = [(1, 0.25, False), (1, 0.6, False), (1, 0.6, True), (1, 1.0, False), (2, 0.6, False), (2, 0.6, True),
          (2, 1.0, False), (4, 1.0, False)]


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def run_share(pool: torch.Tensor, experts: int, frac: float, packed: bool, calls: int, threads: int, gap_us: float,
              rng: np.random.Generator, warm: bool = False, own: int = 0) -> dict:
    """`calls` kernel calls on `experts` fresh experts each (`frac` of their rows), traced. With `warm`, each call's
    experts are first read once on the kernel's pool (`read_sweep`, untimed), as a worker that knew the next
    layer's cold experts could do while the GPU runs that layer's attention: the kernel then reads them from the
    caches (L2/L3) instead of RAM. With `own` (bytes), up to that many bytes of their gate/up rows are read first
    by the threads that will compute them (`warm_rows`, whole experts in order, untimed; the mailbox worker's
    warm-ahead), and the kernel computes those rows on those threads."""
    rows = max(1, round(INTER * frac))
    ld = rows if packed else INTER
    gu_elems = 2 * INTER * HIDDEN
    x = torch.randn(1, HIDDEN)
    out = torch.zeros(1, HIDDEN)
    idx = torch.zeros(1, dtype=torch.int64)
    w = torch.ones(1)
    base, stride = pool.data_ptr(), pool.stride(0) * 2
    t: dict[str, int] = {}
    read_s, read_bytes = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(calls):
        meta = array.array("q")
        chosen = rng.choice(pool.shape[0], size=experts, replace=False)
        for e in chosen:
            addr = base + int(e) * stride
            meta.extend((addr, addr + gu_elems * 2, idx.data_ptr(), w.data_ptr(), 1, rows, ld))
        if warm:
            ce.read_sweep([pool[int(e), : 3 * INTER * HIDDEN] for e in chosen], threads)
        wrows = None
        if own:
            left, wrows = own, array.array("q")
            for _ in chosen:
                wrows.append(min(rows, left // (4 * HIDDEN)))
                left -= wrows[-1] * 4 * HIDDEN
            r0 = time.perf_counter()
            read_bytes += ce.warm_rows([base + int(e) * stride for e in chosen], wrows, HIDDEN, ld, threads)
            read_s += time.perf_counter() - r0
        ce.trace(True)
        ce.run_packed(x, meta, out, threads, warm=wrows)
        for k, v in ce.trace(False).items():
            t[k] = t.get(k, 0) + v
        spin(gap_us)
    wall = time.perf_counter() - t0
    n = max(1, t["calls"])
    us = {k[:-3]: t[k] / n / 1e3 for k in t if k.endswith("_ns")}
    return {"experts": experts, "fraction": frac, "packed": packed, "warm": warm, "own": own, "bytes": t["bytes"] // n, "us": us,
            "gbps": t["bytes"] / max(1, t["call_ns"]), "threads_joined": t["threads_joined"] / n,
            "phase1_chunks": t["phase1_chunks"] / n, "claimed_ahead": t["claimed_ahead"] / n, "wall_s": wall,
            "read_us": read_s / max(1, calls) * 1e6, "read_gbps": read_bytes / read_s / 1e9 if read_s else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--gap-us", type=float, default=80.0)
    ap.add_argument("--pool-experts", type=int, default=96, help="distinct experts cycled through (beyond the LLC)")
    ap.add_argument("--knobs", default="claim_ahead=0,down_split=0;claim_ahead=4,down_split=1",
                    help="knob sets to compare, ';' between sets (default: without and with claiming down chunks "
                         "ahead and pairing down rows across a chunk's halves, the defaults)")
    ap.add_argument("--warm", action="store_true", help="also time every share with its experts read just before "
                    "(in the caches), with the first knob set")
    ap.add_argument("--own", type=float, default=0.0, help="also time every share with up to this many MB of its "
                    "gate/up rows read first by the threads that compute them (warm-ahead), with the first knob set")
    ap.add_argument("--read-knobs", default="", help="with --own: warm-ahead's read settings to compare, ';' between "
                    "sets (e.g. \"warm_streams=1;warm_streams=4,warm_touch=2\"; default: the kernel's)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    if ce.backend() == "torch":
        raise SystemExit("the CPU expert kernel is not available here (torch fallback): nothing to trace")
    slot = -(-3 * INTER * HIDDEN // 2048) * 2048  # elements, page-aligned rows like a store slot
    pool = torch.empty(args.pool_experts, slot, dtype=torch.bfloat16)
    pool.normal_(0, 0.02)
    rng = np.random.default_rng(0)
    sets = [parse_knobs(part, "--knobs") for part in args.knobs.split(";")]
    defaults = ce.tune(**{k: v for s in sets for k, v in s.items()})  # the values in force before
    results = []
    print(f"backend {ce.backend()}, {args.threads} threads, gap {args.gap_us} us, {args.calls} calls a share")
    print("knobs | share | us/call | GB/s | setup | last in | gate/up | barrier wait | down | end idle | claimed")
    for knobs in sets:
        ce.tune(**defaults)
        ce.tune(**knobs)
        label = ",".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"
        run_share(pool, 1, 1.0, False, 20, args.threads, args.gap_us, rng)  # warm the pool's threads
        rows = []
        for experts, frac, packed in SHARES:
            r = run_share(pool, experts, frac, packed, args.calls, args.threads, args.gap_us, rng)
            u = r["us"]
            print(f"{label} | {experts} x {frac:.2f}{' packed' if packed else ''} | {u['call']:.1f} | {r['gbps']:.1f} | {u['setup']:.1f} | "
                  f"{u['last_arrival']:.1f} | {u['phase1']:.1f} | {u['barrier_wait']:.1f} | {u['phase2']:.1f} | "
                  f"{u['end_idle']:.1f} | {r['claimed_ahead']:.1f}")
            rows.append(r)
        fitted = [r for r in rows if not r["packed"]]
        b = np.array([r["bytes"] for r in fitted], dtype=float)
        t = np.array([r["us"]["call"] for r in fitted])
        slope, intercept = np.polyfit(b, t, 1)
        fit = {"fixed_us": float(intercept), "gbps_marginal": float(1e-3 / slope) if slope > 0 else None}
        print(f"{label}: fixed cost {intercept:.1f} us a call, marginal rate {fit['gbps_marginal'] or 0:.1f} GB/s")
        results.append({"knobs": knobs, "shares": rows, "fit": fit})
    if args.warm:  # the same shares from the caches, first knob set: what reading ahead could win at most
        ce.tune(**defaults)
        ce.tune(**sets[0])
        for warm in (False, True):
            for experts, frac, packed in SHARES:
                if packed:
                    continue
                r = run_share(pool, experts, frac, packed, args.calls, args.threads, args.gap_us, rng, warm=warm)
                print(f"{'warm' if warm else 'cold'} | {experts} x {frac:.2f} | {r['us']['call']:.1f} us | "
                      f"{r['gbps']:.1f} GB/s | gate/up {r['us']['phase1']:.1f} | down {r['us']['phase2']:.1f}")
                results.append({"knobs": sets[0], "warm": warm, "shares": [r]})
    if args.own:  # warm-ahead: each thread's piece read by itself just before (timed: the read's GB/s, Python's call
        # overhead included), between cold calls; once per read setting
        ce.tune(**defaults)
        ce.tune(**sets[0])
        own = int(args.own * 1e6)
        read_sets = [parse_knobs(part, "--read-knobs") for part in args.read_knobs.split(";")] if args.read_knobs else [{}]
        print("read knobs | share | read us | read GB/s | call us (cold -> read ahead) | gate/up (cold -> read ahead)")
        for experts, frac, packed in SHARES:
            if packed:
                continue
            for rk in read_sets:
                cold = run_share(pool, experts, frac, packed, args.calls // 2, args.threads, args.gap_us, rng)
                old = ce.tune(**rk)
                r = run_share(pool, experts, frac, packed, args.calls // 2, args.threads, args.gap_us, rng, own=own)
                ce.tune(**old)
                results.append({"knobs": sets[0], "read_knobs": rk, "own": own, "shares": [cold, r]})
                label = ",".join(f"{k}={v}" for k, v in rk.items()) or "defaults"
                print(f"{label} | {experts} x {frac:.2f} | {r['read_us']:.1f} | {r['read_gbps'] or 0:.1f} | "
                      f"{cold['us']['call']:.1f} -> {r['us']['call']:.1f} | {cold['us']['phase1']:.1f} -> "
                      f"{r['us']['phase1']:.1f}")
    ce.tune(**defaults)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_kernel_trace.json").write_text(json.dumps(
        {"backend": ce.backend(), "threads": args.threads, "gap_us": args.gap_us, "calls": args.calls,
         "results": results}, indent=1))


if __name__ == "__main__":
    main()
