"""`strata demo-model --arch minimax_m2`: the tiny, small and bench sizes under the release's names (transformers
loads the very files, no key missing or unexpected, and strata runs them as transformers does), in bf16 or in the
release's block-scaled FP8; the bench size is MiniMax-M2's configuration (planned in
tests/plan/test_minimax_m2_plan.py)."""

from __future__ import annotations

import json

import pytest
import torch

from strata import Engine
from strata.cli import main
from strata.errors import ConfigError
from strata.kernels.quant import ExpertFormat
from strata.runtime.demo.configs import DemoSpec, demo_config, expected_bytes
from strata.runtime.demo.model import write_demo_model
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.config import ModelConfig

ARCH = "minimax_m2"
FP32 = {"dtype": "float32", "max_context": 256, "cpu_numerics": "gpu"}


def test_tiny_runs_as_transformers_runs_it(tmp_path):
    from transformers import AutoModelForCausalLM

    d = write_demo_model(tmp_path / "tiny", "tiny", engram=False, progress=False, arch=ARCH)
    assert json.loads((d / "strata_demo.json").read_text())["arch"] == ARCH
    assert sum(f.stat().st_size for f in d.glob("*.safetensors")) > expected_bytes("tiny", engram=False, arch=ARCH)
    names = Checkpoint.open(d).index.names()
    assert "model.layers.2.block_sparse_moe.experts.15.w2.weight" in names
    assert "model.layers.2.block_sparse_moe.e_score_correction_bias" in names
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (64,)  # the whole projection's norm
    prompt = list(range(5, 120, 7))
    with torch.no_grad():
        ref = torch.log_softmax(model.eval()(torch.tensor([prompt])).logits[0].float(), dim=-1)
    with Engine.from_pretrained(d, device="cpu", config={"runtime": FP32}) as engine:
        assert (engine.score(prompt) - ref).abs().max().item() < 1e-4


def test_fp8_as_the_release_ships_it(tmp_path):
    """`--experts fp8`: every projection but the routers in e4m3 (32 x 32 blocks at the tiny width), experts per
    projection under Mixtral's names; strata runs it as it runs the bf16 weights those round to."""
    plain = write_demo_model(tmp_path / "bf16", "tiny", engram=False, progress=False, arch=ARCH)
    fp8 = write_demo_model(tmp_path / "fp8", "tiny", engram=False, progress=False, arch=ARCH, experts="fp8")
    ckpt = Checkpoint.open(fp8)
    assert ckpt.expert_format == ExpertFormat("fp8", block=(32, 32)) and ckpt.expert_layout == "per-expert"
    assert ckpt.index["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == "F8_E4M3"
    assert ckpt.index["model.layers.0.block_sparse_moe.gate.weight"].dtype == "BF16"
    assert ckpt.index["model.layers.0.block_sparse_moe.e_score_correction_bias"].dtype == "F32"
    prompt = list(range(5, 100, 7))
    with Engine.from_pretrained(plain, device="cpu", config={"runtime": FP32}) as bf16, \
            Engine.from_pretrained(fp8, device="cpu", config={"runtime": FP32}) as quantized:
        err = (quantized.score(prompt) - bf16.score(prompt)).abs().max().item()
        assert 0 < err < 0.5  # the same model, rounded to e4m3


def test_sizes_and_options(capsys, tmp_path):
    small = ModelConfig.from_hf(demo_config("small", engram=False, arch=ARCH))
    assert (small.num_layers, small.num_experts, small.num_experts_per_tok, small.rope.dim) == (8, 64, 8, 32)
    bench = ModelConfig.from_hf(demo_config("bench", engram=False, arch=ARCH))
    assert (bench.num_layers, bench.num_heads, bench.num_kv_heads, bench.head_dim, bench.rope.dim) == (62, 48, 8, 128,
                                                                                                      64)
    assert (bench.num_experts, bench.moe_intermediate_size, bench.vocab_size) == (256, 1536, 200064)
    assert DemoSpec("bench", 4, arch=ARCH).num_layers == 4
    with pytest.raises(ConfigError, match="not written for --arch minimax_m2"):
        DemoSpec("tiny", arch=ARCH, experts="mxfp4")
    with pytest.raises(ConfigError, match="not written for --arch minimax_m2"):
        DemoSpec("tiny", arch=ARCH, route_skew=1.0)
    assert main(["demo-model", str(tmp_path / "x"), "--size", "tiny", "--arch", ARCH, "--route-skew", "1"]) == 2
    assert "--route-skew" in capsys.readouterr().err
