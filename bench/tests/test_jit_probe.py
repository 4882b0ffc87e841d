"""bench/jit_probe.py's bookkeeping (no GPU): a wrapped compiler records each build's kernel name and seconds, even
when the build fails, and the probe runs end to end on the CPU (where nothing is built)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench import jit_probe


def test_a_timed_build_records_its_kernel_even_when_it_fails():
    def _split_kernel():
        pass

    def build(src, target=None, options=None):
        raise RuntimeError("no GPU here")

    before = len(jit_probe._builds)
    timed = jit_probe._timed("triton", build, jit_probe._triton_name)
    with pytest.raises(RuntimeError, match="no GPU"):
        timed(SimpleNamespace(fn=_split_kernel), target=None)  # an ASTSource: its `fn` is the kernel's function
    assert jit_probe._builds[before][:2] == ("triton", "_split_kernel") and jit_probe._builds[before][2] >= 0
    assert jit_probe._triton_name((object(), SimpleNamespace(name="from_ir")), {}) == "from_ir"  # a bound call's self


def test_the_probe_runs_the_warm_up_on_the_cpu(tiny_model_dir, tmp_path, capsys):
    assert jit_probe.main(["--model", str(tiny_model_dir), "--config", '{"runtime": {"device": "cpu"}}',
                           "--max-batch", "2", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "jit_probe.json").read_text())
    assert out["warmup"].startswith("warmed up in") and "decode batch sizes 1-2" in out["warmup"]
    assert out["builds_in_warmup_s"] == 0 and out["builds"] == []  # the CPU path builds no kernel
    assert "builds inside it" in capsys.readouterr().out
