"""bench/cpu/cpu_omp_workers.py on the tiny demo model: every state and hand-off timed each round, the shipped
hand-off put back, the medians written."""

from __future__ import annotations

import json
import sys

from bench.cpu import cpu_omp_workers
from strata.kernels.cpu import experts as ce
from strata.kernels.cpu.library import release_openmp_workers


def test_every_case_is_timed_and_the_hand_off_restored(tiny_model_dir, tmp_path, monkeypatch):
    if not release_openmp_workers():
        import pytest

        pytest.skip("this torch's OpenMP runtime cannot free a thread's workers")
    shipped = ce.plain_max_tokens
    monkeypatch.setattr(sys, "argv", ["cpu_omp_workers.py", "--model", str(tiny_model_dir), "--prompt", "8", "24",
                                      "--rounds", "2", "--plain-max", "64", "2", "--out", str(tmp_path)])
    cpu_omp_workers.main()
    assert ce.plain_max_tokens is shipped
    result = json.loads((tmp_path / "cpu_omp_workers.json").read_text())
    names = ["alive, plain_max=64", "freed, plain_max=64", "alive, plain_max=2", "freed, plain_max=2"]
    for n in ("8", "24"):
        assert list(result["prefill_s"][n]) == names and all(len(v) == 2 for v in result["prefill_s"][n].values())
        assert list(result["median_s"][n]) == names and all(v > 0 for v in result["median_s"][n].values())
