"""Tiny GGUF files of qwen2moe, deepseek2 (DeepSeek-V3: MLA with its kv_b split into attn_k_b / attn_v_b, sigmoid
routing with exp_probs_b, a leading dense layer, a shared expert) and llama with experts (Mixtral), written as
llama.cpp's convert_hf_to_gguf.py writes them, routed experts random valid ggml blocks; the transformers model holds
those experts dequantized by `gguf` (the oracle). A file carries the demo's gpt2 BPE vocabulary, or with
`sentencepiece` the SentencePiece ("llama") one of tests/support/gguf_sentencepiece_vocab.py, as a Mixtral release
ships."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf_blocks_random import random_blocks
from gguf_models import VOCAB, _vocab
from gguf_sentencepiece_vocab import llama_tokenizer, write_llama_vocab

COMMON = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=2, pad_token_id=None)  # fmt: skip


def _config(arch: str):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "qwen2moe":
        return Qwen2MoeConfig(**COMMON, num_key_value_heads=2, moe_intermediate_size=256, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=256,
                              decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                              rope_parameters=rope)  # fmt: skip
    if arch == "llama":
        return MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=None, rope_parameters=rope)  # fmt: skip
    return DeepseekV3Config(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                            topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=64,
                            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                            rope_interleave=True, rope_parameters=rope)  # fmt: skip


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: q/k rows of each head interleaved in pairs (its rotary layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_arch_gguf(directory: Path, arch: str, types: dict[int, tuple[str, str, str]], seed: int = 0,
                    split_max_tensors: int = 0, sentencepiece: bool = False):
    """(transformers model in fp32, path of the GGUF or of its first part) of a tiny `arch` model ("qwen2moe",
    "deepseek2", "llama"); MoE layer L's gate / up / down experts in `types[L]`; the original tokenizer.json beside
    it."""
    import gguf
    from transformers import AutoModelForCausalLM

    from strata.runtime.demo.tokenizer import tokenizer_json

    cfg = _config(arch)
    if sentencepiece:
        spm, scores, _ = llama_tokenizer()
        cfg.vocab_size = spm.get_vocab_size()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # routers and correction biases away from ties, so top-k picks the same experts
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    rng = np.random.default_rng(seed)
    experts = {}
    for layer, (gt, ut, dt) in types.items():
        mod = model.model.layers[layer].mlp.experts
        e, two_i, h = mod.gate_up_proj.shape
        i = two_i // 2
        blocks = [np.stack([random_blocks(t, rows, k, rng) for _ in range(e)])
                  for t, rows, k in ((gt, i, h), (ut, i, h), (dt, h, i))]
        deq = [torch.from_numpy(gguf.quants.dequantize(b, gguf.GGMLQuantizationType[t])).float()
               for b, t in zip(blocks, (gt, ut, dt), strict=True)]
        with torch.no_grad():
            mod.gate_up_proj.copy_(torch.cat([deq[0], deq[1]], dim=1))
            mod.down_proj.copy_(deq[2])
        experts[layer] = list(zip((gt, ut, dt), blocks, strict=True))
    directory.mkdir(parents=True, exist_ok=True)
    tok_path = directory / "tokenizer.json"
    tok_path.write_text(spm.to_str() if sentencepiece else tokenizer_json(VOCAB), encoding="utf-8")
    path = directory / f"tiny-{arch}.gguf"
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    _metadata(w, arch, cfg)
    if sentencepiece:
        write_llama_vocab(w, spm, scores)
    else:
        _vocab(gguf, w, tok_path)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[{"qwen2moe": "QWEN2MOE", "deepseek2": "DEEPSEEK2", "llama": "LLAMA"}[arch]],
                               cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        t = t.float()
        if name.endswith("e_score_correction_bias"):  # as convert_hf_to_gguf.py renames it
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if name.endswith("kv_b_proj.weight"):  # llama.cpp splits MLA's kv_b into k_b [heads, rank, nope], v_b
            heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
            kv = t.view(heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
            prefix = names.get_name(name, try_suffixes=(".weight",)).rsplit(".", 2)[0]
            w.add_tensor(f"{prefix}.attn_k_b.weight", kv[:, :nope].transpose(1, 2).contiguous().numpy())
            w.add_tensor(f"{prefix}.attn_v_b.weight", kv[:, nope:].contiguous().numpy())
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        w.add_tensor(new, t.contiguous().numpy())
    for layer, projs in experts.items():
        for proj, (t, blocks) in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), projs, strict=True):
            w.add_tensor(f"blk.{layer}.{proj}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return model, sorted(directory.glob(f"tiny-{arch}-*-of-*.gguf"))[0]
    return model, path


def _metadata(w, arch: str, cfg) -> None:
    """The architecture's keys as llama.cpp's converter writes them."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen2moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    elif arch == "llama":
        w.add_expert_count(cfg.num_local_experts)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    else:  # deepseek2, as DeepSeek-V3 is written: MLA sizes in their "_mla" keys, the MQA form in the plain ones
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_gating_func(gguf_sigmoid())
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def gguf_sigmoid():
    import gguf

    return gguf.ExpertGatingFuncType.SIGMOID
