"""The Engram row store's host path: a layer's rows started (cache lookups, reads of the misses queued) and
waited for (reads finished, misses admitted to the cache, rows gathered on the device), prefetches absorbed.

Tickets started and not yet waited for are live: admissions never evict their cache hits. Prefetched tickets
are pending until their reads have landed and their rows are admitted (a prefetch is only a hint: rows that
find no room are dropped).
"""

from __future__ import annotations

import torch

from strata.tiers.rows.cached import CachedRows, on_device
from strata.tiers.rows.load import RowTables
from strata.tiers.rows.reads import TierReads
from strata.tiers.rows.tickets import RowStats, Ticket


class HostRows:
    """Serves rows of `tables` on the host: from the device's own table where it reads them in place, else
    through `cached` (None: no row cache, every row read) and `reads`; `prefetch`: reads start at `start`."""

    def __init__(self, tables: RowTables, cached: CachedRows | None, reads: TierReads, stats: RowStats,
                 prefetch: bool):
        self.tables, self.cached, self.reads, self.stats = tables, cached, reads, stats
        self.prefetch_on = prefetch
        self._live: list[Ticket] = []  # started, not yet waited for: their cache hits must stay put
        self._pending: list[Ticket] = []  # prefetches not yet absorbed into the cache

    def start(self, layer: int, rows: torch.Tensor) -> Ticket:
        """Begin serving `rows` (int64 CPU [T, heads]) of `layer`; returns at once."""
        self.absorb(block=False)
        uniq, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        self.stats.lookups += rows.numel()
        self.stats.unique += uniq.numel()
        ticket = Ticket(layer, uniq, inverse, tuple(rows.shape), torch.empty(0), uniq)
        if self.tables.in_place:
            return ticket
        if self.cached is not None:
            ticket.slots = self.cached.lookup(layer, uniq)
            ticket.miss = uniq[ticket.slots < 0]
            self.stats.served("cache", int((ticket.slots >= 0).sum()))
        if self.prefetch_on:
            self.reads.issue(ticket)
        self._live.append(ticket)
        return ticket

    def wait(self, ticket: Ticket) -> torch.Tensor:
        """The rows of `ticket` [T, heads, head_dim] on the device, waiting only for reads still in flight."""
        tables, device, dim = self.tables, self.tables.device, self.tables.dim
        if tables.in_place:  # one gather kernel over the VRAM table or the mapped one
            self.stats.served(tables.tier, ticket.uniq.numel())
            table = tables.device_table(ticket.layer)
            return table[on_device(ticket.uniq[ticket.inverse], device)].view(*ticket.shape, dim)
        self.take(ticket)
        if self.cached is None:  # every row was read: staged holds them in `uniq` order
            if not ticket.miss.numel():  # a step without rows
                return torch.empty(*ticket.shape, dim, dtype=tables.dtype, device=device)
            staged = ticket.staged.to(device, non_blocking=True)
            return staged[on_device(ticket.inverse, device)].view(*ticket.shape, dim)
        slots = self.cached.admit(ticket, self.protected())
        if slots is None:  # the cache cannot take every miss (a tiny cache): hits from it, misses as read
            return self.cached.assemble(ticket)
        return self.cached.gather(slots[ticket.inverse]).view(*ticket.shape, dim)

    def prefetch(self, layer: int, rows: torch.Tensor) -> None:
        """Read `rows` of `layer` into the cache ahead of need (e.g. a whole prompt at admission)."""
        if self.tables.in_place or self.cached is None or not self.prefetch_on:
            return
        ticket = self.start(layer, rows)
        self.stats.prefetched += ticket.miss.numel()
        self._pending.append(ticket)

    def absorb(self, block: bool) -> None:
        """Admit finished prefetches (all of them when `block`) into the cache; nothing is gathered."""
        keep = []
        for ticket in self._pending:
            if not (block or all(f.done() for f in ticket.reads)):
                keep.append(ticket)
                continue
            self.take(ticket)
            if self.cached is not None:  # rows that find no room are dropped: a prefetch is only a hint
                self.cached.admit(ticket, self.protected())
        self._pending = keep

    @property
    def prefetching(self) -> bool:
        """Whether prefetched rows wait to be absorbed (holding cache room until they are)."""
        return bool(self._pending)

    def take(self, ticket: Ticket) -> None:
        """The ticket is no longer live; wait for its reads (queued now if prefetch is off)."""
        self._live = [t for t in self._live if t is not ticket]
        self.reads.wait(ticket)

    def protected(self) -> list[torch.Tensor]:
        """The cache hits of every live ticket (int64 slots, one tensor a ticket): admissions keep them."""
        return [t.hit_slots() for t in self._live]
