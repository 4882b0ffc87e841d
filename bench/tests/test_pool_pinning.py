"""bench/probes/pool_pinning.py's CPU-side parts: the CPU order it pins by, the thread census and its sampler."""

from __future__ import annotations

import os
import threading
import time

from bench.probes import pool_pinning


def test_cores_first_orders_every_allowed_cpu_once():
    order = pool_pinning.cores_first()
    assert sorted(order) == sorted(os.sched_getaffinity(0))


def test_tasks_see_a_new_thread_and_its_cpu_time():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="spinner")
    before = pool_pinning.tasks()
    t.start()
    try:
        time.sleep(0.3)
        during = pool_pinning.tasks()
    finally:
        stop.set()
        t.join()
    new = set(during) - set(before)
    assert len(new) == 1
    state, cpu, ticks, name = during[new.pop()]
    assert cpu in os.sched_getaffinity(0) and ticks >= 0 and name


def test_sampler_counts_its_samples():
    with pool_pinning.Sampler(period=0.01) as s:
        time.sleep(0.2)
    report = s.report()
    assert report["samples"] >= 5 and 0.0 <= report["shared"] <= 1.0
