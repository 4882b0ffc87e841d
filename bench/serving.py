"""Serving benchmark: concurrent streams and the pause a long prompt causes, through the real HTTP server.

    python bench/serving.py [--model DIR] [--config FILE] [--out DIR] [--max-tokens 128]

Starts `strata serve` in a subprocess on 127.0.0.1 (default model: the `small` demo model written to a
temporary directory), then measures with streaming completions:
- 1, 4 and 8 concurrent users: aggregate tok/s, slowest and mean stream tok/s;
- 4 users decoding while a prompt of 64K tokens (or the model's context, if smaller) is prefilled:
  the longest gap between two tokens any of them sees.
Writes `serving.json` into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str, max_tokens: int,
                     stamps: list[float]) -> int:
    """One streaming completion; appends the arrival time of every token to `stamps`."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    n = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
                n += 1
    return n


async def users(url: str, model: str, n_users: int, max_tokens: int) -> dict:
    prompt = " ".join(f"w{i}" for i in range(128))
    stamps = [[] for _ in range(n_users)]
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(stream_one(client, url, model, prompt, max_tokens, stamps[i])
                                        for i in range(n_users)))
        wall = time.perf_counter() - t0
    rates = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1]
    return {"users": n_users, "tokens": sum(counts), "seconds": round(wall, 2),
            "aggregate_tok_s": round(sum(counts) / wall, 2), "slowest_stream_tok_s": round(min(rates), 2),
            "mean_stream_tok_s": round(sum(rates) / len(rates), 2)}


async def long_prompt_pause(url: str, model: str, context: int, decode_tokens: int) -> dict:
    """4 users decode; a long prompt arrives; the longest inter-token gap they see while it prefills."""
    stamps = [[] for _ in range(4)]
    long_len = min(65536, context - 64)
    async with httpx.AsyncClient() as client:
        tasks = [asyncio.create_task(stream_one(client, url, model, "hello there", decode_tokens, stamps[i]))
                 for i in range(4)]
        while min(len(s) for s in stamps) < 8:  # all four are decoding
            await asyncio.sleep(0.01)
        t_long = time.perf_counter()
        long_stamps: list[float] = []
        await stream_one(client, url, model, [100 + (i % 4000) for i in range(long_len)], 1, long_stamps)
        t_done = time.perf_counter()
        await asyncio.gather(*tasks)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b >= t_long and a <= t_done]
    return {"long_prompt_tokens": long_len, "prefill_seconds": round(t_done - t_long, 2),
            "max_pause_s": round(max(gaps), 3) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None:
        from strata.runtime.demo_model import write_demo_model

        model_dir = str(write_demo_model(Path(tempfile.mkdtemp()) / "small", "small", progress=False))
    port = free_port()
    cmd = [sys.executable, "-m", "strata", "serve", model_dir, "--port", str(port), "--max-batch", "8"]
    if args.config:
        cmd += ["--config", args.config]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"server exited with {server.returncode}")
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        stats = httpx.get(f"{url}/v1/strata/stats").json()
        context = int(stats.get("max_context", 4096))
        result = {"model": model_dir, "context": context, "cases": []}
        asyncio.run(users(url, model, 1, 16))  # warm-up
        for n in (1, 4, 8):
            case = asyncio.run(users(url, model, n, args.max_tokens))
            result["cases"].append(case)
            print(case, flush=True)
        one = result["cases"][0]["aggregate_tok_s"]
        for case in result["cases"]:
            case["vs_one_user"] = round(case["aggregate_tok_s"] / one, 2)
            case["slowest_vs_mean"] = round(case["slowest_stream_tok_s"] / case["mean_stream_tok_s"], 2)
        result["pause"] = asyncio.run(long_prompt_pause(url, model, context, decode_tokens=4 * args.max_tokens))
        print(result["pause"], flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serving.json").write_text(json.dumps(result, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
