"""Engram decode steps computed entirely on the device, so a CUDA graph can hold them.

When every Engram layer's table is readable by the compute device in place (`RowSource.device_table`:
the table in VRAM, pinned RAM or tmpfs through its device mapping, or the in-memory reference
tables), a decode step needs no host work at all: from the step's token ids [B], cache slots [B] and
positions [B] (all device tensors of a `DecodeBatch`) it

    records each token in the device history      tokens[slot, pos] = id
    builds the n-grams                             column j = compressed id of the token j back (pad before the start)
    hashes them per layer                          the same `NgramHasher.rows` arithmetic, on device tensors
    gathers the rows                               table[row ids] -> [B, heads, head_dim], inside the layer
    maps the convolution's taps and ring slots     from the positions alone

Everything is a fixed-shape tensor op, so `DecodeGraphs` captures it with the rest of the step. Host
work for the row statistics (`count_direct`) happens before the replay. Tables on disk, behind the host
row cache, are served the same way through a handshake (`HandshakeEngramStep`): the step hashes on the
device, posts the row ids to the host's serving thread before layer 0 and waits on the device for each
Engram layer's answer (strata.tiers.rows.handshake). Prefill chunks, and decode without a handshake,
take `EngramRuntime.begin`'s host path instead; a CUDA graph of such a step reads its inputs from the
buffers of a `StaticEngramStep` (strata.runtime.model.engram.static), which the host refills before each replay.
"""

from __future__ import annotations

import torch

from strata.runtime.model.engram.hashing import NgramHasher


class DeviceEngramStep:
    """One decode step's Engram inputs, computed on the device (the `EngramStep` interface)."""

    def __init__(self, hasher: NgramHasher, tables: dict[int, torch.Tensor], grams: torch.Tensor, taps: torch.Tensor,
                 ring_dst: torch.Tensor, ring_src: torch.Tensor, cache):
        self.hasher, self.tables, self.grams, self.cache = hasher, tables, grams, cache
        self.taps, self.ring_dst, self.ring_src = taps, ring_dst, ring_src

    def rows(self, layer: int) -> torch.Tensor:
        """The layer's rows [B, heads, head_dim]: hashed and gathered on the device."""
        table = self.tables[layer]
        ids = self.hasher.rows(layer, self.grams.to(table.device))  # [B, heads]
        return table[ids]

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.taps, self.ring_dst, self.ring_src


class HandshakeEngramStep(DeviceEngramStep):
    """A decode step whose rows come from the host row cache: every layer's row ids were posted to the host
    when the step was built; `rows` waits on the device for the host's answer, then gathers in place."""

    def __init__(self, handshake, tokens: int, *args):
        super().__init__(*args)
        self.handshake, self.tokens = handshake, tokens

    def rows(self, layer: int) -> torch.Tensor:
        return self.handshake.rows(layer, self.tokens)


