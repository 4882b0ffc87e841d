"""MiniMax-M2 against transformers 5.25's `MiniMaxM2ForCausalLM` on tiny random checkpoints (fp32, CPU).

Both on-disk layouts (the release's per-expert `block_sparse_moe.experts.E.w1/w2/w3` with the correction bias beside
the router, transformers' fused one): `Engine.score` equals transformers' log-softmax within 1e-4 and 32 greedy
tokens are transformers' greedy tokens; then the same at 2,100 tokens, through the tiers from a pinned budget of a
few experts and disk, and for the release's block-scaled FP8 (`fmt` "float8_e4m3fn") against transformers on the
dequantized weights. The config of the release is read as transformers reads it, and its MTP layers are read past.
"""

from __future__ import annotations

import json

import pytest
import torch
from minimax_m2_models import build_minimax_m2_reference
from quantized_models import dequantized_checkpoint, oracle, quantize_checkpoint
from safetensors.torch import save_file

from reference_models import VOCAB, reference_greedy
from strata import Engine
from strata.kernels.quant import ExpertFormat
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.config import ModelConfig
from strata.runtime.plan.checkpoints.inspect import summarize_checkpoint

ATOL = 1e-4
FP32 = {"dtype": "float32", "max_context": 256}

# MiniMaxAI/MiniMax-M2's config.json (its auto_map and a few bookkeeping keys left out)
RELEASE = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attention_dropout": 0.0,
    "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 1536, "max_position_embeddings": 196608, "mtp_transformer_layers": 1,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "num_mtp_modules": 3, "output_router_logits": False, "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "sliding_window": None,
    "tie_word_embeddings": False, "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True,
    "vocab_size": 200064, "bos_token_id": 200034, "eos_token_id": 200020,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
}  # fmt: skip


def check(engine: Engine, model, prompt: list[int], n_greedy: int = 32) -> None:
    """Log-probabilities within ATOL of transformers' and `n_greedy` of its greedy tokens (through its KV cache:
    MiniMax-M2 attends without a window, so transformers' cached decode is its full forward's)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours = engine.score(prompt)
    assert ours.shape == (len(prompt), VOCAB) and ours.dtype == torch.float32
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"
    out = engine.generate(prompt, max_tokens=n_greedy, temperature=0.0)
    assert out.token_ids == reference_greedy(model, prompt, n_greedy, cached=True)


def test_release_config_reads_as_transformers_reads_it():
    from transformers import MiniMaxM2Config

    cfg = ModelConfig.from_hf(RELEASE)
    hf = MiniMaxM2Config(**{k: v for k, v in RELEASE.items() if k != "quantization_config"})
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (62, 48, 8, 128)
    assert cfg.rope.dim == int(128 * hf.rope_parameters["partial_rotary_factor"]) == 64
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"] == 5e6 and cfg.rope.rope_type == "default"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 1536)
    assert all(cfg.moe_layers) and cfg.shared_expert_intermediate_size == 0 and cfg.intermediate_size == 0
    assert (cfg.router, cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.fp32_router) == ("sigmoid_topk", True, 1.0,
                                                                                           False)
    assert cfg.qk_norm and cfg.qk_norm_whole and not cfg.qkv_bias and cfg.sliding_windows == [None] * 62
    assert (cfg.quant_method, cfg.weight_block) == ("fp8", (128, 128))
    # an explicit partial_rotary_factor wins over rotary_dim (transformers' order); no rotary_dim: every dim rotates
    assert ModelConfig.from_hf({**RELEASE, "partial_rotary_factor": 0.25}).rope.dim == 32
    assert ModelConfig.from_hf({k: v for k, v in RELEASE.items() if k != "rotary_dim"}).rope.dim == 128


@pytest.mark.parametrize("fused", [False, True], ids=["release-names", "fused"])
def test_matches_transformers(fused, tmp_path):
    model, directory = build_minimax_m2_reference(tmp_path / "m2", fused=fused)
    names = Checkpoint.open(directory).index.names()
    if not fused:  # the release's names, which strata reads as Mixtral's
        assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names
        assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in names
    else:
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.e_score_correction_bias" in names
    engine = Engine.from_pretrained(directory, config={"runtime": {**FP32, "experts": "memory"}}, device="cpu")
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    check(engine, model, prompt)


def test_long_context_matches_transformers(tmp_path):
    """2,100 tokens, a quarter of each head rotated (an explicit partial_rotary_factor over rotary_dim)."""
    model, directory = build_minimax_m2_reference(tmp_path / "m2long", long=True, seed=3)
    engine = Engine.from_pretrained(directory, config={"runtime": {"dtype": "float32", "max_context": 2200}},
                                    device="cpu")
    assert engine.model.rotary.inv_freq.numel() * 2 == 4  # 16-wide heads, 4 dims rotated
    prompt = torch.randint(0, VOCAB, (2100,), generator=torch.Generator().manual_seed(2)).tolist()
    check(engine, model, prompt)


def test_tiered_from_disk_matches_memory_and_transformers(tmp_path):
    """Experts served by the tiers from a pinned budget of two experts (24 KiB each in fp32), the rest from disk:
    the scores and tokens of every expert in memory, and transformers'."""
    model, directory = build_minimax_m2_reference(tmp_path / "m2", seed=5)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    memory = Engine.from_pretrained(directory, config={"runtime": {**FP32, "experts": "memory"}}, device="cpu")
    config = {"runtime": FP32, "store": {"mode": "packed"},
              "tiers": {"pinned": {"budget": "48KiB"}, "disk": {"scrub": False}}}
    with Engine.from_pretrained(directory, config=config, device="cpu") as engine:
        assert (engine.score(prompt) - memory.score(prompt)).abs().max().item() < 1e-5
        assert engine.generate(prompt, max_tokens=12, temperature=0.0).token_ids == memory.generate(
            prompt, max_tokens=12, temperature=0.0).token_ids
        check(engine, model, prompt, n_greedy=12)
        assert engine.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk


