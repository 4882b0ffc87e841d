"""Which optional kernel features a forward pass uses: the fused kernels (Triton on CUDA, the compiled decode rows
on the CPU: strata.kernels.cpu.rows) and programmatic dependent launch (`[debug] fused_kernels`, `[debug] pdl`); and
the CPU kernel pool's thread count for a CPU pass's dense projections (`[debug] cpu_threads`,
strata.kernels.cpu.dense).

The kernels' wrappers ask deep inside a forward pass (`fused.fused_ok`, `pdl.on`), where no engine is in reach, so
the engine's model sets its options around each forward pass (`MoETransformer.forward`) and the wrappers read them
here: a context variable, so two engines of one process (or threads of one engine) each see their own. A CUDA
graph captures the kernels its capture launched, so a replayed step keeps the options it was captured with.
Outside any forward pass the defaults hold (both on).

    with kernel_options(KernelOptions(fused=False)):
        hidden = model.run_layers(...)   # torch's op chains instead of the fused kernels
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    """fused: the decode step's fused kernels, Triton on CUDA and the compiled decode rows on the CPU (off: torch's op
    chains, the reference for bisecting numerics);
    pdl: programmatic dependent launch where the GPU has it (off: kernels wait for the one before to end);
    cpu_threads: the CPU kernel pool's threads for dense projections on the CPU (None: the pool's default count;
    the same count as the expert calls', or the pool is rebuilt between them)."""

    fused: bool = True
    pdl: bool = True
    cpu_threads: int | None = None


DEFAULT = KernelOptions()
_current: ContextVar[KernelOptions] = ContextVar("strata_kernel_options", default=DEFAULT)


def current() -> KernelOptions:
    """The options of the forward pass running on this thread (the defaults outside one)."""
    return _current.get()


class kernel_options:  # noqa: N801 - used as a context manager, like contextlib's
    """`options` hold inside the block, on this thread; the ones before come back after it. (A class, not a
    generator: entered once a forward pass, it costs a context variable's set and reset.)"""

    __slots__ = ("options", "_token")

    def __init__(self, options: KernelOptions):
        self.options = options

    def __enter__(self) -> KernelOptions:
        self._token = _current.set(self.options)
        return self.options

    def __exit__(self, *exc) -> None:
        _current.reset(self._token)
