"""The few CUDA driver entry points a native thread of strata calls itself (csrc/mailbox_ahead.h): looked up in
libcuda with ctypes and handed over as addresses, so the native code links no CUDA library and builds without
CUDA headers. torch does not expose them; CuPy is an optional extra.

    ctx, fns = copy_entry_points(torch.device("cuda", 0))   # None on hosts without a CUDA driver
"""

from __future__ import annotations

import ctypes

import torch

ENTRY_POINTS = ("cuCtxSetCurrent", "cuMemcpyHtoDAsync_v2", "cuMemcpy2DAsync_v2")


class Memcpy2D(ctypes.Structure):
    """cuda.h's CUDA_MEMCPY2D (csrc/mailbox_ahead.h's `Memcpy2D`); CU_MEMORYTYPE_HOST = 1, DEVICE = 2."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


def copy_entry_points(device: torch.device) -> tuple[int, list[int]] | None:
    """(the device's current CUDA context, the addresses of `ENTRY_POINTS`), with torch's context current on this
    thread; None where there is no CUDA driver to ask (CPU hosts) or it lacks one of them."""
    if device.type != "cuda":
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.zeros(1, device=device)  # the primary context made current here
        ctx = ctypes.c_void_p()
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
            return None
    try:
        fns = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in ENTRY_POINTS]
    except AttributeError:
        return None
    return int(ctx.value), [int(f) for f in fns]
