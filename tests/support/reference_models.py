"""Tiny random checkpoints built offline with transformers' own classes, for the reference tests.

Each architecture has a short-context variant and a long-context one (RoPE scaling or a sliding
window active below 2,048 tokens), saved in either expert layout: per expert (transformers'
default `save_pretrained`) or fused 3-D (`save_original_format=False`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 160


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files, by name."""
    from safetensors import safe_open

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name] = f.get_tensor(name)
    return out


def require_transformers(version: str, what: str, installed: str | None = None) -> None:
    """Fail a test whose oracle is transformers' `what` when the installed transformers (or `installed`) is older than
    `version`, naming both: an older release computing the architecture otherwise is not strata's error."""
    from packaging.version import Version

    if installed is None:
        import transformers

        installed = transformers.__version__
    if Version(installed) < Version(version):
        import pytest

        pytest.fail(f"transformers {installed} computes {what} otherwise than {version}, the oracle these tests "
                    f"follow: pip install 'transformers>={version}'", pytrace=False)


def _configs(long: bool) -> dict:
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Glm4MoeConfig,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=4096, initializer_range=0.1, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512}
    return {
        "qwen3_moe": Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
            rope_parameters=yarn if long else {"rope_type": "default", "rope_theta": 10000.0},
        ),
        "qwen2_moe": Qwen2MoeConfig(
            **common, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
            decoder_sparse_step=2 if not long else 1,
            use_sliding_window=long, sliding_window=256 if long else None, max_window_layers=3,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0} if long
            else {"rope_type": "default", "rope_theta": 10000.0},
        ),
        "mixtral": MixtralConfig(
            **common, num_key_value_heads=2, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
            sliding_window=300 if long else None,
        ),
        "deepseek_v3": DeepseekV3Config(
            **common, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, kv_lora_rank=24, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, norm_topk_prob=True,
            rope_parameters={**yarn, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
            if long else {"rope_type": "default", "rope_theta": 10000.0},
        ),
        # GLM-4.5: rotary on half of each head; short: q/k/v biases and q/k norms on; long: both off, as GLM-4.5 ships
        "glm4_moe": Glm4MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=not long,
            use_qk_norm=not long,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
        # DeepSeek-V2: short: q_lora_rank and group_limited_greedy (V2); long: V2-Lite's q_proj, greedy and YaRN
        "deepseek_v2": DeepseekV2Config(
            **common, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
            topk_method="greedy" if long else "group_limited_greedy", routed_scaling_factor=2.0,
            kv_lora_rank=24, q_lora_rank=None if long else 32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            rope_parameters={**yarn, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
            if long else {"rope_type": "default", "rope_theta": 10000.0},
        ),
    }


ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "deepseek_v2")
WINDOWED = ("qwen2_moe", "mixtral")  # their long-context variants attend through a sliding window


def build_reference(arch: str, directory: Path, *, fused: bool = False, long: bool = False, seed: int = 0):
    """Create, save and return (transformers model in fp32 eval mode, checkpoint dir)."""
    from transformers import AutoModelForCausalLM

    cfg = _configs(long)[arch]
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # exercise DeepSeek's selection-only bias (zero at init)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    model.save_pretrained(directory, save_original_format=not fused)
    write_tokenizer(directory)
    return model, directory


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, cached: bool = False) -> list[int]:
    """Greedy decoding by the definition: the full forward over the whole sequence at every step; or, `cached`,
    one forward over the prompt and one a token through transformers' KV cache (the same tokens, ~100x faster at
    2K tokens; only where no sliding window is active: transformers 5.24's cached path disagrees with its own
    forward on sliding-window models once the prompt exceeds the window, so `generate` is no oracle there)."""
    if cached:
        out, ids = model(torch.tensor([prompt]), use_cache=True), []
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[ids[-1]]]), cache=out.cache, use_cache=True)
        return ids
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over VOCAB-2 made-up words (the tests feed token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab["<unk>"] = VOCAB - 2
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
