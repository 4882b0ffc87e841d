"""bench/probes/after_kernel.py: every op timed after a kernel call and alone, for each row count, into its JSON."""

from __future__ import annotations

import json
import sys

from bench.probes import after_kernel


def test_each_op_is_timed_after_a_kernel_call_and_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["after_kernel.py", "--rows", "2", "3", "--calls", "2", "--rounds", "1",
                                      "--out", str(tmp_path)])
    after_kernel.main()
    record = json.loads((tmp_path / "after_kernel.json").read_text())
    assert record["bench"] == "after_kernel" and record["command"].endswith("--out " + str(tmp_path))
    names = {"torch zero_", "numpy fill", "rms_norm, torch chain"}
    assert set(record["results"]) == {f"{rows} rows, {name}" for rows in (2, 3) for name in names}
    for row in record["results"].values():
        assert row["after_kernel_us"] > 0 and row["alone_us"] > 0 and len(row["rounds_after_us"]) == 1
