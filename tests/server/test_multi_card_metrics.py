"""Per-card tier statistics of a model split over several cards: `/metrics` series and the dashboard panel.

The snapshots are real: the tiny 6-layer demo model over two CPU stages (`staged_tiered` of
tests/conftest.py, one tier manager per stage, each with a simulated GPU tier of 8 slots) scores a few
tokens, and `DeviceTiers.stats()` is what the collector and the page are given. On CPU both stages share
a device, so the cards are keyed "cpu/0" and "cpu/1" and no activation crosses a card (0 stage hops).
"""

from __future__ import annotations

import copy
import itertools
import json
from types import SimpleNamespace

import pytest
from dashboard_browser import Chromium, needs_chromium, serve_app
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from staged_models import IDS, score_in_chunks

from strata.server.dashboard import mount_dashboard
from strata.server.metrics import ServerMetrics

CARDS = ("cpu/0", "cpu/1")
# each card's GpuPlan, listed out of stage order: the collector matches them to cards by device name
PLAN = SimpleNamespace(slot_bytes=4096, gpus=[SimpleNamespace(device="cpu/1", slot_bytes=300),
                                              SimpleNamespace(device="cpu/0", slot_bytes=100)])


@pytest.fixture(scope="module")
def snapshot(staged_tiered):
    """`DeviceTiers.stats()` after scoring a prompt, once the background copies have settled."""
    score_in_chunks(staged_tiered.model, staged_tiered.checkpoint.config, IDS)
    assert staged_tiered.manager.wait_settled(60)
    snap = staged_tiered.manager.stats()
    assert set(snap["devices"]) == set(CARDS) and "stage_hops" in snap
    return json.loads(json.dumps(snap))  # as the server sends it (layer keys become strings)


def scrape(tiers: dict, plan=PLAN, device: str = "cpu") -> tuple[str, dict[str, list[tuple[dict, float]]]]:
    """The exposition text of the server's live collector given `tiers`, and its samples: name -> [(labels, value)]."""
    engine = SimpleNamespace(plan=plan, stats=lambda: {"tiers": tiers, "engram": None, "device": device})
    scheduler = SimpleNamespace(stats=lambda: {"running": 0, "waiting": 0})
    text = ServerMetrics(lambda: (engine, scheduler)).render().decode()
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return text, samples


def by(samples: dict, name: str, *keys: str) -> dict:
    """{label values: value} of one series; fails on a repeated label set."""
    out = {}
    for labels, value in samples.get(name, []):
        key = tuple(labels.get(k) for k in keys)
        assert key not in out, f"{name}{key} twice"
        out[key] = value
    return out


