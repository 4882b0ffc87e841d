"""`strata serve` start-up: seconds from launching the server (store already built) until /health answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.suite.cases import Case
from bench.suite.strata_case import engine_config, record


def run_serve(case: Case, model: Path, summary: dict, settings: dict, out_dir: Path, limit_s: float) -> dict:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return record(case, "skipped", f"fastapi/uvicorn not importable here ({e}); carry them as wheels")
    from strata.config import load_config
    from strata.runtime.build import ensure_store
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
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    ready = None
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
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if ready is None:
        return record(case, "error", f"not ready within {limit_s:.0f} s")
    return record(case, "ok", None, metrics={"ready_s": round(ready, 2)}, config=cfg)
