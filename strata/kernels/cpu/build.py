"""Building and opening the CPU expert kernel's shared library (csrc/cpu_experts.cpp) with torch's
C++ extension builder, cached under $STRATA_CACHE/ext keyed by a hash of the sources, the flags, torch's
and Python's versions; `one_line` turns a build error into the line worth printing."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from strata.tiers.store.files import cache_root

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("cpu_experts.cpp", "cpu_experts_formats.h", "cpu_experts_act.h", "cpu_experts_isa.h",
            "cpu_experts_kernel.h", "cpu_experts_dot2.h", "cpu_experts_tile4.h", "cpu_experts_job.h",
            "cpu_experts_emu.h", "cpu_experts_call.h", "cpu_experts_rows.cpp", "cpu_experts_async.h",
            "cpu_experts_gguf.h", "cpu_experts_gguf_layout.h", "cpu_experts_gguf_emu.h", "cpu_experts_gguf_avx512.h",
            "cpu_experts_gguf_kernel.h",
            "cpu_pool.h", "cpu_dense.h", "cpu_warm.h", "cpu_tuning.h", "cpu_mailbox.cpp", "cpu_mailbox_serve.h",
            "cpu_quantize.cpp", "cpu_quantize_search.h", "cpu_bits.h", "cpu_bf16.h", "cpu_rows.cpp", "cpu_dequant.cpp",
            "cpu_dequant_rows.h", "cpu_dequant_avx512.h")
# Plain x86-64 (the vector code is compiled per function, under target pragmas); no FMA contraction, so
# a*b+c rounds the same way in every instruction set and in the emulations.
_CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden"]
_LDFLAGS = ["-pthread"]
_STALE_LOCK_S = 600  # a build takes seconds; a lock file this old belongs to a build that died


def _cache_root() -> Path:
    return cache_root() / "ext"


def build_and_open() -> ctypes.CDLL:
    """Compile the kernel (once per source hash) and open it, with every entry point's signature declared."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise RuntimeError(f"no vector kernel for {machine}")
    from torch.utils import cpp_extension

    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_CSRC / name).read_bytes())
    h.update(repr((torch.__version__, platform.python_version(), _CFLAGS, _LDFLAGS)).encode())
    name = f"strata_cpu_experts_{h.hexdigest()[:16]}"
    build_dir = _cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"  # torch's FileBaton: a build killed midway leaves it, and later loads wait forever
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    except OSError:
        pass
    if sys.stderr.isatty() and not (build_dir / f"{name}.so").exists():  # a minute of silence otherwise
        print("strata: compiling the CPU kernels for this machine (once for these sources)...", file=sys.stderr,
              flush=True)
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)  # its compiler-compatibility banner is many lines long
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # copies of the flags: torch appends its own to the lists it is given, which would change the hash above
            path = cpp_extension.load(name=name, sources=[str(_CSRC / n) for n in _SOURCES if n.endswith(".cpp")],
                                      extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS),
                                      build_directory=str(build_dir), with_cuda=False,
                                      is_python_module=False, verbose=False)
    finally:
        torch_log.setLevel(level)
    if not isinstance(path, str):  # torch versions that return None for non-Python modules
        path = str(build_dir / f"{name}.so")
    lib = ctypes.CDLL(path)
    lib.strata_cpu_isa_mask.argtypes = []
    lib.strata_cpu_isa_mask.restype = ctypes.c_int
    lib.strata_cpu_configure.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    lib.strata_cpu_configure.restype = ctypes.c_int
    lib.strata_cpu_read_sweep.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.strata_cpu_read_sweep.restype = ctypes.c_uint64
    lib.strata_cpu_shutdown.argtypes = []
    lib.strata_cpu_shutdown.restype = ctypes.c_int
    lib.strata_cpu_experts.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.strata_cpu_experts.restype = ctypes.c_int
    lib.strata_cpu_experts_fmt.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.strata_cpu_experts_fmt.restype = ctypes.c_int
    lib.strata_cpu_experts_act.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_void_p]
    lib.strata_cpu_experts_act.restype = ctypes.c_int
    lib.strata_cpu_experts_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.strata_cpu_experts_rows.restype = ctypes.c_int
    lib.strata_cpu_experts_warm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int, ctypes.c_void_p]
    lib.strata_cpu_experts_warm.restype = ctypes.c_int
    lib.strata_cpu_warm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.strata_cpu_warm.restype = ctypes.c_int64
    lib.strata_cpu_warm_bytes.argtypes = lib.strata_cpu_warm.argtypes
    lib.strata_cpu_warm_bytes.restype = ctypes.c_int64
    lib.strata_cpu_warm_form.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_void_p]
    lib.strata_cpu_warm_form.restype = ctypes.c_int64
    lib.strata_cpu_warm_drain.argtypes = []
    lib.strata_cpu_warm_drain.restype = ctypes.c_int
    lib.strata_cpu_test_straggler.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.strata_cpu_test_straggler.restype = ctypes.c_int
    lib.strata_cpu_experts_start.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.strata_cpu_experts_start.restype = ctypes.c_int
    lib.strata_cpu_experts_wait.argtypes = [ctypes.POINTER(ctypes.c_double)]
    lib.strata_cpu_experts_wait.restype = ctypes.c_int
    lib.strata_mailbox_start.argtypes = [ctypes.c_void_p] * 8
    lib.strata_mailbox_start.restype = ctypes.c_int64
    lib.strata_mailbox_stop.argtypes = [ctypes.c_int64]
    lib.strata_mailbox_stop.restype = ctypes.c_int
    lib.strata_mailbox_log_codes.argtypes = []
    lib.strata_mailbox_warm.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    lib.strata_mailbox_warm.restype = ctypes.c_int
    lib.strata_cpu_trace.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.strata_cpu_trace.restype = ctypes.c_int
    lib.strata_cpu_trace_threads.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.strata_cpu_trace_threads.restype = ctypes.c_int
    lib.strata_cpu_tune.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.strata_cpu_tune.restype = ctypes.c_int64
    lib.strata_cpu_meta_fields.argtypes = []
    lib.strata_cpu_meta_fields.restype = ctypes.c_int
    lib.strata_mailbox_log_codes.restype = ctypes.c_int
    lib.strata_gguf_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p]
    lib.strata_gguf_quantize.restype = ctypes.c_int64
    lib.strata_cpu_dequant_runtime.argtypes = [ctypes.c_void_p] * 3
    lib.strata_cpu_dequant_runtime.restype = ctypes.c_int
    lib.strata_cpu_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.strata_cpu_dequant.restype = ctypes.c_int
    return lib


def one_line(exc: BaseException) -> str:
    """The telling line of a build error (the compiler's 'error:' line, a missing tool...)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for marker in ("error:", "not found", "no such file", "permission denied"):
        hits = [ln for ln in lines if marker in ln.lower()]
        if hits:
            return f"{type(exc).__name__}: {hits[0][-200:]}"
    return f"{type(exc).__name__}: {(lines or [''])[0][:200]}"
