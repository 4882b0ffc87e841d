"""A GGUF's SentencePiece ("llama") tokenizer rebuilt from its metadata against the Hugging Face tokenizer it was
written from (tests/support/gguf_sentencepiece_vocab.py): identical ids on varied text (leading, trailing and repeated
spaces, newlines, characters the vocabulary lacks so byte fallback runs, special tokens in the text), identical
decoding, BOS / EOS as the file says; the merges derived from pieces and scores as transformers derives them."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

gguf = pytest.importorskip("gguf")

from gguf_sentencepiece_vocab import corpus, llama_tokenizer, write_llama_vocab  # noqa: E402

from strata.errors import UnsupportedError  # noqa: E402
from strata.tiers.store.gguf_sentencepiece import derived_merges  # noqa: E402
from strata.tiers.store.gguf_tokenizer import tokenizer_json, write_tokenizer_files  # noqa: E402

TEXTS = [
    "", " ", "   ", "a", "Hello world", " hello", "hello ", "  two  leading, two  inner and trailing  ",
    "line one\nline two\n\nafter a blank line\n", "\n", "tab\tseparated\tvalues", "\r\nwindows line",
    "München Straße, café, naïve résumé", "Ελλάδα καλημέρα, привет мир", "東京 日本語 中文 데이터",
    "unseen: 🙂🎉 ☃ Ω ∑ ก ﬁ", "emoji only 🙂", "Zürich Ångström Ærø", "3.14159 + 2024 = 1000000 0x1F",
    "#include <stdio.h>\nint main(void) { return 0; }", "<s>a BOS in the text</s> and <unk>", "▁already▁marked",
    "\u00a0no-break\u00a0space", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "the the the  the   the",
]


def _fields(tmp_path, tok, scores, merges=None, **flags) -> dict:
    """The metadata of a GGUF holding `tok`'s vocabulary, as `gguf` reads it back."""
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    write_llama_vocab(w, tok, scores, merges, **flags)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {key: f.contents() for key, f in gguf.GGUFReader(path).fields.items()}


def _texts() -> list[str]:
    return TEXTS + corpus(150, seed=11)


def _assert_same(original, rebuilt) -> None:
    differ = [t for t in _texts() if rebuilt.encode(t).ids != original.encode(t).ids]
    assert not differ, f"{len(differ)} texts encode differently, first {differ[0]!r}"
    for t in _texts():
        ids = original.encode(t).ids
        assert rebuilt.decode(ids) == original.decode(ids)
        assert rebuilt.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)
        pair = original.encode(t, "and a second")
        assert rebuilt.encode(t, "and a second").ids == pair.ids


@pytest.fixture(scope="module")
def spm():
    return llama_tokenizer()


def test_pieces_and_scores_without_merges(spm, tmp_path):
    from tokenizers import Tokenizer

    tok, scores, _ = spm
    fields = _fields(tmp_path, tok, scores)
    assert "tokenizer.ggml.merges" not in fields
    rebuilt = Tokenizer.from_str(tokenizer_json(fields, "vocab.gguf"))
    _assert_same(tok, rebuilt)
    ids = tok.encode("unseen: 🙂 and\nnewline").ids
    assert ids[0] == 1 and any(3 <= i < 259 for i in ids)  # BOS; byte pieces for what the vocabulary lacks
    assert rebuilt.decode(ids) == "unseen: 🙂 and\nnewline"
    del fields["tokenizer.ggml.add_bos_token"]  # absent: llama.cpp adds BOS to a SentencePiece vocabulary
    assert Tokenizer.from_str(tokenizer_json(fields, "vocab.gguf")).encode("x").ids[0] == 1


def test_merges_in_the_file(spm, tmp_path):
    from tokenizers import Tokenizer

    tok, scores, merges = spm
    fields = _fields(tmp_path, tok, scores, merges)
    assert len(fields["tokenizer.ggml.merges"]) == len(merges) and set(fields["tokenizer.ggml.scores"]) == {-1000.0}
    _assert_same(tok, Tokenizer.from_str(tokenizer_json(fields, "vocab.gguf")))


