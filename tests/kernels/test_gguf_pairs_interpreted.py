"""The GGUF experts' Triton kernels of tests/kernels/test_gguf_pairs.py (its `test_kernel_` tests) that CPU CI can run:
through Triton's interpreter, in a subprocess (TRITON_INTERPRET is read when Triton is imported). On CUDA hosts that
module runs them natively."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gguf_pair_in_place_and_dequantize_kernels_under_tritons_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/kernels/test_gguf_pairs.py", "-k", "test_kernel_"],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    # every kernel test ran and passed (none skipped: the interpreter runs them all)
    assert run.returncode == 0 and " passed" in tail and "skipped" not in tail, run.stdout[-3000:] + run.stderr[-2000:]
    assert int(tail.split(" passed")[0].split()[-1]) >= 24, tail
