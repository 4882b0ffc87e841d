"""A table-row gather's arithmetic: the 4 KiB blocks a set of rows touches, deduplicated and coalesced into runs of
consecutive blocks to read, and the rows picked out of the blocks read in one index_select."""

from __future__ import annotations

import numpy as np
import torch

from strata.tiers.storage.aligned_io import ALIGN


def block_runs(starts: np.ndarray, row_bytes: int, max_blocks: int) -> tuple[np.ndarray, ...]:
    """(ub, pos, run_a, run_b): the blocks to read for rows of `row_bytes` at byte offsets `starts` [n], where row i
    lies in a scratch buffer holding them, and the runs of consecutive blocks (at most `max_blocks` each) to read
    them in. Duplicate rows and rows straddling blocks are fine."""
    first = starts // ALIGN  # [n] first and last block of every row
    span = (starts + row_bytes - 1) // ALIGN - first + 1
    if int(span.max()) == 1:
        blocks = first
    else:  # rows over several blocks: list every block of every row
        reps = np.repeat(first, span)
        blocks = reps + np.arange(reps.size) - np.repeat(np.cumsum(span) - span, span)
    ub = np.unique(blocks)  # [m] sorted distinct blocks; scratch holds block ub[j] at j * ALIGN
    pos = np.searchsorted(ub, first) * ALIGN + (starts - first * ALIGN)  # row i in scratch
    cut = np.flatnonzero(np.diff(ub) != 1) + 1  # runs of consecutive blocks: [run_a[j], run_b[j]) of ub
    run_a, run_b = np.concatenate(([0], cut)), np.concatenate((cut, [ub.size]))
    if int((run_b - run_a).max()) > max_blocks:  # a run longer than a chunk: cut into chunk-sized pieces
        pieces = [(s, min(s + max_blocks, b)) for a, b in zip(run_a.tolist(), run_b.tolist(), strict=True)
                  for s in range(a, b, max_blocks)]
        run_a, run_b = (np.array(c, dtype=np.int64) for c in zip(*pieces, strict=True))
    return ub, pos, run_a, run_b


def gather_rows(src: torch.Tensor, pos: np.ndarray, row_bytes: int, dst: torch.Tensor) -> None:
    """dst[i] = src[pos[i] : pos[i] + row_bytes] for uint8 `src` [L] and `dst` [n, row_bytes], vectorised.

    Every position is r0 + k*g (g = gcd of the offsets from r0), so `src` seen as windows of row_bytes
    with step g is a 2-D view and the gather is one index_select: no per-row Python. When rows do not
    straddle (g a multiple of row_bytes) the view is a plain contiguous [rows, row_bytes] table."""
    r0 = int(pos.min())
    rel = pos - r0
    g = int(np.gcd.reduce(rel)) or row_bytes
    if g % row_bytes == 0:
        nrows = (src.numel() - r0) // row_bytes
        windows, step = src[r0 : r0 + nrows * row_bytes].view(nrows, row_bytes), row_bytes
    else:
        windows, step = src[r0:].unfold(0, row_bytes, g), g  # [(L - r0 - row_bytes) // g + 1, row_bytes]
    torch.index_select(windows, 0, torch.from_numpy(rel // step), out=dst)
