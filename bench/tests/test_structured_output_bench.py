"""bench/structured_output.py on the tiny model: both batches decode every stream to --tokens (the schema is long
enough that none completes it), and the report holds the figures docs/benchmarks.md cites."""

from __future__ import annotations

import json

from bench.structured_output import main


def test_the_benchmark_runs_every_stream_to_the_end(tiny_model_dir, tmp_path):
    assert main(["--model", str(tiny_model_dir), "--streams", "3", "--tokens", "12", "--repeat", "1",
                 "--max-context", "256", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "structured_output.json").read_text())
    assert result["streams"] == 3 and result["device"] == "cpu"
    for name in ("plain", "json_schema"):
        [run] = result["runs"][name]
        assert run["tokens"] == [12, 12, 12] and run["finish"] == ["length"] and run["decode_tok_s"] > 0
    assert result["runs"]["json_schema"][0]["text"].startswith('{"topic": "')
    assert set(result["median_decode_tok_s"]) == {"plain", "json_schema"} and "cost" in result