def test_every_tier_series_is_per_card(snapshot):
    text, samples = scrape(snapshot)
    helps = [line for line in text.splitlines() if line.startswith(("# HELP", "# TYPE"))]
    assert len(helps) == len(set(helps)), "a metric family is emitted twice"

    # one device label per card, never the merged totals under the engine's device
    for name in ("strata:tier_lookups_total", "strata:tier_hits_total", "strata:tier_capacity_objects",
                 "strata:tier_stall_seconds_total", "strata:prefetch_precision", "strata:tier_damaged_objects"):
        assert {lbl["device"] for lbl, _ in samples[name]} == set(CARDS), name

    lookups = by(samples, "strata:tier_lookups_total", "device", "tier")
    hits = by(samples, "strata:tier_hits_total", "device", "tier")
    for card in CARDS:
        own = snapshot["devices"][card]
        assert lookups[card, "gpu"] == own["lookups"] > 0  # the fastest tier is reached by every lookup
        assert {t: hits[card, t] for c, t in hits if c == card} == {t: r["hits"] for t, r in own["tiers"].items()}
        assert by(samples, "strata:tier_hit_ratio", "device", "tier")[card, "gpu"] == pytest.approx(own["gpu_hit_rate"])
        assert by(samples, "strata:tier_capacity_objects", "device", "tier")[card, "gpu"] == 8
    # summing over `device` gives the merged snapshot
    assert sum(lookups[c, "gpu"] for c in CARDS) == snapshot["lookups"]
    for tier, row in snapshot["tiers"].items():
        assert sum(hits[c, tier] for c in CARDS) == row["hits"], tier
        assert sum(v for (c, t), v in by(samples, "strata:tier_resident_objects", "device", "tier").items()
                   if t == tier) == row["resident"], tier
    moved = by(samples, "strata:tier_bytes_moved_total", "device", "path")
    for path, p in snapshot["paths"].items():
        assert sum(moved.get((c, path), 0) for c in CARDS) == p["bytes"], path
    # each card's GPU slots are sized by its own GpuPlan; the host tiers by the plan's slot
    resident_b = by(samples, "strata:tier_resident_bytes", "device", "tier")
    for card, slot in (("cpu/0", 100), ("cpu/1", 300)):
        own = snapshot["devices"][card]["tiers"]
        assert resident_b[card, "gpu"] == own["gpu"]["resident"] * slot
        assert resident_b[card, "disk"] == own["disk"]["resident"] * 4096 > 0

    # the stage hops (none on one CPU device, but the series are there)
    hops = snapshot["stage_hops"]
    assert by(samples, "strata:stage_hops_total")[()] == hops["hops"]
    assert by(samples, "strata:stage_hop_bytes_total")[()] == hops["bytes"]
    assert by(samples, "strata:stage_hop_seconds_total")[()] == hops["seconds"]


def test_stage_hop_values_and_single_card_shape(snapshot):
    busy = {**snapshot, "stage_hops": {"hops": 12, "bytes": 3 << 20, "seconds": 0.25, "timed": 12}}
    _, samples = scrape(busy)
    assert by(samples, "strata:stage_hops_total")[()] == 12
    assert by(samples, "strata:stage_hop_bytes_total")[()] == 3 << 20
    assert by(samples, "strata:stage_hop_seconds_total")[()] == 0.25

    # one card's own snapshot, as a single-card engine reports it: the engine's device, no hop series
    single = {k: v for k, v in snapshot["devices"]["cpu/1"].items()
              if k not in ("stage_layers", "gpu_hit_rate", "pcie_bytes")}
    _, samples = scrape(single, plan=None, device="cuda:0")
    assert {lbl["device"] for lbl, _ in samples["strata:tier_lookups_total"]} == {"cuda:0"}
    assert not [n for n in samples if n.startswith("strata:stage_hop")]
    assert by(samples, "strata:tier_lookups_total", "tier")[("gpu",)] == single["lookups"]


# ---- the dashboard ----------------------------------------------------------------------------------
def stats_app(make_stats) -> FastAPI:
    """A server whose `/v1/strata/stats` answers `make_stats()` (no engine: the residency grid says 503)."""
    app = FastAPI()
    app.get("/v1/strata/stats")(make_stats)
    mount_dashboard(app, lambda: None)
    return app


def test_page_loads_the_cards_script(snapshot):
    client = TestClient(stats_app(lambda: snapshot))
    page = client.get("/dashboard").text
    assert "dashboard/static/dashboard_cards.js" in page and 'id="cards-panel"' in page and 'id="card-table"' in page
    r = client.get("/dashboard/static/dashboard_cards.js")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    js = r.text
    assert "strataDashboardPlugins" in js and "cards-panel" in js
    assert "http://" not in js and "https://" not in js
    card = snapshot["devices"]["cpu/0"]
    for key in ("stage_layers", "gpu_hit_rate", "lookups", "pcie_bytes"):  # what the panel reads is in the stats
        assert key in card and key in js
    for key in ("hops", "bytes", "seconds", "timed"):
        assert key in snapshot["stage_hops"]
    assert "stage_hops" in js and "tiers.devices" in js


