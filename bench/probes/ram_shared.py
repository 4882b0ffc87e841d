"""Do the two cold-expert paths share host RAM? PCIe copies from pinned RAM and the CPU expert kernel both
read host memory; the roofline of a split decode step adds their rates (55 + 70 GB/s on the H200 box), which
holds only if the memory controller serves both at once.

    python bench/probes/ram_shared.py [--gib 4] [--threads 16] [--gpus 0,1] [--out DIR]

Measures, each alone and then both at once: pinned -> GPU copies in expert-sized chunks (9.4 MB, the bench
model's expert) and the CPU kernel's read sweep (`cpu_experts.read_sweep`, the kernel's thread pool and
loads) over separate buffers. Together: the copies are enqueued, the sweep repeats until they have landed,
and each rate is taken over its own bytes and time. Writes ram_shared.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

CHUNK = 9_437_184  # one expert of the bench model (Qwen3-30B-A3B shape, bf16)


def _copies(src: list[torch.Tensor], dst: torch.Tensor, stream: torch.cuda.Stream):
    """Enqueue every chunk of `src` into the rows of `dst` (a ring) on `stream`; returns (start, end) events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for i, s in enumerate(src):
            dst[i % dst.shape[0]].copy_(s, non_blocking=True)
        end.record(stream)
    return start, end


def measure(gib: float, threads: int | None, gpus: list[int]) -> dict:
    from strata.kernels.cpu import experts as ce
    from strata.tiers.storage.pinned import PinnedPool

    n = int(gib * 2**30 // CHUNK)
    pool = PinnedPool(CHUNK, n, background=False)
    src = [pool.slot(i) for i in range(n)]
    for s in src:
        s.fill_(1)  # touch every page
    cpu_bufs = [torch.ones(CHUNK, dtype=torch.uint8) for _ in range(n)]  # what the CPU reads meanwhile
    dsts = [torch.empty((64, CHUNK), dtype=torch.uint8, device=f"cuda:{g}") for g in gpus]
    streams = [torch.cuda.Stream(device=f"cuda:{g}") for g in gpus]
    nbytes = n * CHUNK
    out: dict = {"gib_per_path": gib, "chunk_bytes": CHUNK, "gpus": gpus, "threads": threads or ce.default_threads()}

    def copies() -> list:  # every card copies all of `src` at once (each from the same pinned pool)
        evs = []
        for g, dst, stream in zip(gpus, dsts, streams, strict=True):
            with torch.cuda.device(g):
                evs.append(_copies(src, dst, stream))
        return evs

    def rate(evs) -> list[float]:
        for _, end in evs:
            end.synchronize()
        return [nbytes / (start.elapsed_time(end) / 1000) / 1e9 for start, end in evs]

    for g, dst, stream in zip(gpus, dsts, streams, strict=True):  # warm-up
        with torch.cuda.device(g):
            _copies(src[:8], dst, stream)
        torch.cuda.synchronize(g)
    ce.read_sweep(cpu_bufs[:8], threads)
    pcie_alone = rate(copies())
    out["pcie_alone_GB_s"] = [round(r, 1) for r in pcie_alone]
    sweep = min(ce.read_sweep(cpu_bufs, threads) for _ in range(3))
    out["cpu_alone_GB_s"] = round(nbytes / sweep / 1e9, 1)

    for g in gpus:
        torch.cuda.synchronize(g)
    evs = copies()
    t0, read = time.perf_counter(), 0
    while not all(end.query() for _, end in evs):  # the CPU reads while the copies run, 1/8 of its buffers at a time
        part = cpu_bufs[(read // CHUNK) % n :][: max(1, n // 8)]
        ce.read_sweep(part, threads)
        read += len(part) * CHUNK
    t_cpu = time.perf_counter() - t0
    pcie = rate(evs)
    cpu = read / t_cpu / 1e9
    out.update(pcie_together_GB_s=[round(r, 1) for r in pcie], cpu_together_GB_s=round(cpu, 1),
               combined_GB_s=round(sum(pcie) + cpu, 1),
               combined_vs_sum_alone=round((sum(pcie) + cpu) / (sum(pcie_alone) + out["cpu_alone_GB_s"]), 3))
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0, help="bytes each path reads, in GiB")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: the kernel's default)")
    ap.add_argument("--gpus", default="0", help="cards copying at once, e.g. 0,1")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ram_shared.py needs a CUDA GPU (it measures pinned -> GPU copies); none is available")
    res = measure(args.gib, args.threads or None, [int(g) for g in args.gpus.split(",")])
    print(json.dumps(res), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ram_shared.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
