"""Device views of pinned host memory: CUDA tensors whose kernels read page-locked RAM over PCIe.

On 64-bit Linux CUDA uses unified virtual addressing: memory allocated with `cudaHostAlloc` (torch's
pinned memory) is mapped into every device's address space at the same address. A CUDA tensor built
on that address (through `__cuda_array_interface__`, so no extra library is needed) is a zero-copy
view: an index kernel on it fetches just the bytes it reads across PCIe, inside a CUDA graph and
without any host work. That suits tiny random reads (Engram rows: tens of bytes each), not bulk
transfers, which stay with the copy engines. A file in tmpfs can be served the same way once its
mapping is page-locked (`register_file`: `cudaHostRegister` on the mapped pages, which tmpfs keeps in
RAM anyway).
"""

from __future__ import annotations

import torch


class _HostArray:
    """The CUDA array interface of a pinned byte range; keeps the owning CPU tensor alive."""

    def __init__(self, owner: torch.Tensor):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (owner.numel() * owner.element_size(),),
            "typestr": "|u1",
            "data": (owner.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on `device` aliasing the pinned CPU tensor `host` (same bytes, same shape and dtype),
    or None where that is impossible: no CUDA, `host` not page-locked or not contiguous, or the driver
    does not map it for `device`. Writes through either tensor are seen by the other."""
    if device.type != "cuda" or not torch.cuda.is_available() or host.device.type != "cpu":
        return None
    if not host.is_contiguous() or host.numel() == 0 or not host.is_pinned():
        return None
    want = torch.device(device)
    if want.index is None:  # "cuda": the current card
        want = torch.device("cuda", torch.cuda.current_device())
    try:
        with torch.cuda.device(want):
            flat = torch.as_tensor(_HostArray(host), device=want)
    except (RuntimeError, TypeError, ValueError):
        return None
    if flat.data_ptr() != host.data_ptr() or flat.device != want:  # mapped for another card only
        return None
    return flat.view(host.dtype).view(host.shape)


_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 0x1, 0x2


class RegisteredFile:
    """A file (a tmpfs copy) mapped into this process and page-locked with `cudaHostRegister`, so that
    `device_view(self.tensor, device)` reads it in place. `close()` unregisters it."""

    def __init__(self, path: str, nbytes: int):
        import numpy as np

        self._array = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
        self.tensor = torch.from_numpy(self._array)  # uint8 [nbytes], aliasing the mapping
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
            self.tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED))
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._registered = False
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


def register_file(path: str, nbytes: int) -> RegisteredFile | None:
    """`RegisteredFile(path, nbytes)`, or None where CUDA cannot page-lock the mapping."""
    if not torch.cuda.is_available():
        return None
    try:
        return RegisteredFile(path, nbytes)
    except (OSError, ValueError, RuntimeError):  # torch.cuda.CudaError is a RuntimeError
        return None
