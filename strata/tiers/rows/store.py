"""The tiered Engram row store: table rows served from a hot-row cache and the tier holding the tables.

    full tables:  gpu (whole in VRAM) | pinned (whole in page-locked RAM) | tmpfs (a copy in /dev/shm) | disk (the store)
    row cache:    a slab of `capacity` rows on the compute device (VRAM on CUDA, RAM on CPU-only hosts),
                  with frequency-aware eviction: decayed use counts, the least used rows go first
    zero copy:    on CUDA, tables in pinned RAM or tmpfs (the copy mapped and page-locked) are read by the
                  GPU in place through their device mapping (strata.tiers.storage.uva), like VRAM tables: no row
                  cache, no staging (`zero_copy=False`, or a mapping CUDA refuses: the row cache serves them)

`start(layer, rows)` returns at once: cached rows are known, the missing ones are read in batches of
`read_batch` rows (aligned block reads, many in flight: `DiskReader.read_rows`) on background
threads. `wait(ticket)` blocks only for reads that have not finished (the stall it counts), copies
the missing rows to the device, admits them into the cache and returns [T, heads, head_dim]. Decode
steps in CUDA graphs take their rows through strata.tiers.rows.graph_steps (slots in the host cache,
which the GPU reads in place; with `[debug] engram_graph_wait`, a host thread answering the graph itself).
The cache is shared with that thread: the public methods run under `lock`.

Every table is checked at start-up: a missing or mis-sized file stops it (as in `ExpertStore.open`),
and each chunk's checksum is verified while the table is loaded (gpu, pinned), copied (tmpfs) or, for
disk, read in a streaming pass: a damaged table stops start-up with an error naming it. That full pass
runs once per table file, not once per start: a verification record (strata.tiers.store.verify_record) then
vouches for the file while its size, mtime, ctime and inode stay the same, so later starts skip the
read (disk; tmpfs, whose recorded copy in /dev/shm is reused) or only the checksums (gpu, pinned hold
the table and read it anyway). Rows read while serving (`DiskReader.read_rows` on the store file or the
tmpfs copy) are not checksummed, as before the record: they come from a file the pass or the record
vouched for, and damage that leaves the file's identity unchanged is for `strata verify`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from strata.errors import CheckpointError, ConfigError
from strata.tiers.rows.cache import RowCache
from strata.tiers.rows.graph_steps import GraphStepsMixin, locked
from strata.tiers.rows.load import TableLoadingMixin
from strata.tiers.storage.diskio import DiskReader
from strata.tiers.storage.uva import RegisteredFile, device_view
from strata.tiers.store.format import TORCH_DTYPES, TableEntry
from strata.tiers.store.store import ExpertStore

ENGRAM_TIERS = ("gpu", "pinned", "tmpfs", "disk")


def table_name(layer: int) -> str:
    """The store's table object holding Engram layer `layer`'s rows."""
    return f"engram.{layer}"


@dataclass
class RowStats:
    """Counters for `stats()`: row lookups, where they were served, bytes read, stall."""

    lookups: int = 0  # rows asked for (with repeats)
    unique: int = 0  # distinct rows asked for, per step
    hits: dict = field(default_factory=dict)  # tier -> distinct rows served from it
    bytes_read: int = 0  # bytes read from the backing tier
    stall_s: float = 0.0  # seconds a layer waited for rows that had not arrived
    prefetched: int = 0  # rows fetched ahead by `prefetch`


@dataclass(eq=False)  # identity comparison: `wait` finds a ticket in the live list by identity
class _Ticket:
    """One `start`: the distinct rows asked for, their cache slots, the misses and their reads."""

    layer: int
    uniq: torch.Tensor  # int64 [m] distinct rows of the layer
    inverse: torch.Tensor  # int64 [T * heads] position of each asked-for row in `uniq`
    shape: tuple  # (T, heads)
    slots: torch.Tensor  # int64 [m] cache slot of each distinct row, -1 where absent (empty: no cache)
    miss: torch.Tensor  # int64 [k] rows to read from the tier
    reads: list[Future] | None = None  # None until the reads are queued
    staged: torch.Tensor | None = None  # [k, head_dim] the read rows, on the CPU


class EngramRowStore(TableLoadingMixin, GraphStepsMixin):
    """Rows of every Engram table of a store, from `tier`, through a `row_cache`-row cache on `device`."""

    def __init__(self, store: ExpertStore, layers: list[int], tier: str, device: torch.device, row_cache: int,
                 prefetch: bool = True, read_batch: int = 4096, tmpfs_dir: str = "/dev/shm/strata",
                 threads: int = 8, zero_copy: bool = True):
        if tier not in ENGRAM_TIERS:
            raise ConfigError(f"engram.tier = {tier!r} is invalid; use auto or one of {', '.join(ENGRAM_TIERS)}")
        self.store, self.tier, self.device, self.prefetch_on = store, tier, device, prefetch
        self.read_batch = max(1, read_batch)
        self.tables: dict[int, TableEntry] = {}
        for layer in layers:
            name = table_name(layer)
            if name not in store.index.tables:
                raise CheckpointError(f"{store.directory}: the store has no Engram table {name!r} (layer {layer}); "
                                      "delete the store and re-run `strata convert`")
            self.tables[layer] = store.index.tables[name]
        first = next(iter(self.tables.values()))
        self.dtype, self.dim = TORCH_DTYPES[first.dtype], first.row_shape[-1]
        self.row_bytes = first.row_bytes
        self.base, total = {}, 0
        for layer, t in self.tables.items():  # one global row space over all layers
            self.base[layer], total = total, total + t.num_rows
        self.total_rows = total
        self.stats_ = RowStats()
        self.lock = threading.RLock()  # the cache's bookkeeping: the compute thread and the handshake's host thread
        self.handshake = None  # a RowHandshake once `start_handshake` made one (decode graphs wait on the device)
        self._row_server = None  # strata.tiers.rows.serve.NativeRowServer for `serve_layer` (False: unavailable)
        self._live: list[_Ticket] = []  # started, not yet waited for: their cache hits must stay put
        self._pending: list[_Ticket] = []  # prefetches not yet absorbed into the cache
        self.full: dict[int, torch.Tensor] = {}  # gpu / pinned tiers: whole tables
        self.paths: dict[int, str] = {}  # tmpfs / disk tiers: files to read rows from
        self.reader = DiskReader(threads) if tier in ("tmpfs", "disk") else None
        self.verified_from_record: set[str] = set()  # tables whose checksum pass a record made unnecessary
        self.tmpfs_reused: set[str] = set()  # tables whose tmpfs copy from an earlier start was reused
        self.chunks_read = 0  # table chunks read at start-up
        self._load(tmpfs_dir)
        # pinned tables on CUDA: the gather kernel reads rows straight from pinned RAM through its device
        # mapping (a few bytes per row across PCIe, inside the step's graph): no row cache, no host copies
        self.mapped: dict[int, torch.Tensor] = {}
        self._registered: list[RegisteredFile] = []  # tmpfs copies page-locked for zero-copy reads
        if tier in ("pinned", "tmpfs") and device.type == "cuda" and zero_copy:
            self._map_tables()
        direct = tier == "gpu" or bool(self.mapped) or (tier == "pinned" and device.type == "cpu")
        cache_rows = 0 if direct else min(row_cache, total)
        # on CUDA the row cache in front of tmpfs or disk lives in pinned RAM that the GPU reads in place:
        # rows read from the tier are written there by the host (no staging copy, no scatter kernel) and a
        # decode step's gather runs inside its CUDA graph (`gather_view`, `finish_step`)
        self.gather_view: torch.Tensor | None = None
        slab = None
        if cache_rows and zero_copy and tier in ("tmpfs", "disk"):
            if device.type == "cuda":
                with torch.cuda.device(device):
                    slab = torch.empty(cache_rows, self.dim, dtype=self.dtype, pin_memory=True)
                self.gather_view = device_view(slab, device)
                slab = slab if self.gather_view is not None else None  # a mapping CUDA refuses: a VRAM slab
            else:  # CPU-only hosts: the slab is in RAM anyway, and the compute reads it in place
                slab = self.gather_view = torch.empty(cache_rows, self.dim, dtype=self.dtype)
        self._gathered = None  # CUDA event after the last gather from the host slab: its slots are rewritten after it
        self.cache = RowCache(total, cache_rows, self.dim, self.dtype, device, slab=slab) if cache_rows > 0 else None

    # -- the row source protocol (strata.runtime.model.engram.layer.RowSource) -------------------------------------
    @locked
    def start(self, layer: int, rows: torch.Tensor) -> _Ticket:
        """Begin serving `rows` (int64 CPU [T, heads]) of `layer`; returns at once."""
        self._absorb(block=False)
        uniq, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        self.stats_.lookups += rows.numel()
        self.stats_.unique += uniq.numel()
        ticket = _Ticket(layer, uniq, inverse, tuple(rows.shape), torch.empty(0), uniq)
        if self.tier == "gpu" or self.mapped:
            return ticket
        if self.cache is not None:
            ticket.slots = self.cache.lookup(uniq + self.base[layer])
            ticket.miss = uniq[ticket.slots < 0]
            self._count("cache", int((ticket.slots >= 0).sum()))
        if self.prefetch_on:
            self._issue(ticket)
        self._live.append(ticket)
        return ticket

    @locked
    def wait(self, ticket: _Ticket) -> torch.Tensor:
        """The rows of `ticket` [T, heads, head_dim] on the device, waiting only for reads still in flight."""
        layer, uniq = ticket.layer, ticket.uniq
        if self.tier == "gpu" or self.mapped:  # one gather kernel over the VRAM table or the mapped one
            self._count(self.tier, uniq.numel())
            table = self.full[layer] if self.tier == "gpu" else self.mapped[layer]
            return table[self._on_device(uniq[ticket.inverse])].view(*ticket.shape, self.dim)
        self._live = [t for t in self._live if t is not ticket]
        self._await(ticket)
        if self.cache is None:  # every row was read: staged holds them in `uniq` order
            if not ticket.miss.numel():  # a step without rows
                return torch.empty(*ticket.shape, self.dim, dtype=self.dtype, device=self.device)
            staged = ticket.staged.to(self.device, non_blocking=True)
            return staged[self._on_device(ticket.inverse)].view(*ticket.shape, self.dim)
        live = [t.slots[t.slots >= 0] for t in self._live]
        slots = self._admit(ticket, live)
        if slots is None:  # the cache cannot take every miss (a tiny cache): hits from it, misses as read
            return self._assemble(ticket)
        return self._gather(slots[ticket.inverse]).view(*ticket.shape, self.dim)

    def _await(self, ticket: _Ticket) -> None:
        """Wait for the ticket's reads (queued now if prefetch is off); the wait is the stall."""
        if ticket.reads is None:
            self._issue(ticket)
        t0 = time.perf_counter()
        for f in ticket.reads:
            f.result()
        self.stats_.stall_s += time.perf_counter() - t0
        self._count(self.tier, ticket.miss.numel())

    def _admit(self, ticket: _Ticket, protect: list[torch.Tensor]) -> torch.Tensor | None:
        """Put the ticket's read rows into the cache, never evicting `protect`ed slots; the slot of every
        distinct row (int64 [m]), or None when not every miss fits (some may have been admitted)."""
        slots, hit = ticket.slots, ticket.slots >= 0
        if not ticket.miss.numel():
            return slots
        placed = self.cache.place(ticket.miss + self.base[ticket.layer], torch.cat([*protect, slots[hit]]))
        ok = placed >= 0
        if not bool(ok.all()):
            if bool(ok.any()):
                self._write_rows(placed[ok], ticket.staged, ok.nonzero().view(-1))
            return None
        self._write_rows(placed, ticket.staged, None)
        slots = slots.clone()
        slots[~hit] = placed
        return slots

    def _write_rows(self, slots: torch.Tensor, staged: torch.Tensor, pick: torch.Tensor | None) -> None:
        """Cache slots `slots` [k] get the read rows `staged[pick]` (all of them when `pick` is None)."""
        if self.gather_view is None:  # the slab is on the device: stream-ordered copies
            rows = staged.to(self.device, non_blocking=True)
            self.cache.slab[self._on_device(slots)] = rows if pick is None else rows[self._on_device(pick)]
            return
        if self._gathered is not None:  # a gather may still read slots being reused: let it finish first
            self._gathered.synchronize()
            self._gathered = None
        self.cache.slab[slots] = staged if pick is None else staged[pick]  # host RAM, written by the host

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of cache `slots` (CPU int64) on the device: from the VRAM slab, or the host slab in place."""
        if self.gather_view is None:
            return self.cache.slab[self._on_device(slots)]
        out = self.gather_view[self._on_device(slots)]
        self.replayed()
        return out

    def _assemble(self, ticket: _Ticket) -> torch.Tensor:
        """Cache hits from the slab, misses as read, when not every miss fits in the cache."""
        hit = ticket.slots >= 0
        out = torch.empty(ticket.uniq.numel(), self.dim, dtype=self.dtype, device=self.device)
        if bool(hit.any()):
            out[self._on_device(hit.nonzero().view(-1))] = self._gather(ticket.slots[hit])
        out[self._on_device((~hit).nonzero().view(-1))] = ticket.staged.to(self.device, non_blocking=True)
        return out[self._on_device(ticket.inverse)].view(*ticket.shape, self.dim)

    def _on_device(self, index: torch.Tensor) -> torch.Tensor:
        """A host index tensor on the compute device: through pinned memory, so the copy does not block."""
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def device_table(self, layer: int) -> torch.Tensor | None:
        """The layer's whole table as the compute device reads it in place (VRAM, or pinned / tmpfs RAM
        through its device mapping), or None when rows go through the row cache (decode steps then take
        the host path)."""
        if self.tier == "gpu":
            return self.full[layer]
        return self.mapped.get(layer)

    def note_direct(self, layer: int, n: int) -> None:
        """Count `n` lookups the device served itself from `device_table(layer)` (a decode step in a graph)."""
        self.stats_.lookups += n
        self._count(self.tier, n)

    @locked
    def prefetch(self, layer: int, rows: torch.Tensor) -> None:
        """Read `rows` of `layer` into the cache ahead of need (e.g. a whole prompt at admission)."""
        if self.tier == "gpu" or self.mapped or self.cache is None or not self.prefetch_on:
            return
        ticket = self.start(layer, rows)
        self.stats_.prefetched += ticket.miss.numel()
        self._pending.append(ticket)

    # -- internals -----------------------------------------------------------------------------------
    def _issue(self, ticket: _Ticket) -> None:
        """Queue the reads of the ticket's missing rows in batches of `read_batch` rows."""
        with torch.inference_mode(False):  # reader threads write the buffers outside inference mode
            self._queue_reads(ticket)

    def _queue_reads(self, ticket: _Ticket) -> None:
        miss, layer = ticket.miss, ticket.layer
        pin = self.device.type == "cuda" and self.gather_view is None  # copied to a VRAM slab; a host slab takes pageable
        ticket.staged = torch.empty(miss.numel(), self.dim, dtype=self.dtype, pin_memory=pin)
        ticket.reads = []
        if not miss.numel():
            return
        self.stats_.bytes_read += miss.numel() * self.row_bytes
        flat = ticket.staged.view(torch.uint8).view(miss.numel(), self.row_bytes)
        for a in range(0, miss.numel(), self.read_batch):
            part, dst = miss[a : a + self.read_batch], flat[a : a + self.read_batch]
            if self.tier == "pinned":
                ticket.reads.append(_done(torch.index_select(self.full[layer], 0, part, out=ticket.staged[a : a + self.read_batch])))
            else:
                t = self.tables[layer]
                base = 0 if self.tier == "tmpfs" else t.offset
                ticket.reads.append(self.reader.read_rows(self.paths[layer], base, self.row_bytes, part.numpy(), dst))

    def _absorb(self, block: bool) -> None:
        """Admit finished prefetches (all of them when `block`) into the cache; nothing is gathered."""
        keep = []
        for ticket in self._pending:
            if not (block or all(f.done() for f in ticket.reads)):
                keep.append(ticket)
                continue
            self._live = [t for t in self._live if t is not ticket]
            self._await(ticket)
            if self.cache is not None:  # rows that find no room are dropped: a prefetch is only a hint
                self._admit(ticket, [t.slots[t.slots >= 0] for t in self._live])
        self._pending = keep

    @locked
    def absorb_prefetches(self) -> None:
        """Wait for every prefetch in flight and admit its rows (a warm-up: the row cache primed with a history)."""
        self._absorb(block=True)

    def _count(self, tier: str, n: int) -> None:
        self.stats_.hits[tier] = self.stats_.hits.get(tier, 0) + n

    @locked
    def stats(self) -> dict:
        """Row lookups, distinct rows served per tier, bytes read, stall seconds, cache residency."""
        s = self.stats_
        return {
            "tier": self.tier, "zero_copy": bool(self.mapped),
            "lookups": s.lookups, "unique_rows": s.unique, "hits": dict(s.hits),
            "bytes_read": s.bytes_read, "stall_s": s.stall_s, "prefetched_rows": s.prefetched,
            "cache_rows": self.cache.capacity if self.cache else 0, "cache_resident": self.cache.resident if self.cache else 0,
            "cache_evictions": self.cache.evictions if self.cache else 0,
            "cache_in": "pinned RAM, read in place" if self.gather_view is not None else "device" if self.cache else None,
            "table_bytes": sum(t.nbytes for t in self.tables.values()),
        }  # fmt: skip

    def close(self) -> None:
        if self.handshake is not None:
            self.handshake.close()
            self.handshake = None
        if self.reader is not None:
            self.reader.close()
        self.mapped = {}
        if self._registered:
            torch.cuda.synchronize(self.device)  # no kernel may still read a mapping being unregistered
            self._unregister()


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def resolve_tier(tier: str, table_bytes: int, ram_available: int, tmpfs_budget: int) -> str:
    """`engram.tier = "auto"`: pinned RAM when the tables take at most half the available RAM, else tmpfs
    when its budget holds them, else disk (only hot rows cached)."""
    if tier != "auto":
        return tier
    if table_bytes <= ram_available // 2:
        return "pinned"
    if table_bytes <= tmpfs_budget:
        return "tmpfs"
    return "disk"

