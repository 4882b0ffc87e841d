"""Tiny GGUF files for the tests: a transformers model with random weights whose routed experts are replaced by random
valid ggml blocks, written as llama.cpp writes the architecture (names, metadata keys, a gpt2 BPE vocabulary), and the
same model with those experts dequantized by `gguf` — the oracle strata's GGUF reading is checked against."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf_blocks_random import random_blocks

VOCAB = 300  # the demo tokenizer trained to this size (byte-level BPE, three special tokens)


def _qwen3_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=256,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05,
                          tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=None,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_qwen3_gguf(directory: Path, types: list[tuple[str, str, str]], seed: int = 0):
    """(transformers model in fp32, GGUF path) of a tiny Qwen3-MoE whose layer L's gate / up / down experts are in
    `types[L]`; the model holds those experts dequantized."""
    import gguf
    from transformers import AutoModelForCausalLM

    from strata.runtime.demo.tokenizer import tokenizer_json

    cfg = _qwen3_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    rng = np.random.default_rng(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    experts = {}
    for layer, (gt, ut, dt) in enumerate(types):
        blocks = [np.stack([random_blocks(t, rows, k, rng) for _ in range(e)])
                  for t, rows, k in ((gt, i, h), (ut, i, h), (dt, h, i))]
        deq = [torch.from_numpy(gguf.quants.dequantize(b, gguf.GGMLQuantizationType[t])).float()
               for b, t in zip(blocks, (gt, ut, dt), strict=True)]
        mod = model.model.layers[layer].mlp.experts
        with torch.no_grad():
            mod.gate_up_proj.copy_(torch.cat([deq[0], deq[1]], dim=1))
            mod.down_proj.copy_(deq[2])
        experts[layer] = list(zip((gt, ut, dt), blocks, strict=True))
    directory.mkdir(parents=True, exist_ok=True)
    tok_path = directory / "tokenizer.json"
    tok_path.write_text(tokenizer_json(VOCAB), encoding="utf-8")
    path = directory / "tiny-qwen3moe.gguf"
    _write(gguf, path, model, cfg, experts, tok_path)
    return model, path


def _write(gguf, path: Path, model, cfg, experts: dict, tok_path: Path) -> None:
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    _vocab(gguf, w, tok_path)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3MOE, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        w.add_tensor(new, t.float().contiguous().numpy())
    for layer, projs in experts.items():
        for proj, (t, blocks) in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), projs, strict=True):
            w.add_tensor(f"blk.{layer}.{proj}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _vocab(gguf, w, tok_path: Path) -> None:
    """The tokenizer as llama.cpp's gpt2 vocabulary (tokens, types, merges, special ids) and ChatML's template."""
    from strata.runtime.demo.tokenizer import CHAT_TEMPLATE

    d = json.loads(tok_path.read_text(encoding="utf-8"))
    by_id = {i: t for t, i in d["model"]["vocab"].items()}
    added = {a["id"]: a for a in d["added_tokens"]}
    by_id.update({i: a["content"] for i, a in added.items()})
    n = max(by_id) + 1
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([by_id[i] for i in range(n)])
    w.add_token_types([(3 if added[i]["special"] else 4) if i in added else 1 for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]])
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
