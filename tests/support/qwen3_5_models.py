"""Tiny random Qwen3.5-MoE checkpoints built offline with transformers' own `Qwen3_5MoeForCausalLM` (text only) and
`Qwen3_5MoeForConditionalGeneration` (the releases' multimodal layout: `qwen3_5_moe` with a `text_config`, the
decoder under `model.language_model.`, a vision tower beside it).

Both Gated DeltaNet and gated full-attention layers appear; key and value head dims differ and value heads outnumber
key heads (each key head serves two), the rotary covers a quarter of each full-attention head as the releases'
does, and the parameters transformers initialises to constants (the zero-centred norms' weights, the gated norm's,
dt_bias) are drawn at random, so a wrong formula anywhere changes the logits. transformers' loader takes the text
model's experts in both layouts (per expert, and fused 3-D); the multimodal class is saved fused, as the releases
ship it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reference_models import VOCAB, write_tokenizer

LIN, FULL = "linear_attention", "full_attention"


def q35_text_config(long: bool = False, layers: int = 4):
    from transformers import Qwen3_5MoeTextConfig

    types = [LIN, FULL, LIN, LIN] if not long else [LIN, LIN, LIN, FULL]
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096, initializer_range=0.1,
        layer_types=(types * layers)[:layers],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0 if long else 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


def _randomise(model, seed: int) -> None:
    """Draw the parameters transformers initialises to constants."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.2)
            elif name.endswith(("norm.weight", "layernorm.weight")):  # zero-centred: 1 + weight multiplies
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
            elif name.endswith("dt_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)


def build_q35_reference(directory: Path, *, fused: bool = False, long: bool = False, seed: int = 0,
                        layers: int = 4):
    """Create, save and return (transformers Qwen3_5MoeForCausalLM in fp32 eval mode, checkpoint dir)."""
    from transformers import AutoModelForCausalLM

    cfg = q35_text_config(long, layers)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomise(model, seed)
    model.save_pretrained(directory, save_original_format=not fused)
    write_tokenizer(directory)
    return model, directory


def build_q35_release(directory: Path, seed: int = 0):
    """A multimodal checkpoint as the releases ship it (config `qwen3_5_moe` with text_config and vision_config,
    `model.language_model.*`, `model.visual.*`, fused experts): (transformers model in fp32 eval mode, dir)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = q35_text_config()
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    cfg = Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    _randomise(model, seed)
    model.save_pretrained(directory, save_original_format=False)
    write_tokenizer(directory)
    return model, directory
