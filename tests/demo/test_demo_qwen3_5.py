"""`strata demo-model --arch qwen3_5_moe`: a Qwen3.5-MoE checkpoint (fused experts, as the releases ship them) that
transformers loads with no key missing or unexpected, and strata computes alike, in memory and through the tiers."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.errors import ConfigError
from strata.runtime.demo.model import write_demo_model
from strata.tiers.store.safetensors_index import TensorIndex


def test_tiny_loads_in_transformers_and_strata_alike(tmp_path):
    from transformers import AutoModelForCausalLM

    d = write_demo_model(tmp_path / "q35", size="tiny", arch="qwen3_5_moe", progress=False)
    assert write_demo_model(d, size="tiny", arch="qwen3_5_moe", progress=False) == d  # the same model: kept
    names = TensorIndex.from_dir(d).names()
    assert "model.layers.0.linear_attn.conv1d.weight" in names and "model.layers.3.self_attn.q_norm.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    ref, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    engine = Engine.from_pretrained(d, device="cpu", config={"runtime": {"dtype": "float32", "experts": "memory",
                                                                         "max_context": 512}})
    prompt = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = torch.log_softmax(ref.eval()(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert (engine.score(prompt) - expected).abs().max().item() < 1e-4
    cfg = {"runtime": {"max_context": 512, "dtype": "float32"}}
    with Engine.from_pretrained(d, device="cpu", config=cfg) as tiered:
        ids = engine.generate(prompt[:40], max_tokens=8, temperature=0.0).token_ids
        assert tiered.generate(prompt[:40], max_tokens=8, temperature=0.0).token_ids == ids


def test_options_it_does_not_write_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--experts: not written for --arch qwen3_5_moe"):
        write_demo_model(tmp_path / "q", size="tiny", arch="qwen3_5_moe", experts="fp8", progress=False)
    with pytest.raises(ConfigError, match="--layers"):
        write_demo_model(tmp_path / "l", size="tiny", layers=0, arch="qwen3_5_moe", progress=False)
    d = write_demo_model(tmp_path / "two", size="tiny", layers=2, arch="qwen3_5_moe", progress=False)
    assert Engine.from_pretrained(d, device="cpu", config={"runtime": {"experts": "memory", "max_context": 64}}
                                  ).checkpoint.config.qwen3_5.layer_types == ["linear_attention"] * 2
