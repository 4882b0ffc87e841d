"""DeepSeek-V4's compressors: every m source tokens pooled into one compressed KV entry (transformers'
`DeepseekV4HCACompressor` / `DeepseekV4CSACompressor`, and the indexer's own compressor).

Each source token is projected to a value `kv` and a gate (`kv_proj`, `gate_proj`); entry w is the per-channel
softmax (over source slots, fp32, with a learned bias per position in the window) weighted sum of the values,
RMS-normed and rotated at position w*m with the "compress" rotary:

    HCA (overlap=False): slots = window w's m tokens                               width = dim
    CSA (overlap=True):  slots = window w-1's first half (Ca) ++ window w's second half (Cb), 2m slots
                         (window 0 has no predecessor: its Ca slots weigh 0)         width = 2 * dim

Entries depend on source positions only, so a sequence's entries are the same whether its prompt ran in one pass
or in chunks: a chunk completes the windows ending inside it, reading the earlier part of those windows (and, for
CSA, the window before) from the source ring the cache keeps per slot.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.runtime.model.deepseek_v4.cache import CompressedState
from strata.runtime.model.deepseek_v4.norms import FloatRMSNorm
from strata.runtime.model.deepseek_v4.rope import InterleavedRope, rotate
from strata.runtime.model.layers import project

ENTRY_STEP = 512  # entries are read in spans of whole steps: few distinct matrix shapes (see `entry_span`)


def entry_span(count: int, capacity: int) -> int:
    """How many of a slot's entries to read when `count` are complete: `count` rounded up to `ENTRY_STEP` (at most
    the `capacity`). The rest are masked like entries a query may not see yet; reading whole steps keeps the
    products' shapes to a few (each new shape of a bf16 product on the CPU keeps a oneDNN primitive, hundreds of MB
    over a long prompt whose entry count grows every chunk)."""
    return min(capacity, -(-count // ENTRY_STEP) * ENTRY_STEP)


class Compressor(nn.Module):
    """Pools `rate` source tokens of width `dim` (x2 with `overlap`) into entries [dim]; parameters as transformers'."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = FloatRMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (kv, gate) [N, width]: every source token's projections."""
        return project(self.kv_proj, x), project(self.gate_proj, x)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first: int, rope: InterleavedRope) -> torch.Tensor:
        """Entries of consecutive windows from their sources: kv, gate [n * m + lead, width] (lead = m earlier rows
        with `overlap`, the window before the first, or none when the first window is window 0), first window
        index `first` -> entries [n, dim]."""
        m, d = self.rate, self.dim
        lead = m if self.overlap and first > 0 else 0
        n = (kv.shape[0] - lead) // m
        if n <= 0:
            return kv.new_zeros((0, d))
        # the bias belongs to a row's position in its window (rows are window-aligned); gate + fp32 bias -> fp32
        g = (gate.view(-1, m, gate.shape[-1]) + self.position_bias).reshape(gate.shape)
        if not self.overlap:
            win_kv = kv.view(n, m, d)
            weights = g.view(n, m, d).softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        else:
            cur_kv, cur_g = kv[lead:].view(n, m, 2 * d), g[lead:].view(n, m, 2 * d)
            win_kv = kv.new_zeros((n, 2 * m, d))
            win_g = g.new_full((n, 2 * m, d), float("-inf"))
            win_kv[:, m:] = cur_kv[..., d:]  # Cb: this window's second half
            win_g[:, m:] = cur_g[..., d:]
            prev_kv = torch.cat([kv[:lead].view(-1, m, 2 * d), cur_kv[:-1]]) if lead else cur_kv[:-1]
            prev_g = torch.cat([g[:lead].view(-1, m, 2 * d), cur_g[:-1]]) if lead else cur_g[:-1]
            skip = 0 if lead else 1  # window 0 has no Ca
            win_kv[skip:, :m] = prev_kv[..., :d]
            win_g[skip:, :m] = prev_g[..., :d]
            weights = win_g.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.kv_norm((win_kv * weights).sum(dim=1))  # [n, d]
        positions = (torch.arange(n, device=kv.device) + first) * m
        cos, sin = rope(positions, pooled.dtype)
        return rotate(pooled[:, None, :], cos, sin)[:, 0]

    def update(self, state: CompressedState, slot: int, start: int, kv: torch.Tensor, gate: torch.Tensor,
               rope: InterleavedRope) -> int:
        """A chunk of one sequence: its L new tokens' kv, gate [L, width] at positions start.. -> the windows they
        complete written to `state.entries[slot]`, the source ring brought to position start + L. Returns the
        number of entries the sequence has now ((start + L) // m)."""
        m, ring, n_new = self.rate, state.ring, kv.shape[0]
        end = start + n_new
        first, last = start // m, end // m  # windows [first, last) complete in this chunk
        if last > first:
            lo = first * m - (m if self.overlap and first > 0 else 0)  # the first source position they read
            old = torch.arange(lo, start, device=kv.device) % ring
            src_kv = torch.cat([state.src_kv[slot, old], kv]) if start > lo else kv
            src_g = torch.cat([state.src_gate[slot, old], gate]) if start > lo else gate
            src_kv, src_g = src_kv[: last * m - lo], src_g[: last * m - lo]
            state.entries[slot, first:last] = self.pool(src_kv, src_g, first, rope)
        keep = min(n_new, ring)
        dst = torch.arange(end - keep, end, device=kv.device) % ring
        state.src_kv[slot, dst] = kv[n_new - keep :]
        state.src_gate[slot, dst] = gate[n_new - keep :]
        return last
