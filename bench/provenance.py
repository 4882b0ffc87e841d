"""Where a benchmark's figures come from: the commit it measured (for the JSON every bench script writes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def commit() -> str:
    """The commit measured: $STRATA_BENCH_COMMIT where set (a copy of the tree without its git metadata, as the GPU
    machine gets: `COMMIT=... bash bench/gpu_run.sh` sets it), else the checkout's short hash ("" outside a git
    checkout)."""
    if given := os.environ.get("STRATA_BENCH_COMMIT"):
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def write_record(out_dir: str | None, name: str, bench: str, script: str, argv: list[str] | None, **fields) -> dict:
    """A bench script's JSON record: `bench`, the UTC date, the commit, the command (`script` and its arguments:
    `argv`, else the process's), the machine's CPU and count, then `fields`; written to OUT_DIR/NAME when `out_dir`
    is given. Returns the record."""
    import json
    import platform
    import sys
    import time

    record = {"bench": bench, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
              "command": " ".join(["python", script, *(argv if argv is not None else sys.argv[1:])]),
              "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}, **fields}
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / name).write_text(json.dumps(record, indent=1))
    return record
