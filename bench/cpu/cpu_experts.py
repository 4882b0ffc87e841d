"""CPU expert kernel vs torch's per-expert matmul vs the RAM read bandwidth, measured in the same run.

    python bench/cpu/cpu_experts.py [--out DIR] [--threads N] [--pool-gib G] [--seconds S] [--backends a,b]
                                    [--experts bf16,fp8,mxfp4,q4_k,q6_k,q2_k,q8_0] [--shapes qwen3-30b-a3b,deepseek-v3]
                                    [--rounds R] [--tokens 1,4]

Shapes: Qwen3-30B-A3B (H=2048, I=768, 9.4 MB per expert in bf16) and DeepSeek-V3 (H=7168, I=2048, 88 MB).
One call = one layer: 8 experts, each with all N tokens (N = 1 and 4; --tokens). The experts come from a pool of
distinct experts, each in its own buffer (a store blob: strata.kernels.quant.ExpertLayout), about --pool-gib
GiB per shape and format (Qwen in bf16: 48 layers x 8 = 384 experts at the default 4 GiB), cycled layer by
layer, so every call reads cold weights from RAM, not from the caches.

--experts: the formats the experts are stored in: bf16 (default), fp8 (block-scaled e4m3, 128 x 128 blocks),
mxfp4 (e2m1 with an e8m0 scale per 32 values) and GGUF's q4_k, q6_k, q2_k and q8_0 (every matrix in that ggml block
type), the kernel reading them as stored (QuantMatrix views of the blob). A quantized pool holds one expert quantized
from random bf16 weights (GGUF: random blocks with small finite f16 scales), copied into every blob (the kernel's
speed does not depend on the values). Every format's pool of a shape is held at once (formats x G GiB), and
--rounds R measures each format and backend R times, alternating, keeping the best: on a machine shared with
other work, a burst of it then costs one round of every format rather than one format's figures.

Figures are effective GB/s = bytes of the experts a call uses, in their format (values and scales: the blob's
payload) / its wall time, for
  kernel   strata.kernels.cpu.experts.cpu_experts_forward, every backend this CPU runs
  torch    one `expert_swiglu` per expert on bf16 activations (bf16 F.linear), weighted and added
           with index_add_, torch.set_num_threads(--threads): ~23 GB/s on the H200 machine's 16 cores
  ram      the larger of torch.sum over a 2 GiB fp32 buffer (best of 5) and a streaming read of the
           expert pools on the kernel's own thread pool (`cpu_experts.read_sweep`, best of 3 per shape),
           both with --threads threads: the ceiling the ratios are taken against
Also, for N=1: each format's compute ceiling per core on every backend (`core_rate`: one thread, one cached
expert, timed on the thread's own CPU clock, so it holds on a shared machine); on the default backend a
software-prefetch-distance sweep and a thread-count sweep; and the fixed cost of one call (8 tiny experts:
Python argument handling, ctypes, fork/join).
Prints a table with ratios (kernel / torch, kernel / ram; for a quantized format, its GB/s / the same backend's on
bf16 experts, the issue's target being >= 0.8: the conversion must not make the kernel compute-bound) and writes
`cpu_experts.json` into --out. About 40 s a format on the 2-core dev machine; budget about a minute a format on the
16-core box. torch's per-expert matmul runs on bf16 experts only.
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
from strata.kernels.gguf_blocks import BLOCK_TYPES
from strata.kernels.quant import ExpertFormat, ExpertLayout

GiB = 1 << 30
SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048)}
FORMATS = {"bf16": ExpertFormat("plain", "BF16"), "fp8": ExpertFormat("fp8", block=(128, 128)),
           "mxfp4": ExpertFormat("mxfp4"),
           **{t.lower(): ExpertFormat("gguf", ggml=((t,), (t,), (t,))) for t in ("Q4_K", "Q6_K", "Q2_K", "Q8_0")}}
GGUF_SCALES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q8_0": (0,)}  # byte offsets of a block's f16 scales
EXPERTS_PER_LAYER = 8
TOKENS = (1, 4)
TARGET_GBS = 60.0
TARGET_OF_BF16 = 0.8  # a quantized format's GB/s over bf16's, same backend, shape and tokens
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


def make_pool(H: int, inter: int, pool_bytes: int, fmt: str = "bf16", seed: int = 0) -> tuple[list, list[torch.Tensor]]:
    """Distinct experts, each one blob of its format's layout (bf16: [gate_up 2I*H | down H*I], filled from a random
    block; fp8, mxfp4: one quantized expert copied into each); (the kernel's (gate_up, down) per expert, the blobs)."""
    layout = ExpertLayout.build(FORMATS[fmt], H, inter)
    count = max(2 * EXPERTS_PER_LAYER, pool_bytes // layout.payload_bytes // EXPERTS_PER_LAYER * EXPERTS_PER_LAYER)
    g = torch.Generator().manual_seed(seed)
    experts, blobs = [], []
    if fmt == "bf16":
        per = 3 * inter * H
        block = (torch.randn(per + 4096, generator=g) * 0.02).to(torch.bfloat16)
        for i in range(count):
            blob = torch.empty(per, dtype=torch.bfloat16)
            off = (i * 977) % 4096  # distinct contents per expert
            blob.copy_(block[off: off + per])
            blobs.append(blob)
            experts.append((blob[: 2 * inter * H].view(2 * inter, H), blob[2 * inter * H:].view(H, inter)))
        return experts, blobs
    if layout.fmt.kind == "gguf":
        one = layout.pack_gguf(*(gguf_blocks(layout.fmt.ggml[j][0], rows, k, g)
                                 for j, (rows, k) in enumerate(((inter, H), (inter, H), (H, inter)))))
    else:
        one = layout.pack(torch.randn(2 * inter, H, generator=g) * 0.02, torch.randn(H, inter, generator=g) * 0.02)
    for _ in range(count):
        blob = one.clone()
        blobs.append(blob)
        experts.append(layout.matrices(blob))
    return experts, blobs


def gguf_blocks(name: str, rows: int, k: int, g: torch.Generator) -> tuple[str, torch.Tensor]:
    """(name, uint8 [rows, row bytes]): random blocks of a ggml type, each f16 scale set to 2^-10 (finite weights)."""
    t = BLOCK_TYPES[name]
    blocks = torch.randint(0, 256, (rows, k // t.block_values, t.block_bytes), generator=g, dtype=torch.uint8)
    for offset in GGUF_SCALES[name]:
        blocks[:, :, offset: offset + 2] = torch.tensor([0x00, 0x14], dtype=torch.uint8)  # f16 0x1400 = 2^-10
    return name, blocks.reshape(rows, -1)


def pool_bytes_of(blobs: list[torch.Tensor]) -> int:
    return sum(b.numel() * b.element_size() for b in blobs)


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


def core_rate(layer: list, nbytes: int, H: int, backend: str, calls: int = 30) -> float:
    """GB/s one thread computes one expert at, the expert in the caches and time counted on the thread's own CPU clock
    (`time.thread_time`: the figure holds on a machine shared with other work): the format's compute ceiling per
    core, which the kernel stays under its memory-bound rate as long as cores x it exceeds that rate. Includes the
    Python call's overhead (tens of us a call)."""
    x, idx, tw = torch.randn(1, H), [torch.zeros(1, dtype=torch.int64)], [torch.ones(1)]
    for _ in range(5):
        ce.cpu_experts_forward(x, layer[:1], idx, tw, threads=1, backend=backend)
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        for _ in range(calls):
            ce.cpu_experts_forward(x, layer[:1], idx, tw, threads=1, backend=backend)
        best = min(best, time.thread_time() - t0)
    return nbytes * calls / best / 1e9


def reading(fmt: str, backends: list[str]) -> list[str]:
    """The backends that read experts of `fmt` as stored (a GGUF type a backend lacks would run the torch path)."""
    return [b for b in backends if ce.backend(b, FORMATS[fmt]) == b]


def bench_case(result: dict, pools: dict[str, list], shape: str, H: int, inter: int, N: int, backends: list[str],
               threads: int, ram: float, seconds: float, rounds: int = 1) -> None:
    """One shape and token count, every format of `pools` (format -> layers): torch's per-expert matmul (bf16 only),
    then every kernel backend on every format, `rounds` times alternating formats and backends, the best of each kept
    (a burst of other work on a shared machine then costs one round of each, not one format's figures); rows appended
    to result["cases"] and printed; then, for N=1, prefetch and thread-count sweeps of the first backend per format."""
    x = torch.randn(N, H)
    xb = x.bfloat16()
    idx = [torch.arange(N) for _ in range(EXPERTS_PER_LAYER)]
    tw = [torch.full((N,), 1.0 / EXPERTS_PER_LAYER) for _ in range(EXPERTS_PER_LAYER)]
    layer_bytes = {fmt: EXPERTS_PER_LAYER * ExpertLayout.build(FORMATS[fmt], H, inter).payload_bytes for fmt in pools}

    def gbs_of(fmt, fn, secs=seconds):
        layers = pools[fmt]
        fn(layers[0])
        el, calls = run_calls(layers, fn, secs)
        return calls * layer_bytes[fmt] / el / 1e9, el / calls * 1e3

    def torch_layer(layer):
        out = torch.zeros_like(x)
        for (gu, dn), i, w in zip(layer, idx, tw, strict=True):
            out.index_add_(0, i, expert_swiglu(xb.index_select(0, i), gu, dn).float() * w[:, None])
        return out

    def kernel(b, t=threads):
        return lambda layer: ce.cpu_experts_forward(x, layer, idx, tw, threads=t, backend=b)

    rows: dict[tuple[str, str], tuple[float, float]] = {}
    if "bf16" in pools:
        old_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rows["bf16", "torch"] = gbs_of("bf16", torch_layer)
        finally:
            torch.set_num_threads(old_threads)
    for _ in range(rounds):
        for fmt in pools:
            for b in reading(fmt, backends):
                got = gbs_of(fmt, kernel(b))
                if got[0] > rows.get((fmt, b), (0.0,))[0]:
                    rows[fmt, b] = got
    base = rows.get(("bf16", "torch"), (None,))[0]
    for fmt in pools:
        for path in ["torch", *backends]:
            if (fmt, path) not in rows:
                continue
            gbs, ms = rows[fmt, path]
            bf16_gbs = rows.get(("bf16", path), (None,))[0]
            vs_bf16 = round(gbs / bf16_gbs, 2) if fmt != "bf16" and bf16_gbs else None
            vs_torch = round(gbs / base, 2) if base and fmt == "bf16" else None
            result["cases"].append({"shape": shape, "H": H, "I": inter, "format": fmt, "tokens": N, "path": path,
                                    "gbs": round(gbs, 2), "ms_per_layer": round(ms, 3), "vs_torch": vs_torch,
                                    "vs_bf16": vs_bf16, "of_ram": round(gbs / ram, 3),
                                    "pool_experts": len(pools[fmt]) * EXPERTS_PER_LAYER})
            ratio = f"{vs_torch:>7.2f}x" if vs_torch else (f"{vs_bf16:>6.2f}xb" if vs_bf16 else f"{'':>8}")
            print(f"{shape:<15} {fmt:<6} {N:>2} {path:<12} {gbs:>7.1f} {ms:>9.3f} {ratio} {gbs / ram:>6.0%}", flush=True)

    if N == 1:  # each format's compute ceiling per core (one cached expert, the thread's CPU clock)
        for fmt in pools:
            rates = {b: round(core_rate(pools[fmt][0], layer_bytes[fmt] // EXPERTS_PER_LAYER, H, b), 1)
                     for b in reading(fmt, backends)}
            result.setdefault("core_gbs", {})[f"{shape} {fmt}"] = rates
            print(f"  {fmt}: one core, one cached expert (thread CPU time) -> GB/s {rates}", flush=True)
    for fmt in pools if N == 1 and backends else ():  # tuning sweeps on the default backend, shorter runs
        b = backends[0]
        default_pf = ce.prefetch_bytes()
        sweep = {}
        for pf in PREFETCH_SWEEP:
            ce.configure(prefetch_bytes=pf)
            sweep[pf] = round(gbs_of(fmt, kernel(b), seconds / 2)[0], 1)
        ce.configure(prefetch_bytes=default_pf)
        result.setdefault("prefetch_sweep", {})[f"{shape} {fmt} N=1 {b}"] = sweep
        print(f"  {fmt} {b}: software prefetch bytes -> GB/s {sweep} (in use: {default_pf})", flush=True)
        logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or threads
        counts = sorted({max(1, threads * k // 4) for k in (1, 2, 3)} | {max(1, threads - 1), threads, logical})
        tsweep = {t: round(gbs_of(fmt, kernel(b, t), seconds / 2)[0], 1) for t in counts}
        result.setdefault("thread_sweep", {})[f"{shape} {fmt} N=1 {b}"] = tsweep
        print(f"  {fmt} {b}: threads -> GB/s {tsweep}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--threads", type=int, default=None, help="kernel and torch threads (default: physical cores)")
    ap.add_argument("--pool-gib", type=float, default=4.0,
                    help="GiB of distinct experts per shape and format, every format's held at once (default 4)")
    ap.add_argument("--rounds", type=int, default=1, help="times each format and backend is measured, alternating; "
                    "the best kept (default 1)")
    ap.add_argument("--seconds", type=float, default=1.5, help="minimum timed seconds per case")
    ap.add_argument("--backends", default=None, help="comma-separated kernel backends (default: all this CPU runs)")
    ap.add_argument("--experts", default="bf16", help="comma-separated expert formats: bf16, fp8, mxfp4, q4_k, q6_k, "
                    "q2_k, q8_0 (default bf16)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts (default 1,4)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated shapes (default {','.join(SHAPES)})")
    args = ap.parse_args()
    formats = [f.strip() for f in args.experts.split(",") if f.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    tokens = [int(n) for n in args.tokens.split(",") if n.strip()]
    bad = [f for f in formats if f not in FORMATS] + [s for s in shapes if s not in SHAPES]
    if bad or not formats or not shapes:
        raise SystemExit(f"unknown format or shape {bad or '(none given)'}: choose --experts from {', '.join(FORMATS)} "
                         f"and --shapes from {', '.join(SHAPES)}")
    if "bf16" in formats:  # the quantized formats' ratios are taken against it: measure it first
        formats = ["bf16"] + [f for f in formats if f != "bf16"]
    t_start = time.perf_counter()
    threads = args.threads or ce.default_threads()

    t0 = time.perf_counter()
    available = ce.available_backends()
    load_s = time.perf_counter() - t0
    backends = [b for b in (args.backends.split(",") if args.backends else available) if b in available and b != "torch"]
    default = ce.backend()
    result = {"machine": machine(), "threads": threads, "pool_gib": args.pool_gib, "experts_per_layer": EXPERTS_PER_LAYER,
              "tokens": tokens,
              "tokens_routing": "every token of the call routed to all 8 experts of the layer",
              "extension_load_s": round(load_s, 2), "backends": available, "default_backend": default,
              "prefetch_bytes": ce.prefetch_bytes(), "target_gbs": TARGET_GBS, "experts": formats,
              "target_of_bf16": TARGET_OF_BF16, "rounds": args.rounds, "cases": []}
    print(f"threads {threads}; kernel backends {backends or 'none'}, default {default} "
          f"(extension load {load_s:.1f} s)", flush=True)
    if backends:
        result["call_overhead_us"] = round(overhead_us(threads, backends[0]), 1)
        print(f"fixed cost per call (8 tiny experts, {backends[0]}): {result['call_overhead_us']} us", flush=True)

    ram_sum = ram_bandwidth(threads)
    result["ram_torch_sum_gbs"] = round(ram_sum, 2)
    print(f"RAM read bandwidth, torch.sum over 2 GiB fp32, {threads} threads: {ram_sum:.1f} GB/s", flush=True)
    sweeps = []
    for shape in shapes:  # one pool at a time (a pool of each shape and format would not fit a small machine's RAM)
        blobs = make_pool(*SHAPES[shape], int(args.pool_gib * GiB), formats[0])[1]
        for _ in range(3):
            el = ce.read_sweep(blobs, threads)
            if el:
                sweeps.append(pool_bytes_of(blobs) / el / 1e9)
        del blobs
    if sweeps:
        result["ram_read_sweep_gbs"] = round(max(sweeps), 2)
        print(f"RAM read bandwidth, strata read sweep over the expert pools (AVX2 loads), {threads} threads: "
              f"{max(sweeps):.1f} GB/s", flush=True)
    ram = max([ram_sum, *sweeps])
    result["ram_gbs"] = round(ram, 2)
    print(f"RAM ceiling used for the ratios: {ram:.1f} GB/s", flush=True)
    print(f"{'shape':<15} {'format':<6} {'N':>2} {'path':<12} {'GB/s':>7} {'ms/layer':>9} {'x torch':>8} {'of RAM':>7}"
          "   (quantized formats: x bf16, the same backend's GB/s on bf16 experts)", flush=True)

    for shape in shapes:
        H, inter = SHAPES[shape]
        pools = {}
        for fmt in formats:
            pool = make_pool(H, inter, int(args.pool_gib * GiB), fmt)[0]
            pools[fmt] = [pool[i: i + EXPERTS_PER_LAYER] for i in range(0, len(pool), EXPERTS_PER_LAYER)]
        for N in tokens:
            bench_case(result, pools, shape, H, inter, N, backends, threads, ram, args.seconds, args.rounds)
        del pools, pool

    quant = [c for c in result["cases"] if c["vs_bf16"] is not None]
    for fmt in formats[1:] if quant else ():
        worst = min((c for c in quant if c["format"] == fmt and c["path"] == default), key=lambda c: c["vs_bf16"],
                    default=None)
        if worst:
            result.setdefault("worst_vs_bf16", {})[fmt] = worst["vs_bf16"]
            print(f"{fmt} on {default}: worst {worst['vs_bf16']:.2f}x bf16's GB/s ({worst['shape']}, {worst['tokens']} "
                  f"tokens; target >= {TARGET_OF_BF16})")

    ones = [c for c in result["cases"] if c["path"] == default and c["tokens"] == 1 and c["format"] == "bf16"]
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
