"""`strata demo-model --arch deepseek_v4`: a DeepSeek-V4 checkpoint under the release's tensor names that transformers
and strata both load, and compute alike."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.errors import ConfigError
from strata.runtime.demo.model import write_demo_model
from strata.tiers.store.safetensors_index import TensorIndex


def test_tiny_loads_in_transformers_and_strata_alike(tmp_path):
    from transformers import AutoModelForCausalLM

    d = write_demo_model(tmp_path / "v4", size="tiny", arch="deepseek_v4", progress=False)
    assert write_demo_model(d, size="tiny", arch="deepseek_v4", progress=False) == d  # the same model: kept
    names = TensorIndex.from_dir(d).names()
    assert "embed.weight" in names and "layers.0.ffn.gate.tid2eid" in names and "layers.1.attn.indexer.wq_b.weight" in names
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(d, device="cpu", config={"runtime": {"dtype": "float32", "experts": "memory",
                                                                         "max_context": 512}})
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(0)).tolist()  # CSA and HCA entries
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert (engine.score(prompt) - expected).abs().max().item() < 1e-4
    cfg = {"runtime": {"max_context": 512, "dtype": "float32"}}
    with Engine.from_pretrained(d, device="cpu", config=cfg) as tiered:  # its store: the I32 tid2eid a table
        assert tiered.tiers.store.index.tables["tid2eid.0"].dtype == "I32"
        ids = engine.generate(prompt[:40], max_tokens=8, temperature=0.0).token_ids
        assert tiered.generate(prompt[:40], max_tokens=8, temperature=0.0).token_ids == ids


def test_options_it_does_not_write_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--route-skew: not written for --arch deepseek_v4"):
        write_demo_model(tmp_path / "q", size="tiny", arch="deepseek_v4", route_skew=1.0, progress=False)
    with pytest.raises(ConfigError, match="--experts 'int4' is invalid; use one of bf16, fp8, mxfp4"):
        write_demo_model(tmp_path / "i", size="tiny", arch="deepseek_v4", experts="int4", progress=False)
    with pytest.raises(ConfigError, match="the demo model is trained"):
        write_demo_model(tmp_path / "d", size="demo", arch="deepseek_v4", progress=False)
    with pytest.raises(ConfigError, match="--layers"):
        write_demo_model(tmp_path / "l", size="tiny", layers=0, arch="deepseek_v4", progress=False)


def test_fp4_scales_alone_are_the_quantizers():
    """The quantized demo writes an FP4 expert's scales without rounding its values: the same bytes quantize_mxfp4
    gives, over magnitudes from subnormal to near float32's largest and all-zero groups."""
    from strata.kernels.quant import quantize_mxfp4
    from strata.runtime.demo.deepseek_v4_quant import mxfp4_scales

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-40, 38, 256)
    w[3, :32], w[5, 32:64], w[7, 64:96] = 0.0, 6.0, 1e-45
    assert torch.equal(mxfp4_scales(w), quantize_mxfp4(w)[1])
