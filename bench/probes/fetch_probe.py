"""What a split decode layer's fetch of the worker's answer costs when the answer is already there, and of what.

    python bench/probes/fetch_probe.py [--calls 64] [--floats 2048] [--out DIR]

Each variant runs `calls` times back to back in one CUDA graph (the answer's `done` word already holds the
generation waited for), replayed 20 times: us a call. Variants:
  empty        a one-warp Triton kernel that stores one word: the graph's launch floor
  wait         the acquire loop on `done` alone (one program, one warp), no data
  fetch        `host_signal.wait_and_fetch` as decode runs it (2 programs of 1,024 fp32, volatile loads)
  fetch_plain  the same with plain loads of the answer after the acquire
  fetch_p8     the same as fetch_plain in 8 programs of 256 fp32
  read_only    the answer's plain loads alone, 8 programs, no wait
Writes fetch_probe.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from strata.kernels.gpu.host_signal import load_acquire, wait_and_fetch  # noqa: E402


@triton.jit
def _empty(out_ptr):
    tl.store(out_ptr, 1.0)


@triton.jit
def _wait(hdr_ptr, gen_ptr):
    want = tl.load(gen_ptr)
    seen = load_acquire(hdr_ptr + 1, True)
    while seen != want:
        seen = load_acquire(hdr_ptr + 1, True)


@triton.jit
def _fetch(hdr_ptr, gen_ptr, src_ptr, out_ptr, n, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    pid = tl.program_id(0)
    if WAIT:
        want = tl.load(gen_ptr)
        seen = load_acquire(hdr_ptr + 1, True)
        while seen != want:
            seen = load_acquire(hdr_ptr + 1, True)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(src_ptr + offs, mask=m, other=0.0), mask=m)


def timed(fn, calls: int) -> float:
    """us a call of `fn`, `calls` of them captured in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / (20 * calls), 2)


def answered(n: int) -> tuple[torch.Tensor, ...]:
    """(header, gen, src, out): a page-locked mailbox header whose `done` already holds the generation `gen`
    [1] (device), an fp32 answer `src` [n] (page-locked) and `out` [n] (device) to fetch it into."""
    header = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    header[1] = 7
    gen = torch.tensor([7], dtype=torch.int64, device="cuda")
    return header, gen, torch.randn(n, pin_memory=True), torch.empty(n, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--floats", type=int, default=2048)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    n = args.floats
    header, gen, src, out = answered(n)
    word = torch.empty(1, device="cuda")
    variants = {
        "empty": lambda: _empty[(1,)](word, num_warps=1),
        "wait": lambda: _wait[(1,)](header, gen, num_warps=1),
        "fetch": lambda: wait_and_fetch(header, gen, src, out),
        "fetch_plain": lambda: _fetch[(triton.cdiv(n, 1024),)](header, gen, src, out, n, BLOCK=1024, WAIT=True, num_warps=4),
        "fetch_p8": lambda: _fetch[(triton.cdiv(n, 256),)](header, gen, src, out, n, BLOCK=256, WAIT=True, num_warps=2),
        "read_only": lambda: _fetch[(triton.cdiv(n, 256),)](header, gen, src, out, n, BLOCK=256, WAIT=False, num_warps=2),
    }
    res = {"calls": args.calls, "floats": n}
    for rep in range(2):  # twice: the second pass is the one to read (clocks settled)
        for name, fn in variants.items():
            out.zero_()
            res[name] = timed(fn, args.calls)
            if name not in ("empty", "wait") and not torch.equal(out.cpu(), src):
                res[name + "_wrong"] = True
        print(rep, res, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fetch_probe.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
