"""Where a decode step's GPU time goes: torch.profiler over a few replayed decode steps.

    python bench/tools/profile_decode.py --model DIR [--config '{"runtime": {"experts": "memory"}}'] [--out DIR]
Prints the top CUDA kernels by total time and writes profile_decode.txt; `--host` adds the host's side
(cProfile of the same decode, torch ops by self CPU time), which is where a tiered step's time goes. The default
config loads every expert into the model, a quantized model's dequantized to bf16: pass '{"runtime": {"experts":
"tiered"}}' to profile its experts in their format.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def pair_kernel_rate(tokens: int = 1, k: int = 8, e: int = 128, h: int = 2048, i: int = 768) -> dict:
    """The pair kernels alone on Qwen3-30B-A3B expert shapes: achieved GB/s of expert weights read."""
    from strata.kernels.gpu.experts.grouped import SlotWeights, pair_experts

    gu = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / 32
    dn = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / 32
    sw, ident = SlotWeights(gu, dn), torch.arange(e, device="cuda", dtype=torch.int32)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(tokens * k, h, device="cuda")
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(tokens)]).reshape(-1)
    for _ in range(3):
        pair_experts(x, sw, ident, ids, y)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 200
    start.record()
    for _ in range(n):
        pair_experts(x, sw, ident, ids, y)
    end.record()
    torch.cuda.synchronize()
    s = start.elapsed_time(end) / 1000 / n
    nbytes = len(set(ids.tolist())) * 3 * h * i * 2
    return {"tokens": tokens, "pairs": tokens * k, "us_per_call": round(s * 1e6, 1), "GB_per_s": round(nbytes / s / 1e9, 1)}


def copy_probe(nbytes: int = 9_437_184, n: int = 48) -> dict:
    """Is a copy from the pinned pool asynchronous? Host microseconds per `copy_` call (an asynchronous copy
    returns in a few microseconds; a synchronous one takes the transfer time, ~170 us for 9.4 MB at 55 GB/s),
    for the pool's registered mmap slabs and for cudaHostAlloc memory, and the GB/s the copies reach."""
    from strata.tiers.storage.pinned import PinnedPool

    pool = PinnedPool(nbytes, n, background=False)
    dst = torch.empty((n, nbytes), dtype=torch.uint8, device="cuda")
    alloc = torch.empty((n, nbytes), dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, src in (("registered", [pool.slot(i) for i in range(n)]), ("host_alloc", list(alloc))):
        for _rep in range(2):  # the second pass is measured
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(n):
                dst[i].copy_(src[i], non_blocking=True)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        out[name] = {"host_us_per_copy": round((t1 - t0) / n * 1e6, 1), "GB_per_s": round(n * nbytes / (t2 - t0) / 1e9, 1),
                     "is_pinned": bool(src[0].is_pinned())}
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default='{"runtime": {"experts": "memory", "max_context": 1024}}')
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (a short one keeps prefill out of the kernel table)")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--host", action="store_true",
                    help="also profile the host: Python functions by cumulative time (cProfile) over the same "
                         "decode, and the torch table by self CPU time (where a tiered step's overheads show)")
    ap.add_argument("--no-kernels", action="store_true", help="skip timing the pair kernels alone")
    args = ap.parse_args()
    from strata import Engine

    # the shipped launches (bench/probes/pair_kernel_probe.py sweeps them)
    rates = [] if args.no_kernels else [pair_kernel_rate(t) for t in (1, 8)]
    print("pair kernels:", rates, flush=True)

    print("copy probe:", copy_probe(), flush=True)
    engine = Engine.from_pretrained(args.model, config=json.loads(args.config), device="cuda")
    vocab = engine.checkpoint.config.vocab_size
    prompt = [(100 + i * 37) % vocab for i in range(args.prompt)]
    engine.generate(prompt, max_tokens=8, temperature=1.0, seed=1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompt, max_tokens=args.tokens, temperature=1.0, seed=2, stop_token_ids=[])
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    text = f"pair kernels: {rates}\n{args.tokens} tokens in {dt:.3f} s ({args.tokens / dt:.1f} tok/s, profiled)\n{table}"
    if args.host:
        import cProfile
        import io
        import pstats

        host = cProfile.Profile()
        t0 = time.perf_counter()
        host.enable()
        engine.generate(prompt, max_tokens=args.tokens, temperature=1.0, seed=3, stop_token_ids=[])
        torch.cuda.synchronize()
        host.disable()
        dt = time.perf_counter() - t0
        buf = io.StringIO()
        pstats.Stats(host, stream=buf).sort_stats("cumulative").print_stats(45)
        pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(30)
        cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        text += f"\n\nhost: {args.tokens} tokens in {dt:.3f} s under cProfile\n{buf.getvalue()}\n{cpu}"
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile_decode.txt").write_text(text)


if __name__ == "__main__":
    main()
