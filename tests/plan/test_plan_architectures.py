"""The planner on GLM-4.5-Air's and DeepSeek-V2-Lite's shapes (the `--arch` bench demo configs, written as sparse
files: headers only): experts, their bytes and the KV cache a token, GQA over 8 KV heads and MLA's latent."""

from __future__ import annotations

import pytest
from test_inspect import write_sparse_checkpoint
from test_planner import host

from strata.runtime.demo.configs import demo_config
from strata.runtime.demo.weights import tensor_specs
from strata.runtime.plan.planner import plan

GiB = 1 << 30

# arch: (MoE layers, experts, expert bytes in bf16, KV bytes a token: GLM K and V of 8 heads x 128 in 46 layers,
# DeepSeek-V2-Lite's 512-wide latent and 64-wide rotary key in 27)
SHAPES = {"glm4_moe": (45, 128, 3 * 4096 * 1408 * 2, 46 * 2 * 8 * 128 * 2),
          "deepseek_v2": (26, 64, 3 * 2048 * 1408 * 2, 27 * (512 + 64) * 2)}


@pytest.mark.parametrize("arch", list(SHAPES))
def test_bench_shapes_plan(arch, tmp_path):
    cfg = demo_config("bench", engram=False, arch=arch)
    spec = [("", t.name, t.dtype, t.shape) for t in tensor_specs(cfg)]
    write_sparse_checkpoint(tmp_path / arch, spec, cfg, shards=4)
    layers, experts, expert_bytes, kv_token = SHAPES[arch]
    p = plan(tmp_path / arch, host(gpu=80 * GiB, ram=256 * GiB), {"runtime": {"max_context": 8192}})
    assert (p.moe_layers, p.experts_per_layer, p.expert_bytes) == (layers, experts, expert_bytes)
    assert p.kv_bytes == kv_token * 8192 and p.kv_bytes_per_1k == kv_token * 1024
    assert p.tier("gpu").fraction > 0 and f"{layers} MoE layers x {experts}" in p.format()
