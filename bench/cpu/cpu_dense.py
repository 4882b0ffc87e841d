"""The CPU dense kernel's weight-read rate by rows of activations: a decode step's projections for 1 to 16 streams.

    python bench/cpu/cpu_dense.py [--shape 151936 2048] [--rows 1 2 4 8 16] [--threads 1 2] [--repeat 15]
                                  [--prefetch 0 2048] [--rounds 1] [--out DIR]

Times `strata.kernels.cpu.dense.linear` (bf16 weights in 2 MiB pages, as an engine loads them; fp32 out, as the LM
head's logits) on a weight of `--shape` (default the bench model's LM head, 622 MB: larger than any cache), for each
row count and thread count; the figure is the weight's bytes over the median call. One stream is one row; a decode
step of S streams reads every dense weight once for S rows. `--prefetch`: software prefetch distances in bytes
(`library.configure(prefetch_bytes=)`; default: this CPU's), each case timed at each in turn, `--rounds` times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[151936, 2048], metavar=("N", "K"))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--prefetch", type=int, nargs="+", default=None, help="prefetch distances to alternate (bytes)")
    p.add_argument("--rounds", type=int, default=1, help="times each case is timed at each distance, alternating")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from bench.provenance import write_record
    from strata.kernels.cpu import dense, library
    from strata.runtime.model.hugepages import copy_to_huge_pages

    n, k = args.shape
    shipped = library.prefetch_bytes()
    weight = copy_to_huge_pages(torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    results = []
    for threads in args.threads:
        for rows in args.rows:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
            if dense.linear(x, weight, None, torch.float32, threads=threads) is None:
                raise SystemExit(f"cpu_dense: the dense kernel does not take {rows} rows here (no AVX2, or too many)")
            for rnd in range(args.rounds):
                for pf in args.prefetch or [None]:
                    if pf is not None:
                        library.configure(prefetch_bytes=pf)
                    times = []
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        dense.linear(x, weight, None, torch.float32, threads=threads)
                        times.append(time.perf_counter() - t0)
                    t = statistics.median(times)
                    results.append({"threads": threads, "rows": rows, "prefetch": library.prefetch_bytes(), "round": rnd,
                                    "ms": round(t * 1e3, 2), "GB_s": round(weight.numel() * 2 / t / 1e9, 1)})
                    print(json.dumps(results[-1]), flush=True)
    if args.prefetch:
        library.configure(prefetch_bytes=shipped)
    write_record(args.out, "cpu_dense.json", "cpu/cpu_dense", "bench/cpu/cpu_dense.py", argv, shape=[n, k], results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
