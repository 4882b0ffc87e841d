"""Engram row statistics in `/metrics` and `/v1/strata/stats`: a real Engine on the tiny demo model.

The tables live on disk (`engram.tier = "disk"`), so rows really flow through the row cache and the
disk reader; a demo model built without Engram layers has no Engram series at all, and plain
in-memory tables (`runtime.experts = "memory"`) have only the tier.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from strata.server.metrics import engram_metrics

MODEL = "demo"
PROMPT = "Engram looks up hashed n-grams of the recent tokens"


def scrape(client: TestClient) -> dict[str, list[tuple[dict, float]]]:
    """Every sample of /metrics: name -> [(labels, value)]."""
    text = client.get("/metrics").text
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(samples: dict, name: str, **labels) -> float:
    hits = [v for lbl, v in samples.get(name, []) if all(lbl.get(k) == want for k, want in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {samples.get(name)}"
    return hits[0]


def serve(engine) -> Iterator[TestClient]:
    from strata.server.app import create_app

    sched = engine.scheduler(max_batch=2, token_budget=128)
    sched.start()
    try:
        with TestClient(create_app(engine, sched, MODEL)) as client:
            yield client
    finally:
        sched.stop(drain=False)
        engine.close()


@pytest.fixture(scope="module")
def disk_client(tiny_model_dir):
    from strata import Engine

    engine = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"engram": {"tier": "disk"}})
    assert engine.stats()["engram"]["tier"] == "disk"
    yield from serve(engine)


def test_engram_series_follow_a_generation(disk_client):
    before = scrape(disk_client)
    lookups0 = one(before, "strata:engram_row_lookups_total", device="cpu")
    for _ in range(2):  # the second prompt's rows are in the cache whatever the reads' timing (prefetches
        # absorbed before a step count its rows as cache hits, those still in flight as disk reads)
        r = disk_client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12})
        assert r.status_code == 200, r.text
    after = scrape(disk_client)
    stats = disk_client.get("/v1/strata/stats").json()["engram"]  # idle now: the same figures as the scrape

    assert one(after, "strata:engram_info", device="cpu", table_tier="disk") == 1.0
    lookups = one(after, "strata:engram_row_lookups_total", device="cpu")
    assert lookups > lookups0 and lookups == stats["lookups"]
    assert one(after, "strata:engram_bytes_read_total", device="cpu") == stats["bytes_read"] > 0
    assert one(after, "strata:engram_stall_seconds_total", device="cpu") == pytest.approx(stats["stall_s"])
    assert one(after, "strata:engram_table_bytes", table_tier="disk", device="cpu") == stats["table_bytes"] > 0
    assert one(after, "strata:engram_row_cache_capacity_rows", device="cpu") == stats["cache_rows"] > 0
    assert one(after, "strata:engram_row_cache_resident_rows", device="cpu") == stats["cache_resident"] > 0
    assert one(after, "strata:engram_row_cache_evictions_total", device="cpu") == stats["cache_evictions"]

    # distinct rows per serving tier: the disk served the first reads, the cache the repeats (the second prompt)
    served = {lbl["tier"]: v for lbl, v in after["strata:engram_rows_served_total"]}
    assert set(served) == {"cache", "disk"} and served == {t: stats["hits"].get(t, 0) for t in served}
    assert served["disk"] > 0 and served["cache"] > 0
    ratio = {lbl["tier"]: v for lbl, v in after["strata:engram_row_hit_ratio"]}
    assert ratio == pytest.approx({t: n / sum(served.values()) for t, n in served.items()})

    # the stats JSON has every field the dashboard's Engram panel reads
    assert {"tier", "lookups", "hits", "bytes_read", "stall_s", "cache_rows", "cache_resident", "cache_evictions",
            "table_bytes"} <= set(stats)


def test_no_engram_series_without_engram(tmp_path):
    from strata import Engine
    from strata.runtime.demo.model import write_demo_model

    path = write_demo_model(tmp_path / "plain", size="tiny", engram=False, progress=False)
    engine = Engine.from_pretrained(path, device="cpu")
    assert engine.stats()["engram"] is None
    for client in serve(engine):
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).status_code == 200
        samples = scrape(client)
        assert "strata:tier_lookups_total" in samples  # the scrape worked
        assert not [n for n in samples if n.startswith("strata:engram")]


def test_in_memory_tables_report_only_their_tier(tiny_model_dir):
    from strata import Engine

    engine = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"experts": "memory"}})
    assert engine.stats()["engram"] == {"tier": "memory"}
    for client in serve(engine):
        samples = scrape(client)
        engram = {n for n in samples if n.startswith("strata:engram")}
        assert engram == {"strata:engram_info"}
        assert one(samples, "strata:engram_info", table_tier="memory") == 1.0


def test_per_device_engram_stats_are_labelled_by_device():
    """A multi-GPU engine's `{"devices": {...}}` shape: one sample per card, nothing crashes."""
    per = {"devices": {"cuda:0": {"tier": "gpu", "lookups": 6, "hits": {"gpu": 4}, "table_bytes": 100},
                       "cuda:1": {"tier": "pinned", "lookups": 3, "hits": {"cache": 1, "pinned": 2},
                                  "cache_rows": 8, "table_bytes": 50}}}
    samples = _exported(per, "cuda:0")
    assert one(samples, "strata:engram_row_lookups_total", device="cuda:1") == 3
    assert one(samples, "strata:engram_row_hit_ratio", device="cuda:1", tier="pinned") == pytest.approx(2 / 3)
    assert one(samples, "strata:engram_row_hit_ratio", device="cuda:0", tier="gpu") == 1.0
    assert one(samples, "strata:engram_table_bytes", device="cuda:1", table_tier="pinned") == 50
    assert list(engram_metrics(None, "cpu")) == [] and list(engram_metrics({}, "cpu")) == []
    assert not [n for n in samples if "handshake" in n]  # no card served rows through a handshake


def test_handshake_series():
    """Tables on disk decoding in one graph a step: the handshake's counters are exported, by device."""
    stats = {"tier": "disk", "lookups": 10, "hits": {"cache": 4, "disk": 6}, "cache_rows": 64,
             "handshake": {"steps": 7, "serve_s": 0.25, "first_layer_s": 0.125, "gpu_wait_spins": 900}}
    samples = _exported(stats, "cuda:0")
    assert one(samples, "strata:engram_handshake_steps_total", device="cuda:0") == 7
    assert one(samples, "strata:engram_handshake_serve_seconds_total", device="cuda:0") == 0.25
    assert one(samples, "strata:engram_handshake_first_layer_seconds_total", device="cuda:0") == 0.125
    assert one(samples, "strata:engram_handshake_gpu_wait_polls_total", device="cuda:0") == 900


def _exported(stats: dict, device: str) -> dict:
    """What a scrape shows for `engine.stats()["engram"] == stats`: name -> [(labels, value)]."""
    from prometheus_client import CollectorRegistry, generate_latest

    class Live:
        def describe(self):
            return []

        def collect(self):
            yield from engram_metrics(stats, device)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Live())
    samples: dict = {}
    for family in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples
