"""bench/cpu/omp_spin.py: environment sets parsed, each run in its own process with its environment, alternated,
and the medians written."""

from __future__ import annotations

import json
import sys

import pytest

from bench.cpu import omp_spin


def test_an_environment_set_is_name_value_pairs():
    assert omp_spin.parse_env("") == {}
    assert omp_spin.parse_env("GOMP_SPINCOUNT=1000 OMP_WAIT_POLICY=PASSIVE") == {
        "GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": "PASSIVE"}
    with pytest.raises(SystemExit, match="not NAME=VALUE"):
        omp_spin.parse_env("GOMP_SPINCOUNT")


def test_every_set_runs_in_its_own_process_each_round(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(sys, "argv", ["omp_spin.py", "--model", str(tiny_model_dir), "--env", "", "GOMP_SPINCOUNT=1000",
                                      "--prompt", "8", "--reps", "1", "--rounds", "2", "--layer-tokens", "0",
                                      "--out", str(tmp_path)])
    omp_spin.main()
    result = json.loads((tmp_path / "omp_spin.json").read_text())
    # the sets alternate, their order reversed every other round
    assert [(r["round"], r["env"]) for r in result["runs"]] == [(1, ""), (1, "GOMP_SPINCOUNT=1000"),
                                                               (2, "GOMP_SPINCOUNT=1000"), (2, "")]
    assert all(r["prefill_tok_s"]["8"] > 0 for r in result["runs"])
    assert [r["env_seen"]["GOMP_SPINCOUNT"] for r in result["runs"]] == [None, "1000", "1000", None]
    assert set(result["medians"]) == {"", "GOMP_SPINCOUNT=1000"}
    assert result["medians"][""]["prefill_8_tok_s"] > 0
