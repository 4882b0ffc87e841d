"""`strata plan` and `strata inspect` on MiniMax-M2 as it ships (the `--arch minimax_m2` bench demo config with
`--experts fp8`, written as sparse files: headers only): 62 layers x 256 FP8 experts in 128 x 128 blocks, bf16 norms,
embeddings and routers, float32 correction biases."""

from __future__ import annotations

from test_inspect import write_sparse_checkpoint
from test_planner import host

from strata.cli import main
from strata.kernels.quant import ExpertFormat
from strata.runtime.demo.configs import demo_config
from strata.runtime.demo.quantized import weight_jobs
from strata.runtime.demo.weights import tensor_specs
from strata.runtime.plan.checkpoints.inspect import format_summary, summarize_checkpoint
from strata.runtime.plan.planner import plan

GiB = 1 << 30


def test_bench_headers_plan_and_inspect(tmp_path, capsys):
    """The experts, their bytes and the KV cache a token (K and V of 8 heads x 128 in 62 layers, bf16)."""
    cfg = demo_config("bench", engram=False, experts="fp8", arch="minimax_m2")
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    specs = weight_jobs(tensor_specs(cfg), "fp8", cfg)[0]
    write_sparse_checkpoint(tmp_path / "m2", [("", t.name, t.dtype, t.shape) for t in specs], cfg, shards=8)
    expert = 3 * 1536 * 3072 + 3 * 12 * 24 * 4  # three e4m3 matrices and their float32 block scales
    summary = summarize_checkpoint(tmp_path / "m2")
    assert (summary.num_layers, summary.moe_layers, summary.experts_per_layer, summary.expert_bytes) == (62, 62, 256,
                                                                                                        expert)
    assert summary.expert_format == ExpertFormat("fp8", block=(128, 128)) and not summary.notes
    assert summary.bytes_by_role["router"] == 62 * (256 * 3072 * 2 + 256 * 4) and summary.bytes_by_role["other"] == 0
    assert main(["inspect", str(tmp_path / "m2")]) == 0
    out = capsys.readouterr().out
    assert "62 (62 MoE, 0 dense)" in out and "256 per layer, 8 active per token" in out and "fp8 128x128" in out
    assert format_summary(summary) in out
    p = plan(tmp_path / "m2", host(gpu=80 * GiB, ram=256 * GiB), {"runtime": {"max_context": 8192}})
    assert (p.moe_layers, p.experts_per_layer, p.expert_bytes) == (62, 256, expert)
    kv_token = 62 * 2 * 8 * 128 * 2
    assert p.kv_bytes == kv_token * 8192 and p.kv_bytes_per_1k == kv_token * 1024
    assert p.tier("gpu").fraction > 0 and "62 MoE layers x 256" in p.format()
