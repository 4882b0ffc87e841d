"""A plain, all-in-memory Engram (after DeepSeek's reference demo, one residual stream): the semantics
strata's Engram layers must reproduce. Whole sequences at once, numpy hashing, nn.Conv1d; no state."""

from __future__ import annotations

import math

import numpy as np
import torch
from sympy import isprime
from torch import nn


def _next_prime(start: int, seen: set[int]) -> int:
    c = start + 1
    while not (isprime(c) and c not in seen):
        c += 1
    return c


def table_sizes(cfg: dict) -> dict[int, list[int]]:
    """Per layer the primes of every (order, head), distinct across layers (order 2's heads first)."""
    seen: set[int] = set()
    out = {}
    for layer in cfg["layer_ids"]:
        sizes = []
        for base in cfg["engram_vocab_size"]:
            start = base - 1
            for _ in range(cfg["n_head_per_ngram"]):
                p = _next_prime(start, seen)
                seen.add(p)
                sizes.append(p)
                start = p
        out[layer] = sizes
    return out


def hash_ids(cfg: dict, token_map: np.ndarray, ids: np.ndarray, layer: int) -> np.ndarray:
    """[T, heads] row ids (with head offsets) of one whole sequence `ids` [T]."""
    x = token_map[np.asarray(ids, dtype=np.int64)][None, :]  # [1, T] compressed
    pad = int(token_map[cfg["pad_id"]])
    n_max = cfg["max_ngram_size"]
    max_long = np.iinfo(np.int64).max
    half = max(1, int(max_long // cfg["compressed_vocab_size"]) // 2)
    mult = np.random.default_rng(int(cfg["seed"] + 10007 * layer)).integers(0, half, size=(n_max,), dtype=np.int64) * 2 + 1
    t = x.shape[1]
    shifts = [x if k == 0 else np.pad(x, ((0, 0), (k, 0)), constant_values=pad)[:, :t] for k in range(n_max)]
    sizes = table_sizes(cfg)[layer]
    out, h = [], 0
    for n in range(2, n_max + 1):
        mix = shifts[0] * mult[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, shifts[k] * mult[k])
        for _ in range(cfg["n_head_per_ngram"]):
            out.append(mix % sizes[h])
            h += 1
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return (np.stack(out, axis=2) + offsets)[0]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def engram_output(cfg: dict, token_map: np.ndarray, ids: list[int], hidden: torch.Tensor, layer: int,
                  w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The Engram output [T, H] of one whole sequence for hidden states `hidden` [T, H].

    `w`: the layer's tensors by checkpoint suffix (multi_head_embedding.embedding.weight, key_proj.weight...)."""
    eps, hsz = cfg["norm_eps"], hidden.shape[-1]
    rows = torch.from_numpy(hash_ids(cfg, token_map, np.asarray(ids), layer))
    emb = w["multi_head_embedding.embedding.weight"][rows].flatten(1).to(hidden.dtype)  # [T, E]
    key = _rms(emb @ w["key_proj.weight"].t() + w["key_proj.bias"], w["norm1.weight"], eps)
    query = _rms(hidden, w["norm2.weight"], eps)
    gate = (key * query).sum(-1) / math.sqrt(hsz)
    gate = (gate.abs().clamp_min(1e-6).sqrt() * gate.sign()).sigmoid().unsqueeze(-1)
    value = gate * (emb @ w["value_proj.weight"].t() + w["value_proj.bias"])  # [T, H]
    k = cfg["kernel_size"]
    conv = nn.Conv1d(hsz, hsz, k, groups=hsz, bias=False, padding=(k - 1) * cfg["max_ngram_size"],
                     dilation=cfg["max_ngram_size"]).to(hidden.dtype)
    conv.weight.data.copy_(w["short_conv.conv.weight"])
    y = conv(_rms(value, w["short_conv.norm.weight"], eps).t()[None])[..., : value.shape[0]]
    return value + torch.nn.functional.silu(y[0].t())
