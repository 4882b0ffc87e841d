"""The CPU expert kernel's compiled library and its settings: which backend runs, the pool's threads, the knobs.

    lib = library()                    # the extension, built (or found in the cache) on first use; None without it
    name = backend(requested, kind)    # "avx512_bf16", "avx512", "avx2" or "torch"
    configure(threads=12, cpus=range(12), spin_us=1000, prefetch_bytes=2048)
    old = tune(claim_ahead=4); trace(True); ...kernel calls...; phases = trace(False)

The compute that runs on it is strata.kernels.cpu.experts' (`cpu_experts_forward`, `run_packed`, `start_packed`, the
mailbox worker), which re-exports this module's public names (`ce.backend`, `ce.configure`, ...);
strata.kernels.cpu.dense runs on the same library and thread pool. This module holds the process's state of it: the
loaded library, the CPU's instruction sets, the thread count and prefetch distance set by `configure`.

Backends (`backend()` says which one runs; the `backend=` argument picks, an engine's `[debug] cpu_kernel`):
  avx512_bf16  AVX-512 BF16 `vdpbf16ps`: activations and the intermediate silu(gate)*up are rounded to
               bf16, products summed in fp32. Default where the CPU has it (FP8 experts also need
               AVX512_VBMI; without it they take avx512).
  avx512       AVX-512F, bf16 weights widened to fp32 by shifts, fp32 activations and accumulation.
  avx2         AVX2 + FMA, same numerics as avx512 (8 lanes). Default on other x86-64 CPUs.
  avx512_emulated, avx512_bf16_emulated
               portable scalar emulations of the two AVX-512 kernels (same template, lane layout, weight
               conversions and summation order: bit-identical to them by construction, in every format), so
               their logic is tested on machines without AVX-512. Slow; only on request.
  torch        the reference math in fp32 on the upcast weights (`expert_swiglu`), one expert at a
               time. Used when the extension cannot be built (no compiler, not x86-64, build error:
               one warning line), when asked for ("torch"), and for plain experts with more than
               `experts.plain_max_tokens(backend)` tokens (prefill-sized groups: compute-bound, torch/oneDNN does
               them as well, on a CPU with AMX far better; the executor should send those to the GPU anyway),
               which under the compiled backends run
               as torch's bf16 GEMMs on the bf16 weights as stored (`expert_args.bf16_expert`: fp32 sums, bf16
               activations, within the avx512_bf16 bound). A quantized expert with more tokens stays on
               the kernel, its tokens in groups of `max_tokens(backend)` (torch would dequantize it first:
               a 512-token Q4_K_M prompt ran 3.4x faster so on the development machine), except where the
               GEMMs run on AMX: there one with more than `experts.quant_max_tokens(backend, kind)` tokens
               is dequantized by the compiled dequantizer (strata.kernels.cpu.dequant) for them.

`configure` sets the default thread count (else the physical cores this process may run on), the pool's
CPUs, how long idle workers spin and the software prefetch distance; `tune` the scheduling knobs
(`strata.kernels.cpu.tuning`). The extension is cached under $STRATA_CACHE/ext (else
$XDG_CACHE_HOME/strata/ext or ~/.cache/strata/ext), keyed by a hash of its sources, the compiler flags,
torch's and Python's versions.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence

import torch

from strata.kernels.cpu import expert_args, tuning
from strata.kernels.cpu.build import build_and_open, one_line
from strata.kernels.cpu.tuning import TRACE_FIELDS, TUNE_KEYS  # noqa: F401 (the knobs' and the trace's names)
from strata.kernels.quant import ExpertFormat

log = logging.getLogger(__name__)

_ISA = {"avx2": 1, "avx512": 2, "avx512_bf16": 3, "avx512_emulated": 4, "avx512_bf16_emulated": 5}
_VBMI = 6  # the ISA mask's bit for AVX512_VBMI, which avx512_bf16 reads FP8 weights with
_AUTO_ORDER = ("avx512_bf16", "avx512", "avx2")
BACKENDS = ("avx512_bf16", "avx512", "avx2", "torch")

DEFAULT_PREFETCH_BYTES = 2048
"""Software prefetch distance along each weight row, of the expert kernel and of the dense kernel (decode's projections
and LM head), where `PREFETCH_BYTES_BY_VENDOR` does not name the CPU's vendor; `configure(prefetch_bytes=)` overrides;
0: off. On an AMX Xeon VM the dense kernel read the bench model's LM head at 21.0 GB/s without it and 23.3-24.3 GB/s at
512-4,096 bytes, the expert kernel 21.8 against 24.4-24.6 GB/s (docs/benchmarks.md)."""

PREFETCH_BYTES_BY_VENDOR = {"AuthenticAMD": 0}
"""The distance by /proc/cpuinfo's vendor_id: a Zen 4 VM's hardware prefetchers read faster alone, the expert kernel's
one token 40.8-42.8 GB/s against 34.9-36.0 at 2 KiB and the dense kernel's LM head 37.7 against 32.4 GB/s
(docs/benchmarks.md, "No software prefetch on AMD CPUs")."""

_lock = threading.Lock()
META = 7  # int64 fields of one expert's row in `experts.run_packed`'s meta (csrc/cpu_experts.cpp's META_FIELDS)
_lib: ctypes.CDLL | None = None
_lib_tried = False
_isa_mask = 0
_warned: set[str] = set()
_threads_override: int | None = None
_prefetch_override: int | None = None
build_seconds: float | None = None
"""Wall time of the first load in this process (build or cache hit), for logs and benchmarks."""


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _load() -> ctypes.CDLL | None:
    """The extension, built (or found in the cache) once per process; None when it cannot be had."""
    global _lib, _lib_tried, _isa_mask, build_seconds
    if _lib_tried:
        return _lib
    with _lock:
        if not _lib_tried:
            t0 = time.perf_counter()
            try:
                lib = build_and_open()
                if lib.strata_cpu_meta_fields() != META:
                    raise RuntimeError(f"kernel takes {lib.strata_cpu_meta_fields()} meta fields, strata packs {META}")
                _isa_mask = lib.strata_cpu_isa_mask()
                lib.strata_cpu_configure(spin_us(), None, -1, prefetch_bytes())
                _lib = lib
            except Exception as exc:  # no compiler, no ninja, not x86-64, read-only cache...
                log.warning("strata: CPU expert kernel unavailable (%s); using the torch fallback", one_line(exc))
            build_seconds = time.perf_counter() - t0
            _lib_tried = True
    return _lib


def library() -> ctypes.CDLL | None:
    """The compiled library, loaded (built on first use) and configured; None when it cannot be had. The other
    kernels compiled into it (strata.kernels.cpu.dense) run on the same thread pool."""
    return _load()


# ---- the kernel's knobs, trace and read probes (strata.kernels.cpu.tuning), on the loaded kernel ----------------
def tune(**knobs: int) -> dict[str, int]:
    """Set the kernel's scheduling knobs (`TUNE_KEYS`); returns their values before ({} without the kernel)."""
    return tuning.tune(_load(), **knobs)


