"""Kimi K2 / K2.5 releases in miniature, built offline: a tiktoken tokenizer as Kimi ships one (tiktoken.model,
tokenizer_config.json, tokenization_kimi.py) and a kimi_k2 / kimi_k25 checkpoint around a tiny DeepSeek-V3 built
with transformers' own class (the oracle).

The ranks are a byte-level BPE trained here on a short text (tiktoken's file format: one base64 token and its rank
per line). The module's source carries Kimi K2's pat_str and a statement that fails if the module is ever run.
"""

from __future__ import annotations

import base64
import collections
import json
from pathlib import Path

import torch

# Kimi K2's split pattern, as tokenization_kimi.py spells it
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])  # fmt: skip
RESERVED = 256
CORPUS = ("In the beginning the model read the text, and the text was good. The tokens merged, the tokens split; "
          "numbers 12345 and 2026 went by three digits. 模型读取文本，文本很好。 It's the model's tokenizer: "
          "they'll say it's fine.\n\n    Indented code(x) == 42;\n")
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 5: "<|im_system|>",
         6: "<|im_middle|>", 7: "<|tool_call_begin|>", RESERVED - 1: "[UNK]", RESERVED + 1: "[PAD]"}
NOT_SPECIAL = {7}  # listed with "special": false (skip_special_tokens keeps it)
MODULE_SOURCE = '''
raise SystemExit("tokenization_kimi.py was executed; strata must only read it")


class TikTokenTokenizer:
    num_reserved_special_tokens = {reserved}

    pat_str = "|".join(
        [
{patterns}
        ]
    )
'''.format(reserved=RESERVED, patterns="\n".join(f'            r"""{p}""",' for p in KIMI_PAT_STR.split("|")))


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then `merges` merges of the commonest adjacent pair within words."""
    import regex

    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in regex.findall(KIMI_PAT_STR, text, flags=regex.V1)]  # (V1: &&)
    while len(ranks) < 256 + merges:
        pairs = collections.Counter((a, b) for w in words for a, b in zip(w, w[1:], strict=False))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.setdefault(a + b, len(ranks))  # (a token two merges both make keeps its first rank)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i : i + 2] = [a + b]
                i += 1
    return ranks


def write_kimi_tokenizer(directory: Path, merges: int = 40, module: bool = True) -> tuple[dict[bytes, int], dict[str, int]]:
    """Write tiktoken.model, tokenizer_config.json (and tokenization_kimi.py) into `directory`; returns (ranks,
    special tokens {content: id}) for the oracle, tiktoken.Encoding(pat_str=KIMI_PAT_STR, ...)."""
    directory.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks(CORPUS, merges)
    with open(directory / "tiktoken.model", "w") as f:
        for token, rank in ranks.items():
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    base = len(ranks)
    added = {str(base + k): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": k not in NOT_SPECIAL} for k, name in NAMED.items()}
    config = {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
              "added_tokens_decoder": added, "model_max_length": 1048576,
              "chat_template": "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
                               "{{ m['content'] }}<|im_end|>{% endfor %}"
                               "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if module:
        (directory / "tokenization_kimi.py").write_text(MODULE_SOURCE)
    specials = {f"<|reserved_token_{i}|>": i for i in range(base, base + RESERVED + 2)}
    specials = {**{k: v for k, v in specials.items() if v - base not in NAMED}, **{n: base + k for k, n in NAMED.items()}}
    return ranks, specials


def oracle_encoding(ranks: dict[bytes, int], specials: dict[str, int]):
    """tiktoken's own Encoding of those files, as Kimi's class builds it."""
    import tiktoken

    return tiktoken.Encoding("kimi-test", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def build_kimi(directory: Path, nested: bool, seed: int = 0, *, fused: bool = False, long: bool = False):
    """A kimi_k2 checkpoint (config.json in Kimi K2's spelling: rope_scaling/rope_theta, scoring_func, topk_method)
    or, `nested`, a kimi_k25 one (that config under text_config beside a vision_config; the language model's tensors
    under `language_model.`, beside a vision tower's and a projector's), with Kimi's tokenizer files. Experts are
    saved per expert, as Kimi ships them, or `fused` 3-D (`save_original_format=False`); `long` gives a context of
    4,096 positions (YaRN's factor 8 over 512) for prompts past 2,048 tokens. Returns (transformers' DeepSeek-V3 of
    the same weights in fp32 eval mode, directory)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0 if long else 4.0,
            "original_max_position_embeddings": 512, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(vocab_size=640, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, max_position_embeddings=4096 if long else 2048, initializer_range=0.1,
                           rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                           tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=24,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                           first_k_dense_replace=1, routed_scaling_factor=2.827, kv_lora_rank=24, q_lora_rank=32,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, norm_topk_prob=True,
                           rope_parameters=yarn)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    model.save_pretrained(directory, save_original_format=not fused)
    _, specials = write_kimi_tokenizer(directory)
    text = json.loads((directory / "config.json").read_text())
    rope = text.pop("rope_parameters")
    text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], rope_theta=rope.pop("rope_theta"),
                rope_scaling={"type": rope.pop("rope_type"), **rope}, scoring_func="sigmoid", topk_method="noaux_tc",
                moe_layer_freq=1, num_nextn_predict_layers=0, bos_token_id=specials["[BOS]"],
                eos_token_id=specials["[EOS]"])
    if not nested:
        (directory / "config.json").write_text(json.dumps(text))
        return model, directory
    top = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "bos_token_id": specials["[BOS]"], "eos_token_id": specials["[EOS]"], "pad_token_id": specials["[PAD]"],
           "tie_word_embeddings": False, "text_config": text,
           "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 32, "patch_size": 14}}
    (directory / "config.json").write_text(json.dumps(top))
    weights = directory / "model.safetensors"
    tensors = {f"language_model.{name}": t for name, t in load_file(weights).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 14, 14)
    tensors["mm_projector.proj.0.weight"] = torch.randn(64, 128)
    save_file(tensors, weights)
    return model, directory
