"""The Engram row store's side of decode steps in CUDA graphs, for tables behind the host row cache the GPU
reads in place (disk, or tmpfs without zero copy): the host admits a step's rows to the cache and hands the
graph their slots, for the whole step before a replay (`finish_step`), layer by layer between the pieces of a
segmented graph (`check_step`, `finish_one`), or to a one-graph step that waits on the device for them
(`start_handshake`: strata.tiers.rows.handshake). Mixed into `EngramRowStore` (strata.tiers.rows.store).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


def locked(method):
    """Run `method` under the store's lock: the handshake's host thread serves decode steps from it too."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


class GraphStepsMixin:
    """Uses the store's `cache`, `gather_view`, `device`, `tier`, `lock`, `handshake`, `stats_`, `row_bytes`,
    `_live`, `_pending`, `_gathered`, `_row_server` and its `start`, `_await`, `_admit`, `_absorb`, `_count`."""

    @locked
    def finish_step(self, tickets: dict) -> dict[int, torch.Tensor]:
        """Every layer's rows of a decode step in the cache, for a gather inside the step's CUDA graph:
        waits for the reads, admits the misses (no row of the step evicts another) and returns, per layer,
        the cache slot of each asked-for row (int64 [T * heads], CPU). Raises when the cache cannot hold
        the step's rows at once (the graph's capture then fails and the step runs eagerly)."""
        self.check_step(tickets)
        out: dict[int, torch.Tensor] = {}
        held: list[torch.Tensor] = []
        left = dict(tickets)
        for layer, ticket in tickets.items():
            del left[layer]
            out[layer] = self.finish_one(ticket, held, left.values())
        return out

    @locked
    def check_step(self, tickets: dict) -> None:
        """Raise unless the cache can hold every distinct row of a decode step at once (`finish_one` on each
        of its layers then cannot fail)."""
        if self.gather_view is None:
            raise RuntimeError("finish_step needs the host row cache the GPU reads in place (CUDA, tmpfs or disk tables)")
        # admission evicts any slot but the protected ones (the hits of the step and of live tickets), so the
        # step's misses fit when they and the distinct protected slots do not outnumber the cache
        hits = [t.slots[t.slots >= 0].numpy() for t in [*tickets.values(), *self._live]]
        protected = np.unique(np.concatenate(hits)).size if hits else 0
        if protected + sum(t.miss.numel() for t in tickets.values()) >= self.cache.capacity:
            raise RuntimeError(f"the Engram row cache ({self.cache.capacity} rows) cannot hold one decode step's "
                               "rows; raise engram.row_cache")

    @locked
    def finish_one(self, ticket, held: list[torch.Tensor], others) -> torch.Tensor:
        """One layer of a decode step (`finish_step`), so a segmented graph can admit each layer's rows right
        before that layer while the reads of later layers are still in flight: waits for this ticket's reads
        only, admits its misses without evicting `held` (the slots of the step's layers finished so far; this
        one's are appended) or the hits of `others` (its layers still to come) and of live tickets; returns the
        cache slot of each asked-for row (int64 [T * heads], CPU)."""
        self._live = [t for t in self._live if t is not ticket]
        self._await(ticket)
        protect = held + [t.slots[t.slots >= 0] for t in others]
        slots = self._admit(ticket, protect + [t.slots[t.slots >= 0] for t in self._live])
        if slots is None and self._pending:  # prompts' prefetches held cache rows: admitted, they free them
            self._absorb(block=True)
            slots = self._admit(ticket, protect + [t.slots[t.slots >= 0] for t in self._live])
        if slots is None:
            raise RuntimeError(f"the Engram row cache ({self.cache.capacity} rows) cannot hold one decode step's "
                               "rows; raise engram.row_cache")
        held.append(slots)
        return slots[ticket.inverse]

    def replayed(self) -> None:
        """A CUDA graph that gathers from the host slab was launched: its slots are rewritten only after it."""
        if self.gather_view is not None and self.gather_view.is_cuda:
            self._gathered = torch.cuda.Event()
            self._gathered.record()

    @locked
    def serve_layer(self, layer: int, ids: np.ndarray, held: list[np.ndarray], out: np.ndarray) -> None:
        """One Engram layer of a one-graph decode step (the rows' handshake): its rows (`ids`, int64 [T * heads])
        admitted to the host cache without evicting `held` (the slots of the step's layers served so far; this
        one's are appended), each id's slot written to `out`. In one native call where the tables are on disk
        (strata.tiers.rows.serve), else through `start` and `finish_one`."""
        from strata.tiers.rows.serve import NativeRowServer, NoRoom

        if self._row_server is None and self.tier == "disk":
            try:
                self._row_server = NativeRowServer(self)
            except (RuntimeError, ValueError) as e:
                log.warning("Engram rows served from Python: %s", e)
                self._row_server = False
        if not self._row_server:
            held_t = [torch.from_numpy(h) for h in held]
            ticket = self.start(layer, torch.from_numpy(ids.copy()).view(-1, 1))
            out[:] = self.finish_one(ticket, held_t, ()).numpy()
            held.append(held_t[-1].numpy())
            return
        self._absorb(block=False)
        if self._gathered is not None:  # an eager gather may still read slots about to be reused
            self._gathered.synchronize()
            self._gathered = None
        for attempt in (0, 1):
            protect = np.concatenate([*held, *(t.slots[t.slots >= 0].numpy() for t in self._live)]) if \
                held or self._live else np.empty(0, dtype=np.int64)
            try:
                m, hits, read, seconds = self._row_server.serve(layer, ids, protect, out)
                break
            except NoRoom:
                if attempt or not self._pending:
                    raise
                self._absorb(block=True)  # prompts' prefetches held cache rows: admitted, they free them
        s = self.stats_
        s.lookups += ids.size
        s.unique += m
        s.bytes_read += read * self.row_bytes
        s.stall_s += seconds
        self._count("cache", hits)
        self._count(self.tier, read)
        held.append(out.copy())

    def start_handshake(self, layers: list[int], heads: int, max_tokens: int):
        """Serve decode steps of up to `max_tokens` tokens (fewer when the cache cannot hold that many tokens'
        rows at once) to CUDA graphs that wait on the device for their rows (strata.tiers.rows.handshake);
        None where that cannot run (no host cache the GPU reads in place, no Triton or native helpers)."""
        from strata.tiers.rows.handshake import RowHandshake

        if self.handshake is None and self.gather_view is not None and self.gather_view.is_cuda:
            max_tokens = min(max_tokens, (self.cache.capacity - 1) // (len(layers) * heads))
            if max_tokens >= 1:
                try:
                    self.handshake = RowHandshake(self, layers, heads, max_tokens, self.device)
                except RuntimeError as e:
                    log.warning("Engram rows served between graph segments: %s", e)
        return self.handshake
