"""The dashboard's history ring: bounded levels, coarser steps, rates from counters, counters that restart."""

from __future__ import annotations

import asyncio
import json

import pytest

from strata.server.dashboard_history import History, Resolution, Sampler, figures_of


def figures(gen: float, running: float = 0, paths: dict | None = None, engram_rows: float | None = None) -> dict:
    """A sample's figures as `figures_of` gives them, with the counters the tests drive."""
    return {"lookups": 2 * gen, "hits": {"pinned": gen, "disk": gen}, "tiers": ["pinned", "disk"], "gen": gen,
            "prompt": 0, "paths": paths or {}, "running": running, "waiting": 0,
            "engram": None if engram_rows is None else {"tier": "disk", "hits": {"cache": engram_rows}, "bytes": 0,
                                                        "stall": 0.0},
            "cards": None, "hop_bytes": None}


def rate(a: dict, b: dict, key: str = "gen") -> float:
    return (b[key] - a[key]) / (b["t"] - a["t"])


def test_levels_are_bounded_and_merge_oldest_first():
    history = History((Resolution(1.0, 5.0), Resolution(10.0, 30.0)))
    for i in range(100):
        history.add(float(i), figures(10.0 * i))
    samples = history.samples()
    ts = [s["t"] for s in samples]
    assert ts == sorted(set(ts)), ts
    assert ts[-5:] == [95.0, 96.0, 97.0, 98.0, 99.0]  # the fine level: its 5 newest
    assert ts[:-5] == [70.0, 80.0, 90.0]  # the coarse level before them: 3 samples (30 s at 10 s)
    assert len(history) == 5 + 3
    # since: only what is newer, reaching into the coarse level
    assert [s["t"] for s in history.samples(since=80.0)] == [90.0, 95.0, 96.0, 97.0, 98.0, 99.0]
    assert history.samples(since=99.0) == []
    json.dumps(samples)  # JSON-ready


def test_coarse_steps_keep_exact_rates_and_average_gauges():
    history = History((Resolution(1.0, 3.0), Resolution(10.0, 100.0)))
    t = 0.0
    for i in range(41):  # jittered ticks: a coarse step must not stretch to 11 s
        history.add(t, figures(gen=25.0 * t, running=i % 4))
        t += 0.96 if i % 2 else 1.04
    coarse = history.samples()[:-3]
    steps = [b["t"] - a["t"] for a, b in zip(coarse, coarse[1:], strict=False)]
    assert len(coarse) == 4 and all(9.5 <= s <= 10.5 for s in steps), steps
    for a, b in zip(coarse, coarse[1:], strict=False):  # the counters give the true mean rate over each step
        assert rate(a, b) == pytest.approx(25.0)
    # a coarse sample's gauge is the mean over the fine samples since the one before it
    assert 1.0 <= coarse[1]["running"] <= 2.0 and coarse[1]["running"] != int(coarse[1]["running"])


def test_a_late_sample_gives_the_right_rate():
    history = History()
    for t in (0.0, 1.0, 2.0, 3.7, 4.0):  # the tick at 3 came 0.7 s late
        history.add(t, figures(gen=12.0 * t))
    samples = history.samples()
    assert [rate(a, b) for a, b in zip(samples, samples[1:], strict=False)] == pytest.approx([12.0] * 4)


def test_counters_that_restart_count_on():
    history = History((Resolution(1.0, 60.0), Resolution(10.0, 600.0)))
    raw = [0, 10, 20, 30, 5, 15, 25]  # the source restarted from zero after 30 (and counted 5 since)
    stored = [history.add(float(t), figures(gen=g, paths={"disk->pinned": 100 * g}, engram_rows=g))
              for t, g in enumerate(raw)]
    gen = [s["gen"] for s in stored]
    assert gen == [0, 10, 20, 30, 35, 45, 55]  # monotonic: what was counted after the restart is added on
    assert rate(stored[3], stored[4]) == 5.0 and rate(stored[0], stored[6]) == 55 / 6
    assert [s["paths"]["disk->pinned"] for s in stored] == [100 * g for g in gen]
    assert [s["hits"]["pinned"] for s in stored] == gen and [s["lookups"] for s in stored] == [2 * g for g in gen]
    assert [s["engram"]["hits"]["cache"] for s in stored] == gen
    # a counter that appears later starts at its own value; a second restart adds on again
    later = history.add(7.0, figures(gen=2, paths={"disk->pinned": 300, "tmpfs->pinned": 7}))
    assert later["gen"] == 57 and later["paths"] == {"disk->pinned": 5500 + 300, "tmpfs->pinned": 7}
    # gauges are never rebased
    assert history.add(8.0, figures(gen=3, running=1))["running"] == 1