def test_the_derived_merges_are_transformers(spm):
    from transformers.tokenization_utils_base import generate_merges

    tok, scores, _ = spm
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    tied = [float(random.Random(0).choice((0, -1, -2))) for _ in tokens]  # ties: the order among equals matters
    for s in (scores, tied):
        want = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, s, strict=True)))
        assert derived_merges(tokens, s) == want


@pytest.mark.parametrize(("add_bos", "add_eos"), [(False, False), (False, True), (True, True)])
def test_bos_and_eos_as_the_file_says(tmp_path, add_bos, add_eos):
    from tokenizers import Tokenizer

    tok, scores, _ = llama_tokenizer(add_bos=add_bos, add_eos=add_eos)
    fields = _fields(tmp_path, tok, scores, add_bos=add_bos, add_eos=add_eos)
    rebuilt = Tokenizer.from_str(tokenizer_json(fields, "vocab.gguf"))
    _assert_same(tok, rebuilt)
    assert (rebuilt.encode("x").ids[0] == 1) == add_bos and (rebuilt.encode("x").ids[-1] == 2) == add_eos


def test_without_the_space_prefix(spm, tmp_path):
    from tokenizers import Tokenizer

    tok, scores, _ = spm
    fields = _fields(tmp_path, tok, scores)
    fields["tokenizer.ggml.add_space_prefix"] = False
    rebuilt = Tokenizer.from_str(tokenizer_json(fields, "vocab.gguf"))
    plain = [t for t in _texts() if t and "<s>" not in t]  # the original puts a "▁" after a special token too
    for t in plain:  # no "▁" put before the text: a leading space gives the one the original adds
        assert rebuilt.encode(" " + t).ids == tok.encode(t).ids


def test_the_files_written_for_the_store(spm, tmp_path):
    from strata.runtime.generation.text.tokenizer import Tokenizer

    tok, scores, _ = spm
    fields = _fields(tmp_path, tok, scores)
    fields["tokenizer.chat_template"] = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    write_tokenizer_files(SimpleNamespace(fields=fields, path=tmp_path / "vocab.gguf"), tmp_path)
    conf = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert {k: conf[k] for k in ("bos_token", "eos_token", "unk_token", "add_bos_token", "add_eos_token")} == {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    assert conf["chat_template"] == fields["tokenizer.chat_template"]
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.add_bos_token and loaded.bos_token_id == 1 and loaded.eos_token_ids == {2}
    for t in _texts():
        assert loaded.encode(t) == tok.encode(t).ids
        assert loaded.decode(tok.encode(t).ids, skip_special_tokens=True) == tok.decode(tok.encode(t).ids)
    prompt = loaded.apply_chat_template([{"role": "user", "content": "Grüße 🙂"}])
    assert loaded.encode(prompt) == tok.encode(prompt).ids


def test_what_is_not_rebuilt_is_a_one_line_error(spm, tmp_path):
    tok, scores, _ = spm
    fields = _fields(tmp_path, tok, scores)
    cases = [({"tokenizer.ggml.model": "rwkv"}, "GGUF tokenizer model 'rwkv' is not one strata rebuilds"),
             ({"tokenizer.ggml.model": "bert"}, "GGUF tokenizer model 'bert' is not one strata rebuilds"),
             ({"tokenizer.ggml.scores": None}, "neither merges nor scores"),
             ({"tokenizer.ggml.token_type": [7] * len(scores)}, "token_type holds"),
             ({"tokenizer.ggml.pre": "llama3"}, "pre-tokenizer 'llama3'"),
             ({"tokenizer.ggml.precompiled_charsmap": b"\0"}, "precompiled normalizer")]
    for change, message in cases:
        changed = {k: v for k, v in {**fields, **change}.items() if v is not None}
        with pytest.raises(UnsupportedError, match=message) as e:
            tokenizer_json(changed, "vocab.gguf")
        assert "\n" not in str(e.value) and "tokenizer.json" in str(e.value)
