"""bench/linear_attention_decode.py on the tiny Qwen3.5-MoE demo model: both contexts decoded for every round, the
per-token times and their ratio written as JSON."""

from __future__ import annotations

import json

from bench.linear_attention_decode import main


def test_a_short_run_writes_its_figures(tmp_path):
    assert main(["--model", str(tmp_path / "q35"), "--size", "tiny", "--short", "16", "--long", "96", "--tokens", "4",
                 "--rounds", "2", "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "linear_attention_decode.json").read_text())
    assert set(result["decode_ms_per_token"]) == {"16", "96"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["decode_ms_per_token_rounds"].values())
    ms = result["decode_ms_per_token"]
    assert result["ratio_long_over_short"] == ms["96"] / ms["16"] and result["max_context"] == 96 + 4 + 16
    assert result["meets_target"] == (result["ratio_long_over_short"] <= 1.3)
