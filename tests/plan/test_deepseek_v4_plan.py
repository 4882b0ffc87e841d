"""The planner on DeepSeek-V4: its KV cache (sliding windows + compressed entries) counted as the cache allocates it,
per 1K tokens shown, the architecture's 1M-token context plannable where it fits and refused where it does not.

DeepSeek-V4-Flash's shapes (the `bench` demo configuration) are written as headers over sparse files: the planner
reads headers only."""

from __future__ import annotations

import pytest
import torch
from demo_checkpoints import header_only_checkpoint
from test_planner import GiB, host

from strata.runtime.demo.deepseek_v4 import v4_config, v4_tensors
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.cache import DeepseekV4Cache, kv_bytes, kv_growth
from strata.runtime.plan.planner import PlanError, plan

MILLION = 1 << 20


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    cfg = v4_config("bench")
    d = header_only_checkpoint(tmp_path_factory.mktemp("v4-flash") / "m", cfg, v4_tensors(cfg))
    return d, ModelConfig.from_hf(cfg)


def test_kv_bytes_are_what_the_cache_allocates():
    cfg = ModelConfig.from_hf(v4_config("tiny"))
    for n in (1, 31, 128, 1000, 4096):
        cache = DeepseekV4Cache(cfg, 2, n, torch.bfloat16, "cpu")
        assert cache.nbytes == 2 * kv_bytes(cfg, n, torch.bfloat16)
    fixed, per_token = kv_growth(cfg, torch.bfloat16)
    # past the window, each 1K tokens adds the same: compressed entries (and CSA's indexer keys) only
    assert kv_bytes(cfg, 5120, torch.bfloat16) - kv_bytes(cfg, 4096, torch.bfloat16) == per_token * 1024
    assert kv_bytes(cfg, 4096, torch.bfloat16) == fixed + per_token * 4096
    s, d = cfg.deepseek_v4, cfg.head_dim  # tiny: CSA, HCA, CSA after a sliding-window layer
    assert per_token == 2 * (2 * (d + s.index_head_dim) / 4 + d / 128)


def test_a_million_tokens_plan_on_an_h200_and_are_refused_on_a_24_gib_card(flash):
    d, cfg = flash
    p = plan(d, host(gpu=141 * GiB, ram=512 * GiB), {"runtime": {"max_context": MILLION}})
    assert p.max_context == MILLION and p.kv_bytes == kv_bytes(cfg, MILLION, torch.bfloat16)
    per_1k = kv_bytes(cfg, 2 * MILLION, torch.bfloat16) - kv_bytes(cfg, 2 * MILLION - 1024, torch.bfloat16)
    assert p.kv_bytes_per_1k == per_1k and 6 * GiB < p.kv_bytes < 7 * GiB  # ~1/10 of an uncompressed cache
    out = p.format()
    assert "KV cache     1 x 1048576 tokens" in out and "per 1K tokens a sequence" in out
    assert "eager decode steps" not in out and p.decode_graphs  # its decode steps are captured in CUDA graphs
    with pytest.raises(PlanError, match="KV cache for 1048576 tokens .* lower runtime.max_context to"):
        plan(d, host(gpu=24 * GiB, ram=512 * GiB), {"runtime": {"max_context": MILLION}})
    auto = plan(d, host(gpu=141 * GiB, ram=512 * GiB))  # "auto": the model's 1M, whose cache takes < a quarter
    assert auto.max_context == MILLION
    two = plan(d, host(gpu=141 * GiB, ram=512 * GiB), {"runtime": {"max_context": MILLION},
                                                       "planner": {"max_batch": 2}})
    assert two.kv_bytes == 2 * p.kv_bytes
