"""The demo model's Engram layers: config.json section per size, tensor specs, the normalisation table.

Checkpoint names (documented in docs/engram.md), for each Engram layer L:

    model.layers.L.engram.multi_head_embedding.embedding.weight   [sum_k M_k, head_dim]  the table (all heads)
    model.layers.L.engram.key_proj.{weight,bias}                  [H, E], [H]           E = heads * head_dim
    model.layers.L.engram.value_proj.{weight,bias}                [H, E], [H]
    model.layers.L.engram.norm1.weight, norm2.weight               [H]   key / query RMSNorm
    model.layers.L.engram.short_conv.norm.weight                   [H]
    model.layers.L.engram.short_conv.conv.weight                   [H, 1, kernel_size]
    model.engram.token_map                                         [vocab] F32 holding integer ids (exact < 2^24)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from strata.runtime.model.engram.hashing import EngramConfig, build_token_map

ENGRAM_KINDS: tuple[str, ...] = (
    "engram.multi_head_embedding.embedding.weight", "engram.key_proj.weight", "engram.key_proj.bias",
    "engram.value_proj.weight", "engram.value_proj.bias", "engram.norm1.weight", "engram.norm2.weight",
    "engram.short_conv.norm.weight", "engram.short_conv.conv.weight", "model.engram.token_map",
)  # fmt: skip

# per size: (layer ids, heads per order, row width per order, base table size per order)
_SIZES = {
    "tiny": ([1], 2, 16, [1000, 1000]),
    "small": ([1, 5], 4, 128, [50_000, 50_000]),
    "bench": ([1, 24], 8, 512, [100_000, 100_000]),  # ~0.4 GB: the model stays ~61 GB
}


@contextlib.contextmanager
def demo_tables(size: str, rows_per_order: int) -> Iterator[None]:
    """Inside the block, the `size` demo model's Engram tables have `rows_per_order` base rows per n-gram
    order (benchmarks enlarge them well past the row cache before `write_demo_model`)."""
    saved = _SIZES[size]
    _SIZES[size] = (saved[0], saved[1], saved[2], [rows_per_order] * len(saved[3]))
    try:
        yield
    finally:
        _SIZES[size] = saved


def _tokenizer_vocab(vocab_size: int) -> int:
    """The demo tokenizer's trained size for a demo vocab_size (demo_model.TOKENIZER_VOCAB)."""
    return min(vocab_size, 8192)


@functools.cache
def demo_token_map(tokenizer_vocab: int, vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: the demo tokenizer's ids through the reference normaliser."""
    from strata.runtime.demo.tokenizer import build_tokenizer

    return build_token_map(build_tokenizer(tokenizer_vocab), vocab_size)


def demo_engram_config(size: str, num_layers: int, vocab_size: int, pad_id: int) -> dict:
    """config.json's `engram` section for a demo size (layers past `num_layers` dropped)."""
    layers, heads, width, base = _SIZES[size]
    cvocab = int(demo_token_map(_tokenizer_vocab(vocab_size), vocab_size).max()) + 1
    cfg = EngramConfig(layer_ids=[i for i in layers if i < num_layers] or [num_layers - 1], engram_vocab_size=base,
                       compressed_vocab_size=cvocab, pad_id=pad_id, max_ngram_size=3, n_head_per_ngram=heads,
                       n_embed_per_ngram=width, seed=0, kernel_size=4)
    return cfg.to_dict()


def engram_specs(cfg: dict, spec_cls) -> list:
    """TensorSpecs of the Engram tensors of a demo config.json dict (`spec_cls` is demo_weights.TensorSpec)."""
    ecfg = EngramConfig(**cfg["engram"])
    tok_vocab = _tokenizer_vocab(cfg["vocab_size"])
    h, e = cfg["hidden_size"], ecfg.embed_dim
    out = [spec_cls("model.engram.token_map", (cfg["vocab_size"],), dtype="F32", init=f"token_map:{tok_vocab}")]
    for layer in ecfg.layer_ids:
        p = f"model.layers.{layer}.engram."
        out += [
            spec_cls(p + "multi_head_embedding.embedding.weight", (ecfg.table_rows(layer), ecfg.head_dim)),
            spec_cls(p + "key_proj.weight", (h, e)), spec_cls(p + "key_proj.bias", (h,)),
            spec_cls(p + "value_proj.weight", (h, e)), spec_cls(p + "value_proj.bias", (h,)),
            spec_cls(p + "norm1.weight", (h,), init="ones"), spec_cls(p + "norm2.weight", (h,), init="ones"),
            spec_cls(p + "short_conv.norm.weight", (h,), init="ones"),
            spec_cls(p + "short_conv.conv.weight", (h, 1, ecfg.kernel_size)),
        ]  # fmt: skip
    return out