def trace(on: bool | None) -> dict[str, int]:
    """The kernel's per-call phase trace, summed over calls (`TRACE_FIELDS`): the sums so far, then on, off or
    left as it is (None); see `tuning.trace`."""
    return tuning.trace(_load(), on)


def trace_threads(threads: int) -> list[dict[str, float]]:
    """The trace's per-thread means since it was last turned on, for pool threads 0..threads-1 (`tuning`)."""
    return tuning.trace_threads(_load(), threads)


def read_sweep(buffers: Sequence[torch.Tensor], threads: int | None = None) -> float | None:
    """Seconds to read every byte of `buffers` once on the kernel's pool; None without its AVX2 path (`tuning`)."""
    return tuning.read_sweep(_load() if available_isa("avx2") else None, buffers, threads or default_threads())


def warm_rows(addresses: Sequence[int], rows: Sequence[int], hidden: int, inter: int, threads: int | None = None,
              row_bytes: int | None = None) -> int:
    """Read experts' leading gate/up `rows` into the pool threads' caches, as warm-ahead does; bytes read (`tuning`;
    row_bytes: a gate_up row's bytes in the experts' format, default bf16's 2 * hidden)."""
    lib = _load() if backend() != "torch" else None
    return tuning.warm_rows(lib, addresses, rows, hidden, inter, threads or default_threads(), row_bytes)