def test_a_coarse_step_across_a_restart_counts_both_sides():
    history = History((Resolution(1.0, 2.0), Resolution(5.0, 600.0)))
    for t, g in enumerate([0, 10, 20, 30, 5, 15, 25]):  # restarted after t=3; 30 + 15 counted by t=5
        history.add(float(t), figures(gen=g))
    coarse = [s for s in history.samples() if s["t"] in (0.0, 5.0)]
    assert [s["t"] for s in history.samples()] == [0.0, 5.0, 6.0]
    assert rate(*coarse) == 45 / 5


def test_sample_times_must_grow_and_levels_get_coarser():
    history = History()
    history.add(5.0, figures(1))
    with pytest.raises(ValueError, match="not after"):
        history.add(5.0, figures(2))
    with pytest.raises(ValueError, match="growing steps"):
        History((Resolution(10.0, 60.0), Resolution(1.0, 600.0)))


def test_figures_of_reads_the_stats_snapshot():
    stats = {
        "generated_tokens": 40, "prompt_tokens": 12,
        "tiers": {"lookups": 208, "tiers": {"pinned": {"hits": 172}, "disk": {"hits": 36}},
                  "paths": {"disk->pinned": {"bytes": 2064384}},
                  "devices": {"cuda:0": {"lookups": 100, "tiers": {"gpu": {"hits": 90}}, "pcie_bytes": 7},
                              "cuda:1": {"lookups": 108, "tiers": {}, "pcie_bytes": 0}},
                  "stage_hops": {"hops": 3, "bytes": 4096}},
        "engram": {"tier": "disk", "devices": {"cuda:0": {"hits": {"cache": 4, "disk": 1}, "bytes_read": 10, "stall_s": 0.5},
                                               "cuda:1": {"hits": {"cache": 1}, "bytes_read": 6, "stall_s": 0.25}}},
        "scheduler": {"running": 2, "waiting": 1},
    }
    f = figures_of(stats)
    assert f == {"lookups": 208, "hits": {"pinned": 172, "disk": 36}, "tiers": ["pinned", "disk"], "gen": 40,
                 "prompt": 12, "paths": {"disk->pinned": 2064384}, "running": 2, "waiting": 1,
                 "engram": {"tier": "disk", "hits": {"cache": 5, "disk": 1}, "bytes": 16, "stall": 0.75},
                 "cards": {"cuda:0": {"lookups": 100, "gpu_hits": 90, "pcie": 7},
                           "cuda:1": {"lookups": 108, "gpu_hits": None, "pcie": 0}},
                 "hop_bytes": 4096}
    # in-memory experts, no Engram, no scheduler: empty figures rather than errors
    assert figures_of({"experts": "memory", "tiers": None, "engram": None}) == {
        "lookups": 0, "hits": {}, "tiers": [], "gen": None, "prompt": None, "paths": {}, "running": None,
        "waiting": None, "engram": None, "cards": None, "hop_bytes": None}


def test_sampler_skips_what_it_cannot_read():
    clock = iter(range(100))
    reads = iter([None, RuntimeError("engine closed"), figures(4), RuntimeError("again")])

    def read():
        item = next(reads)
        if isinstance(item, Exception):
            raise item
        return item

    sampler = Sampler(History(), read, clock=lambda: float(next(clock)))
    assert sampler.sample_once() is None  # nothing served yet
    assert sampler.sample_once() is None  # a failed read is skipped
    assert sampler.sample_once()["gen"] == 4
    assert sampler.sample_once() is None and len(sampler.history) == 2


def test_sampler_task_ends_with_its_event_loop():
    sampled = []

    def read():
        sampled.append(1)
        return figures(len(sampled))

    sampler = Sampler(History(), read, step_s=0.01)

    async def serve_a_while():
        sampler.ensure_running()
        sampler.ensure_running()  # one task per loop
        await asyncio.sleep(0.2)
        assert sampler.running

    asyncio.run(serve_a_while())  # the loop's end cancels the task, as when the server stops
    assert not sampler.running
    count = len(sampled)
    assert count >= 3
    times = [s["t"] for s in sampler.history.samples()]
    assert times == sorted(times) and len(times) == count
