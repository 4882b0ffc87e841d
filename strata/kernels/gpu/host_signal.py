"""A GPU stream that waits for a word in page-locked host memory: the device side of a CPU worker's answer.

`wait_for_host(done, gen, error, spins)` enqueues one single-warp kernel that reads the int64 word `done` (page-locked,
so the GPU reads it over PCIe through unified addressing) until it equals the device scalar `gen` [1] int64, then
returns; the work queued after it on the stream runs once the host has answered. It is a plain kernel, so a CUDA
graph captures it like any other (stream memory operations would need driver calls torch does not expose). After
`max_spins` reads (about a second per million on the H200 box) it stops waiting and writes the generation it
waited for to `error`, so a dead worker shows as an error on the host instead of a GPU that spins forever.

`wait_and_fetch` does the same wait and then copies the worker's answer from host memory into a device tensor in
the kernel right after it, where a graph would otherwise add a copy node (a few microseconds of copy-engine
latency on each MoE layer's path). `store_release` and `load_acquire` are the system-scope ordering both ends rely on.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

MAX_SPINS = 20_000_000  # ~10-40 s of polling: far beyond any layer's CPU share, short enough to surface a hang


def available() -> bool:
    """Whether `wait_for_host` can run here (a CUDA GPU and Triton)."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def load_acquire(ptr, FENCE: tl.constexpr):
        """The int64 at `ptr` (host memory), read with acquire semantics at system scope: loads after it see at
        least what the host wrote before it released that value. FENCE False (Triton's interpreter): a plain
        volatile load."""
        if FENCE:
            return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                             is_pure=False, pack=1)
        else:
            return tl.load(ptr, volatile=True)

    @triton.jit
    def fence_system(anchor, FENCE: tl.constexpr):
        """Order this thread's earlier stores (host memory included) before its later ones, at system scope."""
        if FENCE:
            tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, $1;", "=r,r", [anchor], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def store_release(ptr, value, FENCE: tl.constexpr):
        """Store int64 `value` at `ptr` (host memory) with release semantics at system scope: a host that reads it
        also sees every store that happened before it (this thread's, and what it acquired from others)."""
        if FENCE:
            tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.b32 $0, 0;", "=r,l,l", [ptr, value],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.store(ptr, value)

    @triton.jit
    def _acquire_kernel(done_ptr, gen_ptr, error_ptr, spins_ptr, max_spins, FENCE: tl.constexpr):
        # one warp; every pointer an int64 word in page-locked host memory but gen's (device)
        want = tl.load(gen_ptr)
        seen = load_acquire(done_ptr, FENCE)
        spins = 0
        while (seen != want) & (spins < max_spins):
            seen = load_acquire(done_ptr, FENCE)
            spins += 1
        if seen != want:
            tl.store(error_ptr, want)
        tl.store(spins_ptr, spins.to(tl.int64))

    @triton.jit
    def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        # launched without PDL, so it runs once the acquire kernel before it has ended: src's words, written before
        # the host released `done`, are read from host memory (volatile: never from a cache). TRIGGER: nothing here
        # waits on an earlier kernel, so the combine after it (launched with PDL) may launch now
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, tl.load(src_ptr + offs, mask=m, other=0.0, volatile=True), mask=m)


READ_BLOCK = 256  # fp32 of the answer a program of the copy kernel reads
# Two kernels, not one: one warp acquires `done`, then the copy reads with plain volatile loads. One kernel in which
# every thread of every program took its own system-scope acquire had a floor of 9.4 us with the answer already
# there, against 4.1-4.3 us for the two (bench/probes/fetch_probe.py, H200 box, code a46c739).


def wait_for_host(done: torch.Tensor, gen: torch.Tensor, error: torch.Tensor, spins: torch.Tensor,
                  max_spins: int = MAX_SPINS) -> None:
    """Make the current stream wait until done[0] (int64, page-locked) equals `gen` [1] int64 (device): one warp's
    kernel reads it with acquire semantics at system scope, so work queued after it sees what the host wrote before
    it released `done`. spins[0] (page-locked) gets the reads it took (0: the host had answered before the GPU
    asked; reported as how long the GPU waited for the host); after `max_spins` reads it gives up and writes the
    generation it waited for to error[0]. On CPU tensors it runs only under Triton's interpreter (tests)."""
    if triton is None:
        raise RuntimeError("waiting on host memory from the GPU needs Triton")
    _acquire_kernel[(1,)](done, gen, error, spins, max_spins, FENCE=gen.is_cuda, num_warps=1,
                          **pdl.FP_FUSION)


def wait_and_fetch(header: torch.Tensor, gen: torch.Tensor, src: torch.Tensor, out: torch.Tensor,
                   max_spins: int = MAX_SPINS) -> None:
    """`wait_for_host` on a mailbox header (int64 [8], page-locked: [1] done, [3] the generation given up on, [4]
    reads of done while waiting), then copy fp32 `src` [n] (page-locked) into `out` [n] (device) in the kernel right
    after it (a graph would otherwise add a copy node: a few microseconds of copy-engine latency on each MoE layer's
    path)."""
    if triton is None:
        raise RuntimeError("waiting on host memory from the GPU needs Triton")
    n = src.numel()
    if out.numel() != n or src.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError(f"wait_and_fetch copies fp32 [{n}] into fp32 [{n}], got {out.dtype} [{out.numel()}]")
    wait_for_host(header[1:2], gen, header[3:4], header[4:5], max_spins)
    _read_kernel[(max(1, triton.cdiv(n, READ_BLOCK)),)](src, out, n, BLOCK=READ_BLOCK, TRIGGER=pdl.on(out),
                                                        num_warps=2, **pdl.FP_FUSION)
