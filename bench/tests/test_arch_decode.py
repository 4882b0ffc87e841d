"""bench/arch_decode.py on the CPU: a tiny gpt-oss demo model, every case run and written with its decode rate."""

from __future__ import annotations

import json


def test_arch_decode_writes_every_case(tmp_path):
    from bench.arch_decode import main

    assert main(["--arch", "gpt_oss", "--size", "tiny", "--device", "cpu", "--tokens", "24", "--repeat", "1",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "arch_decode.json").read_text())
    assert set(result["median_tok_s"]) == {"memory/graphs", "memory/eager", "tiered/graphs", "tiered/eager"}
    assert result["experts"] == "mxfp4" and result["layers"] is None and 0 < result["budget_bytes"] < result["expert_bytes"]
    for runs in result["runs"].values():
        assert [r["tokens"] for r in runs] == [24] and all(r["tok_s"] > 0 for r in runs)
    assert result["runs"]["tiered/eager"][0]["decode"].startswith("experts on CPU threads from RAM")
