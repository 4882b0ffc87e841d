"""Prometheus metrics for the server, named in vLLM's style with a `strata:` prefix.

Request metrics (token counters, latency histograms) are updated by the request handlers. Everything
that already lives elsewhere (the scheduler's queue, the tier manager's counters) is read at scrape
time by a custom collector, so it costs nothing between scrapes and can never drift from the source.
Each app has its own `CollectorRegistry`, so several servers (or tests) in one process do not collide.

Tier series (labels `tier` and `device`). A model split over several cards reports each card's own
tier manager under `device` (e.g. "cuda:1"; the merged totals are not emitted, since summing over
`device` gives them); a single-card engine's series carry the engine's device:
  strata:tier_lookups_total       lookups that reached this tier (not served by a faster one)
  strata:tier_hits_total          lookups this tier served
  strata:tier_hit_ratio           hits / lookups of the tier (for the first tier: the share of all lookups)
  strata:tier_resident_objects / strata:tier_resident_bytes / strata:tier_capacity_objects / strata:tier_evictions_total
  strata:tier_bytes_moved_total, strata:tier_bandwidth_bytes_per_second   (label `path`, e.g. "disk->pinned")
  strata:tier_stall_seconds_total, strata:prefetch_precision, strata:prefetch_recall, strata:tier_damaged_objects
  strata:tier_promotions_total    experts promoted into the GPU tier in the background (split decode)

Prefix cache series (no labels): prompt tokens computed against those served from the cache
  strata:prompt_tokens_computed_total, strata:prompt_tokens_cached_total, strata:prefix_cache_hit_ratio

Stage-hop series (no labels; only for a model split over several cards): activation copies between cards
  strata:stage_hops_total, strata:stage_hop_bytes_total, strata:stage_hop_seconds_total (0 unless hops are timed)

Engram row series (label `device`; none at all for a model without Engram layers). Where the tables
live is `strata:engram_info{table_tier}` ("memory": plain in-memory tables, and no other series):
  strata:engram_row_lookups_total        table rows asked for (with repeats)
  strata:engram_unique_rows_total        distinct rows asked for, counted per step
  strata:engram_rows_served_total        distinct rows served, label `tier`: "cache" (the row cache on the
                                         compute device) or the table tier ("gpu", "pinned", "tmpfs", "disk")
  strata:engram_row_hit_ratio            rows served by the tier / rows served by all (since start)
  strata:engram_bytes_read_total, strata:engram_stall_seconds_total, strata:engram_prefetched_rows_total
  strata:engram_row_cache_resident_rows / strata:engram_row_cache_capacity_rows / strata:engram_row_cache_evictions_total
  strata:engram_table_bytes              bytes of all tables, label `table_tier`
  strata:engram_handshake_{steps,serve_seconds,first_layer_seconds,gpu_wait_polls}_total
                                         tables on disk, one graph a step: the host thread's serving (if any)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

log = logging.getLogger("strata.server")

TIER_ORDER = ("gpu", "pinned", "tmpfs", "disk")  # fastest first: a lookup falls through to the next
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)


class ServerMetrics:
    """The app's registry: request counters and histograms, plus live scheduler and tier gauges.

    `live()` returns `(engine, scheduler)` once the model is loaded, else None (while loading).
    """

    def __init__(self, live: Callable[[], tuple[Any, Any] | None]):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.prompt_tokens = Counter("strata:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("strata:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.request_success = Counter("strata:request_success", "Finished sequences by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_errors = Counter("strata:request_errors", "Requests answered with an error, by HTTP status.",
                                      ["status"], registry=r)
        self.ttft = Histogram("strata:time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("strata:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("strata:e2e_request_latency_seconds", "Arrival to last token of a sequence.",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_LiveCollector(live))

    def count_error(self, error: Any) -> None:
        """Count a request answered with an error (an `APIError`) under its HTTP status."""
        self.request_errors.labels(str(error.status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def sequence(self) -> SequenceTimer:
        """A timer for one generated sequence, started now."""
        return SequenceTimer(self)


class SequenceTimer:
    """Feeds TTFT, inter-token latency and end-to-end latency of one sequence into the histograms."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0
        self.done = False

    def token(self) -> None:
        """Call on every generated token."""
        now = time.perf_counter()
        (self.metrics.ttft if self.tokens == 0 else self.metrics.itl).observe(now - self.last)
        self.last, self.tokens = now, self.tokens + 1

    def finish(self, reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """Call once when the sequence ends (not for a cancelled one)."""
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.start)
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)
        m.request_success.labels(reason or "unknown").inc()


