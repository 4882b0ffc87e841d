"""CPU expert kernel vs torch's per-expert matmul vs the RAM read bandwidth, measured in the same run.

    python bench/cpu_experts.py [--out DIR] [--threads N] [--pool-gib G] [--seconds S] [--backends a,b]

Shapes: Qwen3-30B-A3B (H=2048, I=768, 9.4 MB per expert) and DeepSeek-V3 (H=7168, I=2048, 88 MB).
One call = one layer: 8 experts, each with all N tokens (N = 1 and 4). The experts come from a pool of
distinct experts, each in its own buffer (gate_up then down, like a store blob), about --pool-gib GiB
per shape (Qwen: 48 layers x 8 = 384 experts at the default 4 GiB), cycled layer by layer, so every
call reads cold weights from RAM, not from the caches.

Figures are effective GB/s = weight bytes of the experts a call uses / its wall time, for
  kernel   strata.kernels.cpu.experts.cpu_experts_forward, every backend this CPU runs
  torch    one `expert_swiglu` per expert on bf16 activations (bf16 F.linear), weighted and added
           with index_add_, torch.set_num_threads(--threads): ~23 GB/s on the H200 machine's 16 cores
  ram      the larger of torch.sum over a 2 GiB fp32 buffer (best of 5) and a streaming read of the
           expert pools on the kernel's own thread pool (`cpu_experts.read_sweep`, best of 3 per shape),
           both with --threads threads: the ceiling the ratios are taken against
Also, for N=1 on the default backend: a software-prefetch-distance sweep and a thread-count sweep, and
the fixed cost of one call (8 tiny experts: Python argument handling, ctypes, fork/join).
Prints a table with ratios (kernel / torch, kernel / ram) and writes `cpu_experts.json` into --out.
About 40 s on the 2-core dev machine; budget about a minute on the 16-core box.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from strata.kernels.cpu import experts as ce
from strata.kernels.experts import expert_swiglu

GiB = 1 << 30
SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048)}
EXPERTS_PER_LAYER = 8
TOKENS = (1, 4)
TARGET_GBS = 60.0
PREFETCH_SWEEP = (0, 1024, 2048, 4096, 8192)  # TARGET_GBS: >= 60 GB/s effective on the H200 machine's 16 cores


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def make_pool(H: int, inter: int, pool_bytes: int, seed: int = 0) -> tuple[list, list[torch.Tensor]]:
    """Distinct experts, each one bf16 blob [gate_up 2I*H | down H*I], filled from a random block."""
    per = 3 * inter * H
    count = max(2 * EXPERTS_PER_LAYER, pool_bytes // (2 * per) // EXPERTS_PER_LAYER * EXPERTS_PER_LAYER)
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(per + 4096, generator=g) * 0.02).to(torch.bfloat16)
    experts, blobs = [], []
    for i in range(count):
        blob = torch.empty(per, dtype=torch.bfloat16)
        off = (i * 977) % 4096  # distinct contents per expert
        blob.copy_(block[off: off + per])
        blobs.append(blob)
        experts.append((blob[: 2 * inter * H].view(2 * inter, H), blob[2 * inter * H:].view(H, inter)))
    return experts, blobs


def run_calls(layers: list, fn, seconds: float) -> tuple[float, int]:
    """Call fn(layer) cycling through the layers until `seconds` have passed; (elapsed, calls)."""
    calls, t0 = 0, time.perf_counter()
    while True:
        fn(layers[calls % len(layers)])
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed, calls


def ram_bandwidth(threads: int, nbytes: int = 2 * GiB, reps: int = 5) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = 0.0
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf.sum()
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        torch.set_num_threads(old)
    del buf
    return best


def overhead_us(threads: int, backend: str) -> float:
    """Fixed cost of one call (Python argument handling, ctypes, fork/join) on a tiny 8-expert layer."""
    H, inter = 64, 16
    layer = [(torch.zeros(2 * inter, H, dtype=torch.bfloat16), torch.zeros(H, inter, dtype=torch.bfloat16))
             for _ in range(EXPERTS_PER_LAYER)]
    x, idx, tw = torch.zeros(1, H), [torch.zeros(1, dtype=torch.int64)] * 8, [torch.ones(1)] * 8
    for _ in range(200):
        ce.cpu_experts_forward(x, layer, idx, tw, threads=threads, backend=backend)
    n, t0 = 2000, time.perf_counter()
    for _ in range(n):
        ce.cpu_experts_forward(x, layer, idx, tw, threads=threads, backend=backend)
    return (time.perf_counter() - t0) / n * 1e6


def bench_case(result: dict, layers: list, shape: str, H: int, inter: int, N: int, backends: list[str], threads: int,
               ram: float, seconds: float) -> None:
    """One shape and token count: torch's per-expert matmul, then every kernel backend (plus prefetch and
    thread-count sweeps of the first backend for N=1); rows appended to result["cases"] and printed."""
    layer_bytes = EXPERTS_PER_LAYER * 3 * inter * H * 2
    x = torch.randn(N, H)
    xb = x.bfloat16()
    idx = [torch.arange(N) for _ in range(EXPERTS_PER_LAYER)]
    tw = [torch.full((N,), 1.0 / EXPERTS_PER_LAYER) for _ in range(EXPERTS_PER_LAYER)]

    def gbs_of(fn, secs=seconds):
        fn(layers[0])
        el, calls = run_calls(layers, fn, secs)
        return calls * layer_bytes / el / 1e9, el / calls * 1e3

    def torch_layer(layer):
        out = torch.zeros_like(x)
        for (gu, dn), i, w in zip(layer, idx, tw, strict=True):
            out.index_add_(0, i, expert_swiglu(xb.index_select(0, i), gu, dn).float() * w[:, None])
        return out

    def kernel(b, t=threads):
        return lambda layer: ce.cpu_experts_forward(x, layer, idx, tw, threads=t, backend=b)

    rows = {}
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows["torch"] = gbs_of(torch_layer)
    finally:
        torch.set_num_threads(old_threads)
    for b in backends:
        rows[b] = gbs_of(kernel(b))
    base = rows["torch"][0]
    for path, (gbs, ms) in rows.items():
        result["cases"].append({"shape": shape, "H": H, "I": inter, "tokens": N, "path": path, "gbs": round(gbs, 2),
                                "ms_per_layer": round(ms, 3), "vs_torch": round(gbs / base, 2),
                                "of_ram": round(gbs / ram, 3), "pool_experts": len(layers) * EXPERTS_PER_LAYER})
        print(f"{shape:<15} {N:>2} {path:<12} {gbs:>7.1f} {ms:>9.3f} {gbs / base:>7.2f}x {gbs / ram:>6.0%}", flush=True)

    if N == 1 and backends:  # tuning sweeps on the default backend, shorter runs
        b = backends[0]
        default_pf = ce.prefetch_bytes()
        sweep = {}
        for pf in PREFETCH_SWEEP:
            ce.configure(prefetch_bytes=pf)
            sweep[pf] = round(gbs_of(kernel(b), seconds / 2)[0], 1)
        ce.configure(prefetch_bytes=default_pf)
        result.setdefault("prefetch_sweep", {})[f"{shape} N=1 {b}"] = sweep
        print(f"  {b}: software prefetch bytes -> GB/s {sweep} (in use: {default_pf})", flush=True)
        logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or threads
        counts = sorted({max(1, threads * k // 4) for k in (1, 2, 3)} | {max(1, threads - 1), threads, logical})
        tsweep = {t: round(gbs_of(kernel(b, t), seconds / 2)[0], 1) for t in counts}
        result.setdefault("thread_sweep", {})[f"{shape} N=1 {b}"] = tsweep
        print(f"  {b}: threads -> GB/s {tsweep}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--threads", type=int, default=None, help="kernel and torch threads (default: physical cores)")
    ap.add_argument("--pool-gib", type=float, default=4.0, help="GiB of distinct experts per shape (default 4)")
    ap.add_argument("--seconds", type=float, default=1.5, help="minimum timed seconds per case")
    ap.add_argument("--backends", default=None, help="comma-separated kernel backends (default: all this CPU runs)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    threads = args.threads or ce.default_threads()

    t0 = time.perf_counter()
    available = ce.available_backends()
    load_s = time.perf_counter() - t0
    backends = [b for b in (args.backends.split(",") if args.backends else available) if b in available and b != "torch"]
    default = ce.backend()
    result = {"machine": machine(), "threads": threads, "pool_gib": args.pool_gib, "experts_per_layer": EXPERTS_PER_LAYER,
              "tokens_routing": "every token of the call routed to all 8 experts of the layer",
              "extension_load_s": round(load_s, 2), "backends": available, "default_backend": default,
              "prefetch_bytes": ce.prefetch_bytes(), "target_gbs": TARGET_GBS, "cases": []}
    print(f"threads {threads}; kernel backends {backends or 'none'}, default {default} "
          f"(extension load {load_s:.1f} s)", flush=True)
    if backends:
        result["call_overhead_us"] = round(overhead_us(threads, backends[0]), 1)
        print(f"fixed cost per call (8 tiny experts, {backends[0]}): {result['call_overhead_us']} us", flush=True)

    ram_sum = ram_bandwidth(threads)
    result["ram_torch_sum_gbs"] = round(ram_sum, 2)
    print(f"RAM read bandwidth, torch.sum over 2 GiB fp32, {threads} threads: {ram_sum:.1f} GB/s", flush=True)
    pools, sweeps = {}, []
    for shape, (H, inter) in SHAPES.items():
        pools[shape] = make_pool(H, inter, int(args.pool_gib * GiB))
        blobs = pools[shape][1]
        nbytes = sum(b.numel() * 2 for b in blobs)
        for _ in range(3):
            el = ce.read_sweep(blobs, threads)
            if el:
                sweeps.append(nbytes / el / 1e9)
        del blobs
    if sweeps:
        result["ram_read_sweep_gbs"] = round(max(sweeps), 2)
        print(f"RAM read bandwidth, strata read sweep over the expert pools (AVX2 loads), {threads} threads: "
              f"{max(sweeps):.1f} GB/s", flush=True)
    ram = max([ram_sum, *sweeps])
    result["ram_gbs"] = round(ram, 2)
    print(f"RAM ceiling used for the ratios: {ram:.1f} GB/s", flush=True)
    print(f"{'shape':<15} {'N':>2} {'path':<12} {'GB/s':>7} {'ms/layer':>9} {'x torch':>8} {'of RAM':>7}", flush=True)

    for shape, (H, inter) in SHAPES.items():
        pool = pools.pop(shape)[0]
        layers = [pool[i: i + EXPERTS_PER_LAYER] for i in range(0, len(pool), EXPERTS_PER_LAYER)]
        for N in TOKENS:
            bench_case(result, layers, shape, H, inter, N, backends, threads, ram, args.seconds)
        del pool, layers

    ones = [c for c in result["cases"] if c["path"] == default and c["tokens"] == 1]
    if ones:
        worst = min(c["gbs"] for c in ones)
        result["default_backend_worst_1tok_gbs"] = worst
        print(f"default backend {default}, 1 token: worst {worst:.1f} GB/s = {worst / ram:.0%} of RAM "
              f"(target >= {TARGET_GBS:.0f} GB/s on the 16-core box)")
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_experts.json").write_text(json.dumps(result, indent=2))
    print(f"done in {result['seconds']} s; wrote {out / 'cpu_experts.json'}")


if __name__ == "__main__":
    main()
