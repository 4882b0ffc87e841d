"""CUPTI kernel records of a bench run's timed decode, summed by kernel: where a batched split step's GPU time goes.

Set `STRATA_BENCH_TRACE=DIR` and the suite's timed workloads (`python -m bench run`) run under torch.profiler; each
writes `DIR/<n>-trace.json`: per CUDA stream, the busy time and the kernels by total time (count, total, median us),
and a few consecutive split layers' kernels raw (from one answer fetch to the fourth after it), as
`bench/tools/serial_phase.py` reads a one-stream step.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

from bench.tools.serial_phase import FETCH, has, profiled_kernels, raw_layers, short


@contextlib.contextmanager
def traced(device: str):
    """Profile CUDA kernels inside the block when $STRATA_BENCH_TRACE names a directory; write its summary there."""
    out = os.environ.get("STRATA_BENCH_TRACE")
    if not out or not device.startswith("cuda"):
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
    kernels = profiled_kernels(prof)
    Path(out).mkdir(parents=True, exist_ok=True)
    n = len(list(Path(out).glob("*-trace.json")))
    (Path(out) / f"{n}-trace.json").write_text(json.dumps(summarize(kernels), indent=1))


def summarize(kernels: list[tuple[str, float, float, int]], top: int = 25) -> dict:
    """Per stream: busy us and the `top` kernels by total time; plus three split layers raw."""
    by = defaultdict(lambda: defaultdict(list))
    for name, start, end, stream in kernels:
        by[stream][short(name)].append(end - start)
    streams = {}
    for stream, names in by.items():
        rows = sorted(((k, len(v), sum(v), statistics.median(v)) for k, v in names.items()), key=lambda r: -r[2])
        streams[str(stream)] = {"busy_us": round(sum(r[2] for r in rows), 1),
                                "kernels": [[k, c, round(t, 1), round(m, 2)] for k, c, t, m in rows[:top]]}
    span = kernels[-1][2] - kernels[0][1] if kernels else 0.0
    # a split layer's period: from one answer's fetch to the next; the slowest ones raw
    reads = [i for i, k in enumerate(kernels) if has(k[0], FETCH)]
    periods = sorted(((kernels[b][2] - kernels[a][2], a, b) for a, b in zip(reads, reads[1:], strict=False)),
                     reverse=True)
    t = [p[0] for p in periods]
    slow = []
    for _, a, b in periods[:3]:
        t0 = kernels[a][2]
        slow.append([[short(k[0]), k[3], round(k[1] - t0, 1), round(k[2] - t0, 1)] for k in kernels[a : b + 1][:120]])
    return {"span_us": round(span, 1), "kernels": len(kernels), "streams": streams,
            "periods_us": {"n": len(t), "median": round(statistics.median(t), 1) if t else None,
                           "p90": round(t[len(t) // 10], 1) if t else None, "max": round(t[0], 1) if t else None,
                           "sum": round(sum(t), 1), "over_2ms": sum(1 for x in t if x > 2000)},
            "slowest": slow,
            "layers": raw_layers(kernels, first=max(0, len(reads) // 2))}
