"""Tiny random DeepSeek-V4 checkpoints built offline with transformers' own `DeepseekV4ForCausalLM`.

Every layer type appears (sliding window, compressed sparse with the lightning indexer, heavily compressed), a hash
MoE layer comes first, and the parameters transformers initialises to constants (sinks, compressor position biases,
hyper-connection bases and scales, the routers' correction bias, the tid2eid table) are drawn at random, so a wrong
formula anywhere changes the logits. `swiglu_limit` is small enough that the clip engages. The long variant has a
short window and small compression rates, so 2,100 tokens cross many windows, compressed entries and top-k picks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reference_models import VOCAB, write_tokenizer

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]


def v4_config(long: bool = False, layers: int = 4):
    from transformers import DeepseekV4Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32,
            "beta_slow": 1}
    return DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, head_dim=32, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8,
        layer_types=(LAYER_TYPES * 2)[:layers],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16 if long else 8},
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), hc_mult=3, hc_sinkhorn_iters=6,
        sliding_window=64 if long else 12, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16,
        index_topk=8 if long else 3, partial_rotary_factor=0.25, max_position_embeddings=4096,
        rope_scaling=yarn if long else None, swiglu_limit=0.3, routed_scaling_factor=1.5, initializer_range=0.1,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


def build_v4_reference(directory: Path, *, fused: bool = False, long: bool = False, seed: int = 0, layers: int = 4):
    """Create, save and return (transformers DeepseekV4ForCausalLM in fp32 eval mode, checkpoint dir)."""
    from transformers import AutoModelForCausalLM

    cfg = v4_config(long, layers)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                t.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base", "e_score_correction_bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith((".scale", "hc_scale")):
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.3)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.1)
    model.save_pretrained(directory, save_original_format=not fused)
    write_tokenizer(directory)
    return model, directory
