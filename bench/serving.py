"""Serving benchmark: concurrent streams, the pause a long prompt causes, and the reproducible-mode penalty,
all through the real HTTP server.

    PYTHONPATH=. python bench/serving.py [--model DIR] [--config FILE] [--out DIR] [--users 1,4,8]
        [--max-tokens 128] [--long-prompt N] [--max-context N] [--max-batch 8] [--token-budget 2048]
        [--decode-gap-target S] [--repro-users 1,4] [--device auto]

Starts `strata serve` in a subprocess on 127.0.0.1 (default model: the `small` demo model written to a
temporary directory; `--max-context` writes a config overriding runtime.max_context), then measures
with streaming completions (greedy, `ignore_eos`, `logprobs: 0` so every token arrives as its own chunk
even when its text is an incomplete UTF-8 piece):

- users (`--users`): per stream, the time to first token (TTFT) and the decode rate (tokens after the
  first / time from first to last token); per case, the aggregate tok/s and three slowest/mean ratios:
  `window` (tokens each stream received while all of them were decoding: the scheduler's fairness),
  `decode` (first to last token of each stream: it charges a stream that started early with the
  prefill of those who joined after it) and `e2e` (tokens / time since the request was sent).
  The server's own step log over the case gives the median decode-only step, how many steps carried prompt
  chunks and the longest step (the longest gap a decoding user saw). Each case runs once unmeasured first
  (warm-up of the step shapes).
- pause: 4 users decode while a prompt of `--long-prompt` tokens (default 64K, or the context less
  64) is prefilled; the longest gap between two tokens any of them sees, and the server's own step
  times over the same window (`/v1/strata/stats?steps=1`), so a client-side gap can be told apart
  from a slow step.
- reproducible (`--repro-users`): aggregate tok/s with `strata_reproducible: "required"` and without,
  and the ratio (the penalty of bit-identical results: a forward pass per reproducible sequence).
Writes `serving.json` into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str, max_tokens: int,
                     stamps: list[float], stop: asyncio.Event | None = None, reproducible: bool = False) -> float:
    """One streaming completion; appends the arrival time (time.time()) of every token to `stamps`.

    Returns the time the request was sent. With `stop`, the stream is closed once it is set (the server
    cancels the sequence). A refused request, an error chunk, or a stream that ends without a token raises
    RuntimeError with what the server said."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "strata_reproducible": "required" if reproducible else "off"}
    sent, finish = time.time(), None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"the server refused a stream: HTTP {r.status_code}: {r.text[:500]}")
        async for line in r.aiter_lines():
            if stop is not None and stop.is_set():
                break
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed a stream: {chunk['error']}")
            choice = (chunk.get("choices") or [{}])[0]
            finish = choice.get("finish_reason") or finish
            now = time.time()
            stamps.extend(now for _ in (choice.get("logprobs") or {}).get("tokens") or ())
    if not stamps and (stop is None or not stop.is_set()):
        raise RuntimeError(f"a stream ended without a token (finish_reason {finish!r}); see the server log")
    return sent


def _ratio(values: list[float]) -> float | None:
    return round(min(values) / statistics.mean(values), 3) if values and statistics.mean(values) > 0 else None


