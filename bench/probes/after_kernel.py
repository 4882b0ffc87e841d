"""What a host op costs right after a CPU expert kernel call, against the same op on its own.

    python bench/probes/after_kernel.py [--rows 64 128] [--calls 40] [--rounds 3] [--out DIR]

A CPU share's partial sum is zeroed in a pinned buffer just before its kernel starts (`PinnedSums.take`), a layer after
the last kernel call. Each op below is timed `--calls` times right after one kernel call (8 bf16 experts of the
bench model's shape, 4 tokens each: ~75 MB of weights streamed through the caches, the pool's workers then idle) and
`--calls` times back to back, `--rounds` rounds (medians): torch's `zero_()` of [rows, 2048] fp32 (torch's intra-op
threads), numpy's `fill` of it (one thread's memset), and an RMSNorm over [rows, 2048] bf16 as a prompt's layers run
it (torch's op chain). Writes DIR/after_kernel.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.provenance import write_record  # noqa: E402
from strata.kernels.cpu import experts as ce  # noqa: E402

H, INTER, EXPERTS, TOKENS = 2048, 768, 8, 4


def ops(rows: int) -> dict:
    """The timed ops on [rows, H] tensors, by name."""
    g = torch.Generator().manual_seed(1)
    buf = torch.empty(rows * H)
    x = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    w = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16)
    return {"torch zero_": buf.zero_, "numpy fill": lambda: buf.numpy().fill(0.0),
            "rms_norm, torch chain": lambda: w * F.rms_norm(x.float(), (H,), eps=1e-6).to(x.dtype)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = [((torch.randn(2 * INTER, H, generator=g) * 0.02).to(torch.bfloat16),
                (torch.randn(H, INTER, generator=g) * 0.02).to(torch.bfloat16)) for _ in range(EXPERTS)]
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    out = torch.zeros(TOKENS, H)

    def kernel() -> None:
        ce.cpu_experts_forward(x, weights, [torch.arange(TOKENS)] * EXPERTS, [torch.ones(TOKENS)] * EXPERTS, out=out)

    results = {}
    for rows in args.rows:
        for name, op in ops(rows).items():
            after, alone = [], []
            for _ in range(args.rounds):
                spent = 0.0
                for _ in range(args.calls):
                    kernel()
                    t0 = time.perf_counter()
                    op()
                    spent += time.perf_counter() - t0
                after.append(spent / args.calls * 1e6)
                op()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    op()
                alone.append((time.perf_counter() - t0) / args.calls * 1e6)
            row = {"after_kernel_us": round(statistics.median(after), 1), "alone_us": round(statistics.median(alone), 1),
                   "rounds_after_us": [round(v, 1) for v in after]}
            results[f"{rows} rows, {name}"] = row
            print(f"{rows:4d} rows  {name:22s} after a kernel call {row['after_kernel_us']:8.1f} us, "
                  f"alone {row['alone_us']:7.1f} us", flush=True)
    write_record(args.out, "after_kernel.json", "after_kernel", "bench/probes/after_kernel.py", None,
                 torch_threads=torch.get_num_threads(), kernel_threads=ce.default_threads(), results=results)


if __name__ == "__main__":
    main()
