"""The CPU/copy split for cold experts follows the rates and never sends prefill groups to the CPU."""

from __future__ import annotations

from strata.runtime.offload.cost_model import Rates, cpu_seconds, split_cold

MB9 = 9_437_184  # a Qwen3-30B-A3B expert in bf16


def test_balanced_rates_split_evenly():
    rates = Rates(cpu_bytes_per_s=50e9, pcie_bytes_per_s=50e9, cpu_flops=1e15)
    s = split_cold({e: 1 for e in range(8)}, MB9, rates)
    assert len(s.cpu) == 4 and len(s.copy) == 4
    assert abs(s.cpu_seconds - s.copy_seconds) <= MB9 / 50e9 + 1e-12


def test_faster_path_takes_more():
    fast_cpu = split_cold({e: 1 for e in range(10)}, MB9, Rates(cpu_bytes_per_s=70e9, pcie_bytes_per_s=35e9))
    assert len(fast_cpu.cpu) > len(fast_cpu.copy)
    slow_cpu = split_cold({e: 1 for e in range(10)}, MB9, Rates(cpu_bytes_per_s=10e9, pcie_bytes_per_s=50e9))
    assert len(slow_cpu.cpu) < len(slow_cpu.copy)
    # the makespan is never worse than either path alone
    r = Rates(cpu_bytes_per_s=30e9, pcie_bytes_per_s=50e9)
    s = split_cold({e: 1 for e in range(10)}, MB9, r)
    assert max(s.cpu_seconds, s.copy_seconds) <= min(10 * MB9 / 30e9, 10 * MB9 / 50e9)


def test_prefill_groups_always_copy_and_cpu_can_be_disabled():
    s = split_cold({0: 500, 1: 1, 2: 64}, MB9, Rates(cpu_bytes_per_s=1e12))
    assert 0 in s.copy and 2 in s.copy and s.cpu == [1]
    assert split_cold({0: 1, 1: 1}, MB9, Rates(), allow_cpu=False).cpu == []


def test_in_flight_copies_shift_work_to_the_cpu():
    r = Rates(cpu_bytes_per_s=50e9, pcie_bytes_per_s=50e9)
    idle = split_cold({e: 1 for e in range(4)}, MB9, r)
    busy = split_cold({e: 1 for e in range(4)}, MB9, r, in_flight_copy_s=10 * MB9 / 50e9)
    assert len(busy.cpu) > len(idle.cpu)


def test_compute_bound_cpu_cost_and_rate_updates():
    r = Rates(cpu_bytes_per_s=50e9, cpu_flops=1e12)
    assert cpu_seconds(MB9, 1, r) == MB9 / 50e9
    assert cpu_seconds(MB9, 30, r) > cpu_seconds(MB9, 1, r)
    r.observe_cpu(MB9, MB9 / 70e9)
    assert 50e9 < r.cpu_bytes_per_s < 70e9


def test_serial_staging_cost_moves_experts_to_the_cpu():
    """In a decode step the CPU share starts after the copies are staged: when staging one copy takes about
    as long as the CPU needs for an expert, the split sends (almost) everything to the CPU; when staging is
    free it splits as before; and in either case the chosen makespan is no worse than one path alone."""
    tokens = {e: 1 for e in range(8)}
    for host_s in (0.0, 40e-6, 150e-6):
        r = Rates(cpu_bytes_per_s=80e9, pcie_bytes_per_s=55e9, copy_host_s=host_s)
        s = split_cold(tokens, MB9, r, serial=True)
        makespan = max(s.cpu_seconds, s.copy_seconds)
        all_cpu = 8 * MB9 / 80e9
        all_copy = max(8 * MB9 / 55e9, 8 * host_s)
        assert makespan <= min(all_cpu, all_copy) + 1e-12
        assert abs(s.cpu_seconds - (len(s.cpu) * MB9 / 80e9 + len(s.copy) * host_s)) < 1e-12
    free = split_cold(tokens, MB9, Rates(cpu_bytes_per_s=80e9, pcie_bytes_per_s=55e9, copy_host_s=0.0), serial=True)
    costly = split_cold(tokens, MB9, Rates(cpu_bytes_per_s=80e9, pcie_bytes_per_s=55e9, copy_host_s=150e-6), serial=True)
    assert len(free.copy) >= 3 and len(costly.copy) <= 1
    # not serial (the CPU share runs while the copies are staged): staging that is quicker than the transfer
    # changes nothing; staging slower than the transfer makes the copy path as slow as the staging thread
    quick = split_cold(tokens, MB9, Rates(copy_host_s=0.0))
    assert quick.copy == split_cold(tokens, MB9, Rates(copy_host_s=10e-6)).copy and quick.copy
    slow = split_cold(tokens, MB9, Rates(copy_host_s=1.0))
    assert slow.copy == [] and slow.cpu == sorted(tokens)
    r = Rates(copy_host_s=50e-6)
    r.observe_stage(2, 400e-6)
    assert 50e-6 < r.copy_host_s < 200e-6
    r.observe_stage(0, 1.0)  # nothing staged: no observation
    assert r.copy_host_s < 200e-6


def test_staging_fit_separates_the_per_layer_cost_from_the_per_copy_cost():
    """Layers staging 1 and 3 copies in 130 and 170 us: 110 us per layer and 20 us per copy (charging it all
    to the copies said 130 us a copy, and the split stopped copying); a consistent per-copy cost stays one."""
    r = Rates(smoothing=0.2)
    for _ in range(30):
        r.observe_stage(1, 130e-6)
        r.observe_stage(3, 170e-6)
    assert abs(r.copy_host_s - 20e-6) < 1e-6 and abs(r.stage_fixed_s - 110e-6) < 1e-6
    same = Rates()
    for _ in range(5):
        same.observe_stage(2, 100e-6)
    assert abs(same.copy_host_s - 50e-6) < 1e-9 and same.stage_fixed_s < 1e-9
    # the fixed part is paid once per layer: with 8 cold experts it no longer hides the cheap extra copies
    tokens = {e: 1 for e in range(8)}
    fitted = split_cold(tokens, MB9, Rates(cpu_bytes_per_s=100e9, pcie_bytes_per_s=50e9, copy_host_s=20e-6,
                                           stage_fixed_s=110e-6), serial=True)
    averaged = split_cold(tokens, MB9, Rates(cpu_bytes_per_s=100e9, pcie_bytes_per_s=50e9, copy_host_s=130e-6), serial=True)
    assert len(fitted.copy) > len(averaged.copy)