def available_isa(name: str) -> bool:
    """Whether the compiled kernel is loaded and this CPU runs its `name` instruction set ("avx2", ...)."""
    return _load() is not None and bool(_isa_mask & (1 << _ISA[name]))


def cpu_info(field: str) -> str:
    """The first CPU's `field` line of /proc/cpuinfo ("flags", "vendor_id", ...); "" where there is none."""
    return _first_cpu_info().get(field, "")


@functools.cache
def _first_cpu_info() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    info.setdefault(key.strip(), value.strip())
                elif info:
                    break  # the first CPU's block ends at its blank line
    except OSError:
        pass
    return info


@functools.cache
def torch_gemms_on_amx() -> bool:
    """Whether torch's bf16 GEMMs run on this CPU's AMX tiles (oneDNN's brgemm: Linux, a CPU with AMX-BF16)."""
    flags = cpu_info("flags").split()
    return "amx_bf16" in flags and "amx_tile" in flags and torch.backends.mkldnn.is_available()


def available_backends() -> list[str]:
    """Backends this machine can run, best first ("torch" always; not the test-only emulations)."""
    lib = _load()
    names = [n for n in _AUTO_ORDER if lib is not None and _isa_mask & (1 << _ISA[n])]
    return names + ["torch"]


def _resolve(requested: str | None, kind: str | ExpertFormat = "plain") -> str:
    fmt = kind if isinstance(kind, ExpertFormat) else None
    kind = fmt.kind if fmt is not None else kind
    name = _resolve_isa(requested)
    if kind == "gguf" and name != "torch" and not expert_args.reads_gguf(name, fmt):
        _warn_once(f"gguf:{name}:{fmt}", "strata: the %s CPU kernel does not read %s experts; using the torch path",
                   name, fmt.name if fmt is not None else "GGUF")
        return "torch"
    if kind == "fp8" and name == "avx512_bf16" and not _isa_mask & (1 << _VBMI):
        _warn_once("vbmi", "strata: the avx512_bf16 CPU kernel reads FP8 experts with AVX512_VBMI, which this CPU "
                   "lacks; using avx512 for them")
        return "avx512" if _isa_mask & (1 << _ISA["avx512"]) else "avx2" if _isa_mask & (1 << _ISA["avx2"]) else "torch"
    return name


def _resolve_isa(requested: str | None) -> str:
    req = (requested or "auto").strip().lower()
    if req == "torch":
        return "torch"
    if req != "auto" and req not in _ISA:
        _warn_once(f"name:{req}", "strata: unknown CPU kernel %r (choose from auto, %s); using auto", req,
                   ", ".join(BACKENDS))
        req = "auto"
    if _load() is None:
        return "torch"
    if req != "auto":
        if _isa_mask & (1 << _ISA[req]):
            return req
        _warn_once(f"isa:{req}", "strata: this CPU cannot run the %s kernel; choosing automatically", req)
    for name in _AUTO_ORDER:
        if _isa_mask & (1 << _ISA[name]):
            return name
    return "torch"


def backend(requested: str | None = None, kind: str | ExpertFormat = "plain") -> str:
    """Which path `cpu_experts_forward(..., backend=requested)` takes here on experts of format kind `kind`
    ("plain", "fp8", "mxfp4", "gguf", or the ExpertFormat: a GGUF one's block types decide): "avx512_bf16",
    "avx512", "avx2" or "torch" (`requested` None or "auto": the best this CPU runs)."""
    return _resolve(requested, kind)


