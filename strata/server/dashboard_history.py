"""The dashboard's history: the figures its charts draw, sampled by the server into a bounded ring.

    history = History()                      # 1 s steps for 5 minutes, then 10 s steps for an hour
    sampler = Sampler(history, read)         # read() -> figures_of(stats), or None while nothing is served
    sampler.ensure_running()                 # on the server's event loop; the loop's end stops it
    history.samples(since=t)                 # what GET /v1/strata/history serves

A sample is what the page's charts need of one `/v1/strata/stats` snapshot (`figures_of`), in the shape
the page's own `figuresOf` (dashboard.js and its panels) gives it:

    {"t": seconds on the monotonic clock, "lookups": n, "hits": {tier: n}, "tiers": [tier names],
     "gen": generated tokens, "prompt": prompt tokens, "paths": {"disk->pinned": bytes, ...},
     "running": requests, "waiting": requests,
     "engram": {"tier": name, "hits": {tier: rows}, "bytes": bytes read, "stall": seconds} | None,
     "cards": {device: {"lookups": n, "gpu_hits": n, "pcie": bytes}} | None, "hop_bytes": bytes | None}

Every number but `t`, `running` and `waiting` is a cumulative counter, so a rate is the difference of
two samples' counters over the difference of their `t`: a sample taken late still gives the right
rate, and a coarse step's rate is exactly the mean over the step. The ring keeps each counter
monotonic: when one drops (its source restarted from zero), the last value seen before the drop is
added to it from then on, so a difference across the restart counts what was counted after it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("strata.server")

GAUGES = ("running", "waiting")  # the numbers of a sample that are not counters (besides t)


@dataclass(frozen=True)
class Resolution:
    """One level of the ring: a sample every `step_s` seconds, kept for `span_s` seconds."""

    step_s: float
    span_s: float

    @property
    def capacity(self) -> int:
        return max(1, math.ceil(self.span_s / self.step_s))


DEFAULT_RESOLUTIONS = (Resolution(1.0, 300.0), Resolution(10.0, 3600.0))


# ---- what a sample holds -------------------------------------------------------------------------
def _num(value: Any) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) else None


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _engram(e: Any) -> dict | None:
    """The Engram panel's counters; a multi-card engine's `{"devices": {...}}` summed over cards."""
    if not isinstance(e, dict):
        return None
    parts = [d for d in _dict(e.get("devices")).values() if isinstance(d, dict)] if "devices" in e else [e]
    tier = e.get("tier", next((d.get("tier") for d in parts if "tier" in d), ""))
    hits: dict[str, float] = {}
    total: dict[str, float] = {}
    for d in parts:
        for name, n in _dict(d.get("hits")).items():
            hits[name] = hits.get(name, 0) + (_num(n) or 0)
        for key in ("bytes_read", "stall_s"):
            if _num(d.get(key)) is not None:
                total[key] = total.get(key, 0) + d[key]
    return {"tier": str(tier or ""), "hits": hits, "bytes": total.get("bytes_read"), "stall": total.get("stall_s")}


def figures_of(stats: dict) -> dict:
    """The sample (without `t`) of one `/v1/strata/stats` snapshot: the engine's `stats()` with the
    scheduler's under "scheduler". Missing keys give 0, None or empty, as the page reads them."""
    tiers = _dict(stats.get("tiers"))
    scheduler = _dict(stats.get("scheduler"))
    per_tier = _dict(tiers.get("tiers"))
    cards = None
    devices = tiers.get("devices")
    if isinstance(devices, dict) and devices:
        cards = {dev: {"lookups": _num(d.get("lookups")),
                       "gpu_hits": _num(_dict(_dict(d.get("tiers")).get("gpu")).get("hits")),
                       "pcie": _num(d.get("pcie_bytes"))}
                 for dev, d in devices.items() if isinstance(d, dict)}
    hops = tiers.get("stage_hops")
    return {
        "lookups": _num(tiers.get("lookups")) or 0,
        "hits": {name: _num(_dict(x).get("hits")) or 0 for name, x in per_tier.items()},
        "tiers": list(per_tier),
        "gen": _num(stats.get("generated_tokens")),
        "prompt": _num(stats.get("prompt_tokens")),
        "paths": {name: _num(_dict(x).get("bytes")) or 0 for name, x in _dict(tiers.get("paths")).items()},
        "running": _num(scheduler.get("running")),
        "waiting": _num(scheduler.get("waiting")),
        "engram": _engram(stats.get("engram")),
        "cards": cards,
        "hop_bytes": _num(hops.get("bytes")) if isinstance(hops, dict) else None,
    }


def _counters(sample: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, dict, str]]:
    """(path, the dict holding it, its key) of every counter in `sample`."""
    for key, value in sample.items():
        if isinstance(value, dict):
            yield from _counters(value, (*prefix, key))
        elif not prefix and key in (*GAUGES, "t"):
            continue
        elif _num(value) is not None:
            yield (*prefix, key), sample, key


