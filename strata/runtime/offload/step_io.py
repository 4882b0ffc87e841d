"""Small host <-> device moves of a decode layer's host step, and grouping its cold pairs by expert."""

from __future__ import annotations

import numpy as np
import torch


def pairs_by_expert(experts: np.ndarray, pairs: np.ndarray) -> dict[int, np.ndarray]:
    """expert -> its pairs among `pairs` (ascending), experts ascending; experts [P] is the expert of each pair."""
    if not pairs.size:
        return {}
    of = experts[pairs]
    if pairs.size <= 64:  # a decode step's few pairs: plain Python beats numpy's per-call cost (~8 us against ~25)
        by: dict[int, list[int]] = {}
        for p, e in zip(pairs.tolist(), of.tolist(), strict=True):
            by.setdefault(e, []).append(p)
        return {e: np.asarray(by[e], dtype=np.int64) for e in sorted(by)}
    order = np.argsort(of, kind="stable")  # stable: each expert's pairs stay ascending
    ids, starts = np.unique(of[order], return_index=True)
    return dict(zip(ids.tolist(), np.split(pairs[order], starts[1:]), strict=True))


def upload(values: np.ndarray, dst: torch.Tensor) -> None:
    """Copy host `values` into `dst` without waiting for the GPU (through pinned memory on CUDA)."""
    src = torch.from_numpy(values)
    if dst.is_cuda:
        src = src.pin_memory()  # the caching host allocator keeps it until the copy has run
    dst.copy_(src, non_blocking=dst.is_cuda)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """`tensors` on the host: asynchronous copies into pinned memory, then one wait for those copies."""
    if not tensors[0].is_cuda:
        return list(tensors)
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors, strict=True):
        h.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    ready.synchronize()
    return host