def isa_code(requested: str | None = None, kind: str = "plain") -> int:
    """The compiled kernel's code for the instruction set `backend(requested, kind)` chooses (0: the torch
    fallback)."""
    name = _resolve(requested, kind)
    return 0 if name == "torch" else _ISA[name]


_default_threads: int | None = None


def default_threads() -> int:
    """configure(threads=...), else the physical cores this process may use."""
    global _default_threads
    if _threads_override:
        return _threads_override
    if _default_threads is None:
        try:
            usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            usable = os.cpu_count() or 1
        try:
            import psutil

            physical = psutil.cpu_count(logical=False) or usable
        except Exception:
            physical = usable
        _default_threads = max(1, min(usable, physical))
    return _default_threads


def configure(threads: int | None = None, cpus: Sequence[int] | None = None, spin_us: int | None = None,
              prefetch_bytes: int | None = None) -> None:
    """Tune the kernel. threads: default thread count. cpus: CPUs to pin the pool's workers to (worker
    i on cpus[i % len]; the calling thread is left alone; [] unpins). spin_us: how long idle workers
    spin before sleeping (default `DEFAULT_SPIN_US`). prefetch_bytes: software prefetch distance along each weight
    row in bytes (default `default_prefetch_bytes()`; 0 turns it off)."""
    global _threads_override, _prefetch_override
    if threads is not None:
        _threads_override = max(1, int(threads))
    if prefetch_bytes is not None:
        _prefetch_override = max(0, int(prefetch_bytes))
    lib = _load()
    if lib is not None and (cpus is not None or spin_us is not None or prefetch_bytes is not None):
        cpu_arr = (ctypes.c_int * max(1, len(cpus or ())))(*(cpus or ()))
        lib.strata_cpu_configure(-1 if spin_us is None else int(spin_us), cpu_arr, -1 if cpus is None else len(cpus),
                                 -1 if prefetch_bytes is None else _prefetch_override)


def default_prefetch_bytes() -> int:
    """This CPU's software prefetch distance: `PREFETCH_BYTES_BY_VENDOR` by its vendor, else `DEFAULT_PREFETCH_BYTES`."""
    return PREFETCH_BYTES_BY_VENDOR.get(cpu_info("vendor_id"), DEFAULT_PREFETCH_BYTES)


def prefetch_bytes() -> int:
    """The software prefetch distance in force: configure(prefetch_bytes=...), else `default_prefetch_bytes()`."""
    return _prefetch_override if _prefetch_override is not None else default_prefetch_bytes()


DEFAULT_SPIN_US = 1000


def spin_us() -> int:
    """How long idle pool workers spin before sleeping when the extension loads (`configure(spin_us=)` changes it
    later): a split decode step calls the kernel once per layer with ~0.2-0.4 ms of GPU and host work between
    calls, so a much shorter spin puts the workers to sleep before every call and small CPU shares wait for their
    wake-ups. Shorter frees the cores sooner on a shared host."""
    return DEFAULT_SPIN_US


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (torch's CPU ops run on them), as a thread done with torch's
    parallel ops should: OpenMP (libgomp) counts every thread's idle workers against the CPUs, and once they outnumber
    them, every team's workers sleep at each barrier instead of spinning, so the thread that runs the model waits on
    futex wake-ups at every op. A 2-core host prefilled 512 tokens of the 2-layer bench model in 0.72 s with the
    loading thread's workers alive, 0.37 s with them freed. False where the runtime has no `omp_pause_resource_all`
    (not libgomp or libiomp, or not Linux); the workers come back on the thread's next parallel op."""
    global _omp
    if _omp is None:
        _omp = False
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
            lib = next((p for p in sorted(paths) if os.path.basename(p).startswith(("libgomp", "libiomp"))), None)
            if lib is not None:
                _omp = ctypes.CDLL(lib)
                _omp.omp_pause_resource_all.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            _omp = False
    return bool(_omp) and _omp.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft
_omp: ctypes.CDLL | bool | None = None

