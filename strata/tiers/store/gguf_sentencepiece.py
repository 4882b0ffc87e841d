"""llama.cpp's "llama" tokenizer model (SentencePiece BPE, as Llama-2, Mistral and Mixtral files carry it) built into
the tokenizer.json their Hugging Face checkpoints ship (LlamaTokenizerFast): a BPE with byte fallback over the file's
`tokens`, normalizer Prepend("▁") + Replace(" ", "▁"), decoder Replace("▁", " ") + ByteFallback + Fuse + Strip, and a
post-processor adding BOS (and EOS) as `add_bos_token` / `add_eos_token` say.

llama.cpp writes a SentencePiece model's pieces and scores but no merges; the merges are then derived from them as
transformers derives them (`generate_merges`): every split of a piece into two pieces of the vocabulary, ranked by the
piece's score.
"""

from __future__ import annotations

from strata.errors import CheckpointError, UnsupportedError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "▁"  # SentencePiece's whitespace mark (U+2581)


def derived_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first: each piece's splits into two pieces of the
    vocabulary (in the order of their ids), ranked by the piece's score, higher first; equal scores keep the longer
    left part first, then the longer right part (transformers' `generate_merges` with the scores)."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        splits.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        merges.extend((left, right, score) for left, right in splits)
    # one sort, reversed and stable: equal keys keep the order above, as transformers' does
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _special_id(fields: dict, key: str, tokens: list[str], where: str) -> int | None:
    i = fields.get(f"tokenizer.ggml.{key}_token_id")
    if i is None:
        return None
    if not 0 <= int(i) < len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.{key}_token_id {int(i)} is outside the {len(tokens)} tokens; "
                              "the file is malformed, convert it again")
    return int(i)


def sentencepiece_tokenizer_json(fields: dict, where: str) -> str:
    """tokenizer.json of a GGUF's `tokenizer.ggml.model == "llama"` metadata `fields`; a one-line error for metadata
    this rebuild does not cover."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"]]
    types = [int(t) for t in fields.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if len(types) != len(tokens) or not set(types) <= {NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE}:
        raise UnsupportedError(f"{where}: tokenizer.ggml.token_type holds {len(types)} types of 1..6 for {len(tokens)} "
                               "tokens; put the model's tokenizer.json beside a converted store")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre != "default" or "tokenizer.ggml.precompiled_charsmap" in fields:
        raise UnsupportedError(f"{where}: a SentencePiece GGUF tokenizer with pre-tokenizer {pre!r} or a precompiled "
                               "normalizer is not one strata rebuilds; put the model's tokenizer.json beside a converted "
                               "store")
    if "tokenizer.ggml.merges" in fields:
        merges = [tuple(str(m).split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in fields:
        scores = [float(s) for s in fields["tokenizer.ggml.scores"]]
        if len(scores) != len(tokens):
            raise CheckpointError(f"{where}: tokenizer.ggml.scores holds {len(scores)} scores for {len(tokens)} tokens; "
                                  "the file is malformed, convert it again")
        merges = derived_merges(tokens, scores)
    else:
        raise UnsupportedError(f"{where}: the SentencePiece GGUF tokenizer has neither merges nor scores to rank them; "
                               "put the model's tokenizer.json beside a converted store")
    unk = _special_id(fields, "unknown", tokens, where)
    if unk is None and UNKNOWN in types:
        unk = types.index(UNKNOWN)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=None if unk is None
                               else tokens[unk], fuse_unk=True, byte_fallback=True, ignore_merges=False))
    # a "▁" before the text (unless add_space_prefix is false) and after each special token, even before a leading
    # space, as SentencePiece and llama.cpp encode: Llama's and Mistral's tokenizer.json normalizer, not the Metaspace
    # pre-tokenizer transformers builds from a GGUF, which adds none before a leading space
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE)] * prefix + [normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + [decoders.Strip(" ", 1, 0)] * prefix)
    special = [i for i, t in enumerate(types) if t in (UNKNOWN, CONTROL)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == USER_DEFINED])
    if (post := _post_processor(fields, tokens, where, processors)) is not None:
        tok.post_processor = post
    return tok.to_str()


def _post_processor(fields: dict, tokens: list[str], where: str, processors):
    """BOS before (llama.cpp's default for SentencePiece) and EOS after each sequence, as the file says; None when
    neither is added."""
    ends = {}  # "bos" / "eos" -> the id of the token added
    for key, default in (("bos", True), ("eos", False)):
        if not bool(fields.get(f"tokenizer.ggml.add_{key}_token", default)):
            continue
        if (i := _special_id(fields, key, tokens, where)) is None:
            raise CheckpointError(f"{where}: tokenizer.ggml.add_{key}_token is set but the file names no "
                                  f"tokenizer.ggml.{key}_token_id; the file is malformed, convert it again")
        ends[key] = i
    if not ends:
        return None

    def sequence(name: str, type_id: int) -> str:
        return " ".join(([f"{tokens[ends['bos']]}:{type_id}"] if "bos" in ends else []) + [f"${name}:{type_id}"]
                        + ([f"{tokens[ends['eos']]}:{type_id}"] if "eos" in ends else []))

    return processors.TemplateProcessing(single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
                                         special_tokens=[(tokens[i], i) for i in dict.fromkeys(ends.values())])
