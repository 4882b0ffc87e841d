"""`strata demo-model --arch gpt_oss`: gpt-oss checkpoints under the release's tensor names (MXFP4 experts as
released, or transformers' bf16 parameters) that transformers and strata both load, and compute alike."""

from __future__ import annotations

import json

import pytest
import torch
from gpt_oss_models import oracle

from strata import Engine
from strata.cli import main
from strata.errors import ConfigError
from strata.runtime.demo.gpt_oss import oss_config, oss_tensors
from strata.runtime.demo.model import write_demo_model
from strata.runtime.model.config import ModelConfig
from strata.tiers.store.safetensors_index import TensorIndex


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_tiny_loads_in_transformers_and_strata_alike(experts, tmp_path):
    d = write_demo_model(tmp_path / "oss", size="tiny", arch="gpt_oss", experts=experts, progress=False)
    assert write_demo_model(d, size="tiny", arch="gpt_oss", experts=experts, progress=False) == d  # kept
    index = TensorIndex.from_dir(d)
    stem = "model.layers.1.mlp.experts."
    if experts == "mxfp4":
        assert index[stem + "gate_up_proj_blocks"].shape == (16, 128, 2, 16) and index[stem + "down_proj_scales"].dtype == "U8"
    else:
        assert index[stem + "gate_up_proj"].shape == (16, 64, 128) and index[stem + "down_proj"].shape == (16, 64, 64)
    assert "model.layers.0.self_attn.sinks" in index and index[stem + "gate_up_proj_bias"].dtype == "BF16"
    ref = oracle(d)  # every tensor read by transformers (it refuses missing or unexpected keys)
    engine = Engine.from_pretrained(d, device="cpu", config={"runtime": {"dtype": "float32", "experts": "memory",
                                                                         "max_context": 512}})
    prompt = torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(0)).tolist()  # past the window
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert (engine.score(prompt) - expected).abs().max().item() < 1e-4
    with Engine.from_pretrained(d, device="cpu", config={"runtime": {"max_context": 512, "dtype": "float32"}}) as tiered:
        assert tiered.tiers.store.expert_format.kind == ("mxfp4" if experts == "mxfp4" else "plain")
        ids = engine.generate(prompt[:40], max_tokens=8, temperature=0.0).token_ids
        assert tiered.generate(prompt[:40], max_tokens=8, temperature=0.0).token_ids == ids


def test_bench_is_gpt_oss_120b(tmp_path):
    """The bench size's config is gpt-oss-120b's (its shapes as strata reads them), its experts MXFP4 as released."""
    cfg = oss_config("bench")
    model = ModelConfig.from_hf(cfg)
    assert (model.num_layers, model.num_experts, model.num_experts_per_tok, model.hidden_size) == (36, 128, 4, 2880)
    assert (model.moe_intermediate_size, model.num_heads, model.num_kv_heads, model.head_dim) == (2880, 64, 8, 64)
    assert model.sliding_windows[:2] == [128, None] and model.vocab_size == 201088 and model.quant_method == "mxfp4"
    blocks = {t.name: t for t in oss_tensors(cfg)}["model.layers.35.mlp.experts.gate_up_proj_blocks"]
    assert blocks.shape == (128, 5760, 90, 16) and blocks.dtype == "U8"
    assert 60 << 30 < sum(t.nbytes for t in oss_tensors(cfg)) < 62 << 30
    assert "quantization_config" not in oss_config("bench", 2, "bf16")


def test_the_cli_writes_mxfp4_unless_told_bf16(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "q"), "--size", "tiny", "--arch", "gpt_oss", "--layers", "2"]) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert main(["demo-model", str(tmp_path / "b"), "--size", "tiny", "--arch", "gpt_oss", "--layers", "2",
                 "--experts", "bf16"]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "b" / "config.json").read_text())
    assert "(gpt_oss) (mxfp4)" in capsys.readouterr().out


def test_options_it_does_not_write_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--experts fp8: gpt-oss ships its experts in MXFP4"):
        write_demo_model(tmp_path / "q", size="tiny", arch="gpt_oss", experts="fp8", progress=False)
    with pytest.raises(ConfigError, match="--route-skew: not written for --arch gpt_oss"):
        write_demo_model(tmp_path / "s", size="tiny", arch="gpt_oss", route_skew=1.0, progress=False)
    with pytest.raises(ConfigError, match="--layers"):
        write_demo_model(tmp_path / "l", size="tiny", layers=0, arch="gpt_oss", progress=False)
