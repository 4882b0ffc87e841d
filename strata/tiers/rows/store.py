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

`EngramRowStore` is made of parts, each in its own module, and its methods delegate to them:

    row_tables  RowTables (load): the tables in their tier, checked at start-up; whole, files, device mappings
    cached      CachedRows (cached): the row cache and its slab, admissions and gathers by slot (None: no cache)
    reads       TierReads (reads): the misses' reads from the tier, on the reader's threads
    host        HostRows (host): tickets started and waited for, prefetches absorbed
    steps       GraphSteps (graph_steps): decode steps in CUDA graphs, the handshake's layers
    stats_      RowStats (tickets): every lookup, row served, byte read and stall counted

Every table is checked at start-up: a missing or mis-sized file stops it (as in `ExpertStore.open`),
and each chunk's checksum is verified while the table is loaded (gpu, pinned), copied (tmpfs) or, for
disk, read in a streaming pass: a damaged table stops start-up with an error naming it. That full pass
runs once per table file, not once per start: a verification record (strata.tiers.store.verify_record) then
vouches for the file while its size, mtime, ctime and inode stay the same, so later starts skip the
read (disk; tmpfs, whose recorded copy in /dev/shm is reused) or only the checksums (gpu, pinned hold
the table and read it anyway). Rows read while serving (`DiskReader.read_rows` on the store file or the
tmpfs copy) are not checksummed: they come from a file the pass or the record
vouched for, and damage that leaves the file's identity unchanged is for `strata verify`.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from strata.errors import CheckpointError, ConfigError
from strata.tiers.rows.cache import RowCache
from strata.tiers.rows.cached import CachedRows
from strata.tiers.rows.graph_steps import GraphSteps
from strata.tiers.rows.host import HostRows
from strata.tiers.rows.load import RowTables
from strata.tiers.rows.reads import TierReads
from strata.tiers.rows.tickets import RowStats, Ticket
from strata.tiers.storage.diskio import DiskReader
from strata.tiers.store.format import TableEntry
from strata.tiers.store.store import ExpertStore

ENGRAM_TIERS = ("gpu", "pinned", "tmpfs", "disk")


def table_name(layer: int) -> str:
    """The store's table object holding Engram layer `layer`'s rows."""
    return f"engram.{layer}"


