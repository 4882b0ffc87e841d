"""Engram layers: hashed n-gram rows, gated by the hidden state, added to the residual stream.

At a configured layer, before its attention (DeepSeek's reference demo, one residual stream):

    e = concat of the token's rows                  [N, heads * head_dim]   (engram_hash.NgramHasher)
    g = sigmoid(signed_sqrt(<rms(key_proj(e)), rms(x)> / sqrt(H)))           [N, 1]
    v = g * value_proj(e)                                                    [N, H]
    x = x + v + silu(causal_depthwise_conv(rms(v)))     kernel_size taps, dilation max_ngram_size

Row ids depend on token ids alone, so `EngramRuntime.begin` hashes the whole step at the start of
the forward pass and asks the row source to start gathering; each Engram layer then waits only for
its own rows. The row source is the layers' own tables (`runtime.experts = "memory"`) or the tiered
row store (strata.tiers.rows.store), which serves rows from the GPU, pinned RAM, tmpfs or disk.

Per-sequence state lives in `EngramCache` (held by the KV cache): the raw token ids of each slot
(the n-gram history across steps) and, per Engram layer, a ring of the last `conv_window` normalised
values (the convolution's history), indexed by position, so chunked prefill and batched decode see
exactly what one pass over the whole sequence would.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from strata.runtime.model.engram.cache import EngramCache
from strata.runtime.model.engram.decode import DeviceEngramStep, device_step, host_decode_inputs
from strata.runtime.model.engram.hashing import EngramConfig, NgramHasher
from strata.runtime.model.kv_cache import DecodeBatch
from strata.runtime.model.layers import RMSNorm

if TYPE_CHECKING:
    from strata.runtime.model.kv_cache import KVCache, StepBatch


class RowSource(Protocol):
    """Where a layer's table rows come from: `start` returns at once, `wait` gives them on the device."""

    def start(self, layer: int, rows: torch.Tensor) -> Any: ...  # rows: int64 CPU [T, heads]

    def wait(self, ticket: Any) -> torch.Tensor: ...  # -> [T, heads, head_dim] in the model dtype

    def prefetch(self, layer: int, rows: torch.Tensor) -> None: ...

    # optional: `device_table(layer)` -> the table the compute device reads in place (or None), and
    # `note_direct(layer, n)` counting n lookups served that way (decode steps on the device)


class MemoryRows:
    """The reference row source: every table whole in the compute device (runtime.experts = "memory")."""

    def __init__(self, tables: dict[int, torch.Tensor]):
        self.tables = tables  # layer -> [rows, head_dim]

    def start(self, layer: int, rows: torch.Tensor) -> Any:
        table = self.tables[layer]
        return table[rows.to(table.device, non_blocking=True)]

    def wait(self, ticket: Any) -> torch.Tensor:
        return ticket

    def prefetch(self, layer: int, rows: torch.Tensor) -> None:
        pass

    def device_table(self, layer: int) -> torch.Tensor:
        return self.tables[layer]


