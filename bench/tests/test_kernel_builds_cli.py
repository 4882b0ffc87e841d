"""bench/kernel_builds.py, the command line over strata.runtime.offload.decode_builds: it prints a line per kernel
and writes the report as kernel_builds.json."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from bench import kernel_builds  # noqa: E402
from strata.kernels.gpu.builds import Unavailable  # noqa: E402
from strata.runtime.offload.decode_builds import count_builds  # noqa: E402


def test_the_command_prints_and_writes_the_report(tmp_path, capsys):
    try:
        expected = count_builds(layers=3, max_batch=2, compile=False)
    except Unavailable as e:
        pytest.skip(str(e))
    assert kernel_builds.main(["--layers", "3", "--max-batch", "2", "--no-compile", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "kernel_builds.json").read_text()) == expected
    assert expected["kernels"]["_pack_kernel"] == {"builds": 2, "seconds": None}  # pair blocks 8 and 16, not compiled
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(expected["kernels"])
