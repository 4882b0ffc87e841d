"""bench/cpu/cpu_dense.py, bench/cpu/sampling.py and bench/cpu/expert_quantize.py on small shapes: every case timed
and written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cpu import cpu_dense, expert_quantize, sampling
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


def test_cpu_dense_alternates_the_prefetch_distances(tmp_path):
    import torch

    from strata.kernels.cpu import library

    if dense.linear(torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(512, 256, dtype=torch.bfloat16)) is None:
        pytest.skip("the dense kernel does not run here")
    before = library.prefetch_bytes()
    cpu_dense.main(["--shape", "512", "256", "--rows", "1", "--threads", "1", "--repeat", "2", "--prefetch", "0",
                    "2048", "--rounds", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu_dense.json").read_text())
    assert [(r["round"], r["prefetch"]) for r in result["results"]] == [(0, 0), (0, 2048), (1, 0), (1, 2048)]
    assert library.prefetch_bytes() == before  # the process's distance as it was


def test_sampling_times_both_draws(tmp_path):
    sampling.main(["--vocab", "3000", "--rows", "1", "3", "--repeat", "20", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "sampling.json").read_text())
    assert [r["rows"] for r in result["results"]] == [1, 3]
    assert all(r["inverse_cdf_us"] > 0 and r["exponential_race_us"] > 0 for r in result["results"])


def test_expert_quantize_times_both_formats_against_another_checkout(tmp_path):
    """--against this very checkout: the same bytes, so the run goes through, each side timed at each thread count;
    a checkout whose MXFP4 quantizer writes other codes is refused."""
    repo = Path(__file__).resolve().parents[2]
    expert_quantize.main(["--shape", "64", "256", "--threads", "1", "2", "--repeat", "2", "--against", str(repo),
                          "--out", str(tmp_path)])
    result = json.loads((tmp_path / "expert_quantize.json").read_text())
    assert [(r["threads"], r["side"]) for r in result["results"]] == [(1, "this"), (1, "against"), (2, "this"),
                                                                       (2, "against")]
    assert all(r["fp8_ms"] > 0 and r["mxfp4_ms"] > 0 for r in result["results"])
    other = tmp_path / "other" / "strata" / "kernels"
    other.mkdir(parents=True)
    source = (repo / "strata" / "kernels" / "quant.py").read_text()
    changed = source.replace("(mag >= mid) if i % 2 else (mag > mid)", "(mag >= mid)")  # ties always round up
    assert changed != source
    (other / "quant.py").write_text(changed)
    with pytest.raises(SystemExit, match="mxfp4 is written in other bytes"):
        expert_quantize.main(["--shape", "64", "256", "--threads", "1", "--repeat", "1", "--against",
                              str(tmp_path / "other")])