# ---- the ring ------------------------------------------------------------------------------------
class History:
    """Samples at a few resolutions, each level a bounded ring; thread-safe.

    The finest level gets every sample. A coarser level takes one when its step has passed since its
    last (within half the finest step, so jitter does not stretch the step): the counters as they are,
    the gauges averaged over the finer samples since its last one.
    """

    def __init__(self, resolutions: tuple[Resolution, ...] = DEFAULT_RESOLUTIONS):
        if not resolutions or any(b.step_s <= a.step_s for a, b in zip(resolutions, resolutions[1:], strict=False)):
            raise ValueError("resolutions must be given finest first, with growing steps")
        self.resolutions = resolutions
        self._levels: list[deque[dict]] = [deque(maxlen=r.capacity) for r in resolutions]
        self._gauges: list[dict[str, list[float]]] = [{} for _ in resolutions]  # per level: since its last sample
        self._offset: dict[tuple, float] = {}  # added to a counter since it restarted
        self._last_raw: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def add(self, t: float, figures: dict) -> dict:
        """Store `figures` (see `figures_of`) taken at time `t` (seconds, monotonic); returns the stored sample."""
        sample = {"t": t, **_copy(figures)}
        with self._lock:
            last = self._levels[0][-1]["t"] if self._levels[0] else None
            if last is not None and t <= last:
                raise ValueError(f"sample time {t} is not after the last one ({last})")
            for path, holder, key in list(_counters(sample)):
                raw = holder[key]
                if raw < self._last_raw.get(path, raw):  # restarted: count on from where it was
                    self._offset[path] = self._offset.get(path, 0) + self._last_raw[path]
                self._last_raw[path] = raw
                holder[key] = raw + self._offset.get(path, 0)
            half_step = self.resolutions[0].step_s / 2
            for level, (res, ring) in enumerate(zip(self.resolutions, self._levels, strict=True)):
                pending = self._gauges[level]
                for name in GAUGES:
                    if _num(sample.get(name)) is not None:
                        pending.setdefault(name, []).append(sample[name])
                if level and ring and t - ring[-1]["t"] < res.step_s - half_step:
                    continue
                kept = dict(sample)
                if level:
                    for name in GAUGES:
                        values = pending.get(name)
                        kept[name] = sum(values) / len(values) if values else None
                pending.clear()
                ring.append(kept)
        return sample

    def samples(self, since: float | None = None) -> list[dict]:
        """Every sample kept, oldest first: a coarser level's only where no finer level reaches back;
        only those after `since` when given."""
        parts: list[list[dict]] = []
        oldest = math.inf
        with self._lock:
            for ring in self._levels:  # finest first; each coarser level adds what lies before the finer ones
                part = [s for s in ring if s["t"] < oldest and (since is None or s["t"] > since)]
                if part:
                    oldest = part[0]["t"]
                parts.append(part)
        return [s for part in reversed(parts) for s in part]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(ring) for ring in self._levels)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return list(value)
    return value


# ---- the sampler ---------------------------------------------------------------------------------
class Sampler:
    """Reads the figures once per `step_s` into `history`, as a task on the server's event loop.

    `read()` runs in a worker thread (never inside an engine step: it takes the same snapshot that
    `GET /v1/strata/stats` does) and returns `figures_of(...)`, or None while no model is served.
    The task ends when cancelled, which the event loop does to every task when the server stops.
    """

    def __init__(self, history: History, read: Callable[[], dict | None], step_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.history, self.read, self.clock = history, read, clock
        self.step_s = step_s if step_s is not None else history.resolutions[0].step_s
        self._task: asyncio.Task | None = None
        self._warned = False
        self._lock = threading.Lock()  # one read at a time, so the samples' times grow

    @property
    def running(self) -> bool:
        """Whether the sampling task is alive."""
        return self._task is not None and not self._task.done()

    def ensure_running(self) -> None:
        """Start sampling on the running event loop unless a task already samples there."""
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._task.get_loop() is loop:
            return
        self._task = loop.create_task(self.run(), name="strata-dashboard-sampler")

    def sample_once(self) -> dict | None:
        """Read the figures and store them; None when there was nothing to read."""
        with self._lock:
            try:
                figures = self.read()
            except Exception as e:  # noqa: BLE001 - e.g. the engine closing under the read; the next tick retries
                if not self._warned:
                    log.warning("dashboard history: reading the statistics failed (%s); retrying every %g s", e,
                                self.step_s)
                    self._warned = True
                return None
            if figures is None:
                return None
            return self.history.add(self.clock(), figures)

    async def run(self) -> None:
        """Sample every `step_s` on the clock's grid (a late tick is skipped, not made up) until cancelled."""
        next_tick = self.clock()
        while True:
            try:
                await asyncio.to_thread(self.sample_once)
            except Exception:  # a fault of the ring itself (not of a read): say so once, and stop sampling
                log.exception("dashboard history: sampling failed; the history stops here")
                return
            next_tick += self.step_s
            now = self.clock()
            if next_tick < now:  # the read took longer than a step: continue from now
                next_tick = now + self.step_s - (now - next_tick) % self.step_s
            await asyncio.sleep(next_tick - now)
