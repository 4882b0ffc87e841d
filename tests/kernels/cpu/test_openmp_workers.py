"""`release_openmp_workers`: the calling thread's OpenMP workers exit (the process's thread count drops by them), and
torch's next parallel op on that thread brings them back with the same results."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from strata.kernels.cpu.library import release_openmp_workers


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_calling_threads_openmp_workers_exit_and_come_back():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
        want = x.exp()  # a parallel op: this thread's team of 2 (one worker) is up
        with_workers = _threads()
        if not release_openmp_workers():
            pytest.skip("torch's OpenMP runtime has no omp_pause_resource_all here")
        deadline = time.monotonic() + 5
        while _threads() >= with_workers and time.monotonic() < deadline:
            time.sleep(0.01)
        released = _threads()
        assert released < with_workers
        assert torch.equal(x.exp(), want)  # the next parallel op: the same result, on workers made again
        assert _threads() > released
    finally:
        torch.set_num_threads(before)


ENGINE_SCRIPT = """
import os, sys, time, torch
from strata import Engine
from strata.kernels.cpu.library import release_openmp_workers

def stable_threads():
    last, since = len(os.listdir("/proc/self/task")), time.monotonic()
    while time.monotonic() - since < 0.5:
        time.sleep(0.05)
        now = len(os.listdir("/proc/self/task"))
        if now != last:
            last, since = now, time.monotonic()
    return last

torch.set_num_threads(2)
engine = Engine.from_pretrained(sys.argv[1], device="cpu")
engine.scheduler()
left = stable_threads()
release_openmp_workers()  # frees nothing more if the engine freed its loading thread's workers
print(left - stable_threads())
torch.randn(4_000_000).exp()  # a parallel op on this thread: its team back
made = stable_threads()
release_openmp_workers()
print(made - stable_threads())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_engine_frees_its_loading_threads_workers(tiny_model_dir):
    """After `Engine.from_pretrained` and `scheduler()`, the thread that called them holds no OpenMP workers: freeing
    them again ends no thread, where after a parallel op of its own it ends the team's worker."""
    import subprocess

    if not release_openmp_workers():
        pytest.skip("torch's OpenMP runtime has no omp_pause_resource_all here")
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert [int(n) for n in out[-2:]] == [0, 1], out
