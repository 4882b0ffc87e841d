"""The live tier dashboard: a static page shipped in the package, the residency grid and the history it draws.

    mount_dashboard(app, get_engine, get_scheduler)   # in create_app
    GET /dashboard                  the page (HTML + vanilla JavaScript + CSS, no build step, no CDN)
    GET /dashboard/static/{name}    its scripts (dashboard.js, its drawing dashboard_draw.js, the API key's
                                    dashboard_auth.js, the panels' dashboard_experts.js (heatmaps),
                                    dashboard_engram.js (Engram) and dashboard_cards.js (per card)) and style sheet
    GET /v1/strata/residency        `residency_grid(engine.tiers)` as JSON (503 while the model loads)
    GET /v1/strata/history[?since=T] the charts' figures, sampled by the server once a second
                                    (`dashboard_history`): 1 s steps for 5 minutes, 10 s steps for an hour

On opening, the page reads the history and draws every chart at once, then polls `GET /v1/strata/stats`
(served by the server: the engine's `stats()` merged with the scheduler's `{"scheduler": {...}}`),
`GET /v1/strata/residency` and the history's new samples every second. It draws hit ratio per tier over
time, tokens per second, running requests, bandwidth per path and a layers x experts heatmap of
residency and traffic; for a model with Engram layers (`engram` in the stats) a panel draws the share of
table rows served per tier (row cache, table tier) over time, bytes read and stall. For a model split
over several cards (`devices` in the tier stats) a panel lists per card its stage layers, GPU hit ratio,
lookups, PCIe bytes and GPU tier use, plus the stage hops. Served without a history (a server that does
not sample), the page samples its own polls instead. It tolerates missing keys.

With `strata serve --api-key KEY`, the page and its static files (`PAGE_PATHS`) answer without the key; the data
routes need it. The page takes the key from its address's fragment (`/dashboard#key=KEY`: a fragment is never sent
to the server; the page removes it from the address bar at once) or, on a 401, from a form it shows; it keeps the
key in the tab's `sessionStorage` and sends it as `Authorization: Bearer KEY` on every poll (dashboard_auth.js).

The sampler is a task on the server's event loop, started by the first event the server handles (the
lifespan's startup, or the first request when the lifespan is off) and cancelled with the loop when the
server stops. It reads the snapshot `GET /v1/strata/stats` does, from a worker thread, never inside a step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from strata.server.api_errors import APIError
from strata.server.dashboard_history import History, Sampler, figures_of

# Tier index in the grid: fastest first. `residency_grid` reports the fastest tier holding a usable copy.
TIERS: tuple[str, ...] = ("gpu", "pinned", "tmpfs", "disk")
NOT_STORED = -1  # (layer, expert) that the store does not hold (never happens for a well-formed store)

_STATIC = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard_auth.js": "text/javascript; charset=utf-8",
    "dashboard_draw.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard_experts.js": "text/javascript; charset=utf-8",
    "dashboard_engram.js": "text/javascript; charset=utf-8",
    "dashboard_cards.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# The page and its files, answered without the API key (`Guard`): they carry no data, and the page asks for the
# key that its polls of the data routes send. Exactly these paths: any other, under /dashboard/static/ too, needs it.
PAGE_PATHS: frozenset[str] = frozenset({"/dashboard", *(f"/dashboard/static/{name}" for name in _STATIC)})
# The page loads nothing from anywhere but this server.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def residency_grid(manager) -> dict:
    """Where every expert of `manager` (a `TierManager` or `DeviceTiers`) lives, and how often each was looked up.

    Returns `{"layers": [moe layer ids], "experts": E, "tiers": TIERS, "present": [tiers this manager
    has], "tier": [[tier index per expert] per layer], "traffic": [[lookups per expert] per layer],
    "layer_lookups": [lookups per layer]}`.
    A tier index is the fastest tier holding a usable copy (an object still being copied in does not
    count); the disk always holds everything.
    """
    keys = list(manager.store.keys())
    layers = sorted({layer for layer, _ in keys})
    experts = max((e for _, e in keys), default=-1) + 1
    row = {layer: i for i, layer in enumerate(layers)}
    tmpfs = getattr(manager, "tmpfs", None)
    tmpfs_layers = {layer for layer in layers if tmpfs is not None and tmpfs.has(layer)}
    disk, tmpfs_i = TIERS.index("disk"), TIERS.index("tmpfs")
    tier = [[NOT_STORED] * experts for _ in layers]
    for layer, expert in keys:
        tier[row[layer]][expert] = tmpfs_i if layer in tmpfs_layers else disk
    usable = manager.usable_keys()  # slotted tier -> keys with a usable copy there, one snapshot
    for name in ("pinned", "gpu"):  # slowest first, so a faster copy overwrites a slower one
        index = TIERS.index(name)
        for layer, expert in usable.get(name, ()):
            if layer in row and 0 <= expert < experts:
                tier[row[layer]][expert] = index
    counted, per_layer = manager.lookup_counts()
    layer_lookups = [per_layer.get(layer, 0) for layer in layers]
    traffic = [[0] * experts for _ in layers]
    for (layer, expert), n in counted.items():
        if layer in row and 0 <= expert < experts:
            traffic[row[layer]][expert] = int(n)
    present = [t for t in TIERS if t == "disk" or t in usable or (t == "tmpfs" and tmpfs is not None)]
    return {"layers": layers, "experts": experts, "tiers": list(TIERS), "present": present, "tier": tier,
            "traffic": traffic, "layer_lookups": layer_lookups}


@cache
def _static_file(name: str) -> bytes:
    return resources.files("strata.server").joinpath("static", name).read_bytes()


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, kind, param, code).body(), status_code=status,
                        headers={"Cache-Control": "no-store"})


def _loading() -> JSONResponse:
    return _error(503, "the model is still loading; retry when GET /health returns 200", "service_unavailable",
                  code="model_loading")


class _StartSampler:
    """ASGI middleware: the first event the server handles starts the sampler on the server's event loop."""

    def __init__(self, app: Any, sampler: Sampler):
        self.app, self.sampler = app, sampler

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        self.sampler.ensure_running()
        await self.app(scope, receive, send)


