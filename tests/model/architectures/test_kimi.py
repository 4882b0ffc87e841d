"""Kimi K2 (`kimi_k2`) and K2.5 (`kimi_k25`: the language model under text_config and `language_model.`, beside a
vision tower) run as the DeepSeek-V3 they are: against transformers' DeepSeek-V3 of the same weights (fp32, CPU), in
both expert layouts, log-probabilities within 1e-4 and 32 identical greedy tokens, through the tiers, with Kimi's
tiktoken tokenizer; then the same at a context of 2,100 tokens with YaRN."""

from __future__ import annotations

import pytest
import torch
from kimi_models import build_kimi

from reference_models import reference_greedy
from strata import Engine
from strata.errors import CheckpointError, UnsupportedError
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.config import ModelConfig
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.store.safetensors_index import TensorIndex

TEXT = "In the beginning the model read the text: 模型读取文本。 It's 2026."
ATOL = 1e-4
CONFIG = {"runtime": {"dtype": "float32", "max_context": 512}, "tiers": {"disk": {"scrub": False}}}


def check_against_reference(model, engine, prompt: list[int], n_greedy: int = 32) -> torch.Tensor:
    """`engine.score(prompt)` within ATOL of transformers' log-softmax and `n_greedy` greedy tokens identical to its
    cached greedy decoding; returns the scores."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours = engine.score(prompt)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"
    out = engine.generate(prompt, max_tokens=n_greedy, temperature=0.0)
    assert out.token_ids == reference_greedy(model, prompt, n_greedy, cached=True)
    assert out.finish_reason == "length"
    return ours


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("nested", [False, True], ids=["kimi_k2", "kimi_k25"])
def test_kimi_matches_deepseek_v3(nested, fused, tmp_path):
    model, directory = build_kimi(tmp_path / "kimi", nested, fused=fused)
    ckpt = Checkpoint.open(directory)
    cfg = ckpt.config
    assert cfg.model_type == ("kimi_k25" if nested else "kimi_k2")
    assert (cfg.attention, cfg.router, cfg.rope.rope_type, cfg.rope.beta_fast) == ("mla", "sigmoid_group", "yarn", 1.0)
    names = ckpt.index.names()
    assert not any(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in names)
    fused_names = [n for n in names if n.endswith("mlp.experts.gate_up_proj")]
    assert len(fused_names) == (1 if fused else 0)  # the one MoE layer's experts, as saved
    with Engine.from_pretrained(directory, config=CONFIG, device="cpu") as engine:
        assert engine.tiers is not None
        prompt = engine.tokenizer.encode(TEXT)
        assert engine.tokenizer.decode(prompt) == TEXT and len(prompt) > 10
        ours = check_against_reference(model, engine, prompt)
    if nested:  # a packed store holds the language model's tensors alone, under transformers' names
        store = convert_checkpoint(directory, tmp_path / "store", progress=False)
        packed = TensorIndex.from_dir(store).names()
        assert "model.embed_tokens.weight" in packed and not any(n.startswith(("vision_", "mm_", "lang")) for n in packed)
        with Engine.from_pretrained(store, config=CONFIG, device="cpu") as engine:
            assert (engine.score(prompt) - ours).abs().max().item() < 1e-6


def test_kimi_long_context_matches_deepseek_v3(tmp_path):
    """2,100 tokens, past the 512 positions YaRN scales from."""
    model, directory = build_kimi(tmp_path / "kimi", False, seed=3, long=True)
    prompt = torch.randint(0, 640, (2100,), generator=torch.Generator().manual_seed(2)).tolist()
    config = {**CONFIG, "runtime": {"dtype": "float32", "max_context": 4096}}
    with Engine.from_pretrained(directory, config=config, device="cpu") as engine:
        assert engine.checkpoint.config.rope.factor == 8.0
        check_against_reference(model, engine, prompt)


def test_kimi_configs_refuse_what_they_are_not(tmp_path):
    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4}
    with pytest.raises(UnsupportedError, match="scoring_func 'softmax'"):
        ModelConfig.from_hf({**base, "model_type": "kimi_k2", "scoring_func": "softmax"})
    with pytest.raises(CheckpointError, match="kimi_k25 has no text_config"):
        ModelConfig.from_hf({"model_type": "kimi_k25"})
    with pytest.raises(UnsupportedError, match="text_config.model_type 'qwen3'"):
        ModelConfig.from_hf({"model_type": "kimi_k25", "text_config": {**base, "model_type": "qwen3"}})
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized"}  # K2.5's INT4 release
    with pytest.raises(UnsupportedError, match="quant_method 'compressed-tensors' is not supported"):
        ModelConfig.from_hf({"model_type": "kimi_k25", "text_config": {**base, "quantization_config": int4}})
    nested = ModelConfig.from_hf({"model_type": "kimi_k25", "eos_token_id": 7, "text_config": {**base, "model_type": "kimi_k2"}})
    assert nested.eos_token_ids == [7] and nested.num_layers == 2 and nested.attention == "mla"
