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