async def users(url: str, model: str, n: int, max_tokens: int, reproducible: bool = False) -> dict:
    """`n` concurrent streams of `max_tokens` tokens each."""
    prompt = " ".join(f"w{i}" for i in range(128))
    stamps: list[list[float]] = [[] for _ in range(n)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
        t0 = time.time()
        outcome = await asyncio.gather(*(stream_one(client, url, model, prompt, max_tokens, stamps[i],
                                                    reproducible=reproducible) for i in range(n)),
                                       return_exceptions=True)
        wall = time.time() - t0
    failed = [str(x) for x in outcome if isinstance(x, BaseException)]
    if len(failed) == n:
        raise RuntimeError(f"all {n} streams failed; the first: {failed[0]}")
    for msg in failed:
        print(f"warning: a stream of the {n}-user case failed: {msg}", file=sys.stderr, flush=True)
    # the figures below are over the streams that completed; `failed` says what happened to the others
    stamps, sent = zip(*[(s, t) for s, t in zip(stamps, outcome, strict=True) if not isinstance(t, BaseException)],
                       strict=True)
    tokens = sum(len(s) for s in stamps)
    ttft = [s[0] - t for s, t in zip(stamps, sent, strict=True)]
    decode = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1 and s[-1] > s[0]]
    e2e = [len(s) / (s[-1] - t) for s, t in zip(stamps, sent, strict=True)]
    w0, w1 = max(s[0] for s in stamps), min(s[-1] for s in stamps)  # every stream decoding
    window = [sum(1 for x in s if w0 < x <= w1) / (w1 - w0) for s in stamps] if w1 - w0 > 0.2 else []
    steps = httpx.get(f"{url}/v1/strata/stats?steps=1", timeout=30).json().get("recent_steps", [])
    during = [st for st in steps if t0 <= st["t"] <= t0 + wall]
    decode_steps = [st["seconds"] for st in during if not st["prompt"]]
    prompt_steps = [st["seconds"] for st in during if st["prompt"]]
    return {"users": n, "reproducible": reproducible, "tokens": tokens, "seconds": round(wall, 3),
            "server_decode_step_s": round(statistics.median(decode_steps), 4) if decode_steps else None,
            # the steps that carried prompt chunks: how many, and the longest (a decoding user's longest gap)
            "server_prompt_steps": len(prompt_steps), "server_max_step_s": round(max(prompt_steps + decode_steps), 4)
            if during else None,
            "aggregate_tok_s": round(tokens / wall, 2),
            "ttft_s": [round(x, 3) for x in ttft], "decode_tok_s": [round(x, 2) for x in decode],
            "e2e_tok_s": [round(x, 2) for x in e2e], "window_tok_s": [round(x, 2) for x in window],
            "window_s": round(max(w1 - w0, 0.0), 3),
            "slowest_vs_mean": {"window": _ratio(window), "decode": _ratio(decode), "e2e": _ratio(e2e)},
            "failed": failed}


async def long_prompt_pause(url: str, model: str, prompt: list[int], n_users: int, context: int) -> dict:
    """`n_users` decode; a long prompt arrives; the longest inter-token gap they see while it prefills."""
    stamps: list[list[float]] = [[] for _ in range(n_users)]
    stop = asyncio.Event()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n_users + 4)) as client:
        tasks = [asyncio.create_task(stream_one(client, url, model, "hello there", context - 32, stamps[i], stop))
                 for i in range(n_users)]
        while min(len(s) for s in stamps) < 8:  # all of them are decoding
            await asyncio.sleep(0.01)
            for t in tasks:
                if t.done():
                    t.result()  # a stream that failed raises here
        t_long = time.time()
        long_stamps: list[float] = []
        await stream_one(client, url, model, prompt, 1, long_stamps)
        t_done = time.time()
        await asyncio.sleep(0.5)  # a few more decode tokens after it
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b >= t_long and a <= t_done]
    steps = httpx.get(f"{url}/v1/strata/stats?steps=1", timeout=30).json()
    window = [st for st in steps.get("recent_steps", []) if t_long <= st["t"] <= t_done + 0.05]
    return {"users": n_users, "long_prompt_tokens": len(prompt), "prefill_seconds": round(t_done - t_long, 3),
            "time_to_first_token_s": round(long_stamps[0] - t_long, 3) if long_stamps else None,
            "max_pause_s": round(max(gaps), 3) if gaps else None,
            "p99_pause_s": round(sorted(gaps)[int(0.99 * (len(gaps) - 1))], 3) if gaps else None,
            "server_steps": len(window), "server_max_step_s": round(max(st["seconds"] for st in window), 3) if window else None,
            "server_prompt_chunks": [st["prompt"] for st in window if st["prompt"]],
            "scheduler": steps.get("scheduler")}


def long_prompt_ids(url: str, n: int) -> list[int]:
    """`n` token ids of plain text, tokenized by the server (works for any model's vocabulary)."""
    words, ids = max(n // 2, 16), []
    while len(ids) < n:
        text = " ".join(f"w{i % 997} item{i}" for i in range(words))
        ids = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=120).json()["tokens"]
        words *= 2
    return ids[:n]


def server_config(args: argparse.Namespace, tmp: Path) -> str | None:
    """The --config file, with runtime.max_context overridden when --max-context is given."""
    if args.max_context is None:
        return args.config
    from strata.server.serve import format_toml

    data = tomllib.loads(Path(args.config).read_text()) if args.config else {}
    data.setdefault("runtime", {})["max_context"] = args.max_context
    path = tmp / "bench-serving.toml"
    path.write_text(format_toml(data) + "\n")
    return str(path)


