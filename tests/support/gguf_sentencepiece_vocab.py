"""A small SentencePiece-style Hugging Face tokenizer (the tokenizer.json form of Llama-2 / Mistral / Mixtral: a BPE
with byte fallback, normalizer Prepend("▁") + Replace(" ", "▁"), decoder Replace + ByteFallback + Fuse + Strip,
BOS added by the post-processor), trained offline by `tokenizers`, and its vocabulary written into a GGUF as
llama.cpp's convert_hf_to_gguf.py writes a SentencePiece vocabulary (`tokenizer.ggml.model` "llama").

The vocabulary is laid out as a SentencePiece BPE model's: <unk> <s> </s>, the 256 byte pieces <0x00>..<0xFF>, the
merged pieces in the order they were learned, then the single characters; a piece's score is minus its rank, bytes and
control pieces score 0. llama.cpp's sentencepiece path writes those pieces and scores and no merges
(`with_merges=False`); its tokenizer.json path (LlamaHfVocab with the merges loaded) writes score -1000 for every
token, the special tokens as control tokens and the merges (`with_merges=True`).
"""

from __future__ import annotations

import json
import random

SPECIALS = ("<unk>", "<s>", "</s>")
_WORDS = (
    "the quick brown fox jumps over lazy dog and then runs into forest where tall trees grow near river banks "
    "tokenizer model weights expert router layer attention cache memory store tier disk pinned prefill decode "
    "München Straße Grüße über schön Äpfel Öl Übung naïve café résumé déjà vu garçon façade crème brûlée "
    "Ελλάδα καλημέρα φίλε Москва привет мир данные 東京 日本語 中文 데이터 ñandú señor año niño "
    "hello world Hello World HELLO 2024 3.14159 42 1000000 0x1F #include <stdio.h> def main(): return x + y;"
).split()
_PUNCT = (".", ",", "!", "?", ":", ";", "-", "(", ")", "\"", "'", "/", "=")


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    """Lines of varied text: words of several scripts, digits, punctuation, leading and repeated spaces, tabs."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(_PUNCT))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        sep = "  " if rng.random() < 0.15 else " "
        lead = " " * rng.choice((0, 0, 0, 1, 2, 4))
        out.append(lead + sep.join(words) + ("\t" if rng.random() < 0.05 else ""))
    return out


def llama_tokenizer(vocab_size: int = 700, add_bos: bool = True, add_eos: bool = False):
    """(tokenizer, scores, merges): the SentencePiece-style `tokenizers.Tokenizer` trained on `corpus()`, its pieces'
    scores (by id) and its learned merges ("a b")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    legacy = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = legacy
    # pieces start at a "▁" and never cross one, as SentencePiece's split_by_whitespace keeps them
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    learner.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                                              show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    chars = sorted((t for t in learned["vocab"] if len(t) == 1), key=learned["vocab"].get)
    pieces = list(dict.fromkeys(a + b for a, b in merges)) + [c for c in chars if c not in SPECIALS]
    tokens = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(rank) for rank in range(len(pieces))]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = legacy
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    ends = (["<s>"] if add_bos else [], ["</s>"] if add_eos else [])
    single = " ".join([*(f"{t}:0" for t in ends[0]), "$A:0", *(f"{t}:0" for t in ends[1])])
    pair = " ".join([single, *(f"{t}:1" for t in ends[0]), "$B:1", *(f"{t}:1" for t in ends[1])])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok, scores, [f"{a} {b}" for a, b in merges]


def write_llama_vocab(w, tok, scores: list[float], merges: list[str] | None = None, add_bos: bool = True,
                      add_eos: bool = False) -> None:
    """`tok`'s vocabulary into GGUFWriter `w` as llama.cpp writes a SentencePiece one: pieces, scores and types
    (unknown, control, byte, normal) with bos/eos/unk ids; with `merges`, as its tokenizer.json path writes it."""
    import gguf

    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [gguf.TokenType.BYTE if t.startswith("<0x") and len(t) == 6 else gguf.TokenType.NORMAL for t in tokens]
    types[:3] = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    if merges is not None:
        scores = [-1000.0] * len(tokens)
        types[0] = gguf.TokenType.CONTROL
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