class EngramStep:
    """One forward pass's Engram work: pending row gathers per layer and the convolution's tap map."""

    def __init__(self, source: RowSource, tickets: dict[int, Any], taps: torch.Tensor, ring_dst: torch.Tensor,
                 ring_src: torch.Tensor, cache: EngramCache):
        self.source, self.tickets, self.cache = source, tickets, cache
        self.taps = taps  # int64 [N, kernel] on the device: index into cat(new [N], ring [slots*W], zero [1])
        self.ring_dst, self.ring_src = ring_dst, ring_src  # where the step's last values go in the ring
        self._moved: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._held: list[torch.Tensor] = []  # slots of the layers `finish_layer` has admitted this step

    def rows(self, layer: int) -> torch.Tensor:
        """The layer's rows for the step's tokens [N, heads, head_dim], waiting if they are not there yet."""
        return self.source.wait(self.tickets.pop(layer))

    def finish(self) -> dict[int, torch.Tensor]:
        """Every layer's rows put in the source's host cache; per layer their cache slots (int64 [N * heads],
        CPU), for a gather from `source.gather_view` inside a CUDA graph (see `StaticEngramStep`)."""
        slots = self.source.finish_step(self.tickets)
        self.tickets = {}
        return slots

    def check(self) -> None:
        """Raise now, before a replay, if the source's host cache cannot hold this step's rows at once."""
        self.source.check_step(self.tickets)
        self._held = []

    def finish_layer(self, layer: int) -> torch.Tensor:
        """One layer's rows put in the host cache (after `check`): their cache slots (int64 [N * heads], CPU).
        The reads of the layers still to come stay in flight, and their cache hits stay put."""
        ticket = self.tickets.pop(layer)
        return self.source.finish_one(ticket, self._held, self.tickets.values())

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(taps, ring_dst, ring_src) on `device`: an Engram layer on another card of a staged model gets
        its own copy, once per step."""
        if self.taps.device == device:
            return self.taps, self.ring_dst, self.ring_src
        if device not in self._moved:
            self._moved[device] = tuple(t.to(device, non_blocking=True) for t in (self.taps, self.ring_dst, self.ring_src))
        return self._moved[device]


class EngramRuntime(nn.Module):
    """Owns the normalisation table (`model.engram.token_map`), hashes steps and starts their gathers."""

    def __init__(self, cfg: EngramConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("token_map", torch.zeros(vocab_size, dtype=torch.int64))
        self.source: RowSource | None = None  # None: the layers' own tables (set by `bind`)
        self._hasher: NgramHasher | None = None
        self._direct: tuple | None = None  # (source, its in-place tables or None), see `direct_tables`
        self._token_maps: dict = {}  # device -> token_map there (staged models keep it on the host)
        self.handshake = None  # decode steps served rows by the host through page-locked memory (`enable_handshake`)

    @property
    def hasher(self) -> NgramHasher:
        if self._hasher is None:
            self._hasher = NgramHasher(self.cfg, self.token_map.detach().cpu())
        return self._hasher

    def bind(self, layers: nn.ModuleList) -> None:
        """Use the layers' own tables as the row source (unless a tiered source was set)."""
        if self.source is None:
            self.source = MemoryRows({i: layers[i].engram.multi_head_embedding.embedding.weight
                                      for i in self.cfg.layer_ids})

    def stats(self) -> dict:
        """The row source's statistics (`engine.stats()["engram"]`): lookups, hits per tier, bytes, stall;
        with a handshake, its steps, host serving seconds and the GPU's waits under "handshake"."""
        stats = getattr(self.source, "stats", None)
        out = stats() if stats is not None else {"tier": "memory"}
        if self.handshake is not None:
            out["handshake"] = self.handshake.stats()
        return out

    def prefetch(self, ids: list[int] | torch.Tensor, history: list[int] | torch.Tensor = ()) -> None:
        """Start fetching the rows of tokens `ids` (after `history`) for every Engram layer; returns at once.

        Called as soon as token ids exist (a prompt at admission, a token right after sampling), so
        the rows are on their way before the forward pass that needs them."""
        if self.source is None:
            return
        grams = self.hasher.grams(torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(history, dtype=torch.int64))
        for layer in self.cfg.layer_ids:
            self.source.prefetch(layer, self.hasher.rows(layer, grams))

    def direct_tables(self, layers: nn.ModuleList) -> dict[int, torch.Tensor] | None:
        """Every Engram layer's table as the compute device reads it in place (VRAM, or pinned/tmpfs RAM
        through its device mapping), or None when any layer needs the host to serve its rows."""
        if self.source is None:
            self.bind(layers)
        if self._direct is None or self._direct[0] is not self.source:  # once per source (asked every step)
            get = getattr(self.source, "device_table", None)
            tables = {layer: get(layer) for layer in self.cfg.layer_ids} if get is not None else {}
            self._direct = (self.source, tables if tables and all(t is not None for t in tables.values()) else None)
        return self._direct[1]

    def enable_handshake(self, max_tokens: int) -> bool:
        """Let CUDA-graph decode steps of up to `max_tokens` tokens take their rows from the source's host
        cache through a handshake (strata.tiers.rows.handshake) instead of host steps between graph
        segments; False when the source cannot (tables read in place need none; see `start_handshake`)."""
        start = getattr(self.source, "start_handshake", None)
        if start is not None and self.handshake is None:
            self.handshake = start(self.cfg.layer_ids, self.cfg.num_heads, max_tokens)
        return self.handshake is not None

    def device_steps(self, layers: nn.ModuleList, tokens: int) -> bool:
        """Whether a decode step of `tokens` tokens is computed entirely on the device (hashing and gathers in
        its graph): tables the device reads in place, or a handshake that holds that many tokens."""
        if self.direct_tables(layers) is not None:
            return True
        return self.handshake is not None and tokens <= self.handshake.max_tokens

    def device_step_queued(self, layers: nn.ModuleList, tokens: int) -> None:
        """A device-side decode step of `tokens` tokens is about to run: count its lookups (tables read in
        place), or raise what failed serving an earlier step and wake the handshake's host thread for it."""
        if self.direct_tables(layers) is not None:
            self.count_direct(tokens)
        else:
            self.handshake.check()
            self.handshake.expect()

    def count_direct(self, tokens: int) -> None:
        """Count a device-side decode step's lookups (`tokens` tokens) in the row statistics, on the host."""
        note = getattr(self.source, "note_direct", None)
        if note is not None:
            for layer in self.cfg.layer_ids:
                note(layer, tokens * self.cfg.num_heads)

    def begin(self, input_ids: torch.Tensor, batch: StepBatch | DecodeBatch, cache: KVCache,
              layers: nn.ModuleList) -> EngramStep | DeviceEngramStep:
        """Hash the step's tokens, record them in the cache, start every layer's gather. A `DecodeBatch`
        (tables the device reads in place) is done entirely on the device: see strata.runtime.model.engram.decode."""
        if self.source is None:
            self.bind(layers)
        if isinstance(batch, DecodeBatch):
            if not self.device_steps(layers, input_ids.numel()):
                raise RuntimeError("a DecodeBatch without Engram inputs needs tables the device reads in place "
                                   "or the rows' handshake")
            tables = self.direct_tables(layers)
            return device_step(self.hasher, self._token_map_on(input_ids.device), tables, input_ids, batch.slots_t,
                               batch.pos_t, cache, self.cfg.kernel_size, self.handshake if tables is None else None)
        ec: EngramCache = cache.engram
        seqs = list(batch.sequences())
        if seqs and all(n == 1 for *_, n in seqs):  # a decode step: vectorised, one device round trip
            g, taps, dst, src = host_decode_inputs(self.hasher, input_ids, seqs, cache, self.cfg.kernel_size)
            tickets = {layer: self.source.start(layer, self.hasher.rows(layer, g)) for layer in self.cfg.layer_ids}
            return EngramStep(self.source, tickets, taps, dst, src, ec)
        n_ctx, w, k, d = self.cfg.max_ngram_size - 1, ec.window, self.cfg.kernel_size, self.cfg.max_ngram_size
        ring = max(w, 1)  # ring positions per slot (EngramCache keeps one even when w == 0)
        ids = input_ids.detach().to("cpu", torch.int64)
        history = self._histories(ec, seqs, n_ctx)  # before this step's tokens are written
        self._record(ec, input_ids, seqs)
        grams, taps, dst, src = [], [], [], []
        n_total, num_slots = ids.numel(), ec.tokens.shape[0]
        zero = n_total + num_slots * ring
        for (slot, start, off, n), past in zip(seqs, history, strict=True):
            grams.append(self.hasher.grams(ids[off : off + n], past))
            pos = torch.arange(start, start + n)
            # tap i reads position p - (k-1-i)*d: this step's value, the ring's, or zero before the start
            q = pos[:, None] - (k - 1 - torch.arange(k))[None, :] * d  # [n, k]
            idx = torch.where(q >= start, off + q - start, n_total + slot * ring + q.remainder(ring))
            taps.append(torch.where(q < 0, torch.full_like(q, zero), idx))
            keep = pos[pos >= start + n - w] if w else pos[:0]  # the last w positions go to the ring
            dst.append(slot * ring + keep.remainder(ring))
            src.append(off + keep - start)
        g = torch.cat(grams)
        tickets = {layer: self.source.start(layer, self.hasher.rows(layer, g)) for layer in self.cfg.layer_ids}
        dev = input_ids.device
        return EngramStep(self.source, tickets, torch.cat(taps).to(dev), torch.cat(dst).to(dev), torch.cat(src).to(dev), ec)

    def _token_map_on(self, device: torch.device) -> torch.Tensor:
        if self.token_map.device == device:
            return self.token_map
        if device not in self._token_maps:
            self._token_maps[device] = self.token_map.to(device)
        return self._token_maps[device]

    @staticmethod
    def _histories(ec: EngramCache, seqs, n_ctx: int) -> list[torch.Tensor]:
        """Each sequence's last `n_ctx` raw tokens before its start (fewer at the sequence start), read
        from the device history in one copy."""
        spans = [(slot, max(0, start - n_ctx), start) for slot, start, _, _ in seqs]
        slot_idx = [slot for slot, a, b in spans for _ in range(a, b)]
        pos_idx = [p for _, a, b in spans for p in range(a, b)]
        flat = ec.tokens[torch.tensor(slot_idx, dtype=torch.int64, device=ec.tokens.device),
                         torch.tensor(pos_idx, dtype=torch.int64, device=ec.tokens.device)].cpu() if pos_idx else None
        out, at = [], 0
        for _, a, b in spans:
            out.append(flat[at : at + b - a] if flat is not None else torch.empty(0, dtype=torch.int64))
            at += b - a
        return out

    @staticmethod
    def _record(ec: EngramCache, input_ids: torch.Tensor, seqs) -> None:
        """Write the step's raw tokens into the device history (one indexed write)."""
        slot_idx = [slot for slot, _, _, n in seqs for _ in range(n)]
        pos_idx = [p for _, start, _, n in seqs for p in range(start, start + n)]
        dev = ec.tokens.device
        ec.tokens[torch.tensor(slot_idx, dtype=torch.int64, device=dev), torch.tensor(pos_idx, dtype=torch.int64, device=dev)] = (
            input_ids.to(dev, torch.int64))


