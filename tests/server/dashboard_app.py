"""What the dashboard tests share: a real engine on the tiny demo model with mixed tiers (a small pinned budget, a
tmpfs tier when /dev/shm is a tmpfs; Engram rows read from disk) and a small app mounting the dashboard whose
`/v1/strata/stats` is the engine's."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fastapi import FastAPI

from strata.server.dashboard import mount_dashboard


@contextlib.contextmanager
def mixed_tier_engine(model_dir: Path) -> Iterator:
    """An `Engine` on `model_dir` whose experts sit in pinned RAM, tmpfs and disk, after one generate."""
    from strata import Engine

    config = {"tiers": {"pinned": {"budget": "120KiB"}},  # 10 of the 32 experts: evictions, disk traffic
              "engram": {"tier": "disk"}}  # Engram rows read from disk through the row cache: the Engram panel
    shm = None
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = tempfile.mkdtemp(prefix="strata-dash-", dir="/dev/shm")
        config["tiers"]["tmpfs"] = {"budget": "256KiB", "path": shm}  # one of the two MoE layers
    eng = Engine.from_pretrained(model_dir, device="cpu", config=config)
    try:
        if eng.tiers.tmpfs is not None:
            eng.tiers.tmpfs.wait(10)
        eng.generate("The experts of a mixture", max_tokens=24)
        yield eng
    finally:
        eng.close()
        if shm:
            shutil.rmtree(shm, ignore_errors=True)


class Scheduler:
    """Stands in for the server's scheduler: the figures it merges into `/v1/strata/stats`."""

    def __init__(self):
        self.running, self.waiting = 1, 0

    def stats(self) -> dict:
        return {"running": self.running, "waiting": self.waiting}


def make_app(get_engine, scheduler: Scheduler | None = None) -> FastAPI:
    """An app serving `/v1/strata/stats` from `get_engine()` (an error while it is None) and the dashboard."""
    app = FastAPI()

    @app.get("/v1/strata/stats")
    def stats():
        eng = get_engine()
        if eng is None:
            return {"error": {"message": "loading"}}
        out = eng.stats()
        if scheduler is not None:
            out["scheduler"] = scheduler.stats()
        return out

    mount_dashboard(app, get_engine, lambda: scheduler)
    return app
