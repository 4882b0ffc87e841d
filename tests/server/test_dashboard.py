"""The live tier dashboard's data: the residency grid, the routes and their errors, the history the sampler took.

A real `Engine` on the tiny demo model (small pinned budget, a tmpfs tier when /dev/shm is a tmpfs, so the
tiers are mixed; Engram rows read from disk: tests/server/dashboard_app.py) answers everything, through a small
app that mounts the dashboard and whose `/v1/strata/stats` is the engine's. The page itself, in real headless
Chromium: tests/server/test_dashboard_page.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
from dashboard_app import Scheduler, make_app, mixed_tier_engine
from fastapi.testclient import TestClient

from strata.server.dashboard import TIERS, residency_grid


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with mixed_tier_engine(tiny_model_dir) as eng:
        yield eng


# ---- the residency grid and the routes --------------------------------------------------------------------
def test_residency_grid_matches_the_tier_manager(engine):
    manager = engine.tiers
    grid = residency_grid(manager)
    json.dumps(grid)  # JSON-ready
    assert grid["layers"] == [1, 2] and grid["experts"] == 16 and grid["tiers"] == list(TIERS)
    assert [len(row) for row in grid["tier"]] == [16, 16]
    flat = [(layer, e, grid["tier"][r][e]) for r, layer in enumerate(grid["layers"]) for e in range(16)]
    pinned = manager.usable_keys()["pinned"]
    for layer, e, t in flat:
        if (layer, e) in pinned:
            assert TIERS[t] == "pinned"
        elif manager.tmpfs is not None and manager.tmpfs.has(layer):
            assert TIERS[t] == "tmpfs"
        else:
            assert TIERS[t] == "disk"
    assert sum(1 for *_, t in flat if TIERS[t] == "pinned") == len(pinned) > 0
    assert sum(grid["layer_lookups"]) == engine.stats()["tiers"]["lookups"] > 0
    assert sum(map(sum, grid["traffic"])) == engine.stats()["tiers"]["lookups"]  # lookups per (layer, expert)


OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error(r: httpx.Response, status: int) -> dict:
    """The body's error, once it is checked to be OpenAI's shape with `status`."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS, body
    return body["error"]


def test_routes_loading_memory_and_static_files(engine):
    state = {"engine": None}
    client = TestClient(make_app(lambda: state["engine"]))
    for route in ("/v1/strata/residency", "/v1/strata/history"):
        err = openai_error(client.get(route), 503)
        assert "loading" in err["message"] and err["type"] == "service_unavailable" and err["code"] == "model_loading"
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for src in ("dashboard/static/dashboard_auth.js", "dashboard/static/dashboard_draw.js",
                "dashboard/static/dashboard.js", "dashboard/static/dashboard_experts.js",
                "dashboard/static/dashboard_engram.js", "dashboard/static/dashboard_cards.js",
                "dashboard/static/dashboard.css"):
        assert src in page.text
        assert client.get("/" + src).status_code == 200
    assert "http://" not in page.text and "https://" not in page.text  # nothing from the network
    js = client.get("/dashboard/static/dashboard.js").text
    assert "v1/strata/stats" in js and "v1/strata/residency" in js and "v1/strata/history" in js
    assert "http://" not in js and "https://" not in js
    assert 'id="engram-panel"' in page.text and 'id="engram-chart"' in page.text
    ejs = client.get("/dashboard/static/dashboard_engram.js").text
    assert "engram-panel" in ejs and "strataDashboardPlugins" in js and "strataDashboardPlugins" in ejs
    assert "http://" not in ejs and "https://" not in ejs
    # the fields of `engram` the panel reads are in the engine's stats
    for key in ("tier", "lookups", "hits", "bytes_read", "stall_s", "cache_rows", "cache_resident", "cache_evictions",
                "table_bytes"):
        assert key in engine.stats()["engram"] and key in ejs
    # the dashboard's own 404s are OpenAI-shaped
    for name in ("..%2Fdashboard.py", "nope.js"):
        err = openai_error(client.get("/dashboard/static/" + name), 404)
        assert err["type"] == "not_found_error" and "no dashboard file" in err["message"], err

    state["engine"] = engine
    grid = client.get("/v1/strata/residency").json()
    assert grid["experts_mode"] == "tiered" and grid["experts"] == 16
    for bad in ("abc", "nan", "inf"):
        err = openai_error(client.get("/v1/strata/history", params={"since": bad}), 400)
        assert err["param"] == "since" and repr(bad) in err["message"], err

    class MemoryEngine:
        tiers = None

    state["engine"] = MemoryEngine()
    grid = client.get("/v1/strata/residency").json()
    assert grid["experts_mode"] == "memory" and grid["tier"] == []


def test_history_route_serves_what_the_sampler_took(engine):
    scheduler = Scheduler()
    app = make_app(lambda: engine, scheduler)
    sampler = app.state.dashboard_sampler
    taken = [sampler.sample_once()]
    scheduler.running, scheduler.waiting = 3, 2
    taken.append(sampler.sample_once())
    body = TestClient(app).get("/v1/strata/history").json()
    assert body["object"] == "strata.history" and body["steps_s"] == [1.0, 10.0] and body["spans_s"] == [300.0, 3600.0]
    served = {s["t"]: s for s in body["samples"]}
    stats = engine.stats()
    for sample, running in zip(taken, (1, 3), strict=True):
        assert served[sample["t"]] == json.loads(json.dumps(sample))  # as taken, JSON-ready
        assert sample["running"] == running and sample["gen"] == stats["generated_tokens"] > 0
        assert sample["lookups"] == stats["tiers"]["lookups"] and sample["engram"]["tier"] == "disk"
    assert taken[1]["t"] > taken[0]["t"] and body["now"] >= taken[1]["t"]
    since = TestClient(app).get("/v1/strata/history", params={"since": taken[0]["t"]}).json()["samples"]
    assert taken[0]["t"] not in [s["t"] for s in since] and taken[1]["t"] in [s["t"] for s in since]
