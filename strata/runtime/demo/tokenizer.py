"""The demo models' tokenizer: a small byte-level BPE trained on English text.

The random-weight sizes train it on the shipped `data/demo_corpus.txt`: that takes a fraction of a
second, so no tokenizer file is shipped for them; `tokenizer_json` caches the result per vocabulary size
for the life of the process. The trained `demo` model ships its own tokenizer.json, trained the same way
(`train_tokenizer_json`) on its own corpus by strata.runtime.demo.train. The `tokenizers` BPE trainer is
deterministic (merges are ranked by count, ties broken by the pair), so the same corpus and vocab size
give a byte-identical tokenizer.json in every process.

Ids are fixed by construction: the three special tokens come first (the trainer puts its
`special_tokens` at ids 0..2), the 256 byte symbols and the learned merges follow, and `<think>` /
`</think>` are appended last as ordinary (non-special) added tokens, so they survive
`skip_special_tokens=True` decoding exactly like Qwen3's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from strata.errors import ConfigError

CORPUS_PATH = Path(__file__).parent / "data" / "demo_corpus.txt"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
SPECIAL_IDS: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
THINK_TOKENS: tuple[str, ...] = ("<think>", "</think>")  # regular added tokens, the last two ids
BYTE_ALPHABET = 256
MIN_VOCAB = len(SPECIAL_TOKENS) + BYTE_ALPHABET + len(THINK_TOKENS)

# ChatML, as Qwen and many others ship it: one `<|im_start|>role\ncontent<|im_end|>\n` per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render `CHAT_TEMPLATE` by hand (no jinja): what `apply_chat_template` must produce."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


@functools.cache
def tokenizer_json(vocab_size: int) -> str:
    """Train the demo BPE with `vocab_size` tokens in all on the shipped corpus (cached) and return its tokenizer.json.

    The result can be a little smaller than `vocab_size` if the corpus runs out of merges.
    """
    return train_tokenizer_json([CORPUS_PATH], vocab_size)


def train_tokenizer_json(corpus_files: list[Path], vocab_size: int) -> str:
    """Train the demo byte-level BPE on `corpus_files` (plain UTF-8 text) and return its tokenizer.json text.

    Deterministic: the same files and vocab size give the same text. The special tokens take ids 0..2 and
    `<think>`/`</think>` the last two ids, whatever the corpus.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ConfigError(f"demo tokenizer vocab_size {vocab_size!r} is too small; use at least {MIN_VOCAB}")
    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level BPE: every string is encodable, every id sequence decodes back to bytes.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),  # leave room for <think>, </think>
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tok.train([str(f) for f in corpus_files], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    for name, want in SPECIAL_IDS.items():  # the config's eos/bos ids rely on this
        assert tok.token_to_id(name) == want, (name, tok.token_to_id(name))
    return tok.to_str(pretty=True)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A fresh `tokenizers.Tokenizer` for the demo vocabulary (training is cached)."""
    return Tokenizer.from_str(tokenizer_json(vocab_size))


def tokenizer_size(vocab_size: int) -> int:
    """Number of ids the trained demo tokenizer really has (added tokens included)."""
    return build_tokenizer(vocab_size).get_vocab_size(with_added_tokens=True)


def write_tokenizer_files(out_dir: Path, vocab_size: int, model_max_length: int, text: str | None = None
                          ) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out_dir`.

    `text`: the tokenizer.json to write (None: the demo BPE of `vocab_size` tokens on the shipped corpus).
    Returns the ids of the special and think tokens, e.g. {"<|im_end|>": 2, "<think>": 510, ...}.
    """
    text = tokenizer_json(vocab_size) if text is None else text
    tok = Tokenizer.from_str(text)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + THINK_TOKENS}
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + THINK_TOKENS
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,  # ChatML prompts start with <|im_start|>, not a BOS
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return ids
