"""`strata serve` start-up: seconds from launching the server (store already built) until /health answers, then
what its first users wait: one request, then four at once (a new decode batch size), each timed the first time and
again (`first_*_s`, `again_*_s`). Before runtime.warmup, each new batch size's decode graph was captured (and on a
fresh install its kernels JIT-built) inside the first request of that size. $STRATA_BENCH_FRESH_JIT=1 gives the
server empty Triton and CuPy kernel caches, as on a fresh install.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.suite.case_config import engine_config
from bench.suite.cases import Case
from bench.suite.strata_case import record


def run_serve(case: Case, model: Path, summary: dict, settings: dict, out_dir: Path, limit_s: float) -> dict:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return record(case, "skipped", f"fastapi/uvicorn not importable here ({e}); carry them as wheels")
    from strata.config import load_config
    from strata.runtime.plan.build import ensure_store
    from strata.server.serve import format_toml

    cfg = engine_config(case, summary, settings, [case.workload])
    cfg["planner"]["max_batch"] = 8
    ensure_store(Path(model), load_config(cfg), progress=False)  # "store already built" is the case's premise
    path = Path(out_dir) / "serve.toml"
    path.write_text(format_toml(cfg) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "strata", "serve", str(model), "--config", str(path), "--port", str(port),
           "--device", settings["device"]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if os.environ.get("STRATA_BENCH_FRESH_JIT") == "1":
        fresh = tempfile.mkdtemp(prefix="strata-jit-")
        env.update(TRITON_CACHE_DIR=f"{fresh}/triton", CUPY_CACHE_DIR=f"{fresh}/cupy")
    log = Path(out_dir) / "serve.log"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.PIPE, text=True)
    ready, firsts = None, {}
    try:
        while time.perf_counter() - t0 < limit_s:
            if proc.poll() is not None:
                err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()
                return record(case, "error", f"server exited with {proc.returncode}: {err[-1] if err else ''}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - t0
                        break
            except OSError:
                pass
            time.sleep(0.1)
        if ready is not None:
            firsts = first_requests(port, Path(model).name)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if ready is None:
        return record(case, "error", f"not ready within {limit_s:.0f} s")
    warm = [line.strip() for line in log.read_text().splitlines() if line.startswith("warmed up")]
    return record(case, "ok", None, metrics={"ready_s": round(ready, 2), **firsts}, config=cfg,
                  warmup=warm[0] if warm else None)


def first_requests(port: int, model: str, tokens: int = 16) -> dict:
    """Seconds for one completion of `tokens` tokens, then four at once (all done), each timed twice: the first
    time a server decodes that batch size, and again."""
    def one(i: int) -> None:
        body = json.dumps({"model": model, "prompt": f"Request {i} asks about the river and the valley", "max_tokens": tokens,
                           "ignore_eos": True, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()

    out = {}
    with ThreadPoolExecutor(4) as pool:
        for when in ("first", "again"):
            for name, n in (("request", 1), ("batch4", 4)):
                t = time.perf_counter()
                list(pool.map(one, range(n)))
                out[f"{when}_{name}_s"] = round(time.perf_counter() - t, 3)
    return out
