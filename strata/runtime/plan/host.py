"""What this host offers the tiers: GPUs and their free VRAM, RAM, tmpfs and disk space.

`probe_host` never fails: a CPU-only host has no GPUs, a missing tmpfs has 0 bytes free (and
`tmpfs_problem` says why), and a path that does not exist yet is measured on its nearest existing parent
(where it would be created).
The planner takes a `HostInfo`, so tests and `strata plan --gpu-mem/--ram` can describe another host.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

# filesystems whose pages live in RAM: a "tmpfs" path anywhere else gives no tmpfs tier
_RAM_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass
class GpuInfo:
    """One CUDA device as seen now."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int


@dataclass
class HostInfo:
    """The memory and storage a plan can use; byte counts are as probed (or as overridden)."""

    gpus: list[GpuInfo] = field(default_factory=list)
    ram_total: int = 0
    ram_available: int = 0
    tmpfs_path: str = ""
    tmpfs_free: int = 0
    tmpfs_problem: str = ""  # why tmpfs_path gives no tmpfs tier ("" when it does), e.g. "... is not a tmpfs mount"
    disk_path: str = ""
    disk_free: int = 0
    cpu_count: int = 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostInfo:
        """The inverse of `to_dict`."""
        return cls(**{**d, "gpus": [GpuInfo(**g) for g in d.get("gpus", [])]})


def probe_host(tmpfs_path: str, disk_path: str) -> HostInfo:
    """Probe GPUs (free VRAM now), RAM, and the free space where the tmpfs and disk tiers live."""
    vm = psutil.virtual_memory()
    tmpfs = _expand(tmpfs_path)
    disk = _expand(disk_path)
    return HostInfo(
        gpus=_probe_gpus(),
        ram_total=int(vm.total),
        ram_available=int(vm.available),
        tmpfs_path=str(tmpfs),
        tmpfs_free=_free_bytes(tmpfs, require_ram_fs=True),
        tmpfs_problem=tmpfs_problem(tmpfs),
        disk_path=str(disk),
        disk_free=_free_bytes(disk),
        cpu_count=os.cpu_count() or 1,
    )


def _probe_gpus() -> list[GpuInfo]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        gpus = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)  # what other processes use is already subtracted
            gpus.append(GpuInfo(index=i, name=torch.cuda.get_device_name(i), total_bytes=int(total), free_bytes=int(free)))
        return gpus
    except Exception:  # a broken driver should not stop a CPU plan; the engine reports CUDA errors itself
        return []


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(path)).expanduser().absolute()


def nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (where `path` would be created)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def tmpfs_problem(path: Path) -> str:
    """Why `path` cannot hold the tmpfs tier, or "": it must be on a RAM filesystem, or not exist yet with
    its nearest existing parent on one (it is created there on first use)."""
    where = nearest_existing(path)
    fstype = _fs_type(where)
    if fstype in _RAM_FILESYSTEMS:
        return ""
    if where != path:
        return f"tiers.tmpfs.path {path} does not exist"
    return f"tiers.tmpfs.path {path} is not a tmpfs mount" + (f" (it is on {fstype})" if fstype else "")


def _free_bytes(path: Path, require_ram_fs: bool = False) -> int:
    """Free bytes on the filesystem that holds (or would hold) `path`; 0 when unknown."""
    where = nearest_existing(path)
    if require_ram_fs and _fs_type(where) not in _RAM_FILESYSTEMS:
        return 0  # e.g. /dev/shm missing: measuring / instead would pretend a disk is RAM
    try:
        return int(shutil.disk_usage(where).free)
    except OSError:
        return 0


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` ("" when it cannot be told)."""
    try:
        parts = psutil.disk_partitions(all=True)
    except Exception:
        return ""
    real = os.path.realpath(path)
    best, fstype = -1, ""
    for p in parts:
        mp = p.mountpoint.rstrip("/") or "/"
        if (real == mp or real.startswith(mp + "/") or mp == "/") and len(mp) >= best:
            best, fstype = len(mp), p.fstype
    return fstype


def l2_cache_bytes(cpu: int = 0, sysfs: str = "/sys/devices/system/cpu") -> int | None:
    """The size of `cpu`'s level-2 cache (unified or data) from sysfs, e.g. 2 MiB on the H200 box's Xeon; None where
    sysfs does not say (not Linux, a container hiding it)."""
    base = Path(sysfs) / f"cpu{cpu}" / "cache"
    try:
        for idx in sorted(base.glob("index*")):
            if (idx / "level").read_text().strip() == "2" and (idx / "type").read_text().strip() in ("Unified", "Data"):
                text = (idx / "size").read_text().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError):
        return None
    return None
