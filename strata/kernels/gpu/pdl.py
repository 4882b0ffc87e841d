"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode layer is a chain of a dozen small kernels, each waiting for the one before it. Inside a CUDA graph
each boundary still costs the next kernel's launch and ramp-up (~1-2 us on the H200: `bench/tools/profile_decode.py`
at 6667112 put ~18 us of an ~85 us all-in-VRAM layer between its kernels). On Hopper and later a kernel launched
with the programmatic-serialization attribute may start while the kernel before it is still running; it must then
wait (`griddepcontrol.wait`) before it touches anything that kernel writes, and a kernel lets its dependants
start early by `griddepcontrol.launch_dependents`. CUDA graphs capture both as a programmatic edge.

The contract every kernel here keeps, so that PDL can never change a result:
- a kernel launched with PDL calls `enter(PDL)` before its first load of anything another kernel writes
  (activations, routing, slots, caches, counters) and before its first store; only loads of weights that no
  kernel in the step writes (a projection's W) may come before it;
- `enter` waits first and then triggers, so a kernel's dependants start only once it runs past its own wait:
  at most one kernel ahead of the running one is resident early, and waits are transitive (a kernel that has
  passed its wait knows every kernel before it in the stream has finished and flushed).
Kernels that spin on host memory (`host_signal`) are launched without it: their dependants start when they end
(the fetch's copy kernel, which runs only once the spin has ended, lets its dependant launch at once).

`[debug] pdl = false` turns it off for an engine (`strata.kernels.options`). It is on only on CUDA devices of
compute capability 9.0 and later with a Triton that has the instructions; elsewhere (CPU, the interpreter, older
GPUs) kernels get PDL=False and launch as before.
"""

from __future__ import annotations

import functools
import os

import torch

from strata.kernels import options

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter has no griddepcontrol


@functools.cache
def _device_ok(index: int) -> bool:
    """Compute capability >= 9.0 and a Triton with the griddepcontrol instructions and the launch option."""
    if triton is None or _INTERPRET:
        return False
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    has_option = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return (has_option and hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")
            and torch.cuda.get_device_capability(index)[0] >= 9)


def on(x: torch.Tensor) -> bool:
    """Whether kernels working on `x`'s device launch with PDL (unless the running forward pass turned it off)."""
    return x.is_cuda and options.current().pdl and _device_ok(x.device.index if x.device.index is not None
                                                              else torch.cuda.current_device())


# Triton's FP fusion (a * b + c contracted to one FMA), named at every launch: the kernels' speed and their checks
# against the references were measured with it on, which Triton 3.9 defaults to with a warning and 3.10 will not.
FP_FUSION = {"enable_fp_fusion": True}


def launch(x: torch.Tensor) -> dict:
    """The launch keywords for a kernel that takes `PDL: tl.constexpr` and calls `enter(PDL)`: its constexpr and,
    where PDL is on, Triton's `launch_pdl` option; FP fusion on (`FP_FUSION`)."""
    return {"PDL": True, "launch_pdl": True, **FP_FUSION} if on(x) else {"PDL": False, **FP_FUSION}


if triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """Wait for the kernel before this one (it has finished and its stores are visible), then let the next
        kernel start launching. A no-op when PDL is off."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
