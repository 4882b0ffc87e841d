"""A GPU stream that waits for a word in page-locked host memory: the device side of a CPU worker's answer.

`wait_for_host(addr, gen, error_addr)` enqueues one single-thread kernel that reads the int64 at host
address `addr` (page-locked, so the GPU reads it over PCIe through unified addressing) until it equals
the device scalar `gen` [1] int64, then returns; the work queued after it on the stream runs once the
host has answered. It is a plain kernel, so a CUDA graph captures it like any other (stream memory
operations would need driver calls torch does not expose). After `max_spins` reads (about a second per
million on the H200 box) it stops waiting and writes the generation it waited for to `error_addr`, so a
dead worker shows as an error on the host instead of a GPU that spins forever.
"""

from __future__ import annotations

import torch

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
    def _wait_kernel(addr, gen_ptr, error_addr, spins_addr, MAX: tl.constexpr):
        word = addr.to(tl.pointer_type(tl.int64))
        want = tl.load(gen_ptr)
        seen = tl.load(word, volatile=True)
        spins = 0
        while (seen != want) & (spins < MAX):
            seen = tl.load(word, volatile=True)
            spins += 1
        if seen != want:
            tl.store(error_addr.to(tl.pointer_type(tl.int64)), want)
        tl.store(spins_addr.to(tl.pointer_type(tl.int64)), spins.to(tl.int64))


def wait_for_host(addr: int, gen: torch.Tensor, error_addr: int, spins_addr: int, max_spins: int = MAX_SPINS) -> None:
    """Make the current stream wait until the int64 at host address `addr` equals `gen` [1] int64 (device).
    How many reads that took lands at host address `spins_addr` (0: the host had answered before the GPU
    asked; the mailbox reports it as how long the GPU waited for its CPU worker)."""
    if not available():
        raise RuntimeError("waiting on host memory from the GPU needs CUDA and Triton")
    _wait_kernel[(1,)](addr, gen, error_addr, spins_addr, MAX=max_spins, num_warps=1)
