"""The Engram row cache with its slab: rows read from the table tier admitted by slot, rows gathered by slot.

The slab holds `capacity` rows [capacity, head_dim]. It lives on the compute device (VRAM on CUDA), or, for
tables on tmpfs or disk with zero copy, in pinned RAM that the GPU reads in place (`gather_view`): rows read
from the tier are written there by the host (no staging copy, no scatter kernel) and a decode step's gather
runs inside its CUDA graph. On CPU-only hosts the slab is in RAM anyway and the compute reads it in place.
"""

from __future__ import annotations

import torch

from strata.tiers.rows.cache import RowCache
from strata.tiers.rows.tickets import Ticket
from strata.tiers.storage.uva import device_view


def on_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device`: through pinned memory on CUDA, so the copy does not block."""
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


class CachedRows:
    """A `capacity`-row cache over the global row space of tables whose layers start at `base` (layer -> first
    row), with rows of `dim` `dtype` values; `host_slab`: the slab in host RAM the device reads in place."""

    def __init__(self, base: dict[int, int], total_rows: int, capacity: int, dim: int, dtype: torch.dtype,
                 device: torch.device, host_slab: bool):
        self.base, self.dim, self.dtype, self.device = base, dim, dtype, device
        self.gather_view: torch.Tensor | None = None  # [capacity, dim] the host slab as the device reads it
        slab = None
        if host_slab:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    slab = torch.empty(capacity, dim, dtype=dtype, pin_memory=True)
                self.gather_view = device_view(slab, device)
                slab = slab if self.gather_view is not None else None  # a mapping CUDA refuses: a VRAM slab
            else:
                slab = self.gather_view = torch.empty(capacity, dim, dtype=dtype)
        self.cache = RowCache(total_rows, capacity, dim, dtype, device, slab=slab)
        self._gathered: torch.cuda.Event | None = None  # after the last gather from the host slab

    def lookup(self, layer: int, uniq: torch.Tensor) -> torch.Tensor:
        """Cache slots of `layer`'s distinct rows `uniq` (int64 CPU [m]), -1 where absent (int64 [m])."""
        return self.cache.lookup(uniq + self.base[layer])

    def admit(self, ticket: Ticket, protect: list[torch.Tensor]) -> torch.Tensor | None:
        """Put the ticket's read rows into the cache, never evicting `protect`ed slots; the slot of every
        distinct row (int64 [m]), or None when not every miss fits (some may have been admitted)."""
        slots, hit = ticket.slots, ticket.slots >= 0
        if not ticket.miss.numel():
            return slots
        placed = self.cache.place(ticket.miss + self.base[ticket.layer], torch.cat([*protect, slots[hit]]))
        ok = placed >= 0
        if not bool(ok.all()):
            if bool(ok.any()):
                self._write_rows(placed[ok], ticket.staged, ok.nonzero().view(-1))
            return None
        self._write_rows(placed, ticket.staged, None)
        slots = slots.clone()
        slots[~hit] = placed
        return slots

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of cache `slots` (CPU int64) on the device: from the VRAM slab, or the host slab in place."""
        if self.gather_view is None:
            return self.cache.slab[on_device(slots, self.device)]
        out = self.gather_view[on_device(slots, self.device)]
        self.replayed()
        return out

    def assemble(self, ticket: Ticket) -> torch.Tensor:
        """Cache hits from the slab, misses as read, when not every miss fits in the cache."""
        hit = ticket.slots >= 0
        out = torch.empty(ticket.uniq.numel(), self.dim, dtype=self.dtype, device=self.device)
        if bool(hit.any()):
            out[on_device(hit.nonzero().view(-1), self.device)] = self.gather(ticket.slots[hit])
        out[on_device((~hit).nonzero().view(-1), self.device)] = ticket.staged.to(self.device, non_blocking=True)
        return out[on_device(ticket.inverse, self.device)].view(*ticket.shape, self.dim)

    def replayed(self) -> None:
        """A gather from the host slab was launched (eagerly, or in a CUDA graph): its slots are rewritten only
        after it."""
        if self.gather_view is not None and self.gather_view.is_cuda:
            self._gathered = torch.cuda.Event()
            self._gathered.record()

    def wait_gathers(self) -> None:
        """Block until the last gather from the host slab has run, so the host may rewrite any slot."""
        if self._gathered is not None:
            self._gathered.synchronize()
            self._gathered = None

    def _write_rows(self, slots: torch.Tensor, staged: torch.Tensor, pick: torch.Tensor | None) -> None:
        """Cache slots `slots` [k] get the read rows `staged[pick]` (all of them when `pick` is None)."""
        if self.gather_view is None:  # the slab is on the device: stream-ordered copies
            rows = staged.to(self.device, non_blocking=True)
            self.cache.slab[on_device(slots, self.device)] = rows if pick is None else rows[on_device(pick, self.device)]
            return
        self.wait_gathers()  # a gather may still read slots being reused: let it finish first
        self.cache.slab[slots] = staged if pick is None else staged[pick]  # host RAM, written by the host
