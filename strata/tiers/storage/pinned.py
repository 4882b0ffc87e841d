"""The pinned-RAM tier's memory: fixed-size slots carved from a few large page-locked slabs, allocated once.

Pinning is slow: cudaHostAlloc (`pin_memory=True`) costs 0.45-0.8 s per GiB on the H200 machine, so 100 GiB
would hold start-up for a minute. `cudaHostRegister` of an anonymous mmap costs about 0.07 s per GiB there and
copies at the same 55 GB/s (a fresh mapping's page faults come on top: 0.44-0.60 s per GiB for both together in
docs/benchmarks.md, section "Tiers: copy and read rates"), so slabs are mmapped and registered, on a background
thread, slab by slab: slot i is usable as soon as its slab is (`slot(i)` waits for it), long before the whole pool is.
On hosts without CUDA the slabs are plain RAM, pre-faulted (MAP_POPULATE) so first use is not a storm of
page faults on the hot path.
"""

from __future__ import annotations

import mmap
import threading

import torch

from strata.errors import StrataError, UnsupportedError
from strata.tiers.storage.huge_pages import advise_huge_pages

ALIGN = 4096
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context (all GPUs of the host)


class _Slab:
    """One page-locked (or plain) allocation: `tensor` uint8 [nbytes], page-aligned."""

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes, self.registered = nbytes, False
        self.mm: mmap.mmap | None = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)  # holds a reference to the mapping
        if not pin:
            # the CPU kernel streams whole experts from these slabs every token: in 2 MiB pages (where the kernel
            # grants them) rather than a TLB miss every 4 KiB; faulted in now, off the hot path
            advise_huge_pages(self.mm, nbytes)
            self.tensor.zero_()
        if pin:
            # Register on this (non-main) thread: a failed cudaHostRegister leaves a per-thread "last error"
            # that would otherwise surface in the next unrelated kernel-launch check of the main thread.
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
            if err == 0:
                self.registered = True
            else:  # e.g. a locked-memory limit on registration: fall back to cudaHostAlloc (slower to create)
                del self.tensor  # drop the export so the mapping can be closed
                self._close_mm(self.mm)
                self.mm = None
                self.tensor = self._host_alloc(nbytes)

    @staticmethod
    def _host_alloc(nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % ALIGN:  # cudaHostAlloc returns page-aligned memory; check anyway
            base = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = -base.data_ptr() % ALIGN
            t = base[skip : skip + nbytes]
        return t

    @staticmethod
    def _close_mm(mm: mmap.mmap) -> None:
        try:
            mm.close()
        except BufferError:  # still exported to a tensor: unmapped when that is collected
            pass

    def free(self) -> None:
        """Unregister and drop this slab (views held elsewhere keep the memory mapped, no longer pinned)."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.mm is not None:
            self._close_mm(self.mm)
            self.mm = None


class PinnedPool:
    """`num_slots` slots of `slot_bytes` (a multiple of 4096) in slabs of about `slab_bytes` of pinned RAM.

    pin=None pins iff CUDA is available; background=True allocates on a thread so start-up is not held."""

    def __init__(self, slot_bytes: int, num_slots: int, *, pin: bool | None = None, slab_bytes: int = 1 << 30,
                 background: bool = True):
        if slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"slot_bytes must be a positive multiple of {ALIGN}, got {slot_bytes}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if pin is None:
            pin = torch.cuda.is_available()
        elif pin and not torch.cuda.is_available():
            raise UnsupportedError("pinned host memory needs a CUDA GPU; use pin=False (or pin=None) on this host")
        self.slot_bytes, self.num_slots, self.pinned = slot_bytes, num_slots, pin
        self.nbytes = slot_bytes * num_slots
        self.slots_per_slab = max(1, slab_bytes // slot_bytes)  # a slab holds whole slots only
        nslabs = -(-num_slots // self.slots_per_slab)
        self._sizes = [min(self.slots_per_slab, num_slots - k * self.slots_per_slab) * slot_bytes for k in range(nslabs)]
        self._slabs: list[_Slab | None] = [None] * nslabs
        self._views: list[tuple[torch.Tensor, ...] | None] = [None] * nslabs  # each slab's slot views
        self._ready = [threading.Event() for _ in range(nslabs)]
        self._done = threading.Event()  # set when the allocator stops (all ready, failed or closed)
        self._error: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._allocate, name="strata-pinned", daemon=True)
        self._thread.start()
        if not background:
            self._thread.join()
            self._raise_if_failed()

    def _allocate(self) -> None:
        try:
            for k, size in enumerate(self._sizes):
                if self._closing:
                    return
                self._slabs[k] = _Slab(size, self.pinned)
                self._ready[k].set()
        except BaseException as e:  # kept, and raised on the next slot()/wait_ready()
            self._error = e
        finally:
            self._done.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StrataError(f"could not allocate the pinned pool ({self.nbytes / 2**30:.1f} GiB): "
                              f"{str(self._error).splitlines()[0] if str(self._error) else type(self._error).__name__}")

    def slot(self, i: int) -> torch.Tensor:
        """Slot i as a uint8 [slot_bytes] view, 4096-aligned; blocks until its slab is allocated (and pinned)."""
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range [0, {self.num_slots})")
        k, j = divmod(i, self.slots_per_slab)
        while not self._ready[k].wait(0.05):
            self._raise_if_failed()
            if self._closing or (self._done.is_set() and not self._ready[k].is_set()):
                raise StrataError("the pinned pool was closed")
        slab = self._slabs[k]
        if slab is None or self._closing:
            raise StrataError("the pinned pool was closed")
        if (views := self._views[k]) is None:  # made once per slab: slicing costs microseconds a copy
            views = self._views[k] = slab.tensor.view(-1, self.slot_bytes).unbind(0)
        return views[j]

    def slot_address(self, i: int) -> int:
        """The host address of slot i (its slab must be allocated: a slot holding an object is)."""
        k, j = divmod(i, self.slots_per_slab)
        slab = self._slabs[k]
        if slab is None or self._closing or not 0 <= i < self.num_slots:
            raise StrataError(f"pinned slot {i} is not allocated")
        return slab.tensor.data_ptr() + j * self.slot_bytes

    def ready_slots(self) -> int:
        """How many slots (from slot 0 on: slabs are allocated in order) are usable now."""
        ready = 0
        for k, ev in enumerate(self._ready):
            if not ev.is_set():
                break
            ready += self._sizes[k] // self.slot_bytes
        return ready

    @property
    def allocating(self) -> bool:
        """True while the background allocator is still pinning slabs."""
        return not self._done.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every slot is usable; False on timeout. Raises StrataError if allocation failed."""
        self._done.wait(timeout)
        self._raise_if_failed()
        return self.ready_slots() == self.num_slots

    def close(self) -> None:
        """Stop allocating, unregister and free every slab. Views handed out stay readable but unpinned."""
        self._closing = True
        self._thread.join()
        if any(s is not None and s.registered for s in self._slabs):
            torch.cuda.synchronize()  # no copy may still be reading a slab when it is unregistered
        for k, slab in enumerate(self._slabs):
            if slab is not None:
                slab.free()
                self._slabs[k] = None
                self._views[k] = None

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PinnedPool({self.num_slots} x {self.slot_bytes} B = {self.nbytes / 2**30:.2f} GiB, "
                f"pinned={self.pinned}, ready={self.ready_slots()})")
