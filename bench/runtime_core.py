"""Runtime-core figures on the GPU machine: writing the `bench` demo model, inspecting it from headers,
loading it, and decoding with every weight in VRAM (the ceiling later tiering is measured against).

    python bench/runtime_core.py --dir /dev/shm/strata-bench [--layers N] [--out DIR]

Writes `runtime_core.json` into --out (default: current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch


def machine() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"gpu": gpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm/strata-bench")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--keep", action="store_true", help="keep the written model")
    args = ap.parse_args()

    from strata import Engine
    from strata.runtime.demo.model import expected_bytes, write_demo_model
    from strata.runtime.plan.checkpoints.inspect import summarize_checkpoint

    result: dict = {"machine": machine(), "layers": args.layers}
    out_dir = Path(args.dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    t0 = time.perf_counter()
    write_demo_model(out_dir, "bench", args.layers, progress=False)
    dt = time.perf_counter() - t0
    size = expected_bytes("bench", args.layers)
    result["write"] = {"bytes": size, "seconds": round(dt, 2), "GB_per_s": round(size / dt / 1e9, 2)}
    print("write", result["write"], flush=True)

    t0 = time.perf_counter()
    summary = summarize_checkpoint(out_dir)
    result["inspect_ms"] = round(1000 * (time.perf_counter() - t0), 1)
    result["total_bytes"] = summary.total_bytes
    print("inspect ms", result["inspect_ms"], flush=True)

    if torch.cuda.is_available():
        t0 = time.perf_counter()
        engine = Engine.from_pretrained(out_dir, device="cuda")
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        result["load"] = {"seconds": round(load_s, 1), "GB_per_s": round(summary.total_bytes / load_s / 1e9, 2),
                          "vram_GiB": round(torch.cuda.memory_allocated() / 2**30, 1)}
        print("load", result["load"], flush=True)
        prompt = list(range(100, 228))  # 128 tokens
        engine.generate(prompt, max_tokens=4)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompt, max_tokens=args.decode_tokens, stop_token_ids=[])
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        stats = engine.stats()
        result["decode"] = {"tokens": len(out.token_ids), "seconds": round(total, 2),
                            "decode_tok_s": round(stats["decode_tokens_per_s"], 2)}
        long_prompt = [100 + (i % 5000) for i in range(2048)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.score(long_prompt)
        torch.cuda.synchronize()
        result["prefill_2048_tok_s"] = round(2048 / (time.perf_counter() - t0), 1)
        print("decode", result["decode"], "prefill tok/s", result["prefill_2048_tok_s"], flush=True)
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "runtime_core.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
