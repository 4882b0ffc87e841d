"""Random Engram-row reads from a table file on disk: one decode layer's misses (`--rows` rows, each its own
4 KiB block) read by the store's `DiskReader` through Linux AIO (all in flight from one thread) and through
native threads (1, 8, 16, 32), through the reader's pool (as prefetches read; the rows' handshake reads with the
same native calls from its own thread, strata.tiers.row_serve). Microseconds per batch: median and p90 over
`--reps` batches.

    python bench/row_reads.py --table ~/.cache/strata-engram-bench/<store>/tables/engram.1.bin [--rows 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from strata.tiers.diskio import DiskReader

ROW_BYTES = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = Path(args.table).expanduser()
    n_rows = path.stat().st_size // ROW_BYTES
    rng = np.random.default_rng(0)
    out = torch.empty(args.rows * ROW_BYTES, dtype=torch.uint8)
    results = {}
    modes = [("aio", 8, True), ("threads-1", 1, False), ("threads-8", 8, False), ("threads-16", 16, False),
             ("threads-32", 32, False)]
    with DiskReader(8) as reader:
        print(f"{path}: O_DIRECT {reader.uses_direct(path)}, {n_rows} rows of {ROW_BYTES} B", flush=True)
        for name, threads, aio in modes * 2:  # twice: the first pass warms the files and threads
            reader.num_threads, reader.aio = threads, aio
            times = []
            for _ in range(args.reps):
                rows = rng.integers(0, n_rows, args.rows)
                t0 = time.perf_counter()
                reader.read_rows(path, 0, ROW_BYTES, rows, out).result()
                times.append(time.perf_counter() - t0)
            q = statistics.quantiles(times, n=10)
            results[name] = {"median_us": round(statistics.median(times) * 1e6, 1), "p90_us": round(q[-1] * 1e6, 1)}
    print(json.dumps(results))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "row_reads.json").write_text(json.dumps({"table": str(path), "rows": args.rows,
                                                                   "results": results}, indent=1))


if __name__ == "__main__":
    main()
