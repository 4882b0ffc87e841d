"""The Triton kernels' tests that CPU CI can run through Triton's interpreter, each module's in a subprocess
(TRITON_INTERPRET is read when Triton is imported). On CUDA hosts those modules run them natively.

The interpreter runs a kernel in one Python thread, so the selected modules' subprocesses run side by side, as many
at once as the host has cores (each with its share of torch's threads): the first of these tests starts them all,
and each test waits for its own module's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (test module, -k expression, the fewest tests it must run: all of them pass, none skipped), the longest first so
# that the side-by-side runs end together
MODULES = [
    # a whole model against transformers (fp32, 1e-4, greedy tokens through prefill and decode)
    ("tests/model/architectures/test_deepseek_v4.py", "matches_transformers and fused and not long", 1),
    ("tests/kernels/test_fused_kernels.py",  # the fused decode kernels
     "(router or residual or softmax_topk or combine or gemv) and not mlp_takes_the_gemv", 1),
    # a whole model: DecodeBatch steps on the fused kernels against the StepBatch path (fp32, 1e-4)
    ("tests/model/architectures/test_qwen3_5_decode.py", "(decode_batch_equals_step_batch and not long) or one_token_prompt", 2),
    ("tests/kernels/test_quant_pairs.py", "test_kernel_", 17),  # FP8 and MXFP4 pairs, in-place reads, dequantizers
    ("tests/kernels/test_pair_forms.py", "test_kernel_", 24),  # every SwiGLU form and the gate_up bias, each format
    ("tests/kernels/test_deepseek_v4_kernels.py", "", 44),  # DeepSeek-V4's hyper-connection weights, rope, norms
    ("tests/kernels/test_gguf_pairs.py", "test_kernel_", 24),  # the same for GGUF experts
    ("tests/kernels/test_decode_attention.py", "decode_attention or plain_build", 5),  # sinks, windows
    ("tests/kernels/test_gated_delta.py", "", 10),  # Qwen3.5's convolution, delta rule and norms
]


def _interpret(module: str, select: str, threads: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": str(threads)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module, "-k", select],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.fixture(scope="session")
def interpreted_runs(request) -> Iterator[dict[str, Future]]:
    """module -> its subprocess's run, for the modules this pytest run selected, started together."""
    pytest.importorskip("triton")
    selected = {item.callspec.params["module"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_kernels_under_tritons_interpreter"}
    modules = [m for m in MODULES if m[0] in selected]
    workers = max(1, min(len(modules), os.cpu_count() or 1))
    threads = max(1, (os.cpu_count() or 1) // workers)
    pool = ThreadPoolExecutor(max_workers=workers)
    runs = {module: pool.submit(_interpret, module, select, threads) for module, select, _ in modules}
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize(("module", "select", "least"), MODULES, ids=[m[0].rsplit("/", 1)[1][5:-3] for m in MODULES])
def test_kernels_under_tritons_interpreter(module, select, least, interpreted_runs):
    run = interpreted_runs[module].result()
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    # every selected test ran and passed (none skipped: the interpreter runs them all)
    assert run.returncode == 0 and " passed" in tail and "skipped" not in tail, run.stdout[-3000:] + run.stderr[-2000:]
    assert int(tail.split(" passed")[0].split()[-1]) >= least, tail
