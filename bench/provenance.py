"""Where a benchmark's figures come from: the commit it measured (for the JSON every bench script writes)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def commit() -> str:
    """The checkout's short commit hash ("" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
