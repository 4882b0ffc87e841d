"""Tiny random gpt-oss checkpoints built offline with transformers' own `GptOssForCausalLM`.

Layers alternate sliding-window and full attention (transformers' default layer_types), q/k/v/o carry biases, YaRN is
on as the release configures it, and what transformers initialises to zeros (the expert biases) or small values (the
sinks, the router's bias) is drawn at random, so a wrong formula anywhere changes the logits. `swiglu_limit` is small
enough that the clamp engages. The expert width differs from the hidden size, so a transposed tensor cannot pass for
the other orientation.

`mxfp4_variant` writes the same model as the release ships its experts: MXFP4 `*_blocks` / `*_scales` under the
release's names (quantized by strata.kernels.quant's quantizer), with `quantization_config` {"quant_method": "mxfp4"};
`oracle` loads it into transformers, which dequantizes the blocks itself: the model of the very weights they decode
to.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from reference_models import VOCAB, read_tensors, require_transformers, write_tokenizer
from strata.kernels.quant import MX_GROUP, quantize_mxfp4


def gpt_oss_config(long: bool = False, layers: int = 4, vocab: int = VOCAB):
    """transformers' GptOssConfig of the tiny model; `long`: a 64-token window (2,100 tokens cross it many times)."""
    from transformers import GptOssConfig

    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096 if not long else 256}
    return GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=64 if long else 12, max_position_embeddings=8192, initializer_range=0.1, rms_norm_eps=1e-5,
        rope_parameters=yarn, swiglu_limit=1.5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )


def build_gpt_oss(directory: Path, *, long: bool = False, seed: int = 0, layers: int = 4, vocab: int = VOCAB):
    """Create, save (transformers' bf16-style layout, in fp32) and return (GptOssForCausalLM fp32 eval, directory)."""
    require_transformers("5.25", "gpt-oss (its SwiGLU clamp and alpha from the config)")
    from transformers import AutoModelForCausalLM

    cfg = gpt_oss_config(long, layers, vocab)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(("sinks", "_bias", "router.bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith("layernorm.weight") or name == "model.norm.weight":
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.1)
    model.save_pretrained(directory)
    if vocab == VOCAB:
        write_tokenizer(directory)
    return model, directory


def _copy_small_files(src: Path, dst: Path, quantization: dict | None) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization is not None:
        cfg["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(cfg))


def mxfp4_variant(src: Path, dst: Path) -> Path:
    """Write `dst`: checkpoint `src` with its experts as the release ships them. transformers' gate_up_proj [E, H, 2I]
    and down_proj [E, I, H] become `gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32] (and down's),
    each output row quantized by `quantize_mxfp4`."""
    out = {}
    for name, t in read_tensors(src).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            rows = t.transpose(1, 2).float()  # [E, N, K]: the release's orientation
            parts = [quantize_mxfp4(m) for m in rows]
            e, n, k = rows.shape
            out[name + "_blocks"] = torch.stack([q for q, _ in parts]).reshape(e, n, k // MX_GROUP, MX_GROUP // 2)
            out[name + "_scales"] = torch.stack([s for _, s in parts])
        else:
            out[name] = t
    _copy_small_files(src, dst, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    save_file(out, dst / "model.safetensors")
    return dst


def oracle(directory: Path, dtype: torch.dtype = torch.float32):
    """transformers' GptOssForCausalLM of checkpoint `directory` (eager attention, eval mode): an MXFP4 one's experts
    dequantized by transformers' own MXFP4 loader (`Mxfp4Config(dequantize=True)`) from the release's names."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    mxfp4 = "quantization_config" in json.loads((directory / "config.json").read_text())
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager", **extra).eval()


# harmony's special tokens (o200k_harmony's), each one id after the 256 byte tokens
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>")
HARMONY_VOCAB = 256 + len(HARMONY_SPECIALS)
# A harmony chat template in the shape of gpt-oss's shipped chat_template.jinja (abridged: the system message, the
# developer message with the instructions and the tools as a TypeScript namespace, then each message in its channel:
# a reply in `final`, reasoning (`thinking`) in `analysis`, a call in `commentary to=functions.NAME` with a json
# constraint ending in <|call|>, a tool's result from `functions.NAME to=assistant`).
HARMONY_TEMPLATE = (
    "{%- set ns = namespace(last_call='') -%}"
    "{%- if not reasoning_effort is defined %}{%- set reasoning_effort = 'medium' %}{%- endif -%}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{%- endif %}<|end|>"
    "{%- set first = messages[0] if messages else none -%}"
    "{%- set instructions = first.content if first and first.role in ['system', 'developer'] else none -%}"
    "{%- if instructions or tools %}<|start|>developer<|message|>"
    "{%- if instructions %}# Instructions\n\n{{ instructions }}{% if tools %}\n\n{% endif %}{% endif %}"
    "{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{%- for tool in tools %}{% set f = tool.function if tool.function else tool %}"
    "{% if f.description %}// {{ f.description }}\n{% endif %}"
    "type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;\n\n{% endfor %}} // namespace functions"
    "{%- endif %}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}{% set f = tc.function if tc.function else tc %}"
    "{%- set ns.last_call = f.name %}<|start|>assistant<|channel|>commentary to=functions.{{ f.name }} "
    "<|constrain|>json<|message|>{{ f.arguments if f.arguments is string else f.arguments | tojson }}<|call|>"
    "{%- endfor %}"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.last_call }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")


def write_harmony_tokenizer(directory: Path) -> dict[str, int]:
    """A byte-level tokenizer (one token a byte: any text encodes) with harmony's special tokens, gpt-oss's stop tokens
    (<|return|>, <|call|>) in generation_config.json and the harmony template as chat_template.jinja, as the release
    ships it. Returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(HARMONY_SPECIALS))
    tok.save(str(directory / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in HARMONY_SPECIALS}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>"}))
    (directory / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|startoftext|>"], "eos_token_id": [ids["<|return|>"], ids["<|call|>"]],
        "pad_token_id": ids["<|endoftext|>"]}))
    (directory / "chat_template.jinja").write_text(HARMONY_TEMPLATE, encoding="utf-8")
    return ids
