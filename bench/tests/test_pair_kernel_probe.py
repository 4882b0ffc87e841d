"""bench/probes/pair_kernel_probe.py launches the decode pair kernels (strata.kernels.gpu.experts.grouped) directly,
each argument by position: its launches must match the kernels' signature and compute what the library's pairs compute.
CPU CI runs them through Triton's interpreter, in a subprocess (TRITON_INTERPRET is read when Triton is imported), at
small shapes (the probe's are the bench model's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_probe_launches() -> float:
    """The probe's gate/up and down launches on 8 pairs of one token over 3 experts at H = 64, I = 32, against
    `grouped._pair_torch`: returns the largest error relative to the reference's largest output."""
    from bench.probes import pair_kernel_probe as pk
    from strata.kernels.gpu.experts import grouped

    pk.H, pk.INTER = 64, 32  # the probe reads its shapes from these at each launch
    e, k, h_dim, inter = 3, pk.K, pk.H, pk.INTER
    torch.manual_seed(0)
    gu = torch.randn(e, 2 * inter, h_dim).to(torch.bfloat16)
    dn = torch.randn(e, h_dim, inter).to(torch.bfloat16)
    slot_of = torch.tensor([2, 0, 1], dtype=torch.int32)  # expert -> slot, not the identity
    ids = torch.tensor([0, 2, 1, 0, 1, 2, 0, 1], dtype=torch.int32)[:k]
    x = torch.randn(1, h_dim).to(torch.bfloat16)
    used, h = torch.empty(k, dtype=torch.int32), torch.empty(k, inter, dtype=torch.float32)
    y = torch.zeros(k, h_dim, dtype=torch.float32)
    pk.gate_up(x, gu, slot_of, ids, used, h, (16, 64, 1, 1))
    pk.down(h, dn, used, y, (16, 32, 1, 1))
    ref, ref_used = torch.zeros(k, h_dim), torch.empty(k, dtype=torch.int32)
    grouped._pair_torch(x, grouped.SlotWeights(gu, dn), slot_of, ids, torch.arange(k, dtype=torch.int32), k, ref,
                        ref_used)
    assert torch.equal(used, ref_used)  # each pair's slot, as the library's pairs look it up
    return float((y - ref).abs().max() / ref.abs().max())


def test_the_probes_pair_launches_under_tritons_interpreter():
    pytest.importorskip("triton")
    code = "import bench.tests.test_pair_kernel_probe as t\nprint(t.check_probe_launches())\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    # the kernels keep h in fp32, the reference rounds it to bf16 before down: one rounding step apart at most
    assert float(run.stdout.strip().splitlines()[-1]) < 2e-2
