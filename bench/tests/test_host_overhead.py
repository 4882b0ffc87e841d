"""bench/cpu/host_overhead.py on the tiny demo model: every one-token step split into its compiled calls and the
rest, and the three host pieces timed warm and after a stream, with the timed calls put back."""

from __future__ import annotations

import json

from bench.cpu import host_overhead
from strata.kernels.cpu import dense
from strata.kernels.cpu import experts as ce
from strata.kernels.cpu.expert_rows import PinnedLayer


def test_step_split_and_host_pieces_written(tiny_model_dir, tmp_path):
    kernel, linear, layer_call = ce.run_packed, dense.linear, PinnedLayer.forward
    host_overhead.main(["--model", str(tiny_model_dir), "--tokens", "6", "--calls", "3", "--stream-mib", "4",
                        "--out", str(tmp_path)])
    assert ce.run_packed is kernel and dense.linear is linear and PinnedLayer.forward is layer_call  # put back
    result = json.loads((tmp_path / "host_overhead.json").read_text())
    assert result["bench"] == "host_overhead" and result["commit"] and result["machine"]["cpus"] > 0
    step = result["step"]
    assert step["steps"] == 5  # the first token comes from the prompt's pass
    assert 0 < step["compiled_ms"] < step["pass_ms"] and 0 < step["host_share"] < 1
    assert abs(step["pass_ms"] - step["compiled_ms"] - step["host_ms"]) < 0.5 * step["pass_ms"]
    pieces = result["host_pieces_us"]
    names = ["cpu_share_host", "group_by_expert", "softmax_topk"]
    assert list(pieces["warm"]) == list(pieces["after_stream"]) == names
    assert all(v > 0 for v in [*pieces["warm"].values(), *pieces["after_stream"].values()])