def test_fp8_release_matches_transformers_on_its_dequantized_weights(tmp_path):
    """The release's format: every projection but the routers in e4m3 with a float32 scale per block (16 x 16 here;
    128 x 128 in the release), experts per projection, `fmt` "float8_e4m3fn"; in memory and through the tiers, whose
    store keeps the experts in FP8."""
    _, plain = build_minimax_m2_reference(tmp_path / "ref", seed=7)
    quantized = quantize_checkpoint(plain, tmp_path / "fp8", "fp8", (16, 16))
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"].update(fmt="float8_e4m3fn", modules_to_not_convert=["gate", "e_score_correction_bias",
                                                                                    "lm_head"])
    (quantized / "config.json").write_text(json.dumps(cfg))
    ckpt = Checkpoint.open(quantized)
    assert ckpt.expert_format == ExpertFormat("fp8", block=(16, 16))
    assert ckpt.index["model.layers.1.block_sparse_moe.experts.3.w3.weight"].dtype == "F8_E4M3"
    assert ckpt.index["model.layers.1.self_attn.q_proj.weight"].dtype == "F8_E4M3"
    assert ckpt.index["model.layers.1.block_sparse_moe.gate.weight"].dtype == "F32"  # routers stay unquantized
    reference = oracle(dequantized_checkpoint(quantized, tmp_path / "dequantized"))
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    exact = {**FP32, "cpu_numerics": "gpu"}  # FP8 experts dequantized to fp32, not the CPU kernel's bf16 products
    check(Engine.from_pretrained(quantized, device="cpu", config={"runtime": {**exact, "experts": "memory"}}),
          reference, prompt, n_greedy=8)
    config = {"runtime": exact, "store": {"mode": "packed"}, "tiers": {"pinned": {"budget": "24KiB"},
                                                                     "disk": {"scrub": False}}}
    with Engine.from_pretrained(quantized, device="cpu", config=config) as tiered:
        assert tiered.tiers.store.expert_format == ExpertFormat("fp8", block=(16, 16))
        check(tiered, reference, prompt, n_greedy=8)
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0


def test_mtp_layers_are_read_past(tmp_path):
    """The release's MTP modules sit at `model.layers.{num_hidden_layers + i}`: the model loads and scores as
    transformers' (which has no MTP) and `strata inspect` counts them as MTP, not as decoder layers."""
    model, directory = build_minimax_m2_reference(tmp_path / "m2", seed=9)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "use_mtp": True, "num_mtp_modules": 2,
                                                       "mtp_transformer_layers": 1}))
    mtp = {f"model.layers.{3 + i}.{n}": torch.zeros(s) for i in range(2) for n, s in (
        ("self_attn.q_proj.weight", (64, 64)), ("block_sparse_moe.gate.weight", (8, 64)),
        ("block_sparse_moe.experts.0.w1.weight", (32, 64)))}
    save_file(mtp, str(directory / "mtp.safetensors"))
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    check(Engine.from_pretrained(directory, config={"runtime": FP32}, device="cpu"), model, prompt, n_greedy=4)
    summary = summarize_checkpoint(directory)
    assert (summary.num_layers, summary.moe_layers, summary.mtp_layers) == (3, 3, 2)
    assert summary.bytes_by_role["mtp"] == sum(t.numel() * 4 for t in mtp.values())
    assert summary.bytes_by_role["other"] == 0 and summary.bytes_by_role["router"] == 3 * (8 * 64 + 8) * 4
    assert not summary.notes, summary.notes
