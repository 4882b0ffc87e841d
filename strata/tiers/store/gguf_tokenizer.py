"""A GGUF file's tokenizer (`tokenizer.ggml.*`) built into a `tokenizers` tokenizer.json, with its chat template.

llama.cpp's "gpt2" model is a byte-level BPE: `tokens` (ids by position), `merges` ("a b"), `token_type` (control
tokens are special added tokens, user-defined ones plain added tokens) and `pre`, the name of the pre-tokenizer's
split regex. Its "llama" model (SentencePiece) is rebuilt by strata.tiers.store.gguf_sentencepiece. The result encodes
as the Hugging Face tokenizer the file was converted from.
"""

from __future__ import annotations

import json
from pathlib import Path

from strata.errors import UnsupportedError
from strata.tiers.store.gguf_sentencepiece import sentencepiece_tokenizer_json

_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's `tokenizer.ggml.pre` -> the split regex its Hugging Face tokenizer runs before byte-level BPE
# (None: ByteLevel's own GPT-2 regex)
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {"gpt-2": None, "default": None, "qwen2": _QWEN2, "llama-bpe": _LLAMA3,
                                         "llama3": _LLAMA3}


def tokenizer_json(fields: dict, where: str) -> str:
    """tokenizer.json of the GGUF metadata `fields`; one-line `UnsupportedError` for a model or pre-tokenizer strata
    cannot rebuild."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = fields.get("tokenizer.ggml.model")
    if model == "llama":
        return sentencepiece_tokenizer_json(fields, where)
    if model != "gpt2":
        raise UnsupportedError(f"{where}: GGUF tokenizer model {model!r} is not one strata rebuilds (gpt2, llama); put "
                               "the model's tokenizer.json beside a converted store")
    pre = str(fields.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedError(f"{where}: GGUF pre-tokenizer {pre!r} is not one strata rebuilds "
                               f"({', '.join(PRE_TOKENIZERS)}); put the model's tokenizer.json beside a converted store")
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"]]
    types = [int(t) for t in fields.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [tuple(str(m).split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    added = {i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)}
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    regex = PRE_TOKENIZERS[pre]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False) for i in sorted(added)])
    return tok.to_str()


def write_tokenizer_files(f, directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, chat template) of GGUFFile `f` into `directory`."""
    fields = f.fields
    if "tokenizer.ggml.tokens" not in fields:
        return
    (directory / "tokenizer.json").write_text(tokenizer_json(fields, str(f.path)), encoding="utf-8")
    tokens = fields["tokenizer.ggml.tokens"]
    conf: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, what in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        i = fields.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            conf[what] = str(tokens[int(i)])
    for key in ("add_bos_token", "add_eos_token"):  # as the file says; tokenizer.json's post-processor adds them
        if (add := fields.get(f"tokenizer.ggml.{key}")) is not None:
            conf[key] = bool(add)
    if (template := fields.get("tokenizer.chat_template")) is not None:
        conf["chat_template"] = str(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(conf, indent=2), encoding="utf-8")
