"""What a new user meets: the first `strata generate` from an empty cache, and a server refusing an oversized body.

    python bench/first_run.py [--body-mib 30] [--out DIR]

1. `strata generate --prompt "The experts of a mixture"` with `STRATA_CACHE` pointing at an empty directory: wall
   seconds (the default demo model is copied, packed into a store and loaded), the text it prints, the cache's size.
2. `strata serve` on the same model: a chat request whose body is `--body-mib` MiB of text is refused
   (`context_length_exceeded`); the seconds to that answer, the worst `/health` latency while it is being refused
   (the server keeps serving others), and the server's resident memory before and after three such requests.
Results go to stdout as JSON (and `--out DIR/first_run.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def first_generate(cache: Path) -> dict:
    env = {**os.environ, "STRATA_CACHE": str(cache)}
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "strata", "generate", "--prompt", "The experts of a mixture"],
                         env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    if run.returncode:
        raise SystemExit(f"strata generate failed ({run.returncode}): {run.stderr.strip()[-400:]}")
    return {"seconds": round(seconds, 2), "text": run.stdout.strip(), "cache_bytes": _du(cache)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def oversized_body(cache: Path, body_mib: int) -> dict:
    port = _free_port()
    env = {**os.environ, "STRATA_CACHE": str(cache)}
    server = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("strata serve did not become ready in 300 s")
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        text = "word " * (body_mib * 1024 * 1024 // 5)
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        rss_before = _rss_kib(server.pid)
        answers, worst_health = [], 0.0
        for _ in range(3):
            done = threading.Event()
            health: list[float] = []

            def probe(done: threading.Event = done, health: list[float] = health) -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    httpx.get(f"{url}/health", timeout=120)
                    health.append(time.perf_counter() - t)
                    time.sleep(0.05)

            prober = threading.Thread(target=probe)
            prober.start()
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
            answers.append({"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3),
                            "code": (r.json().get("error") or {}).get("code")})
            done.set()
            prober.join()
            worst_health = max([worst_health, *health])
        time.sleep(1.0)
        return {"body_mib": body_mib, "answers": answers, "worst_health_s": round(worst_health, 3),
                "rss_mib_before": round(rss_before / 1024, 1), "rss_mib_after": round(_rss_kib(server.pid) / 1024, 1)}
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--body-mib", type=int, default=30)
    p.add_argument("--out", default=None, help="directory for first_run.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="strata-first-run-") as tmp:
        cache = Path(tmp)
        result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                  "load_avg": os.getloadavg(), "generate": first_generate(cache),
                  "oversized_body": oversized_body(cache, args.body_mib)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "first_run.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
