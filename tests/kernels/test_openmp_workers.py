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