def device_step(hasher: NgramHasher, token_map: torch.Tensor, tables: dict[int, torch.Tensor] | None,
                ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, cache, kernel: int,
                handshake=None) -> DeviceEngramStep:
    """The decode step of `ids` [B] at `pos` [B] in cache `slots` [B] (device tensors); `token_map` is the
    compressed-id table on the same device. Writes the tokens into the cache's device history. Rows come
    from `tables` (read in place), or else from the host row cache through `handshake` (a `RowHandshake`:
    the step's row ids are posted to the host here, before any layer runs)."""
    ec = cache.engram
    n = hasher.cfg.max_ngram_size
    w = ec.window
    ring = max(w, 1)
    ids, slots, pos = ids.to(torch.int64), slots.to(torch.int64), pos.to(torch.int64)
    ec.tokens[slots, pos] = ids
    cols = [token_map[ids]]
    pad = torch.full_like(ids, hasher.pad)
    for j in range(1, n):  # the token j back, or padding before the sequence start
        back = pos - j
        prev = token_map[ec.tokens[slots, back.clamp(min=0)]]
        cols.append(torch.where(back >= 0, prev, pad))
    grams = torch.stack(cols, dim=1)  # [B, n]
    b = ids.numel()
    own = torch.arange(b, device=ids.device)
    # tap i reads position pos - (kernel-1-i) * n: the token itself (row b of this step's values), the
    # slot's ring, or the zero row past the rings before the sequence start (EngramRuntime.begin's layout)
    q = pos[:, None] - (kernel - 1 - torch.arange(kernel, device=ids.device))[None, :] * n  # [B, kernel]
    ring_at = b + slots[:, None] * ring + q.remainder(ring)
    taps = torch.where(q >= pos[:, None], own[:, None].expand_as(q), ring_at)
    taps = torch.where(q < 0, torch.full_like(q, b + ec.tokens.shape[0] * ring), taps)
    if w:
        ring_dst, ring_src = slots * ring + pos.remainder(ring), own
    else:
        ring_dst = ring_src = own[:0]
    if tables is None:
        handshake.post({layer: hasher.rows(layer, grams) for layer in handshake.layers})
        return HandshakeEngramStep(handshake, b, hasher, {}, grams, taps, ring_dst, ring_src, ec)
    return DeviceEngramStep(hasher, tables, grams, taps, ring_dst, ring_src, ec)


def host_decode_inputs(hasher: NgramHasher, input_ids: torch.Tensor, seqs: list[tuple[int, int, int, int]], cache,
                       kernel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step (one token per sequence) whose rows the host fetches (a row cache in front of disk):
    the same n-grams, taps and ring indices as `EngramRuntime.begin`'s per-sequence loop, in a few
    vectorised ops and one device round trip (the previous tokens come back with the new ones).

    `seqs`: (slot, position, offset, 1) per sequence. Writes the tokens into the device history. Returns
    grams int64 [B, n] on the CPU and taps [B, kernel], ring_dst [B or 0], ring_src [B or 0] on the device."""
    ec = cache.engram
    dev = ec.tokens.device
    n, w = hasher.cfg.max_ngram_size, ec.window
    ring = max(w, 1)
    b = len(seqs)
    sp = torch.tensor([[s for s, _, _, _ in seqs], [p for _, p, _, _ in seqs]], dtype=torch.int64)  # [2, B]
    back = sp[1][:, None] - torch.arange(n - 1, 0, -1)[None, :]  # [B, n-1] positions pos-(n-1) .. pos-1
    sp_dev = sp.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else sp
    hist = ec.tokens[sp_dev[0][:, None], (sp_dev[1][:, None] - torch.arange(n - 1, 0, -1, device=dev)[None, :]).clamp(min=0)]
    new = input_ids.to(dev, torch.int64)
    ec.tokens[sp_dev[0], sp_dev[1]] = new
    raw = torch.cat([hist, new[:, None]], dim=1).cpu()  # [B, n]: n-1 previous tokens (oldest first), then the new one
    comp = hasher.token_map[raw]
    comp[:, : n - 1][back < 0] = hasher.pad  # before the sequence start
    grams = comp.flip(1)  # column j = the token j back
    slots, pos = sp
    own = torch.arange(b)
    q = pos[:, None] - (kernel - 1 - torch.arange(kernel))[None, :] * n  # [B, kernel]
    taps = torch.where(q >= pos[:, None], own[:, None].expand_as(q), b + slots[:, None] * ring + q.remainder(ring))
    taps = torch.where(q < 0, torch.full_like(q, b + ec.tokens.shape[0] * ring), taps)
    ring_cols = torch.stack([slots * ring + pos.remainder(ring), own], dim=1) if w else torch.empty(b, 0, dtype=torch.int64)
    packed = torch.cat([taps, ring_cols], dim=1)  # one upload: [B, kernel (+ 2)]
    packed = packed.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else packed
    ring_dst, ring_src = (packed[:, kernel], packed[:, kernel + 1]) if w else (packed[:0, 0], packed[:0, 0])
    return grams, packed[:, :kernel], ring_dst, ring_src
