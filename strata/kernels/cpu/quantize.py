"""llama.cpp's reference K-quant quantizers, compiled (csrc/cpu_quantize.cpp): float rows -> GGUF blocks.

    blocks = quantize_rows(w, "Q4_K")   # float32 [rows, K] -> uint8 [rows, K / 256 * 144], or None without the library

The same bytes as strata.tiers.store.gguf_quantize's numpy port of ggml-quants.c (the oracle of
tests/kernels/cpu/test_cpu_quantize.py), some 20-40x faster a thread; that module calls this first and keeps numpy for
machines where the CPU library cannot be built. ctypes releases the GIL for the call, so threads quantize
different rows at once.
"""

from __future__ import annotations

import numpy as np

from strata.kernels.cpu.library import library

TYPE_IDS = {"Q2_K": 10, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml's type ids for the types compiled here
_BYTES = {"Q2_K": 84, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes of a 256-value superblock


def quantize_rows(x: np.ndarray, type_name: str) -> np.ndarray | None:
    """float [..., K] (K a multiple of 256) -> uint8 [..., K / 256 * block bytes]: each row as `type_name` blocks,
    byte for byte llama.cpp's reference quantizer; None for a type not compiled here or without the CPU library."""
    if type_name not in TYPE_IDS:
        return None
    lib = library()
    if lib is None:
        return None
    k = x.shape[-1]
    if k % 256:
        return None
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
    out = np.empty((rows.shape[0], k // 256 * _BYTES[type_name]), dtype=np.uint8)
    got = lib.strata_gguf_quantize(TYPE_IDS[type_name], rows.ctypes.data, rows.shape[0], k, out.ctypes.data)
    if got != out.shape[1]:
        raise RuntimeError(f"strata_gguf_quantize returned {got} bytes a row for {type_name}, expected {out.shape[1]}")
    return out.reshape(*x.shape[:-1], out.shape[1])
