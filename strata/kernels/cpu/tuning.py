"""The CPU expert kernel's scheduling knobs, its per-call phase trace, and a RAM read probe on its thread pool.

Called through strata.kernels.cpu.library, which loads the kernel and hands it to these functions (re-exported by
strata.kernels.cpu.experts, `ce`):

    old = ce.tune(claim_ahead=4, down_split=1)   # knobs (`TUNE_KEYS`); returns the values before
    ce.trace(True); ...kernel calls...; phases = ce.trace(False)   # sums over the calls (`TRACE_FIELDS`)
    per_thread = ce.trace_threads(12)   # each pool thread's means over the same calls

None of the knobs changes a result: each output element keeps one writer and one summation order, whatever the
chunking or which thread reads what (tests/kernels/cpu/test_cpu_experts.py checks bit-equality across settings). They exist
to measure (`bench/cpu/cpu_kernel_trace.py`'s `--knobs`, parsed by `parse_knobs`). Each function takes the loaded
kernel `lib` (None when it is not in use: it then does nothing and returns an empty result, or None).
"""

from __future__ import annotations

import array
import ctypes
import time
from collections.abc import Sequence

import torch

TUNE_KEYS = {"claim_ahead": 1, "chunk_div": 2, "chunk_min": 3, "chunk_max": 4, "down_split": 5, "warm_streams": 6,
             "warm_touch": 7, "rest_chunks": 8, "read_split": 9, "down_stream": 10}
"""`tune`'s knobs (csrc/cpu_experts.cpp, strata_cpu_tune; defaults claim_ahead=4, chunk_div=8, chunk_min=32 KiB,
chunk_max=512 KiB, down_split=1): down chunks a thread claims and reads ahead while the gate/up phase finishes
(0 off, at most 16); chunks of total / (chunk_div x threads) bytes, clamped to [chunk_min, chunk_max];
down_split 1 pairs the down rows a thread reads two at a time across its chunk's halves (two streams in different
pages) instead of adjacent ones; warm-ahead's read (`warm_rows`, defaults 4 and 1) takes warm_streams rows at a time,
interleaved line by line, and touches one 64-byte line in warm_touch (the L2 prefetcher fetching the rest); both
clamped to 1-8; rest_chunks 1 (default) sizes the dynamic gate/up chunks from the rows not read ahead, 0 from the
whole call; read_split 1 (default) leaves the rows of a thread's warm piece that its read did not reach (a read stopped
by the next layer's post) to the dynamic chunks, 0 to that thread; down_stream (bytes, default 128 KiB) the least of
each expert's down rows a down chunk holds in a row, per stream, while every thread still gets chunk_div chunks (a
call with many experts, a prompt's, otherwise spreads a chunk over all of them in short runs, each starting with a RAM
latency)."""

TRACE_FIELDS = ("calls", "setup_ns", "last_arrival_ns", "phase1_ns", "barrier_wait_ns", "phase2_ns", "end_idle_ns",
                "close_ns", "threads_joined", "call_ns", "bytes", "phase1_chunks", "claimed_ahead")
"""`trace`'s sums over calls: set-up before the pool runs, the last thread's arrival, the gate/up phase (until its
last chunk is done), a thread's mean wait at the barrier, the down phase, a thread's mean idle time at the end,
closing the job, threads that joined, the whole call, bytes of weights read, gate/up chunks, down chunks claimed
ahead."""


def parse_knobs(text: str, source: str = "knobs") -> dict[str, int]:
    """Knobs from "name=integer" items, comma-separated (e.g. "claim_ahead=4,chunk_div=16"); ValueError naming
    `source` and the bad item."""
    knobs: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        if name.strip() not in TUNE_KEYS or not value.strip().isdigit():
            raise ValueError(f"{source}: bad item {item!r}: want name=integer with name one of "
                             f"{', '.join(TUNE_KEYS)}")
        knobs[name.strip()] = int(value)
    return knobs


