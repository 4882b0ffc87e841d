"""bench/probes/quant_pair_probe.py packs experts in each format and runs the quantized pair kernels' launches (at the
shipped configuration and at a swept one) against its fp32 reference: CPU CI runs them through Triton's interpreter,
in a subprocess (TRITON_INTERPRET is read when Triton is imported), at small shapes (the probe's are the bench
model's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_probe_launches() -> float:
    """The probe's slots and pair launches for FP8 (16 x 16 blocks) and MXFP4 experts, 2 tokens x 2 pairs over 4
    experts at H = 64, I = 32, shipped and swept configurations: the largest error against its reference relative to
    the reference's largest output (the reference itself checked against the bf16 slots of the same experts)."""
    from bench.probes import quant_pair_probe as qp
    from strata.kernels.quant import ExpertFormat

    qp.H, qp.INTER, qp.E, qp.K = 64, 32, 4, 2  # the probe reads its shapes from these at each call
    qp.FORMATS = {"bf16": ExpertFormat(), "fp8": ExpertFormat("fp8", block=(16, 16)), "mxfp4": ExpertFormat("mxfp4")}
    torch.manual_seed(0)
    gu, dn = torch.randn(4, 64, 64) / 8, torch.randn(4, 64, 32) / 6
    slot_of = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    ids = torch.tensor([0, 2, 3, 1])
    x = torch.randn(2, 64).to(torch.bfloat16)
    worst = 0.0
    plain = qp.reference(x, qp.slots(qp.FORMATS["bf16"], gu, dn)[0], slot_of, ids)
    for name in ("fp8", "mxfp4"):
        sw, _, _, _ = qp.slots(qp.FORMATS[name], gu, dn)
        ref = qp.reference(x, sw, slot_of, ids)
        assert qp.rel_err(ref, plain) < 0.2  # the quantized experts are these experts
        for config in (None, ((4, 32, 1, 1), (8, 32, 1, 1))):
            y, used = torch.zeros(4, 64), torch.empty(4, dtype=torch.int32)
            qp.run_pairs(x, sw, slot_of, ids, y, used, config)
            assert torch.equal(used, slot_of[ids])
            worst = max(worst, qp.rel_err(y, ref))
    return worst


def check_probe_gguf_launches() -> float:
    """The probe's GGUF slots (Q4_K_M's types: gate and up Q4_K, down Q6_K) and pair launches, 2 tokens x 2 pairs over
    4 experts at H = I = 256 (one superblock a row), at a configuration whose tiles hold the whole matrices: the
    largest error against the reference on the dequantized slots, relative to its largest output."""
    from bench.probes import quant_pair_probe as qp

    qp.H, qp.INTER, qp.E, qp.K = 256, 256, 4, 2
    torch.manual_seed(0)
    sw, blob, _, _ = qp.gguf_slots(qp.GGUF_FORMATS["q4_k_m"], "cpu")
    assert blob == sw.layout.payload_bytes and sw.slab.shape[0] == 4
    slot_of = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    ids = torch.tensor([0, 2, 3, 1])
    x = torch.randn(2, 256).to(torch.bfloat16)
    ref = qp.reference(x, sw, slot_of, ids)
    y, used = torch.zeros(4, 256), torch.empty(4, dtype=torch.int32)
    qp.run_pairs(x, sw, slot_of, ids, y, used, ((128, 256, 4, 1), (256, 256, 4, 1)))
    assert torch.equal(used, slot_of[ids])
    return qp.rel_err(y, ref)


def check_probe_in_place_launches() -> float:
    """The probe's in-place reads (--in-place): slots of bf16, FP8 (16 x 16 blocks), MXFP4 and Q4_K_M's GGUF types read
    by host address, 2 tokens x 2 pairs over 4 experts, at tiles that hold the tiny matrices: the largest error against
    the reference on the same slots, relative to its largest output."""
    from bench.probes import quant_pair_probe as qp
    from strata.kernels.quant import ExpertFormat

    torch.manual_seed(0)
    slot_of = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    ids = torch.tensor([0, 2, 3, 1])
    worst = 0.0
    for h, i in ((64, 32), (256, 256)):
        qp.H, qp.INTER, qp.E, qp.K = h, i, 4, 2
        gu, dn = torch.randn(4, 2 * i, h) / 8, torch.randn(4, h, i) / 6
        if h == 64:
            packed = [qp.slots(fmt, gu, dn) for fmt in (ExpertFormat(), ExpertFormat("fp8", block=(16, 16)),
                                                        ExpertFormat("mxfp4"))]
        else:
            packed = [qp.gguf_slots(qp.GGUF_FORMATS["q4_k_m"], "cpu")]
        x = torch.randn(2, h).to(torch.bfloat16)
        for sw, _, slab, layout in packed:
            ref = qp.reference(x, sw, slot_of, ids)
            y = torch.full((4, h), 7.0)
            qp.run_in_place(x, layout, qp.host_addresses(slab, slot_of, ids), y, (i, h, h, i))
            worst = max(worst, qp.rel_err(y, ref))
    return worst


def test_the_probes_in_place_tiles_are_swept_shipped_first():
    from bench.probes import quant_pair_probe as qp
    from strata.kernels.gpu.experts import quant_pairs
    from strata.kernels.gpu.experts.gguf_pairs import GGUF_IN_PLACE_BLOCKS

    assert qp.in_place_configs("plain", True) == [None] and qp.in_place_configs("gguf", False) == [None]
    for kind, shipped in (("gguf", GGUF_IN_PLACE_BLOCKS), ("fp8", quant_pairs.QUANT_IN_PLACE_BLOCKS)):
        configs = qp.in_place_configs(kind, True)
        assert configs[0] is None and shipped not in configs and len(set(configs)) == len(configs)
        assert {c[:2] for c in configs[1:]} | {c[2:] for c in configs[1:]} >= {shipped[:2], shipped[2:]}
        assert all(c[1] % 256 == 0 and c[3] % 256 == 0 for c in configs[1:])  # whole superblocks a column step


def test_the_probe_sweeps_each_formats_own_configurations():
    from bench.probes import quant_pair_probe as qp
    from strata.kernels.gpu.experts import quant_pairs
    from strata.kernels.gpu.experts.gguf_pairs import GGUF_PAIR_CONFIG

    for kind, (gu0, dn0), gate_up, down in (("gguf", GGUF_PAIR_CONFIG, qp.GGUF_GATE_UP, qp.GGUF_DOWN),
                                             ("mxfp4", quant_pairs._config(8, 1), qp.GATE_UP, qp.DOWN)):
        configs = qp.shipped_and_swept(kind, 8)
        assert configs[0] is None  # the shipped configuration first: the row the speed-ups compare
        assert configs[1:] == [(c, dn0) for c in gate_up if c != gu0] + [(gu0, c) for c in down if c != dn0]
    gguf = qp.shipped_and_swept("gguf", 8)[1:]
    assert gguf and all(g[1] % 256 == 0 and d[1] % 256 == 0 for g, d in gguf)  # whole superblocks a column step


def test_the_probes_quantized_pair_launches_under_tritons_interpreter():
    pytest.importorskip("triton")
    code = ("import bench.tests.test_quant_pair_probe as t\n"
            "print(max(t.check_probe_launches(), t.check_probe_gguf_launches(), t.check_probe_in_place_launches()))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.strip().splitlines()[-1]) < 1e-5  # fp32 math on both sides: rounding only