class _LiveCollector:
    """Reads scheduler and tier-manager snapshots at scrape time."""

    def __init__(self, live: Callable[[], tuple[Any, Any] | None]):
        self.live = live

    def describe(self) -> list:
        return []  # collected live; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("strata:server_ready", "1 once the model is loaded and serving, 0 while loading.")
        state = self.live()
        ready.add_metric([], 1.0 if state is not None else 0.0)
        yield ready
        if state is None:
            return
        engine, scheduler = state
        try:
            yield from _scheduler_metrics(scheduler.stats())
            stats = engine.stats()
            yield from _tier_metrics(stats.get("tiers"), str(stats.get("device", "cpu")), engine.plan)
            yield from engram_metrics(stats.get("engram"), str(stats.get("device", "cpu")))
        except Exception:  # a scrape must never fail the server; the log says what broke
            log.exception("collecting live metrics failed")


def _scheduler_metrics(s: dict) -> Iterator[Metric]:
    names = {"running": ("strata:num_requests_running", "Sequences in the running batch."),
             "waiting": ("strata:num_requests_waiting", "Requests queued, not yet running."),
             "kv_slots_free": ("strata:kv_slots_free", "Free KV-cache sequence slots."),
             "max_batch": ("strata:max_batch", "Sequences the scheduler runs together at most.")}
    for key, (name, doc) in names.items():
        if isinstance(s.get(key), int | float):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(s[key]))
            yield g
    yield from _prefix_cache_metrics(s.get("prefix_cache"))


def _prefix_cache_metrics(p: dict | None) -> Iterator[Metric]:
    """Prompt tokens computed against those served from the prefix cache (strata.runtime.generation.prefix_cache)."""
    if not p:
        return
    for key, name, doc in (("computed_tokens", "strata:prompt_tokens_computed", "Prompt tokens run through the model."),
                           ("cached_tokens", "strata:prompt_tokens_cached",
                            "Prompt tokens served from the prefix cache instead of computed.")):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(p.get(key, 0)))
        yield c
    ratio = GaugeMetricFamily("strata:prefix_cache_hit_ratio", "Cached prompt tokens over all prompt tokens served.")
    ratio.add_metric([], float(p.get("hit_ratio", 0.0)))
    yield ratio


