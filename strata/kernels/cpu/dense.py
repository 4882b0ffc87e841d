"""Dense projections of a decode step on the CPU: bf16 weights times a few rows of activations, at RAM bandwidth.

    y = linear(x, weight, bias=None, out_dtype=None, threads=None)   # None when this path does not apply

A decode step's dense projections (attention, dense MLPs, shared experts, routers, the LM head) multiply one row
of activations per sequence by bf16 weights: a GEMV, whose time is reading the weights once. The compiled kernel
(csrc/cpu_dense.h, built into the CPU expert kernel's library) reads every weight row once for all the rows of x,
in chunks taken dynamically by the expert kernel's own thread pool: one pool for the experts and the dense
layers, so a decode step never has two sets of threads (torch's OpenMP team and the pool) spinning against each
other, and a thread the OS has not scheduled (a busy host) holds no work instead of holding up the step, as an
OpenMP region's static split does.

Numerics: with AVX512-BF16 (`vdpbf16ps`), products of the bf16 activations and weights summed in fp32, in an
order fixed by the code (bit-identical for any thread count); without it, the same products widened to fp32 and
summed with FMAs. Either is what a bf16 GEMM computes (torch's bf16 `F.linear` also accumulates in fp32) up to
summation order. The output is fp32 or bf16 (rounded to nearest even).

`linear` returns None (the caller runs `F.linear`) for anything else: fp32 or fp16 weights, activations of
another dtype than the weights, more than `MAX_ROWS` rows (prefill: compute-bound, where torch's GEMM is
faster), tensors not on the CPU, weights whose rows are not contiguous, or no compiled kernel.
"""

from __future__ import annotations

import ctypes

import torch

from strata.kernels.cpu import library as kernel_lib

MAX_ROWS = 16
"""Rows of x one call takes (csrc/cpu_dense.h's kDenseMaxRows)."""

_ISA = {"avx512_bf16": 3, "avx512": 2, "avx2": 1}  # csrc/cpu_experts.cpp's codes
_declared: set[int] = set()


def _kernel(backend: str | None) -> tuple[ctypes.CDLL, int] | None:
    """The library and the instruction set code of `backend` (None: the best this CPU runs); None without it."""
    name = kernel_lib.backend(backend)
    lib = kernel_lib.library() if name in _ISA else None
    if lib is None:
        return None
    if id(lib) not in _declared:
        lib.strata_cpu_dense.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        lib.strata_cpu_dense.restype = ctypes.c_int
        _declared.add(id(lib))
    return lib, _ISA[name]


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs the compiled kernel (cheap checks, no build)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and x.dtype == torch.bfloat16 and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and weight.stride(1) == 1 and x.shape[-1] > 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, threads: int | None = None, *,
           backend: str | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 @ weight [N, K]^T bf16 (+ bias) -> [..., N] in `out_dtype` (fp32 or bf16; None: x's dtype),
    on `threads` threads of the CPU kernel's pool (None: its default count). `backend`: the instruction set
    ("avx512_bf16", "avx512", "avx2"; None or "auto": the best this CPU runs; the CPU expert kernel's names). None
    when this path does not apply (see the module docstring): the caller computes `F.linear` instead."""
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.float32, torch.bfloat16) or not applies(x, weight) or torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad):
        return None
    kernel = _kernel(backend)
    if kernel is None:
        return None
    lib, isa = kernel
    lead, (n, k) = x.shape[:-1], weight.shape
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    # a bias is added after the product (in fp32): the kernel writes the product alone
    y = torch.empty((m, n), dtype=torch.float32 if bias is not None else out_dtype)
    rc = lib.strata_cpu_dense(isa, x2.data_ptr(), m, k, weight.data_ptr(), n, weight.stride(0), y.data_ptr(), n,
                              int(y.dtype == torch.bfloat16), int(threads or kernel_lib.default_threads()))
    if rc != 0:
        raise RuntimeError(f"CPU dense kernel failed with code {rc} (x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    if bias is not None:
        y = y.add_(bias.float()).to(out_dtype)
    return y.reshape(*lead, n)
