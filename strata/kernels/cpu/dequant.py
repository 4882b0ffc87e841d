"""Quantized expert matrices to bf16, compiled (csrc/cpu_dequant.cpp), for torch's GEMMs on a CPU with AMX.

    w = dequantize(m)                                    # QuantMatrix [N, K] (fp8, mxfp4, gguf) -> bf16 [N, K]
    gu, dn = dequantize_expert(gate_up, down, scratch)   # both matrices of an expert into a reused bf16 scratch

Each weight is the oracle's fp32 value (`QuantMatrix.dequantize(torch.float32)`: gguf's numpy, strata.kernels.quant's
torch) rounded to bf16 as `.to(torch.bfloat16)` rounds it, bit for bit. The rows are split over the threads of the
OpenMP runtime torch's own parallel ops run on (`torch.get_num_threads()` of them), the ones the GEMMs that read the
scratch then use. None (`dequantize`) or False (`dequantize_expert`) where the library is not loaded.
"""

from __future__ import annotations

import array
import ctypes
import os
import threading

import torch

from strata.kernels.cpu.library import library
from strata.kernels.quant import MX_GROUP, QuantMatrix, gguf_half_bytes

SEGMENT = 9  # int64 fields of one matrix (or gate_up half) in strata_cpu_dequant's table
_FORMATS = {"fp8": 1, "mxfp4": 2, "gguf": 3}  # expert_args.FORMAT_CODES
_runtime_set: set[int] = set()
_local = threading.local()


def _lib():
    """The library, its OpenMP runtime handed over once (the one torch's parallel ops run on)."""
    lib = library()
    if lib is not None and id(lib) not in _runtime_set:
        omp = _openmp()
        if omp is not None:
            lib.strata_cpu_dequant_runtime(*(ctypes.cast(getattr(omp, f), ctypes.c_void_p) for f in
                                             ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")))
        _runtime_set.add(id(lib))
    return lib


def _openmp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime (libgomp, or libiomp with its GOMP_ entry points) as this process has it loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
        path = next((p for p in sorted(paths) if os.path.basename(p).startswith(("libgomp", "libiomp"))), None)
        if path is None:
            return None
        omp = ctypes.CDLL(path)
        omp.GOMP_parallel  # noqa: B018 (raises AttributeError without it)
        return omp
    except (OSError, AttributeError):
        return None


def _segments(m: QuantMatrix, out: torch.Tensor, table: array.array) -> None:
    """Append `m`'s segments (a GGUF gate_up: its two halves, each in its own type) writing into out [N, K] bf16."""
    n, k = m.shape
    if m.kind == "gguf":
        ids = m.scales.tolist()
        rows, half = n // len(ids), gguf_half_bytes(m.values.numel(), len(ids))
        base, row_out = m.values.data_ptr(), 2 * rows * k
        for j, type_id in enumerate(ids):
            table.extend((3, type_id, base + j * half, 0, rows, k, 1, 1, out.data_ptr() + j * row_out))
        return
    bn, bk = m.block if m.kind == "fp8" else (1, 1)
    table.extend((_FORMATS[m.kind], 0, m.values.data_ptr(), m.scales.data_ptr(), n, k, bn, bk, out.data_ptr()))


def _check(m: QuantMatrix) -> None:
    if m.kind not in _FORMATS:
        raise ValueError(f"no compiled dequantizer for {m.kind} matrices")
    for t in (m.values, m.scales):
        if not (t.is_cpu and t.is_contiguous()):
            raise ValueError("the compiled dequantizer reads contiguous CPU tensors")
    n, k = m.shape
    if m.kind == "mxfp4" and (k % MX_GROUP or m.values.numel() != n * k // 2 or m.scales.numel() != n * k // MX_GROUP):
        raise ValueError(f"mxfp4 matrix {tuple(m.shape)}: want {n * k // 2} values and {n * k // MX_GROUP} scales")
    if m.kind == "fp8" and (m.values.numel() != n * k or m.scales.dtype is not torch.float32):
        raise ValueError(f"fp8 matrix {tuple(m.shape)}: want {n * k} values and float32 scales")


def _run(table: array.array, threads: int | None, portable: bool) -> bool:
    lib = _lib()
    if lib is None:
        return False
    n = len(table) // SEGMENT
    rc = lib.strata_cpu_dequant(table.buffer_info()[0], n, int(threads or torch.get_num_threads()), int(portable))
    if rc != 0:
        raise ValueError("the compiled dequantizer does not read these matrices (a GGUF type it does not know, or a "
                         "row length not a multiple of its block)")
    return True


def dequantize(m: QuantMatrix, out: torch.Tensor | None = None, threads: int | None = None,
               portable: bool = False) -> torch.Tensor | None:
    """m [N, K] -> bf16 [N, K] (into `out`, contiguous, when given); None without the library. `portable`: the
    scalar code even on an AVX-512 CPU (its tests)."""
    _check(m)
    out = torch.empty(m.shape, dtype=torch.bfloat16) if out is None else out
    if tuple(out.shape) != tuple(m.shape) or out.dtype is not torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 {tuple(m.shape)} tensor")
    table = array.array("q")
    _segments(m, out, table)
    return out if _run(table, threads, portable) else None


def scratch(gate_up_shape: tuple[int, int], down_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's bf16 scratch for one expert (gate_up [2I, H], down [H, I]), kept between calls for its shapes:
    a fresh 9 MB buffer a call would be mapped and faulted in again every time."""
    key = (tuple(gate_up_shape), tuple(down_shape))
    held = getattr(_local, "scratch", None)
    if held is None or held[0] != key:
        held = (key, torch.empty(key[0], dtype=torch.bfloat16), torch.empty(key[1], dtype=torch.bfloat16))
        _local.scratch = held
    return held[1], held[2]


def dequantize_expert(gate_up: QuantMatrix, down: QuantMatrix, out: tuple[torch.Tensor, torch.Tensor],
                      threads: int | None = None) -> bool:
    """Both matrices of one expert (gate_up [2I, H], down [H, I]) into `out`'s bf16 tensors of those shapes, in one
    parallel region; False (nothing written) without the library."""
    for m in (gate_up, down):
        _check(m)
    table = array.array("q")
    _segments(gate_up, out[0], table)
    _segments(down, out[1], table)
    return _run(table, threads, False)