READ_CARDS = """(() => {
  const panel = document.getElementById('cards-panel');
  const rows = [...document.querySelectorAll('#card-table tbody tr[data-card]')].map((r) => ({
    card: r.dataset.card,
    text: Object.fromEntries([...r.cells].map((c) => [c.dataset.key, c.textContent.trim()])),
    value: Object.fromEntries([...r.cells].filter((c) => c.dataset.value !== undefined)
                               .map((c) => [c.dataset.key, Number(c.dataset.value)])),
  }));
  const v = (id) => { const e = document.getElementById(id); return e.dataset.value === undefined ? null : Number(e.dataset.value); };
  return { hidden: panel.hidden, cards: document.body.dataset.cards, rows, hops: v('stage-hops'),
           hopBytes: v('stage-hop-bytes'), hopText: document.getElementById('stage-hop-bytes').textContent,
           points: Number(document.getElementById('cards-chart').dataset.points) };
})()"""


@pytest.fixture
def browser():
    chrome = Chromium(needs_chromium())
    yield chrome
    chrome.close()


def test_cards_panel_in_chromium(snapshot, browser):
    polls = itertools.count()

    def live_stats() -> dict:  # the real snapshot, with card 1 moving 1 MB and card 0 looking up 10 experts per poll
        n = next(polls)
        s = copy.deepcopy(snapshot)
        s["devices"]["cpu/1"]["pcie_bytes"] += n * 1_000_000
        s["devices"]["cpu/0"]["lookups"] += n * 10
        s["devices"]["cpu/0"]["tiers"]["gpu"]["hits"] += n * 7
        s["stage_hops"] = {"hops": 4 * n, "bytes": 4096 * n, "seconds": 0.0, "timed": 0}
        return {"tiers": s, "experts": "tiered", "device": "cpu"}

    with serve_app(stats_app(live_stats)) as url:
        browser.open(url + "/dashboard?interval=200")
        browser.wait_for("Number(document.body.dataset.polls) >= 4", what="four polls")
        page = browser.eval(READ_CARDS)
    assert not page["hidden"] and page["cards"] == "2", page
    assert [r["card"] for r in page["rows"]] == list(CARDS)
    rows = {r["card"]: r for r in page["rows"]}
    assert rows["cpu/0"]["text"]["layers"] == "0–2" and rows["cpu/1"]["text"]["layers"] == "3–5"
    for card in CARDS:
        own, row = snapshot["devices"][card], rows[card]
        assert row["value"]["gpu-hit"] == pytest.approx(own["gpu_hit_rate"])
        assert row["value"]["gpu-resident"] == own["tiers"]["gpu"]["resident"]
        assert row["text"]["gpu-resident"].endswith("/ 8")
    assert rows["cpu/0"]["value"]["lookups"] > snapshot["devices"]["cpu/0"]["lookups"]  # the live figures
    assert rows["cpu/1"]["value"]["pcie"] > snapshot["devices"]["cpu/1"]["pcie_bytes"]
    assert rows["cpu/1"]["text"]["pcie"].endswith("/s")  # a live rate next to the total
    assert page["hops"] > 0 and page["hopBytes"] == page["hops"] * 1024 and page["hopText"].endswith("/s")
    assert page["points"] > 0  # card 0's windowed GPU hit ratio is drawn
    assert browser.page_errors() == []


def test_cards_panel_hidden_for_one_card(snapshot, browser):
    single = {k: v for k, v in snapshot.items() if k not in ("devices", "stage_hops")}
    with serve_app(stats_app(lambda: {"tiers": single, "experts": "tiered", "device": "cpu"})) as url:
        browser.open(url + "/dashboard?interval=200")
        browser.wait_for("Number(document.body.dataset.polls) >= 2", what="two polls")
        assert browser.eval("document.getElementById('cards-panel').hidden") is True
        assert browser.eval("document.body.dataset.cards") == "0"
        assert browser.page_errors() == []