def tune(lib: ctypes.CDLL | None, **knobs: int) -> dict[str, int]:
    """Set the kernel's scheduling knobs (`TUNE_KEYS`); returns their values before."""
    for name, value in knobs.items():
        if name not in TUNE_KEYS:
            raise ValueError(f"unknown CPU kernel knob {name!r} (choose from {', '.join(TUNE_KEYS)})")
        if int(value) < 0:
            raise ValueError(f"CPU kernel knob {name} must be >= 0, got {value}")
    if lib is None:
        return {}
    return {name: int(lib.strata_cpu_tune(TUNE_KEYS[name], int(value))) for name, value in knobs.items()}


def trace(lib: ctypes.CDLL | None, on: bool | None) -> dict[str, int]:
    """The kernel's per-call phase trace, summed over calls (`TRACE_FIELDS`; ns except the counts): returns the
    sums so far, then turns tracing on (zeroing the sums), off, or leaves it (None). Costs a few clock reads a
    thread and call while on."""
    if lib is None:
        return {}
    acc = (ctypes.c_int64 * len(TRACE_FIELDS))()
    lib.strata_cpu_trace(-1 if on is None else int(bool(on)), acc)
    return dict(zip(TRACE_FIELDS, (int(v) for v in acc), strict=True))


def trace_threads(lib: ctypes.CDLL | None, threads: int) -> list[dict[str, float]]:
    """The trace's per-thread means since it was last turned on (`trace(True)`), for pool threads 0..threads-1
    (0 is the caller): calls joined, and us after the pool ran until the thread arrived, had computed its warm rows'
    pieces (warm-ahead), had done its part of the gate/up phase, then `warm_rows`: the gate/up row pairs its warm
    pieces held, a call over every traced call (joined or not: what its read reached). Which thread holds the
    phase's end, and why."""
    if lib is None or threads <= 0:
        return []
    threads = min(threads, 64)  # the C side keeps 64
    row = 5  # the C side's kTraceThrRow
    buf = (ctypes.c_int64 * (row * threads))()
    out = []
    for t in range(lib.strata_cpu_trace_threads(buf, threads)):
        calls, *ns, warm_rows = buf[row * t: row * t + row]
        us = [round(v / max(1, calls) / 1e3, 1) for v in ns]
        out.append({"calls": calls, **dict(zip(("arrived_us", "warm_pieces_us", "phase1_us"), us, strict=True)),
                    "warm_rows": round(warm_rows / max(1, buf[0]), 1)})  # over every call: thread 0 joins each
    return out


def read_sweep(lib: ctypes.CDLL | None, buffers: Sequence[torch.Tensor], threads: int) -> float | None:
    """Read every byte of `buffers` (CPU tensors) once on `threads` of the kernel's thread pool; seconds taken, or
    None without the extension's AVX2 path (`lib` None). A RAM read-bandwidth probe for benchmarks (AVX2 loads, the
    same prefetch)."""
    if lib is None:
        return None
    ptrs = array.array("q", [b.data_ptr() for b in buffers])
    sizes = array.array("q", [b.numel() * b.element_size() for b in buffers])
    t0 = time.perf_counter()
    lib.strata_cpu_read_sweep(ptrs.buffer_info()[0], sizes.buffer_info()[0], len(buffers), int(threads))
    return time.perf_counter() - t0


def warm_rows(lib: ctypes.CDLL | None, addresses: Sequence[int], rows: Sequence[int], hidden: int, inter: int,
              threads: int, row_bytes: int | None = None) -> int:
    """Read the gate/up weights of experts' leading `rows` (gate_up [2 inter] rows of `row_bytes` at each address:
    2 * hidden for bf16, the default; hidden for FP8, hidden / 2 for MXFP4's values) into the caches of the kernel's
    threads, each thread the piece `run_packed(..., warm=rows)` with the same thread count gives it: what the
    mailbox worker does for the next layer's predicted cold experts while the GPU runs the serial part of a layer
    (csrc/cpu_mailbox.cpp). Returns the bytes read (0 without the compiled kernel: `lib` None)."""
    if lib is None or not addresses:
        return 0
    a, r = array.array("q", addresses), array.array("q", rows)
    if len(a) != len(r):
        raise ValueError("one row count per address")
    return int(lib.strata_cpu_warm_bytes(a.buffer_info()[0], r.buffer_info()[0], len(a), row_bytes or 2 * hidden,
                                         inter, int(threads), None, 0, None))
