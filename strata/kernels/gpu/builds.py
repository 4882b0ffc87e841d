"""Triton builds of strata's kernels for a GPU target, counted and compiled on any machine, no GPU needed.

Triton builds a kernel once per specialization key: its constexprs, each plain int argument's class (1, a multiple
of 16, other) and each pointer's alignment. `recorded_launches` replaces Triton's launch with its own binder for a
CUDA target (sm_90, the H200, by default): every launch in the block yields its key and runs nothing; with
`compile=True` each new key is also compiled for that target here, on the CPU, with the ptxas Triton's wheel
carries, and timed. The CPU tests otherwise run the kernels only through Triton's interpreter, which compiles
nothing: this finds what only the compiler rejects, and which arguments cost a build per value class.

`as_on_the_gpu` makes the kernels' wrappers take their GPU path on CPU tensors (so their launches reach the
recorder), and `triton_kernels` lists the launchable kernels strata defines. Both patch module state for the
block's duration: use them from one thread, never while serving.
"""

from __future__ import annotations

import collections
import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

from strata.errors import StrataError

H200 = (9, 0)  # CUDA compute capability (major, minor) of the H200: the default target


class Unavailable(StrataError):
    """What the recorder needs is not here: Triton, or Triton's binder as `recorded_launches` knows it."""


def target_name(target: tuple[int, int]) -> str:
    """(9, 0) -> "sm_90": the CUDA architecture's name."""
    return f"sm_{target[0]}{target[1]}"


@contextlib.contextmanager
def recorded_launches(target: tuple[int, int] = H200, compile: bool = False) -> Iterator[dict[str, dict]]:
    """Every Triton launch in the block is recorded, not run: yields {kernel name: {key: build seconds or None}},
    one entry per specialization key Triton's binder gives the launch for the CUDA `target` (major, minor).
    compile: each new key is compiled for `target` on this machine and timed (the seconds; None without).
    Raises `Unavailable` where Triton is missing or its binder is not the one this knows (its internals)."""
    try:
        import triton
        import triton.runtime.jit as jit
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend

        gpu = GPUTarget("cuda", target[0] * 10 + target[1], 32)
        backend = make_backend(gpu)
        make_binder = jit.create_function_from_signature
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"this Triton's binder is not the one strata.kernels.gpu.builds knows: {e}") from e
    keys: dict[str, dict] = collections.defaultdict(dict)
    binders: dict = {}

    # the options JITFunction.run adds to a launch's, where this Triton has them
    added = [name for name in ("instrumentation_mode", "fpsan_homomorphic_casts") if hasattr(knobs.compilation, name)]

    def record(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs.update({name: getattr(knobs.compilation, name) for name in added})
        binder = binders.get(self.fn)
        if binder is None:
            binder = binders[self.fn] = make_binder(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        key = repr((specialization, sorted(options.items())))
        seen = keys[self.fn.__name__]
        if key in seen:
            return
        seen[key] = None
        if compile:
            opts, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
            start = time.perf_counter()
            triton.compile(ASTSource(self, signature, constexprs, attrs), target=gpu, options=opts.__dict__)
            seen[key] = time.perf_counter() - start

    original = jit.JITFunction.run
    jit.JITFunction.run = record
    try:
        yield keys
    finally:
        jit.JITFunction.run = original


def build_counts(keys: dict[str, dict]) -> dict[str, dict]:
    """`recorded_launches`' record summed per kernel: {name: {"builds": keys, "seconds": total compile seconds,
    rounded to 0.01, or None where nothing was compiled}}."""
    out = {}
    for name, seen in keys.items():
        compiled = [s for s in seen.values() if s is not None]
        out[name] = {"builds": len(seen), "seconds": round(sum(compiled), 2) if compiled else None}
    return out


@contextlib.contextmanager
def as_on_the_gpu() -> Iterator[None]:
    """The kernels' wrappers take their GPU path on CPU tensors (launches recorded by `recorded_launches`, never
    run: outside it they would run in Triton's interpreter), with programmatic dependent launch on, as on the H200."""
    from strata.kernels.gpu import fused, pdl

    saved = fused._INTERPRET, pdl.on
    fused._INTERPRET, pdl.on = True, (lambda x: True)
    try:
        yield
    finally:
        fused._INTERPRET, pdl.on = saved


_KERNEL_DEF = re.compile(r"@triton\.jit[^\n]*\n\s*def (_\w+_kernel)\(")


def triton_kernels() -> set[str]:
    """The launchable Triton kernels strata defines: each `def _..._kernel(` under `@triton.jit` in the package's
    sources (read, not imported: the list holds where Triton is missing). A compile check over strata's kernels
    compares what it built against this, so a new kernel cannot be left out of it."""
    import strata

    found: set[str] = set()
    for path in sorted(Path(strata.__file__).parent.rglob("*.py")):
        found |= set(_KERNEL_DEF.findall(path.read_text()))
    return found
