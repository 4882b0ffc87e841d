"""File-system helpers for writers that must never leave a half-written result that looks valid.

Writers (the demo model, store conversion) write into a hidden temporary sibling of the target and
rename it into place at the end; a crash leaves only the temporary directory, which the next writer
removes once its owning process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path


def cache_root() -> Path:
    """strata's cache: $STRATA_CACHE, else $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    if os.environ.get("STRATA_CACHE"):
        return Path(os.environ["STRATA_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "strata"
    return Path.home() / ".cache" / "strata"


def pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite all of `data` (any buffer) at `offset`; a single pwrite may write less (> 2 GiB on Linux)."""
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(out: Path) -> Path:
    """A fresh hidden sibling name for building `out`: `.NAME.tmp-PID-xxxxxxxx`."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_stale_tmp_dirs(out: Path) -> None:
    """Delete temporary siblings of `out` left by writers that crashed (their pid is gone)."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        m = re.fullmatch(rf"\.{re.escape(out.name)}\.tmp-(\d+)-[0-9a-f]+", p.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass  # alive (someone else's) or not a pid: leave it