def _tier_metrics(t: dict | None, device: str, plan: Any) -> Iterator[Metric]:
    """The tier series of `engine.stats()["tiers"]`: one `device` label per card of a staged model (the
    snapshots under "devices"; the merged totals are left out, since summing over `device` gives them),
    else the one snapshot labelled `device`; plus the stage-hop counters when there are stage hops."""
    if not t:
        return
    cards = _cards(t, device, plan)
    labels = ["tier", "device"]
    lookups = CounterMetricFamily("strata:tier_lookups", "Expert lookups that reached this tier.", labels=labels)
    hit_c = CounterMetricFamily("strata:tier_hits", "Expert lookups this tier served.", labels=labels)
    ratio = GaugeMetricFamily("strata:tier_hit_ratio", "Hits over lookups that reached this tier.", labels=labels)
    resident = GaugeMetricFamily("strata:tier_resident_objects", "Experts resident in the tier.", labels=labels)
    resident_b = GaugeMetricFamily("strata:tier_resident_bytes", "Bytes of experts resident in the tier.",
                                   labels=labels)
    capacity = GaugeMetricFamily("strata:tier_capacity_objects", "Expert slots of the tier.", labels=labels)
    evictions = CounterMetricFamily("strata:tier_evictions", "Experts evicted from the tier.", labels=labels)
    moved = CounterMetricFamily("strata:tier_bytes_moved", "Bytes moved between tiers.", labels=["path", "device"])
    bw = GaugeMetricFamily("strata:tier_bandwidth_bytes_per_second", "Achieved bandwidth while moving (bytes/busy s).",
                           labels=["path", "device"])
    stall = CounterMetricFamily("strata:tier_stall_seconds", "Time compute waited for experts to arrive.",
                                labels=["device"])
    pf = {key: GaugeMetricFamily(f"strata:prefetch_{key}", doc, labels=["device"])
          for key, doc in (("precision", "Prefetched experts later used / prefetches issued."),
                           ("recall", "Lookups served by a prefetch / (those + misses)."))}
    damaged = GaugeMetricFamily("strata:tier_damaged_objects", "Experts whose checksum failed.", labels=["device"])
    promoted = CounterMetricFamily("strata:tier_promotions", "Experts promoted into the GPU tier in the background.",
                                   labels=["device"])
    for dev, snap, gpu_slot in cards:
        tiers = snap.get("tiers", {})
        hits = {name: int(v.get("hits", 0)) for name, v in tiers.items()}
        for name, rate in snap.get("hit_rate", {}).items():  # a tier that served lookups but has no residency row
            hits.setdefault(name, round(rate * snap.get("lookups", 0)))
        order = [n for n in TIER_ORDER if n in hits] + sorted(n for n in hits if n not in TIER_ORDER)
        reaching = sum(hits.values())
        for name in order:
            lbl = [name, dev]
            lookups.add_metric(lbl, reaching)
            hit_c.add_metric(lbl, hits[name])
            ratio.add_metric(lbl, hits[name] / reaching if reaching else 0.0)
            reaching -= hits[name]
            row = tiers.get(name)
            if row is not None:
                resident.add_metric(lbl, row.get("resident", 0))
                slot = gpu_slot if name == "gpu" else (plan.slot_bytes if plan is not None else 0)
                resident_b.add_metric(lbl, row.get("resident", 0) * slot)
                capacity.add_metric(lbl, row.get("capacity", 0))
                evictions.add_metric(lbl, row.get("evictions", 0))
        for path, p in sorted(snap.get("paths", {}).items()):
            moved.add_metric([path, dev], p.get("bytes", 0))
            bw.add_metric([path, dev], p["bytes"] / p["seconds"] if p.get("seconds") else 0.0)
        stall.add_metric([dev], float(snap.get("stall_seconds", 0.0)))
        for key, family in pf.items():
            family.add_metric([dev], float(snap.get("prefetch", {}).get(key, 0.0)))
        damaged.add_metric([dev], len(snap.get("damaged", [])))
        promoted.add_metric([dev], int((snap.get("promotions") or {}).get("done", 0)))
    yield from (lookups, hit_c, ratio, resident, resident_b, capacity, evictions, moved, bw, stall, *pf.values(),
                damaged, promoted)
    yield from _hop_metrics(t.get("stage_hops"))


def _cards(t: dict, device: str, plan: Any) -> list[tuple[str, dict, int]]:
    """(device label, tier snapshot, bytes of one GPU slot) per card: each card of a staged model, matched
    to its `GpuPlan` by device name (else by stage order), or the one snapshot of a single-card engine."""
    gpus = list(plan.gpus) if plan is not None and getattr(plan, "gpus", None) else []
    per = t.get("devices")
    if not isinstance(per, dict) or not per:
        return [(device, t, gpus[0].slot_bytes if gpus else 0)]
    by_name = {str(g.device): g for g in gpus}
    out = []
    for i, (dev, snap) in enumerate(per.items()):
        if isinstance(snap, dict):
            g = by_name.get(str(dev)) or (gpus[i] if i < len(gpus) else None)
            out.append((str(dev), snap, g.slot_bytes if g is not None else 0))
    return out


def _hop_metrics(hops: dict | None) -> Iterator[Metric]:
    """Activation copies between the cards of a staged model (`stats()["tiers"]["stage_hops"]`)."""
    if not isinstance(hops, dict):
        return
    for key, name, doc in (
            ("hops", "strata:stage_hops", "Activation copies from one card's stage to the next."),
            ("bytes", "strata:stage_hop_bytes", "Bytes of activations copied between cards."),
            ("seconds", "strata:stage_hop_seconds", "Copy time of the timed stage hops (0 unless hop timing is on).")):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], float(hops.get(key, 0) or 0))
        yield family


ENGRAM_SERVING_ORDER = ("cache", "gpu", "pinned", "tmpfs", "disk")  # the row cache first, then the table tiers
# stats() key -> (metric name, help, counter?) of the per-device Engram figures without a tier label
_ENGRAM_SCALARS = {
    "lookups": ("strata:engram_row_lookups", "Engram table rows asked for (with repeats).", True),
    "unique_rows": ("strata:engram_unique_rows", "Distinct Engram rows asked for, counted per step.", True),
    "bytes_read": ("strata:engram_bytes_read", "Bytes of Engram rows read from the table tier.", True),
    "stall_s": ("strata:engram_stall_seconds", "Time a layer waited for Engram rows to arrive.", True),
    "prefetched_rows": ("strata:engram_prefetched_rows", "Engram rows fetched ahead of need.", True),
    "cache_resident": ("strata:engram_row_cache_resident_rows", "Rows held by the Engram row cache.", False),
    "cache_rows": ("strata:engram_row_cache_capacity_rows", "Row slots of the Engram row cache (0: no cache).",
                   False),
    "cache_evictions": ("strata:engram_row_cache_evictions", "Rows evicted from the Engram row cache.", True),
}


