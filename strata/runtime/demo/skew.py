"""Routing popularity that lives in a demo checkpoint's weights (`strata demo-model --route-skew S`).

Why: random weights do not route uniformly. Through the layers the residual stream of a random
model grows a component shared by all tokens, so deeper routers see nearly the same input for every
token and collapse onto a few experts (on a 6-layer, 128-expert Qwen3-MoE demo, layer 5 sends 99% of
lookups to a quarter of its experts, layer 0 only 39%). That is neither the uniform worst case nor a
controlled skew. `--route-skew` replaces it with a stated popularity profile:

- `uniform`: every expert equally likely at every layer (the worst case for an expert cache);
- S > 0: the expert of popularity rank r gets a routing bias of `-beta * sigma * S * ln(r)`, where
  sigma is the spread of the token-dependent part of the router logit and beta = sqrt(6)/pi turns
  that Gaussian spread into the Gumbel scale of the same width, so the top-1 choice falls off about
  as rank^-S (top-k flattens the head). S = 1 puts about 92% of a 128-expert, top-8 layer's lookups
  on its 40% most popular experts (real models: about 9 in 10 lookups with 38% of experts on the GPU),
  the same at every depth. Each layer ranks its experts by its own permutation.

How (both architectures): one hidden coordinate c, the skew channel, carries a constant `alpha` in
every embedding row, `SKEW_RATIO` times the norm of the rest of the row, so it dominates every
RMSNorm and is present at every token and layer. No layer reads it (column c of each projection that
reads the residual stream is zero) or writes it (row c of o_proj/down_proj is zero), so it crosses
the residual stream unchanged; each router's column c holds the profile. The token-dependent rest
of the stream is small after each RMSNorm (about 1/SKEW_RATIO), which keeps the layers near-linear
and the router's spread the same at every depth; the final norm's weight (SKEW_RATIO) restores
next-token logits of the usual size. DeepSeek-V3 also gets `kv_a_layernorm` = 1/SKEW_RATIO (its
latent norm would otherwise re-amplify the values) and a zero `e_score_correction_bias` (it would
outweigh the small router logits). Because it is all in the weights, every engine running the
checkpoint (transformers included) routes the same way; compute cost is unchanged.

Temporal locality (`--route-locality L`, Qwen3-MoE checkpoints with a skew channel): consecutive tokens of a
real text pick overlapping experts more often than popularity alone explains. Layer 0's first KV group becomes a
recency head: its queries and keys read only the skew channel (constant at every token) into a few rotary
pairs, so after q/k RMSNorm and RoPE its score depends on the distance alone, about sqrt(head_dim) x the mean of
cos(theta_p x distance), largest for the current token: it averages the values of the last tens of tokens
(`RouteSkew.recency_window` is the effective count). Its o_proj columns scale that running mean to `L` times the
token part of the stream, so every router sees the token (weight 1) plus its recent context (weight L); the
routers' profile column grows by sqrt(1 + L^2) so the popularity profile keeps its calibration.

S = 0 (the default) leaves every tensor untouched: the bytes of an unskewed write.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from strata.errors import ConfigError

MAX_SKEW = 4.0  # beyond this one expert per layer takes nearly every token
UNIFORM = "uniform"  # --route-skew uniform: the skew channel with a flat profile
SKEW_RATIO = 512.0  # |skew channel| / |token part of an embedding row|
GUMBEL = math.sqrt(6.0) / math.pi  # Gaussian std -> Gumbel scale of the same spread
MAX_LOCALITY = 4.0  # context weight beyond which a token's own part hardly routes
RECENCY_THETAS = (0.04, 0.025, 0.016)  # rotary frequencies the recency head uses (the nearest the model has)
RECENCY_REFERENCE = 128  # tokens over which `recency_window` counts (the suite's prompt)

# Projections that read the residual stream (through a norm): their column c is zeroed.
_READERS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_a_proj.weight", "kv_a_proj_with_mqa.weight",
            "gate_proj.weight", "up_proj.weight", "lm_head.weight")
# Layer 0's projections that make the recency head (--route-locality).
_RECENCY = ("q_proj.weight", "k_proj.weight", "o_proj.weight")
# Projections that write the residual stream: their row c is zeroed.
_WRITERS = ("o_proj.weight", "down_proj.weight")


def check_skew(value: float | str) -> float | str:
    """Validate a `--route-skew` value: a number in [0, MAX_SKEW] (as float) or "uniform"."""
    given = value
    if isinstance(value, str):
        if value.strip().lower() == UNIFORM:
            return UNIFORM
        try:
            value = float(value)
        except ValueError:
            value = None  # type: ignore[assignment]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_SKEW:
        raise ConfigError(f"--route-skew {given!r} is invalid; use a number in [0, {MAX_SKEW:g}] "
                          f"(0: the plain random weights, 1: typical skew) or \"uniform\"")
    return float(value)


def check_locality(value: float | str) -> float:
    """Validate a `--route-locality` value: a number in [0, MAX_LOCALITY]."""
    given = value
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(given, bool) or not 0 <= value <= MAX_LOCALITY:
        raise ConfigError(f"--route-locality {given!r} is invalid; use a number in [0, {MAX_LOCALITY:g}] "
                          f"(0: none, 1: the recent context weighs as much as the token)")
    return value


def expert_ranks(seed: int, layer: int, num_experts: int) -> torch.Tensor:
    """Popularity rank (1 = most popular) of each expert of `layer`: int64 [E], a per-layer permutation."""
    g = torch.Generator().manual_seed(zlib.crc32(f"strata-skew:{seed}:{layer}".encode()))
    order = torch.randperm(num_experts, generator=g)  # order[r] = expert of rank r + 1
    ranks = torch.empty(num_experts, dtype=torch.long)
    ranks[order] = torch.arange(1, num_experts + 1)
    return ranks


@dataclass(frozen=True)
class RouteSkew:
    """The routing profile of one demo config: `apply(name, tensor)` edits a freshly generated tensor."""

    strength: float  # S; 0 with the channel installed = uniform routing
    seed: int
    model_type: str
    hidden_size: int
    num_experts: int
    std: float  # initializer_range: the std of every random weight
    locality: float = 0.0  # L: weight of the recent context against the token in every router's input
    attention: tuple[int, int, int, float] = (0, 0, 0, 0.0)  # heads, kv heads, head_dim, rope_theta (locality)

    @classmethod
    def for_config(cls, cfg: dict, route_skew: float | str, seed: int, locality: float = 0.0) -> RouteSkew:
        """The profile for a demo config.json dict, a `--route-skew` value (S > 0 or "uniform") and a
        `--route-locality` value (0: none)."""
        value, locality = check_skew(route_skew), check_locality(locality)
        if value == 0:
            raise ValueError("route_skew 0 means the plain random weights: no RouteSkew to apply")
        if locality and (cfg["model_type"] != "qwen3_moe" or cfg.get("num_key_value_heads") is None):
            raise ConfigError(f"--route-locality is written for Qwen3-MoE checkpoints (the bench size); the "
                              f"{cfg['model_type']} demo model has none: leave it at 0")
        experts = cfg.get("num_experts") or cfg["n_routed_experts"]
        attention = (cfg.get("num_attention_heads", 0), cfg.get("num_key_value_heads") or 0,
                     cfg.get("head_dim") or 0, float(cfg.get("rope_theta", 0.0)))
        return cls(0.0 if value == UNIFORM else float(value), seed, cfg["model_type"], cfg["hidden_size"], experts,
                   float(cfg["initializer_range"]), locality, attention)

    @property
    def recency_pairs(self) -> list[int]:
        """Rotary pairs (index i of (i, i + head_dim/2)) the recency head's queries and keys use."""
        _, _, hd, base = self.attention
        theta = base ** (-2 * torch.arange(hd // 2, dtype=torch.float64) / hd)
        return sorted({int((theta - t).abs().argmin()) for t in RECENCY_THETAS})

    def recency_weights(self, length: int = RECENCY_REFERENCE) -> torch.Tensor:
        """The recency head's attention over the last `length` tokens, fp64 [length] (distance 0 first): its
        score is sqrt(head_dim) x the mean over its pairs of cos(theta x distance) (unit q/k norms, 1/sqrt(hd))."""
        _, _, hd, base = self.attention
        pairs = torch.tensor(self.recency_pairs)
        theta = base ** (-2 * pairs.double() / hd)
        dist = torch.arange(length, dtype=torch.float64)[:, None]
        return torch.softmax(math.sqrt(hd) * torch.cos(theta * dist).mean(1), 0)

    @property
    def recency_window(self) -> float:
        """Effective number of recent tokens the recency head averages, (sum w)^2 / sum w^2 over
        `RECENCY_REFERENCE` tokens."""
        w = self.recency_weights()
        return float(1.0 / (w * w).sum())

    def _recency_gain(self) -> float:
        """o_proj gain that makes the recency head's output `locality` x the stream's token part. The token part
        after the input norm has std ~1/SKEW_RATIO a coordinate; v = W_v x has std std*sqrt(H)/SKEW_RATIO; the
        head's average over ~`recency_window` tokens divides that by sqrt(window); the group's identical heads
        through o_proj multiply it by std*sqrt(group * head_dim); the embedding's token part has std `std`."""
        heads, kv, hd, _ = self.attention
        group = heads // kv
        out_std = self.std * math.sqrt(group * hd) * self.std * math.sqrt(self.hidden_size) / SKEW_RATIO
        return self.locality * self.std / (out_std / math.sqrt(self.recency_window))

    @property
    def channel(self) -> int:
        """The hidden coordinate that carries the skew, fixed by the seed."""
        return zlib.crc32(f"strata-skew-channel:{self.seed}".encode()) % self.hidden_size

    @property
    def alpha(self) -> float:
        """The skew channel's value in every embedding row: SKEW_RATIO x the rest of the row's norm."""
        return SKEW_RATIO * self.std * math.sqrt(self.hidden_size - 1)

    def profile(self, layer: int) -> torch.Tensor:
        """-ln(rank) of each expert of `layer`: fp32 [E], 0 for the favourite, negative for the rest."""
        return -torch.log(expert_ranks(self.seed, layer, self.num_experts).float())

    def apply(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Put the profile into tensor `name` (in place; a no-op for tensors it does not touch); returns `t`."""
        c = self.channel
        if ".engram." in name:  # Engram adds value rows to the stream: keep them off the channel
            if name.endswith(("value_proj.weight", "key_proj.weight")):  # [H, E]
                t[c, :] = 0
            elif name.endswith(("value_proj.bias", "key_proj.bias")):
                t[c] = 0
        elif name == "model.embed_tokens.weight":
            t[:, c] = self.alpha
        elif name == "model.norm.weight":
            t.fill_(SKEW_RATIO)  # the final norm's output: token part back to unit RMS
        elif name.endswith("kv_a_layernorm.weight"):
            t.fill_(1.0 / SKEW_RATIO)  # DeepSeek's latent norm would re-amplify keys and values
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            t.zero_()  # a selection bias would outweigh the small router logits
        elif name.endswith("mlp.gate.weight"):  # router [E, H]
            # logit_e = column_c[e] * sqrt(H) + a token-dependent part of std `std * sqrt(H) / SKEW_RATIO`
            # (x sqrt(1 + L^2) with the recent context added to the token)
            spread = math.sqrt(1.0 + self.locality ** 2)
            t[:, c] = GUMBEL * self.std * self.strength * spread * self.profile(_layer(name)) / SKEW_RATIO
        elif self.locality and name.startswith("model.layers.0.self_attn.") and name.endswith(_RECENCY):
            self._recency(name, t)
        elif name.endswith(_WRITERS):
            t[c, :] = 0
        elif name.endswith(_READERS):
            t[:, c] = 0
        return t

    def _recency(self, name: str, t: torch.Tensor) -> None:
        """Layer 0's first KV group as the recency head (module docstring): its q_proj, k_proj or o_proj."""
        heads, kv, hd, _ = self.attention
        group, pairs = heads // kv, torch.tensor(self.recency_pairs)
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # [heads * hd, H], [kv * hd, H]
            rows = group * hd if name.endswith("q_proj.weight") else hd
            t[:, self.channel] = 0  # the other heads stay off the channel (_READERS)
            t[:rows] = 0
            for h in range(rows // hd):  # only the channel, into the first half of each chosen rotary pair
                t[h * hd + pairs, self.channel] = 1.0
        else:  # [H, heads * hd]: the group's columns carry the running mean
            t[self.channel, :] = 0  # (_WRITERS)
            t[:, : group * hd] = (t[:, : group * hd].float() * self._recency_gain()).to(t.dtype)


def _layer(name: str) -> int:
    return int(name.split(".")[2])  # model.layers.L....


__all__ = ["MAX_LOCALITY", "MAX_SKEW", "RouteSkew", "SKEW_RATIO", "UNIFORM", "check_locality", "check_skew",
           "expert_ranks"]
