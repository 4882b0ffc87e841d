"""Kimi's tiktoken tokenizer read from its files, never run: ids and text as tiktoken itself gives them with the
same ranks, pattern and special tokens; the equivalent tokenizer.json the vocabulary readers take; one-line errors
naming a missing or malformed file."""

from __future__ import annotations

import pytest
from kimi_models import CORPUS, KIMI_PAT_STR, NOT_SPECIAL, oracle_encoding, write_kimi_tokenizer

from strata.errors import CheckpointError
from strata.runtime.generation.text import tiktoken_vocab
from strata.runtime.generation.text.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

TEXTS = [
    CORPUS,
    "The model's tokens: they'll merge, it's said. 1234567 + 89 = 1234656",
    "模型读取文本，文本很好。混合 text 与中文 42",
    "tabs\tand\r\nnewlines\n\n\n   trailing spaces   ",
    "emoji 🙂🚀 and accents: café, naïve, Ωμέγα",
    "[BOS]<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "a <|reserved_token_400|> in text, and a <|tool_call_begin|> too",  # (400: a reserved id, base + 104)
    "",
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi-tok")
    ranks, specials = write_kimi_tokenizer(d)
    return d, oracle_encoding(ranks, specials), len(ranks)


def test_encodes_and_decodes_as_tiktoken(kimi_dir):
    d, enc, base = kimi_dir
    tok = Tokenizer.from_dir(d)
    assert base == 256 + 40 and tok.vocab_size == base + 258  # 256 bytes + 40 merges; the class's 258 special ids
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == enc.encode(text, allowed_special="all"), text
        assert tok.decode(ids) == enc.decode(ids) == text
    assert tok.encode("plain words", add_special_tokens=True) == enc.encode("plain words")  # nothing added around
    mixed = tok.encode(TEXTS[5] + TEXTS[6])  # named, reserved and one non-special added token
    assert tok.decode(mixed, skip_special_tokens=True) == enc.decode([i for i in mixed if i < base or i - base in NOT_SPECIAL])
    assert tok.bos_token_id == base and tok.eos_token_ids == {base + 1} and tok.pad_token_id == base + 257
    assert tok.token_to_id("<|im_end|>") == base + 2 and tok.id_to_token(base + 2) == "<|im_end|>"
    assert tok.token_to_id("<|reserved_token_400|>") == 400 and base + 7 not in tok.special_token_ids
    assert tok.id_to_token(ord("A")) == "A" and tok.id_to_token(ord(" ")) == "Ġ"  # the byte-level alphabet
    assert not tok.add_bos_token


def test_stream_decoding_and_chat_template(kimi_dir):
    d, enc, _ = kimi_dir
    tok = Tokenizer.from_dir(d)
    ids = tok.encode(TEXTS[2] + TEXTS[4])
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == TEXTS[2] + TEXTS[4]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert tok.encode(prompt) == enc.encode(prompt, allowed_special="all")


def test_equivalent_tokenizer_json(kimi_dir):
    """What xgrammar and the token bound read: a tokenizer.json that the tokenizers library loads and that
    encodes plain text as tiktoken does; the bound never exceeds the true count."""
    from tokenizers import Tokenizer as HFTokenizer

    d, enc, _ = kimi_dir
    tok = Tokenizer.from_dir(d)
    hf = HFTokenizer.from_str(tok.backend_json())
    for text in TEXTS[:5]:
        assert hf.encode(text, add_special_tokens=False).ids == enc.encode(text), text
    bound = tok.token_bound
    assert bound is not None and all(0 < bound.at_least(t) <= len(tok.encode(t)) for t in TEXTS[:5])


def test_long_runs_are_cut_where_kimi_cuts_them(kimi_dir, monkeypatch):
    """A run of non-whitespace longer than the class allows is encoded in pieces (shrunk here from 25K to 40)."""
    d, enc, _ = kimi_dir
    monkeypatch.setattr(tiktoken_vocab, "MAX_RUN_CHARS", 40)
    tok = Tokenizer.from_dir(d)
    text = "ode" * 30 + " tail"  # cut inside an "ode" (one token unless cut)
    want = enc.encode(text[:40]) + enc.encode(text[40:80]) + enc.encode(text[80:])
    assert tok.encode(text) == want != enc.encode(text)


def test_the_module_pattern_is_read_not_run(tmp_path):
    """The module's pat_str is used as written (a different one changes the ids); the module is never executed
    (its first statement would exit); without the module, Kimi K2's pattern."""
    ranks, specials = write_kimi_tokenizer(tmp_path / "a")
    source = (tmp_path / "a" / "tokenization_kimi.py").read_text()
    assert "SystemExit" in source
    digits = KIMI_PAT_STR.replace(r"\p{N}{1,3}", r"\p{N}")
    (tmp_path / "a" / "tokenization_kimi.py").write_text(source.replace(r'r"""\p{N}{1,3}""",', r'r"""\p{N}""",'))
    text = "numbers 12345 and 2026"
    got = Tokenizer.from_dir(tmp_path / "a").encode(text)
    import tiktoken

    assert got == tiktoken.Encoding("d", pat_str=digits, mergeable_ranks=ranks, special_tokens=specials).encode(text)
    write_kimi_tokenizer(tmp_path / "b", module=False)
    assert Tokenizer.from_dir(tmp_path / "b").encode(text) == oracle_encoding(ranks, specials).encode(text)


def test_missing_or_malformed_files_are_one_line_errors(tmp_path):
    write_kimi_tokenizer(tmp_path / "no-ranks")
    (tmp_path / "no-ranks" / "tiktoken.model").unlink()
    with pytest.raises(CheckpointError, match=r"tiktoken\.model \(its vocabulary\) is missing") as e:
        load_tokenizer(tmp_path / "no-ranks")
    assert "\n" not in str(e.value)
    write_kimi_tokenizer(tmp_path / "bad")
    with open(tmp_path / "bad" / "tiktoken.model", "a") as f:
        f.write("not-base64!! 7\n")
    with pytest.raises(CheckpointError, match=r"tiktoken\.model:\d+: not a `base64-token rank` line"):
        Tokenizer.from_dir(tmp_path / "bad")
    write_kimi_tokenizer(tmp_path / "no-pattern")
    (tmp_path / "no-pattern" / "tokenization_kimi.py").write_text("PAT = compute()\n")
    with pytest.raises(CheckpointError, match=r"tokenization_kimi\.py: no pat_str"):
        Tokenizer.from_dir(tmp_path / "no-pattern")
