"""`strata demo-model --arch glm4_moe|deepseek_v2`: the tiny and bench sizes in those architectures, in real HF
layout (transformers loads the very files, no key missing or unexpected) and run by strata as transformers runs
them; the bench sizes are GLM-4.5-Air's and DeepSeek-V2-Lite's configurations (planned in
tests/plan/test_plan_architectures.py)."""

from __future__ import annotations

import json

import pytest
import torch

from strata import Engine
from strata.cli import main
from strata.errors import ConfigError
from strata.runtime.demo.configs import DemoSpec, demo_config, expected_bytes
from strata.runtime.demo.model import write_demo_model
from strata.runtime.model.config import ModelConfig

ARCHS = ("glm4_moe", "deepseek_v2")


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_runs_as_transformers_runs_it(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    d = write_demo_model(tmp_path / arch, "tiny", engram=False, progress=False, arch=arch)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == arch and json.loads((d / "strata_demo.json").read_text())["arch"] == arch
    assert sum(f.stat().st_size for f in d.glob("*.safetensors")) > expected_bytes("tiny", engram=False, arch=arch)
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model = model.eval()
    prompt = list(range(5, 120, 7))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    with Engine.from_pretrained(d, device="cpu", config={"runtime": {"dtype": "float32", "max_context": 256}}) as e:
        assert (e.score(prompt) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch, layers, experts", [("glm4_moe", 46, 128), ("deepseek_v2", 27, 64)])
def test_bench_configs(arch, layers, experts):
    cfg = ModelConfig.from_hf(demo_config("bench", engram=False, arch=arch))
    assert (cfg.num_layers, cfg.num_experts, cfg.moe_layers[0], cfg.moe_layers[1]) == (layers, experts, False, True)
    if arch == "glm4_moe":  # GLM-4.5-Air: 96 heads of 128 over 8 KV heads, half of each rotated, q/k/v biases
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope.dim, cfg.qkv_bias, cfg.o_bias) == (96, 8, 64, True, False)
    else:  # DeepSeek-V2-Lite: no q_lora_rank, greedy softmax routing over 64 experts, YaRN x40
        assert (cfg.q_lora_rank, cfg.router, cfg.n_group, cfg.rope.rope_type, cfg.rope.factor) == (
            None, "softmax_group", 1, "yarn", 40.0)
    assert DemoSpec("bench", 4, arch=arch).num_layers == 4


def test_sizes_and_archs_not_written_are_refused(capsys, tmp_path):
    with pytest.raises(ConfigError, match="--arch glm4_moe is written in sizes tiny, bench, not 'small'"):
        DemoSpec("small", arch="glm4_moe")
    with pytest.raises(ConfigError, match="--arch 'mixtral' is not written by demo-model"):
        DemoSpec("tiny", arch="mixtral")
    with pytest.raises(ConfigError, match="--arch"):
        write_demo_model(tmp_path / "d", "demo", arch="glm4_moe", progress=False)
    assert main(["demo-model", str(tmp_path / "x"), "--size", "small", "--arch", "deepseek_v2"]) == 2
    assert "not 'small'" in capsys.readouterr().err
