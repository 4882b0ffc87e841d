"""The planner and inspect on gpt-oss-120b as released (the `bench` demo configuration: MXFP4 experts, BF16 dense
weights and expert biases), written as headers over sparse files: both read headers only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from demo_checkpoints import header_only_checkpoint
from test_planner import GiB, host

from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.runtime.demo.gpt_oss import oss_config, oss_tensors
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.kv_cache import KVCache
from strata.runtime.plan.checkpoints.inspect import summarize_checkpoint
from strata.runtime.plan.host import GpuInfo
from strata.runtime.plan.planner import PlanError, plan


@pytest.fixture(scope="module")
def oss120b(tmp_path_factory):
    cfg = oss_config("bench")
    d = header_only_checkpoint(tmp_path_factory.mktemp("gpt-oss-120b") / "m", cfg, oss_tensors(cfg))
    return d, ModelConfig.from_hf(cfg)


def test_inspect_counts_mxfp4_experts_and_dense_biases(oss120b):
    d, cfg = oss120b
    s = summarize_checkpoint(d)
    assert s.expert_format == ExpertFormat("mxfp4") and s.expert_layout == "fused" and s.experts_per_layer == 128
    payload = ExpertLayout.build(ExpertFormat("mxfp4"), 2880, 2880).payload_bytes
    assert s.expert_bytes == 2880 * 2 * 2880 * 17 // 32 + 2880 * 2880 * 17 // 32  # values + e8m0 scales
    assert s.expert_bytes <= payload
    assert s.bytes_by_role["expert_biases"] == 36 * 128 * (2 * 2880 + 2880) * 2  # BF16, dense with each layer
    assert s.bytes_by_role["other"] == 0


def test_plan_reads_mxfp4_in_place_through_the_pair_kernels(oss120b):
    d, cfg = oss120b
    p = plan(d, host(gpu=80 * GiB, ram=256 * GiB), {"runtime": {"max_context": 32768}})
    assert p.store_mode == "in_place" and p.experts_per_layer == 128 and p.moe_layers == 36
    assert p.expert_bytes == ExpertLayout.build(ExpertFormat("mxfp4"), 2880, 2880).payload_bytes
    # sliding-window layers keep full keys and values: the cache is the shared KVCache, every layer per token
    assert p.kv_bytes == KVCache.bytes_per_token(cfg, torch.bfloat16) * 32768 == 36 * 2 * 8 * 64 * 2 * 32768
    # 80 GiB hold every MXFP4 expert: one graph a step, the pair kernels computing the clamped SwiGLU and biases
    assert p.decode.startswith("every expert in VRAM") and p.decode_graphs
    small = plan(d, host(gpu=16 * GiB, ram=256 * GiB), {"runtime": {"max_context": 4096}})
    # 16 GiB: one-graph split decode, cold experts on the CPU worker (the clamped form and biases in its kernel)
    assert small.decode.startswith("split: resident experts by the GPU's pair kernels, cold ones by the CPU worker")
    assert small.decode_graphs
    cpu = plan(d, host(gpu=None, ram=256 * GiB), {"runtime": {"max_context": 4096}})
    assert cpu.decode == "experts on CPU threads from RAM, the compiled kernel"  # the clamped form in it
    two = replace(host(gpu=80 * GiB, ram=256 * GiB), gpus=[GpuInfo(i, "sim", 80 * GiB, 80 * GiB) for i in (0, 1)])
    with pytest.raises(PlanError, match="gpt-oss runs on one device"):
        plan(d, two, {"runtime": {"devices": [0, 1]}})
