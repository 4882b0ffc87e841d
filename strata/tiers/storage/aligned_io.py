"""The pieces aligned store reads are made of: the 4096-byte alignment O_DIRECT asks for, aligned CPU buffers, the
filesystem a path lives on (memory-backed ones are read buffered), a positional read that fills a buffer, and the
check of a caller's output tensor."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from strata.errors import CheckpointError

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (logical block size on every disk we target)
MEMORY_FS = {"tmpfs", "ramfs", "hugetlbfs"}  # filesystems whose files are memory already
PathLike = str | os.PathLike


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose data_ptr is 4096-aligned; `pin` page-locks it when CUDA is available."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    pin = pin and torch.cuda.is_available()
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if t.data_ptr() % ALIGN == 0:  # cudaHostAlloc and large CPU allocations usually are
        return t
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -base.data_ptr() % ALIGN
    return base[skip : skip + nbytes]  # the view keeps `base` alive


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding `path` (longest mount-point prefix in /proc/self/mounts)."""
    real, best, fstype = os.path.realpath(path), "", ""
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])  # \040 = space
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:  # not Linux: treat as a disk
        pass
    return fstype


def pread(path: str, fd: int, buf: np.ndarray, offset: int, need: int) -> None:
    """Fill `buf` (all of it requested, at least `need` bytes required: O_DIRECT reads whole blocks) from `offset`."""
    got = 0
    try:
        while got < need:
            n = os.preadv(fd, [buf[got:]], offset + got)  # loops: Linux caps one call near 2 GiB
            if n <= 0:
                raise CheckpointError(f"{path} ended early: {got} of {need} bytes at offset {offset}; the store file is truncated")
            got += n
    except OSError as e:
        raise CheckpointError(f"cannot read {path} at offset {offset}: {e.strerror}") from e


def as_bytes(out: torch.Tensor, nbytes: int, keep_tensor: bool = False) -> Any:
    """Check `out` is a contiguous CPU uint8 tensor of at least `nbytes`; its first `nbytes` as numpy (or torch)."""
    if out.device.type != "cpu" or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous CPU uint8 tensor, got {out.dtype} on {out.device}")
    if out.numel() < nbytes:
        raise ValueError(f"out holds {out.numel()} bytes, {nbytes} needed")
    flat = out.view(-1)[:nbytes]
    return flat if keep_tensor else flat.numpy()
