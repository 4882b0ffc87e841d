"""The Engram row store's side of decode steps in CUDA graphs, for tables behind the host row cache the GPU
reads in place (disk, or tmpfs without zero copy): the host admits a step's rows to the cache and hands the
graph their slots, for the whole step before a replay (`finish_step`), layer by layer between the pieces of a
segmented graph (`check_step`, `finish_one`), or to a one-graph step that waits on the device for them
(`handshake_for`: strata.tiers.rows.handshake). The row store (strata.tiers.rows.store) calls these under its
lock: the handshake's host thread serves decode steps from the same cache.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from strata.tiers.rows.cached import CachedRows
from strata.tiers.rows.host import HostRows
from strata.tiers.rows.load import RowTables
from strata.tiers.rows.tickets import RowStats, Ticket
from strata.tiers.storage.diskio import DiskReader

log = logging.getLogger(__name__)


def _no_room(capacity: int) -> RuntimeError:
    return RuntimeError(f"the Engram row cache ({capacity} rows) cannot hold one decode step's rows; raise "
                        "engram.row_cache")


class GraphSteps:
    """Decode steps' rows admitted to `cached` (None: no row cache, and no graph steps) through `host`'s
    tickets; a disk tier's layers served in one native call each (strata.tiers.rows.serve) through `reader`
    where `native` and the native helpers allow."""

    def __init__(self, host: HostRows, cached: CachedRows | None, tables: RowTables, reader: DiskReader | None,
                 stats: RowStats):
        self.host, self.cached, self.tables, self.reader, self.stats = host, cached, tables, reader, stats
        self.native = True  # serve_layer on a disk tier: one native call a layer (False: through `finish_one`)
        self.row_server = None  # the NativeRowServer once `serve_layer` made one (False: unavailable)

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

    def check_step(self, tickets: dict) -> None:
        """Raise unless the cache can hold every distinct row of a decode step at once (`finish_one` on each
        of its layers then cannot fail)."""
        if self.cached is None or self.cached.gather_view is None:
            raise RuntimeError("finish_step needs the host row cache the GPU reads in place (CUDA, tmpfs or disk tables)")
        # admission evicts any slot but the protected ones (the hits of the step and of live tickets), so the
        # step's misses fit when they and the distinct protected slots do not outnumber the cache
        hits = [t.hit_slots().numpy() for t in tickets.values()] + [h.numpy() for h in self.host.protected()]
        protected = np.unique(np.concatenate(hits)).size if hits else 0
        capacity = self.cached.cache.capacity
        if protected + sum(t.miss.numel() for t in tickets.values()) >= capacity:
            raise _no_room(capacity)

    def finish_one(self, ticket: Ticket, held: list[torch.Tensor], others) -> torch.Tensor:
        """One layer of a decode step (`finish_step`), so a segmented graph can admit each layer's rows right
        before that layer while the reads of later layers are still in flight: waits for this ticket's reads
        only, admits its misses without evicting `held` (the slots of the step's layers finished so far; this
        one's are appended) or the hits of `others` (its layers still to come) and of live tickets; returns the
        cache slot of each asked-for row (int64 [T * heads], CPU)."""
        self.host.take(ticket)
        protect = held + [t.hit_slots() for t in others]
        slots = self.cached.admit(ticket, protect + self.host.protected())
        if slots is None and self.host.prefetching:  # prompts' prefetches held cache rows: admitted, they free them
            self.host.absorb(block=True)
            slots = self.cached.admit(ticket, protect + self.host.protected())
        if slots is None:
            raise _no_room(self.cached.cache.capacity)
        held.append(slots)
        return slots[ticket.inverse]

    def serve_layer(self, layer: int, ids: np.ndarray, held: list[np.ndarray], out: np.ndarray) -> None:
        """One Engram layer of a one-graph decode step (the rows' handshake): its rows (`ids`, int64 [T * heads])
        admitted to the host cache without evicting `held` (the slots of the step's layers served so far; this
        one's are appended), each id's slot written to `out`. In one native call where the tables are on disk
        (strata.tiers.rows.serve), else through `start` and `finish_one`."""
        from strata.tiers.rows.serve import NativeRowServer, NoRoom

        if self.row_server is None and self.native and self.tables.tier == "disk":
            try:
                self.row_server = NativeRowServer(self.tables, self.cached, self.reader)
            except (RuntimeError, ValueError) as e:
                log.warning("Engram rows served from Python: %s", e)
                self.row_server = False
        if not self.row_server:
            held_t = [torch.from_numpy(h) for h in held]
            ticket = self.host.start(layer, torch.from_numpy(ids.copy()).view(-1, 1))
            out[:] = self.finish_one(ticket, held_t, ()).numpy()
            held.append(held_t[-1].numpy())
            return
        self.host.absorb(block=False)
        self.cached.wait_gathers()  # an eager gather may still read slots about to be reused
        for attempt in (0, 1):
            live = [h.numpy() for h in self.host.protected()]
            protect = np.concatenate([*held, *live]) if held or live else np.empty(0, dtype=np.int64)
            try:
                m, hits, read, seconds = self.row_server.serve(layer, ids, protect, out)
                break
            except NoRoom:
                if attempt or not self.host.prefetching:
                    raise
                self.host.absorb(block=True)  # prompts' prefetches held cache rows: admitted, they free them
        s = self.stats
        s.lookups += ids.size
        s.unique += m
        s.bytes_read += read * self.tables.row_bytes
        s.stall_s += seconds
        s.served("cache", hits)
        s.served(self.tables.tier, read)
        held.append(out.copy())

    def handshake_for(self, source, layers: list[int], heads: int, max_tokens: int):
        """A RowHandshake serving `source`'s rows (the row store: its lock, `gather_view` and `serve_layer`) to
        decode steps of up to `max_tokens` tokens (fewer when the cache cannot hold that many tokens' rows at
        once); None where that cannot run (no host cache the GPU reads in place, no Triton or native helpers)."""
        from strata.tiers.rows.handshake import RowHandshake

        if self.cached is None or self.cached.gather_view is None or not self.cached.gather_view.is_cuda:
            return None
        max_tokens = min(max_tokens, (self.cached.cache.capacity - 1) // (len(layers) * heads))
        if max_tokens < 1:
            return None
        try:
            return RowHandshake(source, layers, heads, max_tokens, self.tables.device)
        except RuntimeError as e:
            log.warning("Engram rows served between graph segments: %s", e)
            return None
