"""Host time per decode step of the Engram row store alone (no model, no GPU): where the disk tier's cost goes.

    python bench/engram_rows_host.py [--tiers pinned,disk] [--table-rows 400000] [--batch 8] [--steps 300]
                                     [--row-cache 65536] [--profile] [--out DIR]

The `small` demo model's two Engram tables (layers 1 and 5, 8 heads each), enlarged to `--table-rows` rows per
head, in a store on the real disk under `--work` (O_DIRECT reads; the page cache does not help). Each step
asks both layers for `--batch` tokens x 8 heads of Zipf-distributed rows (exponent 1.1, as bench/engram.py)
and serves them as a decode step does: `start` per layer, then `finish_step` (rows admitted to the host row
cache the GPU reads in place) where the tier has that cache, else `wait`. Reports microseconds per step and
the part spent waiting for reads (the stall); with `--profile`, the host functions by own time. On the GPU box
a disk-tier decode step costs ~7 ms more than a pinned one (RESULTS.md, issue 6): this separates host
bookkeeping from the reads on any machine. Writes engram_rows_host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np
import torch

from strata.runtime import engram_demo
from strata.runtime.convert import convert_checkpoint
from strata.runtime.demo_model import write_demo_model
from strata.tiers.engram_rows import EngramRowStore
from strata.tiers.store import ExpertStore

LAYERS = [1, 5]


def build_store(work: Path, table_rows: int) -> Path:
    """The enlarged demo model and its store under `work` (reused when already there)."""
    with engram_demo.demo_tables("small", table_rows):
        model = work / f"small-engram-{table_rows}"
        if not model.exists():
            write_demo_model(model, "small", progress=True)
        store = work / f"store-{table_rows}"
        if not store.exists():
            convert_checkpoint(model, store, progress=True)
        return store


def run_tier(store: ExpertStore, tier: str, args) -> dict:
    rs = EngramRowStore(store, LAYERS, tier, torch.device("cpu"), row_cache=args.row_cache, threads=args.threads)
    rng = np.random.default_rng(0)
    heads = 2 * engram_demo._SIZES["small"][1]  # hash heads per n-gram order, orders 2 and 3
    num_rows = {layer: rs.tables[layer].num_rows for layer in LAYERS}

    def step() -> None:
        tickets = {}
        for layer in LAYERS:
            r = np.minimum(rng.zipf(1.1, (args.batch, heads)), num_rows[layer]) - 1
            tickets[layer] = rs.start(layer, torch.from_numpy(r.astype(np.int64)))
        if rs.gather_view is not None:
            rs.finish_step(tickets)
        else:
            for t in tickets.values():
                rs.wait(t)

    try:
        for _ in range(args.warmup):
            step()
        stall0, t0 = rs.stats_.stall_s, time.perf_counter()
        for _ in range(args.steps):
            step()
        per_step = (time.perf_counter() - t0) / args.steps
        out = {"tier": tier, "us_per_step": round(per_step * 1e6, 1),
               "stall_us_per_step": round((rs.stats_.stall_s - stall0) / args.steps * 1e6, 1),
               "hits": rs.stats()["hits"]}
        if args.profile:
            prof, buf = cProfile.Profile(), io.StringIO()
            prof.enable()
            for _ in range(args.steps):
                step()
            prof.disable()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
            out["profile"] = buf.getvalue()
        return out
    finally:
        rs.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default="pinned,disk")
    ap.add_argument("--table-rows", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--row-cache", type=int, default=65536, help="rows in the host row cache")
    ap.add_argument("--threads", type=int, default=8, help="disk reader threads")
    ap.add_argument("--work", default="~/.cache/strata-engram-rows", help="a real disk (not tmpfs)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    store = ExpertStore.open(build_store(work, args.table_rows))
    try:
        results = [run_tier(store, tier, args) for tier in args.tiers.split(",")]
    finally:
        store.close()
    for r in results:
        print(f"{r['tier']:7s} {r['us_per_step']:9.1f} us/step (waiting for reads {r['stall_us_per_step']:.1f}) "
              f"hits {r['hits']}")
        if "profile" in r:
            print(r["profile"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engram_rows_host.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
