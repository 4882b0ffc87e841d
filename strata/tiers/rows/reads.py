"""Reads of the rows a ticket missed in the Engram row cache, from the tier holding the tables: gathered at once
from pinned RAM, or read from the tmpfs or disk file in batches of `read_batch` rows (aligned block reads, many
in flight: `DiskReader.read_rows`) on the reader's threads."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from strata.tiers.rows.load import RowTables
from strata.tiers.rows.tickets import RowStats, Ticket
from strata.tiers.storage.diskio import DiskReader


class TierReads:
    """Reads rows of `tables` (through `reader` for tmpfs and disk) into a ticket's staging buffer, pinned when
    `pin_staging` (copied from there to a VRAM slab); bytes and stall counted in `stats`."""

    def __init__(self, tables: RowTables, reader: DiskReader | None, read_batch: int, pin_staging: bool,
                 stats: RowStats):
        self.tables, self.reader, self.stats = tables, reader, stats
        self.read_batch = max(1, read_batch)
        self.pin_staging = pin_staging

    def issue(self, ticket: Ticket) -> None:
        """Queue the reads of the ticket's missing rows; `ticket.staged` [k, head_dim] receives them."""
        with torch.inference_mode(False):  # reader threads write the buffers outside inference mode
            self._queue(ticket)

    def wait(self, ticket: Ticket) -> None:
        """Wait for the ticket's reads (queued now if they were not); the wait is the stall."""
        if ticket.reads is None:
            self.issue(ticket)
        t0 = time.perf_counter()
        for f in ticket.reads:
            f.result()
        self.stats.stall_s += time.perf_counter() - t0
        self.stats.served(self.tables.tier, ticket.miss.numel())

    def _queue(self, ticket: Ticket) -> None:
        tables, miss, layer = self.tables, ticket.miss, ticket.layer
        row_bytes, batch = tables.row_bytes, self.read_batch
        ticket.staged = torch.empty(miss.numel(), tables.dim, dtype=tables.dtype, pin_memory=self.pin_staging)
        ticket.reads = []
        if not miss.numel():
            return
        self.stats.bytes_read += miss.numel() * row_bytes
        flat = ticket.staged.view(torch.uint8).view(miss.numel(), row_bytes)
        for a in range(0, miss.numel(), batch):
            part, dst = miss[a : a + batch], flat[a : a + batch]
            if tables.tier == "pinned":
                rows = torch.index_select(tables.full[layer], 0, part, out=ticket.staged[a : a + batch])
                ticket.reads.append(_done(rows))
            else:
                base = 0 if tables.tier == "tmpfs" else tables.entries[layer].offset
                ticket.reads.append(self.reader.read_rows(tables.paths[layer], base, row_bytes, part.numpy(), dst))


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f
