"""The token-count lower bound known without tokenizing: never above what encoding gives, on adversarial texts,
for the tokenizer families it claims (byte-level BPE, byte-fallback BPE with normalizers); none for the rest."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from strata.runtime.generation.text.token_bound import token_bound

CORPUS = ["the experts of a mixture route every token", "hello world " * 3, "ﬁne café Ωmega 한국어 ｆｕｌｌ",
          "<|im_start|>user\nhi<|im_end|>", "aaaaaaaaaaaaaaaa bbbbbbbb"] * 20


def _byte_level(normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def _byte_fallback() -> Tokenizer:
    """SentencePiece-style (Llama, Mixtral): "▁" for spaces, byte tokens for what the vocabulary lacks."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for word in ("▁", "▁the", "▁th", "h", "e", "x", "p", "r", "t", "s", "▁t", "aaaaaaaa", "a"):
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [("▁", "t"), ("▁t", "h"), ("▁th", "e")], byte_fallback=True, fuse_unk=True,
                               unk_token=None))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tok


def _adversarial(tok: Tokenizer) -> list[str]:
    vocab = tok.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    rng = random.Random(0)
    # the longest token in full-width letters: 3 bytes a letter that NFKC folds back to 1
    wide = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in longest)
    texts = [longest * 50, wide * 50, "<|im_start|>" * 40, "e\u0301" * 300, "\u1100\u1161\u11a8" * 200, "ｆ" * 300,
             " " * 1000, "\n\t " * 200, "Ω" * 100, "ﬁ" * 200, "aaaaaaaa" * 100, "the experts " * 50,
             "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(2000)),
             "".join(rng.choice(list(vocab)) for _ in range(500))]
    return texts


@pytest.mark.parametrize("make", [_byte_level, lambda: _byte_level(normalizers.NFC()),
                                  lambda: _byte_level(normalizers.NFKC()), _byte_fallback],
                         ids=["byte-level", "byte-level-nfc", "byte-level-nfkc", "byte-fallback"])
def test_bound_never_exceeds_the_real_count(make):
    tok = make()
    bound = token_bound(json.loads(tok.to_str()))
    assert bound is not None
    for text in _adversarial(tok):
        real = len(tok.encode(text, add_special_tokens=False).ids)
        assert bound.at_least(text) <= real, (text[:40], bound.at_least(text), real)
    # and it is a useful bound: a text of many long tokens is known to be long
    assert bound.at_least("x" * 100_000) >= 100_000 // bound.max_bytes_per_token


def test_the_demo_tokenizer_has_a_bound(tiny_model_dir):
    from strata.runtime.generation.text.tokenizer import Tokenizer as StrataTokenizer

    tok = StrataTokenizer.from_dir(tiny_model_dir)
    bound = tok.token_bound
    assert bound is not None and bound.max_bytes_per_token >= len("<|im_start|>")
    for text in ("hello " * 500, "<|im_start|>" * 100, "Z" * 3000):
        assert bound.at_least(text) <= len(tok.encode(text, add_special_tokens=False))


def _no_bound_cases() -> list[tuple[str, Tokenizer]]:
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    whitespace = _byte_level()
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # drops every space
    stripping = _byte_level()
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # swallows the spaces before it
    truncating = _byte_level()
    truncating.enable_truncation(16)
    lowercase = _byte_level(normalizers.Lowercase())
    no_fallback = _byte_fallback()
    spec = json.loads(no_fallback.to_str())
    spec["model"]["byte_fallback"] = False  # unknown characters fused into one unknown token, or dropped
    return [("wordpiece", wordpiece), ("whitespace", whitespace), ("lstrip", stripping), ("truncation", truncating),
            ("lowercase", lowercase), ("no-fallback", Tokenizer.from_str(json.dumps(spec)))]


def test_no_bound_where_a_token_can_cover_unbounded_text():
    for name, tok in _no_bound_cases():
        assert token_bound(json.loads(tok.to_str())) is None, name
