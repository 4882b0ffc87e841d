"""bench/cpu/cpu_dense.py and bench/cpu/sampling.py on small shapes: every case timed and written."""

from __future__ import annotations

import json

import pytest

from bench.cpu import cpu_dense, sampling
from strata.kernels.cpu import dense


def test_cpu_dense_times_every_rows_and_threads_case(tmp_path):
    import torch

    if dense.linear(torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(512, 256, dtype=torch.bfloat16)) is None:
        pytest.skip("the dense kernel does not run here")
    cpu_dense.main(["--shape", "512", "256", "--rows", "1", "4", "--threads", "1", "2", "--repeat", "2",
                    "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu_dense.json").read_text())
    assert [(r["threads"], r["rows"]) for r in result["results"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(r["ms"] > 0 and r["GB_s"] > 0 for r in result["results"]) and result["shape"] == [512, 256]


def test_sampling_times_both_draws(tmp_path):
    sampling.main(["--vocab", "3000", "--rows", "1", "3", "--repeat", "20", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "sampling.json").read_text())
    assert [r["rows"] for r in result["results"]] == [1, 3]
    assert all(r["inverse_cdf_us"] > 0 and r["exponential_race_us"] > 0 for r in result["results"])