def engram_metrics(engram: dict | None, device: str) -> Iterator[Metric]:
    """The Engram row series of `engine.stats()["engram"]` (see the module docstring); nothing when it is None.

    A multi-GPU engine may report `{"devices": {name: stats}}` (one row store per card): each card's
    figures then carry its own `device` label."""
    if not isinstance(engram, dict) or not engram:
        return
    per = engram.get("devices")
    snaps = [(str(d), s) for d, s in per.items() if isinstance(s, dict)] if isinstance(per, dict) else [(device, engram)]
    if not snaps:
        return
    snaps = [(dev, str(s.get("tier", engram.get("tier", "unknown"))), s) for dev, s in snaps]
    info = InfoMetricFamily("strata:engram", "Where the Engram tables live (memory: plain in-memory tables).",
                            labels=["device"])
    for dev, tier, _ in snaps:
        info.add_metric([dev], {"table_tier": tier})
    yield info
    snaps = [x for x in snaps if x[1] != "memory"]  # in-memory tables count no rows
    if not snaps:
        return
    for key, (name, doc, counter) in _ENGRAM_SCALARS.items():
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["device"])
        for dev, _, s in snaps:
            if isinstance(s.get(key), int | float):
                family.add_metric([dev], float(s[key]))
        if family.samples:
            yield family
    served = CounterMetricFamily("strata:engram_rows_served", "Distinct Engram rows served, by serving tier.",
                                 labels=["tier", "device"])
    ratio = GaugeMetricFamily("strata:engram_row_hit_ratio",
                              "Engram rows served by this tier over rows served by all tiers (since start).",
                              labels=["tier", "device"])
    table = GaugeMetricFamily("strata:engram_table_bytes", "Bytes of all Engram tables, by the tier holding them.",
                              labels=["table_tier", "device"])
    for dev, tier, s in snaps:
        hits = {str(k): int(v) for k, v in (s.get("hits") or {}).items() if isinstance(v, int | float)}
        hits.setdefault(tier, 0)  # the table tier always has a series, so the ratio exists before traffic
        if s.get("cache_rows"):  # a row cache exists: its series too
            hits.setdefault("cache", 0)
        total = sum(hits.values())
        order = [n for n in ENGRAM_SERVING_ORDER if n in hits] + sorted(n for n in hits if n not in ENGRAM_SERVING_ORDER)
        for name in order:
            served.add_metric([name, dev], hits[name])
            ratio.add_metric([name, dev], hits[name] / total if total else 0.0)
        if isinstance(s.get("table_bytes"), int | float):
            table.add_metric([tier, dev], float(s["table_bytes"]))
    yield from (served, ratio)
    if table.samples:
        yield table
    yield from _handshake_metrics(snaps)


# the rows' handshake (one-graph decode steps with tables on disk): stats()["handshake"] key -> (name, help)
_HANDSHAKE = {
    "steps": ("strata:engram_handshake_steps", "Decode steps whose Engram rows a host thread served to the graph."),
    "serve_s": ("strata:engram_handshake_serve_seconds", "Host time serving those steps' Engram rows."),
    "first_layer_s": ("strata:engram_handshake_first_layer_seconds",
                      "Host time until each step's first Engram layer was answered (what the GPU may wait for)."),
    "gpu_wait_spins": ("strata:engram_handshake_gpu_wait_polls",
                       "The GPU's polls for an Engram layer's answer that found none yet (about 1 us each)."),
}


def _handshake_metrics(snaps: list) -> Iterator[Metric]:
    for key, (name, doc) in _HANDSHAKE.items():
        family = CounterMetricFamily(name, doc, labels=["device"])
        for dev, _, s in snaps:
            hs = s.get("handshake")
            if isinstance(hs, dict) and isinstance(hs.get(key), int | float):
                family.add_metric([dev], float(hs[key]))
        if family.samples:
            yield family
