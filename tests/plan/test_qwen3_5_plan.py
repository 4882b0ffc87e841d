"""`strata plan` and `strata inspect` on Qwen3.5-35B-A3B as it ships (the `--arch qwen3_5_moe` bench config as the
release's `text_config`, its tensors under `model.language_model.` beside a vision tower and an MTP module, written
as sparse files: headers only): 40 layers x 256 fused experts, the Gated DeltaNet tensors counted as attention, the
per-sequence cache counted as `Qwen35Cache` allocates it (a fixed state per linear layer, keys and values for the 10
full-attention layers), no prefix-cache slots."""

from __future__ import annotations

import pytest
import torch
from test_inspect import write_sparse_checkpoint
from test_planner import GiB, host

from strata.cli import main
from strata.runtime.demo.qwen3_5 import q35_config, q35_tensors
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.qwen3_5.cache import Qwen35Cache, kv_bytes, kv_growth
from strata.runtime.plan.checkpoints.inspect import summarize_checkpoint
from strata.runtime.plan.host import GpuInfo
from strata.runtime.plan.planner import PlanError, plan

VISION = {"model_type": "qwen3_5_moe_vision", "depth": 27, "hidden_size": 1152, "out_hidden_size": 2048}


def release_checkpoint(d, layers: int | None = None) -> dict:
    """The bench config and tensors as the release lays them out; returns the text config."""
    text = q35_config("bench", layers)
    spec = [("", t.name if t.name.startswith("lm_head.") else "model.language_model." + t.name.removeprefix("model."),
             t.dtype, t.shape) for t in q35_tensors(text)]
    spec += [("", "model.visual.blocks.0.attn.qkv.weight", "BF16", (3456, 1152)),
             ("", "mtp.fc.weight", "BF16", (2048, 4096)),
             ("", "mtp.layers.0.mlp.experts.0.gate_proj.weight", "BF16", (512, 2048))]
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text, "vision_config": VISION, "tie_word_embeddings": False}
    write_sparse_checkpoint(d, spec, config, shards=4)
    return text


def test_kv_bytes_are_what_the_cache_allocates():
    cfg = ModelConfig.from_hf(q35_config("tiny"))
    s = cfg.qwen3_5
    for n in (1, 64, 1000):
        assert Qwen35Cache(cfg, 3, n, torch.bfloat16, "cpu").nbytes == 3 * kv_bytes(cfg, n, torch.bfloat16)
    fixed, per_token = kv_growth(cfg, torch.bfloat16)
    assert per_token == 1 * 2 * 2 * 32 * 2  # one full-attention layer: K and V of 2 heads x 32, bf16
    assert fixed == 3 * (s.conv_dim * 3 * 2 + 4 * 16 * 16 * 4)  # 3 linear layers: conv (bf16) + state (fp32)


def test_release_headers_inspect_and_plan(tmp_path, capsys):
    text = release_checkpoint(tmp_path / "q35")
    summary = summarize_checkpoint(tmp_path / "q35")
    expert = 3 * 512 * 2048 * 2
    assert (summary.num_layers, summary.moe_layers, summary.experts_per_layer, summary.expert_bytes) == (40, 40, 256,
                                                                                                        expert)
    assert summary.expert_layout == "fused" and summary.shared_experts == 1
    linear = 2048 * (8192 + 4096 + 32 + 32) * 2 + 8192 * 4 * 2 + 32 * 2 * 2 + 128 * 2 + 4096 * 2048 * 2
    full = (2 * 16 * 256 + 2 * 2 * 256) * 2048 * 2 + 16 * 256 * 2048 * 2 + 2 * 256 * 2
    assert summary.bytes_by_role["attention"] == 30 * linear + 10 * full
    assert summary.bytes_by_role["mtp"] == (2048 * 4096 + 512 * 2048) * 2
    assert summary.bytes_by_role["other"] == 3456 * 1152 * 2  # the vision tower only (strata does not load it)
    assert main(["inspect", str(tmp_path / "q35")]) == 0
    assert "40 (40 MoE, 0 dense)" in capsys.readouterr().out
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": text})
    p = plan(tmp_path / "q35", host(gpu=80 * GiB, ram=256 * GiB),
             {"runtime": {"max_context": 8192, "prefix_cache_slots": 2}})
    state = 30 * ((2 * 2048 + 4096) * 3 * 2 + 32 * 128 * 128 * 4)
    per_token = 10 * 2 * 2 * 256 * 2
    assert kv_growth(cfg, torch.bfloat16) == (state, per_token)
    assert p.kv_bytes == state + per_token * 8192  # one slot: no prefix-cache slots for this model
    assert p.kv_bytes_per_1k == per_token * 1024
    out = p.format()
    assert "eager decode steps" not in out and "prefix cache off" in out and p.decode_graphs
    two = host(gpu=80 * GiB, ram=256 * GiB)
    two.gpus.append(GpuInfo(1, "sim", 80 * GiB, 80 * GiB))
    with pytest.raises(PlanError, match="Qwen3.5-MoE runs on one device"):
        plan(tmp_path / "q35", two, {"runtime": {"max_context": 8192, "devices": [0, 1]}})


def test_config_spellings():
    """A release's text_config (defaults and top-level keys as transformers reads them), a flat text config, and bad
    inputs as one-line errors."""
    from strata.errors import CheckpointError, UnsupportedError

    text = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 8, "rope_parameters": {"rope_theta": 1e7}}
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": text, "eos_token_id": 7})
    s = cfg.qwen3_5
    assert s.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]  # full_attention_interval 4
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.rope.dim, cfg.rope.theta) == (2048, 256, 2, 64, 1e7)
    assert (s.conv_dim, cfg.num_experts, cfg.eos_token_ids) == (8192, 256, [7])
    assert ModelConfig.from_hf({**text, "full_attention_interval": 2}).qwen3_5.full_layers == [1, 3, 5, 7]
    with pytest.raises(CheckpointError, match="text_config"):
        ModelConfig.from_hf({"model_type": "qwen3_5_moe"})
    with pytest.raises(CheckpointError, match="layer_types"):
        ModelConfig.from_hf({**text, "layer_types": ["linear_attention"] * 7 + ["sliding_attention"]})
    with pytest.raises(CheckpointError, match="linear_num_value_heads"):
        ModelConfig.from_hf({**text, "linear_num_value_heads": 24})
    with pytest.raises(UnsupportedError, match="text_config.model_type"):
        ModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": {**text, "model_type": "qwen3_next"}})