def locked(method):
    """Run `method` under the store's lock: the handshake's host thread serves decode steps from it too."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


class EngramRowStore:
    """Rows of every Engram table of a store, from `tier`, through a `row_cache`-row cache on `device`."""

    def __init__(self, store: ExpertStore, layers: list[int], tier: str, device: torch.device, row_cache: int,
                 prefetch: bool = True, read_batch: int = 4096, tmpfs_dir: str = "/dev/shm/strata",
                 threads: int = 8, zero_copy: bool = True):
        if tier not in ENGRAM_TIERS:
            raise ConfigError(f"engram.tier = {tier!r} is invalid; use auto or one of {', '.join(ENGRAM_TIERS)}")
        entries: dict[int, TableEntry] = {}
        for layer in layers:
            name = table_name(layer)
            if name not in store.index.tables:
                raise CheckpointError(f"{store.directory}: the store has no Engram table {name!r} (layer {layer}); "
                                      "delete the store and re-run `strata convert`")
            entries[layer] = store.index.tables[name]
        self.store, self.tier, self.device = store, tier, device
        self.stats_ = RowStats()
        self.lock = threading.RLock()  # the cache's bookkeeping: the compute thread and the handshake's host thread
        self.handshake = None  # a RowHandshake once `start_handshake` made one (decode graphs wait on the device)
        self.row_tables = RowTables(store, entries, tier, device, tmpfs_dir, zero_copy)
        self.reader = DiskReader(threads) if tier in ("tmpfs", "disk") else None
        t = self.row_tables
        direct = t.in_place or (tier == "pinned" and device.type == "cpu")
        cache_rows = 0 if direct else min(row_cache, t.total_rows)
        self.cached = CachedRows(t.base, t.total_rows, cache_rows, t.dim, t.dtype, device,
                                 host_slab=zero_copy and tier in ("tmpfs", "disk")) if cache_rows > 0 else None
        # rows read for a VRAM slab are staged in pinned RAM (an asynchronous copy); a host slab takes pageable
        pin = device.type == "cuda" and self.gather_view is None
        self.reads = TierReads(t, self.reader, read_batch, pin, self.stats_)
        self.host = HostRows(t, self.cached, self.reads, self.stats_, prefetch)
        self.steps = GraphSteps(self.host, self.cached, t, self.reader, self.stats_)

    # -- what the tables and the cache are -----------------------------------------------------------------
    @property
    def tables(self) -> dict[int, TableEntry]:
        """Layer -> its table in the store."""
        return self.row_tables.entries

    @property
    def dtype(self) -> torch.dtype:
        return self.row_tables.dtype

    @property
    def dim(self) -> int:
        """Values per row (the head dimension)."""
        return self.row_tables.dim

    @property
    def full(self) -> dict[int, torch.Tensor]:
        """gpu / pinned tiers: layer -> the whole table [rows, head_dim]."""
        return self.row_tables.full

    @property
    def paths(self) -> dict[int, str]:
        """tmpfs / disk tiers: layer -> the file its rows are read from."""
        return self.row_tables.paths

    @property
    def verified_from_record(self) -> set[str]:
        """Tables whose start-up checksum pass the verification record made unnecessary."""
        return self.row_tables.verified_from_record

    @property
    def tmpfs_reused(self) -> set[str]:
        """Tables whose tmpfs copy from an earlier start was reused."""
        return self.row_tables.tmpfs_reused

    @property
    def chunks_read(self) -> int:
        """Table chunks read at start-up."""
        return self.row_tables.chunks_read

    @property
    def cache(self) -> RowCache | None:
        """The row cache's bookkeeping and slab; None where the device reads the tables themselves."""
        return self.cached.cache if self.cached is not None else None

    @property
    def gather_view(self) -> torch.Tensor | None:
        """The row cache's host slab as the device reads it in place [cache rows, head_dim], or None."""
        return self.cached.gather_view if self.cached is not None else None

    # -- the row source protocol (strata.runtime.model.engram.layer.RowSource) -------------------------------------
    @locked
    def start(self, layer: int, rows: torch.Tensor) -> Ticket:
        """Begin serving `rows` (int64 CPU [T, heads]) of `layer`; returns at once."""
        return self.host.start(layer, rows)

    @locked
    def wait(self, ticket: Ticket) -> torch.Tensor:
        """The rows of `ticket` [T, heads, head_dim] on the device, waiting only for reads still in flight."""
        return self.host.wait(ticket)

    @locked
    def prefetch(self, layer: int, rows: torch.Tensor) -> None:
        """Read `rows` of `layer` into the cache ahead of need (e.g. a whole prompt at admission)."""
        self.host.prefetch(layer, rows)

    @locked
    def absorb_prefetches(self) -> None:
        """Wait for every prefetch in flight and admit its rows (a warm-up: the row cache primed with a history)."""
        self.host.absorb(block=True)

    def device_table(self, layer: int) -> torch.Tensor | None:
        """The layer's whole table as the compute device reads it in place (VRAM, or pinned / tmpfs RAM
        through its device mapping), or None when rows go through the row cache (decode steps then take
        the host path)."""
        return self.row_tables.device_table(layer)

    def note_direct(self, layer: int, n: int) -> None:
        """Count `n` lookups the device served itself from `device_table(layer)` (a decode step in a graph)."""
        self.stats_.lookups += n
        self.stats_.served(self.tier, n)

    # -- decode steps in CUDA graphs (strata.tiers.rows.graph_steps) -----------------------------------------
    @locked
    def finish_step(self, tickets: dict) -> dict[int, torch.Tensor]:
        """Every layer's rows of a decode step in the cache; per layer the slot of each asked-for row
        (`GraphSteps.finish_step`)."""
        return self.steps.finish_step(tickets)

    @locked
    def check_step(self, tickets: dict) -> None:
        """Raise unless the cache can hold every distinct row of a decode step at once."""
        self.steps.check_step(tickets)

    @locked
    def finish_one(self, ticket: Ticket, held: list[torch.Tensor], others) -> torch.Tensor:
        """One layer of a decode step admitted to the cache; the slot of each asked-for row
        (`GraphSteps.finish_one`)."""
        return self.steps.finish_one(ticket, held, others)

    @locked
    def serve_layer(self, layer: int, ids: np.ndarray, held: list[np.ndarray], out: np.ndarray) -> None:
        """One Engram layer of a one-graph decode step, each id's cache slot written to `out`
        (`GraphSteps.serve_layer`)."""
        self.steps.serve_layer(layer, ids, held, out)

    def replayed(self) -> None:
        """A CUDA graph that gathers from the host slab was launched: its slots are rewritten only after it."""
        if self.cached is not None:
            self.cached.replayed()

    def start_handshake(self, layers: list[int], heads: int, max_tokens: int):
        """Serve decode steps of up to `max_tokens` tokens to CUDA graphs that wait on the device for their rows
        (strata.tiers.rows.handshake); None where that cannot run (`GraphSteps.handshake_for`)."""
        if self.handshake is None:
            self.handshake = self.steps.handshake_for(self, layers, heads, max_tokens)
        return self.handshake

    @locked
    def stats(self) -> dict:
        """Row lookups, distinct rows served per tier, bytes read, stall seconds, cache residency."""
        s, cache = self.stats_, self.cache
        return {
            "tier": self.tier, "zero_copy": bool(self.row_tables.mapped),
            "lookups": s.lookups, "unique_rows": s.unique, "hits": dict(s.hits),
            "bytes_read": s.bytes_read, "stall_s": s.stall_s, "prefetched_rows": s.prefetched,
            "cache_rows": cache.capacity if cache else 0, "cache_resident": cache.resident if cache else 0,
            "cache_evictions": cache.evictions if cache else 0,
            "cache_in": "pinned RAM, read in place" if self.gather_view is not None else "device" if cache else None,
            "table_bytes": sum(t.nbytes for t in self.tables.values()),
        }  # fmt: skip

    def close(self) -> None:
        """Stop the handshake's thread and the reader's, drop the device mappings."""
        if self.handshake is not None:
            self.handshake.close()
            self.handshake = None
        if self.reader is not None:
            self.reader.close()
        self.row_tables.close()


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

