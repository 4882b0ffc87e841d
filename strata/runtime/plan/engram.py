"""The planner's Engram side: where a model's Engram tables live and what they take from each memory.

    tier        gpu     the tables whole in VRAM
                pinned  whole in page-locked RAM (on a CUDA GPU read in place: no row cache)
                tmpfs   a copy in tmpfs, which is RAM too (on a CUDA GPU read in place: no row cache)
                disk    the store's own files, a hot-row cache on the compute device
    "auto" picks pinned, tmpfs or disk (strata.tiers.rows.store.resolve_tier), never the GPU.

The row cache is `engram.row_cache` bytes ("auto": 1/8 of the tables, at most 1 GiB) on the compute
device, capped at the tables' size. The planner subtracts these bytes before it sizes the expert tiers,
and refuses a tier that cannot hold the tables, naming one that can.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.config import StrataConfig
from strata.errors import StrataError
from strata.runtime.plan.checkpoints.inspect import format_bytes
from strata.tiers.rows.store import resolve_tier

ROW_CACHE_AUTO_MAX = 1 << 30


class EngramPlanError(StrataError):
    """The Engram tables do not fit where the configuration puts them."""


@dataclass
class EngramPlan:
    """Where the Engram tables live and the bytes they take from the GPU, RAM and tmpfs."""

    tier: str  # gpu | pinned | tmpfs | disk (resolved from "auto")
    table_bytes: int  # all tables, as stored
    zero_copy: bool  # the GPU reads pinned / tmpfs tables in place (no row cache)
    row_cache_bytes: int  # the hot-row cache in front of disk (or of tmpfs read without a mapping)
    gpu_bytes: int  # VRAM: tables (tier gpu) + a row cache in VRAM
    ram_bytes: int  # process RAM: tables (tier pinned, or any whole-table tier on a CPU host) + a row cache in RAM
    tmpfs_bytes: int  # the tmpfs copy (tier tmpfs)
    row_cache_in_ram: bool = False  # on a GPU: the cache is pinned RAM the GPU reads in place (tables on disk)

    def describe(self) -> str:
        """One line for `Plan.format()`."""
        f = format_bytes
        where = {"gpu": "in VRAM", "pinned": "in pinned RAM", "tmpfs": "in tmpfs", "disk": "on disk"}[self.tier]
        how = ", read in place by the GPU" if self.zero_copy else ""
        cache = f"; row cache {f(self.row_cache_bytes)}" if self.row_cache_bytes else ""
        if self.row_cache_bytes and self.row_cache_in_ram:
            cache += " in pinned RAM, read in place by the GPU"
        return f"tables {f(self.table_bytes)} {where}{how}{cache}"


def plan_engram(table_bytes: int, cfg: StrataConfig, on_gpu: bool, several_gpus: bool, ram_room: int,
                tmpfs_budget: int, tmpfs_free: int) -> EngramPlan:
    """The Engram layout for `table_bytes` of tables. `ram_room`: RAM left after the safety margin and
    the model's own RAM. "auto" takes tmpfs only within `tmpfs_budget` (tiers.tmpfs.budget, capped by the
    free space); an explicit `engram.tier = "tmpfs"` may use the `tmpfs_free` bytes of the filesystem.
    Raises `EngramPlanError` when an explicitly chosen tier cannot hold the tables."""
    e, f = cfg.engram, format_bytes
    tier = resolve_tier(e.tier, table_bytes, ram_room, tmpfs_budget)
    if tier == "gpu" and several_gpus:
        raise EngramPlanError('engram.tier = "gpu" is not planned over several GPUs; set engram.tier = "pinned" '
                              'or "auto"')
    if tier == "pinned" and table_bytes > ram_room:
        raise EngramPlanError(f"the Engram tables ({f(table_bytes)}) do not fit in the {f(ram_room)} of RAM left after "
                              'the safety margin; set engram.tier = "tmpfs" or "disk" (or "auto")')
    if tier == "tmpfs" and table_bytes > min(tmpfs_free, ram_room):
        raise EngramPlanError(f"the Engram tables ({f(table_bytes)}) do not fit in tmpfs ({f(min(tmpfs_free, ram_room))} "
                              'usable); raise tiers.tmpfs.budget or set engram.tier = "disk" (or "auto")')
    zero_copy = on_gpu and cfg.debug.engram_zero_copy and tier in ("pinned", "tmpfs")
    wanted = e.row_cache_bytes if e.row_cache_bytes is not None else min(table_bytes // 8, ROW_CACHE_AUTO_MAX)
    cached = not (tier == "gpu" or zero_copy or (tier == "pinned" and not on_gpu))
    cache = min(wanted, table_bytes) if cached else 0
    whole_on_device = table_bytes if tier == "gpu" else 0
    in_ram = on_gpu and cfg.debug.engram_zero_copy and cached  # EngramRowStore: a pinned slab mapped for the GPU
    return EngramPlan(
        tier=tier, table_bytes=table_bytes, zero_copy=zero_copy, row_cache_bytes=cache,
        gpu_bytes=(whole_on_device + (0 if in_ram else cache)) if on_gpu else 0,
        ram_bytes=(table_bytes if tier == "pinned" else 0) + (cache if in_ram else 0) + (0 if on_gpu else whole_on_device + cache),
        tmpfs_bytes=table_bytes if tier == "tmpfs" else 0, row_cache_in_ram=in_ram,
    )  # fmt: skip