def mount_dashboard(app: FastAPI, get_engine: Callable[[], object | None],
                    get_scheduler: Callable[[], object | None] | None = None) -> Sampler:
    """Add `GET /dashboard`, its static files, `GET /v1/strata/residency` and `GET /v1/strata/history` to
    `app`, and the sampler that fills the history; returns the sampler (also `app.state.dashboard_sampler`;
    its `history` holds the samples).

    `get_engine()` returns the loaded `Engine`, or None while the model is still loading (the grid and
    the history answer 503 then, and the page says "loading"). `get_scheduler()` returns the scheduler
    whose running and waiting requests the history samples (None: not sampled).
    """
    def read() -> dict | None:  # in a worker thread, once a second
        engine = get_engine()
        if engine is None:
            return None
        stats = engine.stats()
        scheduler = get_scheduler() if get_scheduler is not None else None
        if scheduler is not None:
            stats["scheduler"] = scheduler.stats()
        return figures_of(stats)

    history = History()
    sampler = app.state.dashboard_sampler = Sampler(history, read)
    app.add_middleware(_StartSampler, sampler=sampler)

    def static(name: str) -> Response:
        return Response(_static_file(name), media_type=_STATIC[name],
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP,
                                 "X-Content-Type-Options": "nosniff"})

    @app.get("/dashboard", include_in_schema=False)
    def dashboard_page() -> Response:
        return static("dashboard.html")

    @app.get("/dashboard/static/{name:path}", include_in_schema=False)  # any path: a wrong one gets our 404
    def dashboard_static(name: str) -> Response:
        if name not in _STATIC:
            return _error(404, f"no dashboard file {name!r}; the dashboard is at GET /dashboard", "not_found_error")
        return static(name)

    @app.get("/v1/strata/residency")
    def strata_residency() -> Response:  # a plain def: FastAPI runs it in a worker thread
        engine = get_engine()
        if engine is None:
            return _loading()
        manager = getattr(engine, "tiers", None)
        if manager is None:  # runtime.experts = "memory" (or the engine was closed): no tiers to show
            return JSONResponse({"layers": [], "experts": 0, "tiers": list(TIERS), "present": [], "tier": [],
                                 "traffic": None, "layer_lookups": [], "experts_mode": "memory"})
        grid = residency_grid(manager)
        grid["experts_mode"] = "tiered"
        return JSONResponse(grid, headers={"Cache-Control": "no-store"})

    @app.get("/v1/strata/history")
    def strata_history(request: Request) -> Response:
        raw = request.query_params.get("since")
        since = None
        if raw is not None:
            try:
                since = float(raw)
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                return _error(400, f"since={raw!r} is not a number; give the `t` of the last sample you have",
                              "invalid_request_error", param="since")
        if get_engine() is None:
            return _loading()
        return JSONResponse({"object": "strata.history", "now": sampler.clock(), "time": time.time(),
                             "steps_s": [r.step_s for r in history.resolutions],
                             "spans_s": [r.span_s for r in history.resolutions],
                             "samples": history.samples(since)}, headers={"Cache-Control": "no-store"})

    return sampler
