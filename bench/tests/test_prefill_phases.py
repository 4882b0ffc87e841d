"""bench/probes/prefill_phases.py's CPU-side parts: its timers, its stack sampler, and the methods it wraps existing."""

from __future__ import annotations

import threading
import time

from bench.probes import prefill_phases


def test_timed_adds_each_call_to_its_phase_and_keeps_the_result():
    clock = prefill_phases.PhaseClock()
    slow = prefill_phases.timed(clock, "nap", lambda s: time.sleep(s) or s)
    assert slow(0.02) == 0.02 and slow(0.03) == 0.03
    assert 0.05 <= clock.sums["nap"] < 0.5
    clock.reset()
    assert clock.sums == {} and clock.submitted == []


def test_the_sampler_counts_a_busy_threads_function_by_its_name():
    sampler = prefill_phases.StackSampler(0.001)
    stop = threading.Event()

    def spin_here():
        while not stop.is_set():
            sum(range(100))

    t = threading.Thread(target=spin_here, name="busy-one")
    sampler.on.set()
    t.start()
    time.sleep(0.2)
    sampler.on.clear()
    stop.set()
    t.join()
    top = sampler.top(3)["busy-one"]
    assert top and "spin_here" in top[0][0] and top[0][1] >= 5


def test_instrument_wraps_methods_the_engine_has(monkeypatch):
    """Every method the probe wraps exists under that name (a rename would leave a phase silently at 0), and the
    wrappers are in place afterwards; monkeypatch puts the originals back."""
    from strata.runtime.generation import scheduler
    from strata.runtime.model.attention import GQAAttention
    from strata.runtime.model.transformer import MoETransformer
    from strata.runtime.offload import cost_model, tiered_moe
    from strata.runtime.offload.cpu_compute import CpuShare
    from strata.runtime.offload.expert_compute import ExpertCompute
    from strata.runtime.offload.tiered_moe import TieredExperts

    targets = [(tiered_moe, "group_by_expert"), (TieredExperts, "_plan_split"), (TieredExperts, "_tier_forward"),
               (TieredExperts, "_batch_forward"), (TieredExperts, "_start_cpu_share"), (GQAAttention, "forward"),
               (MoETransformer, "run_layers"), (scheduler, "run_pass"), (CpuShare, "wait"),
               (ExpertCompute, "cpu_forward"), (cost_model.Rates, "observe_cpu")]
    before = {}
    for owner, name in targets:
        before[(owner, name)] = getattr(owner, name)
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    clock = prefill_phases.PhaseClock()
    prefill_phases.instrument(clock)
    assert all(getattr(owner, name) is not before[(owner, name)] for owner, name in targets)
    rates = cost_model.Rates()
    rates.observe_cpu(1_000_000, 0.001)  # the kernel's seconds go to the clock, and still feed the rate
    assert clock.sums["cpu"] == 0.001
    assert rates.cpu_bytes_per_s != cost_model.Rates().cpu_bytes_per_s
