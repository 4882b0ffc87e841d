"""The fused decode kernels of tests/kernels/test_fused_kernels.py that CPU CI can run: through Triton's interpreter, in a
subprocess (TRITON_INTERPRET is read when Triton is imported). On CUDA hosts that module runs them natively."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_decode_router_gemv_and_residual_combine_under_tritons_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_fused_kernels.py",
                          "-k", "(router or residual or softmax_topk or combine or gemv) and not mlp_takes_the_gemv"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in tail and "skipped" not in tail, run.stdout[-3000:] + run.stderr[-2000:]