class MultiHeadTable(nn.Module):
    """A layer's table, all heads' rows stacked (`multi_head_embedding.embedding.weight` [rows, head_dim])."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(rows, dim)


class ShortConv(nn.Module):
    """RMSNorm, then a causal depthwise convolution (no bias) and SiLU; `conv.weight` [H, 1, kernel]."""

    def __init__(self, hidden: int, kernel: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=False)


class EngramLayer(nn.Module):
    """The Engram block of one decoder layer; `forward(x [N, H], step) -> Engram output [N, H]`."""

    def __init__(self, cfg: EngramConfig, hidden: int, layer: int):
        super().__init__()
        self.layer, self.hidden = layer, hidden
        self.multi_head_embedding: MultiHeadTable | None = MultiHeadTable(cfg.table_rows(layer), cfg.head_dim)
        self.key_proj = nn.Linear(cfg.embed_dim, hidden)
        self.value_proj = nn.Linear(cfg.embed_dim, hidden)
        self.norm1 = RMSNorm(hidden, cfg.norm_eps)  # keys
        self.norm2 = RMSNorm(hidden, cfg.norm_eps)  # queries (the hidden state)
        self.short_conv = ShortConv(hidden, cfg.kernel_size, cfg.norm_eps)

    def forward(self, x: torch.Tensor, step: EngramStep) -> torch.Tensor:
        e = step.rows(self.layer).flatten(1).to(x.dtype)  # [N, heads * head_dim]
        key, query = self.norm1(self.key_proj(e)), self.norm2(x)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)  # [N, 1]
        gate = torch.sigmoid(gate.abs().clamp_min(1e-6).sqrt() * gate.sign())
        value = gate * self.value_proj(e)  # [N, H]
        return value + self._conv(value, step)

    def _conv(self, value: torch.Tensor, step: EngramStep) -> torch.Tensor:
        normed = self.short_conv.norm(value)  # [N, H]
        ring = step.cache.conv[self.layer]  # [slots, W, H]
        flat = ring.view(-1, self.hidden)
        tap_index, ring_dst, ring_src = step.indices(value.device)
        src = torch.cat([normed, flat, normed.new_zeros(1, self.hidden)])
        taps = src[tap_index]  # [N, kernel, H]
        w = self.short_conv.conv.weight[:, 0, :].t().to(value.dtype)  # [kernel, H]
        out = F.silu((taps * w).sum(1))
        if ring_dst.numel():
            flat[ring_dst] = normed[ring_src]
        return out