def wait_settled(url: str, timeout: float = 600.0) -> float:
    """Seconds until the server's tiers finish their start-up placement (`pending_work` 0 in
    /v1/strata/stats), so no case is timed while experts are still being copied in."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        tiers = httpx.get(f"{url}/v1/strata/stats", timeout=10).json().get("tiers") or {}
        if not tiers.get("pending_work", 0):
            break
        time.sleep(0.25)
    return round(time.perf_counter() - t0, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint or store directory (default: the small demo model)")
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--users", default="1,4,8", help="comma-separated concurrent stream counts")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per stream in the user cases")
    ap.add_argument("--long-prompt", type=int, default=65536, help="tokens of the long prompt (capped by the context)")
    ap.add_argument("--pause-users", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=None, help="override runtime.max_context (e.g. 65600)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--decode-gap-target", type=float, default=None, help="seconds (default: the config's)")
    ap.add_argument("--repro-users", default="1,4", help="user counts for the reproducible penalty ('' skips)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-serving-"))
    model_dir = args.model
    if model_dir is None:
        from strata.runtime.demo.model import write_demo_model

        model_dir = str(write_demo_model(tmp / "small", "small", progress=False))
    port = free_port()
    cmd = [sys.executable, "-m", "strata", "serve", model_dir, "--port", str(port), "--max-batch", str(args.max_batch),
           "--token-budget", str(args.token_budget), "--device", args.device]
    config = server_config(args, tmp)
    if config:
        cmd += ["--config", config]
    if args.decode_gap_target is not None:
        cmd += ["--decode-gap-target", str(args.decode_gap_target)]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(3600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"server exited with {server.returncode}")
            time.sleep(0.5)
        settle_s = wait_settled(url)
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        model, context = card["id"], int(card["max_model_len"])
        result: dict = {"model": model_dir, "context": context, "command": cmd[2:], "settle_s": settle_s,
                        "cases": [], "reproducible": []}
        counts = [int(x) for x in args.users.split(",") if x]
        for n in counts:  # warm-up of every step shape before any case is timed, unmeasured
            asyncio.run(users(url, model, n, 32))
        for n in counts:
            case = asyncio.run(users(url, model, n, args.max_tokens))
            result["cases"].append(case)
            print(json.dumps({k: case[k] for k in ("users", "aggregate_tok_s", "server_decode_step_s", "ttft_s",
                                                   "slowest_vs_mean")}), flush=True)
        if counts and counts[0] == 1:  # the one-user case again at the end: its two runs bracket the others
            again = asyncio.run(users(url, model, 1, args.max_tokens))
            result["one_user_again"] = again
            print(json.dumps({"users": 1, "again": True, "aggregate_tok_s": again["aggregate_tok_s"],
                              "server_decode_step_s": again["server_decode_step_s"]}), flush=True)
        if result["cases"]:
            one = max(result["cases"][0]["aggregate_tok_s"], result.get("one_user_again", {}).get("aggregate_tok_s", 0))
            for case in result["cases"]:
                case["vs_first_case"] = round(case["aggregate_tok_s"] / one, 2)
        for n in [int(x) for x in args.repro_users.split(",") if x]:
            off = asyncio.run(users(url, model, n, args.max_tokens))
            asyncio.run(users(url, model, n, 16, reproducible=True))  # warm-up
            on = asyncio.run(users(url, model, n, args.max_tokens, reproducible=True))
            entry = {"users": n, "off_tok_s": off["aggregate_tok_s"], "required_tok_s": on["aggregate_tok_s"],
                     "required_vs_off": round(on["aggregate_tok_s"] / off["aggregate_tok_s"], 3),
                     "off_decode_tok_s": off["decode_tok_s"], "required_decode_tok_s": on["decode_tok_s"]}
            result["reproducible"].append(entry)
            print(json.dumps(entry), flush=True)
        prompt = long_prompt_ids(url, min(args.long_prompt, context - 64))
        result["pause"] = asyncio.run(long_prompt_pause(url, model, prompt, args.pause_users, context))
        print(json.dumps({k: v for k, v in result["pause"].items() if k != "server_prompt_chunks"}), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serving.json").write_text(json.dumps(result, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
