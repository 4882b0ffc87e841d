"""Tiny random MiniMax-M2 checkpoints built offline with transformers' own `MiniMaxM2ForCausalLM`.

Short: the release's spelling of partial rotary (`rotary_dim` 8 of 16) and its RoPE base (5e6). Long: an explicit
`partial_rotary_factor` of 0.25 that wins over `rotary_dim`, base 1e4, so 2,100 positions turn the rotated dims many
times. The parameters transformers initialises to constants (the routers' correction bias, every RMSNorm weight,
the whole-projection q/k norms included) are drawn at random, so a bias that does not choose, or a norm taken per
head, changes the logits. Saved per expert under the release's names (`block_sparse_moe.experts.E.w1`, the bias
beside the router) or fused (`mlp.experts.gate_up_proj`, `mlp.e_score_correction_bias`): transformers loads both.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reference_models import VOCAB, require_transformers, write_tokenizer


def minimax_m2_config(long: bool = False):
    from transformers import MiniMaxM2Config

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25} if long else None
    return MiniMaxM2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=3,
        max_position_embeddings=4096, initializer_range=0.1, rms_norm_eps=1e-6, rope_parameters=rope,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


def build_minimax_m2_reference(directory: Path, *, fused: bool = False, long: bool = False, seed: int = 0):
    """Create, save and return (transformers MiniMaxM2ForCausalLM in fp32 eval mode, checkpoint dir)."""
    require_transformers("5.25", "MiniMax-M2 (its partial rotary from rotary_dim)")
    from transformers import AutoModelForCausalLM

    cfg = minimax_m2_config(long)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif name.endswith("norm.weight"):
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.2)
    model.save_pretrained(directory, save_original_format=not fused)
    write_tokenizer(directory)
    return model, directory
