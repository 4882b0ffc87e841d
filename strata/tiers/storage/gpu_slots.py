"""The GPU tier's memory: one slab of fixed-size expert slots per device, allocated once, and a device-side
map from (layer, expert) to slot.

`slot_of[layer, expert]` lives on the GPU (-1 = not resident) so the MoE step can find resident experts
without a host round trip (a device-to-host read would wait for the queued work and end a CUDA graph);
`slot_of_host` mirrors it for the tier manager. Copies run on a dedicated stream and return an event the
compute stream waits on, so loading cold experts overlaps compute and never blocks the host.

Ordering across the two streams is kept here, with events, so no interleaving of calls can leave the
device map or a slot inconsistent:
  clear(key)        on the compute stream (default): later kernels see -1. It first waits for the
                    copy-stream write that published the key, and records a "freed" event.
  copy_in(slot,..)  waits for the slot's "freed" event (every kernel enqueued before the clear, i.e.
                    every reader of the old expert, has finished) and for `wait_for` if given.
  assign(key, slot) on the copy stream (default), after the copy; waits for the key's last clear.
Typical use: `clear(old)`; `done = load(new, slot, pinned_src)`; later
`torch.cuda.current_stream().wait_event(done)` before reading the slot. The pinned source must not be
overwritten before `done` has completed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from strata.errors import UnsupportedError

Key = tuple[int, int]  # (layer, expert)


class GpuSlots:
    """`num_slots` slots of `slot_bytes` on `device` (a CUDA device, or "cpu" for tests) and the slot map."""

    def __init__(self, slot_bytes: int, num_slots: int, num_layers: int, num_experts: int, device: str | torch.device = "cuda",
                 *, copy_priority: int = 0):
        if slot_bytes <= 0 or num_slots <= 0 or num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"sizes must be positive, got slot_bytes={slot_bytes}, num_slots={num_slots}, "
                             f"num_layers={num_layers}, num_experts={num_experts}")
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise UnsupportedError(f"device {device} needs a CUDA GPU; none is available")
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.device, self.slot_bytes, self.num_slots = device, slot_bytes, num_slots
        self.num_layers, self.num_experts = num_layers, num_experts
        self.slab = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device=device)  # [S, slot_bytes]
        self.slot_of = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=device)  # [L, E]
        self.slot_of_host = np.full((num_layers, num_experts), -1, dtype=np.int32)  # [L, E] host mirror
        self.key_of_slot = np.full((num_slots, 2), -1, dtype=np.int64)  # [S, 2] (layer, expert) held, -1 = free
        self.copy_stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=device, priority=copy_priority) if self.is_cuda else None)
        # cross-stream ordering (CUDA only): the map write that published a slot's key, the clear that
        # freed a slot (kernels enqueued before it are its old expert's readers), a key's last clear
        self._published: dict[int, torch.cuda.Event] = {}
        self._freed: dict[int, torch.cuda.Event] = {}
        self._key_cleared: dict[Key, torch.cuda.Event] = {}
        self.clears_behind_copy = 0  # clears ordered after a copy still in flight (`_count_behind`)
        self._row_views: tuple[torch.Tensor, ...] | None = None  # slab rows, made on first copy
        self._epoch: torch.cuda.Event | None = None  # a timing event recorded before any copy
        if self.is_cuda:
            self._epoch = torch.cuda.Event(enable_timing=True)
            self._epoch.record(self.copy_stream)

    def since_epoch(self, event: torch.cuda.Event) -> float | None:
        """Seconds from the slots' creation (an event recorded then) to finished `event`: one clock for the
        spans of transfers that several threads enqueued (see `PathCounters.add_interval`); None on CPU."""
        return self._epoch.elapsed_time(event) / 1000 if self._epoch is not None else None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _check(self, key: Key, slot: int | None = None) -> tuple[int, int]:
        layer, expert = int(key[0]), int(key[1])
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(f"expert key {key} out of range ({self.num_layers} layers, {self.num_experts} experts)")
        if slot is not None and not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return layer, expert

    def _set_device(self, layer: int, expert: int, value: int, stream: torch.cuda.Stream | None,
                    after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Write one map entry on `stream` (after `after`); returns an event recorded after the write."""
        if not self.is_cuda:
            self.slot_of[layer, expert] = value
            return None
        stream = stream if stream is not None else self.copy_stream
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            # a one-element fill kernel with the value as a launch argument: no H2D copy, no host sync
            self.slot_of[layer, expert].fill_(value)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _count_behind(self, published: torch.cuda.Event | None) -> None:
        """Count a clear that the stream must order after a copy still in flight (its slot's publish event not
        yet reached): that stream (the decode stream, for a promotion's victim) waits for the copy."""
        if published is not None and not published.query():
            self.clears_behind_copy += 1

    def slot_for(self, key: Key) -> int:
        """The slot holding `key` (host mirror), or -1."""
        layer, expert = self._check(key)
        return int(self.slot_of_host[layer, expert])

    def owner(self, slot: int) -> Key | None:
        """The (layer, expert) in `slot`, or None when it is free."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        layer, expert = self.key_of_slot[slot].tolist()
        return None if layer < 0 else (layer, expert)

    def free_slots(self) -> np.ndarray:
        """Indices of the slots holding no expert, ascending (int64 [n])."""
        return np.flatnonzero(self.key_of_slot[:, 0] < 0)

    @property
    def num_resident(self) -> int:
        return int((self.key_of_slot[:, 0] >= 0).sum())

    def assign(self, key: Key, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """Map `key` to `slot` in the host mirror and on the device (on `stream`, default the copy stream,
        so a map entry published after `copy_in` on that stream is never seen before the bytes land)."""
        layer, expert = self._check(key, slot)
        held, cur = self.owner(slot), int(self.slot_of_host[layer, expert])
        if held == (layer, expert):
            return
        if held is not None:
            raise ValueError(f"slot {slot} holds expert {held}: clear it before assigning {key}")
        if cur >= 0:
            raise ValueError(f"expert {key} is already in slot {cur}: clear it first")
        self.slot_of_host[layer, expert] = slot
        self.key_of_slot[slot] = (layer, expert)
        ev = self._set_device(layer, expert, slot, stream, after=self._key_cleared.pop((layer, expert), None))
        if ev is not None:
            self._published[slot] = ev

    def clear(self, key: Key, stream: torch.cuda.Stream | None = None) -> int:
        """Unmap `key` (host mirror, and the device map on `stream`, default the current stream so later
        compute kernels see -1). Returns the slot it held, or -1 if it was not resident."""
        layer, expert = self._check(key)
        slot = int(self.slot_of_host[layer, expert])
        if slot < 0:
            return -1
        self.slot_of_host[layer, expert] = -1
        self.key_of_slot[slot] = -1
        if stream is None and self.is_cuda:
            stream = torch.cuda.current_stream(self.device)
        published = self._published.pop(slot, None)
        self._count_behind(published)
        ev = self._set_device(layer, expert, -1, stream, after=published)
        if ev is not None:
            self._freed[slot] = self._key_cleared[(layer, expert)] = ev
        return slot

    def assign_many(self, keys: Sequence[Key], slots: Sequence[int], stream: torch.cuda.Stream | None = None) -> None:
        """`assign` for many keys with one map upload instead of one kernel per key. For initial placement:
        it does not order itself after earlier `clear`s the way `assign` does."""
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        for key, slot in zip(keys, slots, strict=True):
            layer, expert = self._check(key, slot)
            if self.owner(slot) not in (None, (layer, expert)) or self.slot_of_host[layer, expert] not in (-1, slot):
                raise ValueError(f"cannot assign {key} to slot {slot}: one of them is taken; clear it first")
            self.slot_of_host[layer, expert] = slot
            self.key_of_slot[slot] = (layer, expert)
        self.push_map(stream)

    def push_map(self, stream: torch.cuda.Stream | None = None) -> None:
        """Upload the whole host mirror to `slot_of` (on `stream`, default the copy stream) without a host sync."""
        if not self.is_cuda:
            self.slot_of.copy_(torch.from_numpy(self.slot_of_host))
            return
        # staging from the caching host allocator: it is not reused until this copy has completed
        staging = torch.empty(self.slot_of.shape, dtype=torch.int32, pin_memory=True)
        staging.copy_(torch.from_numpy(self.slot_of_host))
        with torch.cuda.stream(stream if stream is not None else self.copy_stream):
            self.slot_of.copy_(staging, non_blocking=True)

    # -- data ----------------------------------------------------------------------------------------
    def view(self, slot: int) -> torch.Tensor:
        """Slot `slot` as uint8 [slot_bytes] on the device."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return self.slab[slot]

    def copy_in(self, slot: int, src: torch.Tensor, wait_for: torch.cuda.Event | None = None,
                started: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Copy `src` (uint8, <= slot_bytes, pinned when on the host) into `slot` asynchronously on `copy_stream`.

        The copy starts after the slot's last `clear` (its old expert's readers are done) and after `wait_for`;
        `started` (a timing event) is recorded right before the copy itself, after those waits. Returns an event the compute stream can wait on (None on CPU, where the copy is done on return)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        n = src.numel()
        if src.dtype != torch.uint8 or src.dim() != 1 or n > self.slot_bytes:
            raise ValueError(f"src must be a 1-D uint8 tensor of <= {self.slot_bytes} bytes, got {src.dtype} {tuple(src.shape)}")
        dst = self.slab[slot, :n]
        if not self.is_cuda:
            dst.copy_(src)
            return None
        if src.device.type == "cpu" and not src.is_pinned():
            # a pageable source makes the copy synchronous and 5-8x slower (6.5-10 GB/s on the H200 against ~54
            # GB/s pinned): always a bug here
            raise ValueError("src must be pinned host memory (a PinnedPool slot) for an asynchronous copy")
        stream = self.copy_stream
        with torch.cuda.stream(stream):
            freed = self._freed.pop(slot, None)
            for ev in (freed, wait_for):
                if ev is not None:
                    stream.wait_event(ev)
            if started is not None:
                started.record(stream)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=started is not None)
            done.record(stream)
        return done

    def load(self, key: Key, slot: int, src: torch.Tensor, wait_for: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """`copy_in` then `assign` on the copy stream: the map entry is published only after the bytes land."""
        layer, expert = self._check(key, slot)
        held, cur = self.owner(slot), int(self.slot_of_host[layer, expert])
        if held not in (None, (layer, expert)):
            raise ValueError(f"slot {slot} holds expert {held}: clear it before loading {key}")
        if cur not in (-1, slot):
            raise ValueError(f"expert {key} is already in slot {cur}: clear it first")
        done = self.copy_in(slot, src, wait_for)
        self.assign(key, slot, self.copy_stream)
        if done is not None:  # the event now also covers the map update
            done.record(self.copy_stream)
        return done

    # -- batches (one decode layer's cold experts) ---------------------------------------------------------
    def clear_many(self, keys: Sequence[Key]) -> list[int]:
        """`clear` for several keys on the current stream, with one "freed" event for all their slots."""
        slots, cleared = [], []
        stream = torch.cuda.current_stream(self.device) if self.is_cuda else None
        for key in keys:
            layer, expert = self._check(key)
            slot = int(self.slot_of_host[layer, expert])
            if slot < 0:
                continue
            self.slot_of_host[layer, expert] = -1
            self.key_of_slot[slot] = -1
            slots.append(slot)
            cleared.append((layer, expert))
            if stream is not None and (published := self._published.pop(slot, None)) is not None:
                self._count_behind(published)
                stream.wait_event(published)
        if cleared:  # on the current stream: later compute kernels see -1
            self.slot_of.view(-1).index_fill_(0, self._device_ints([[ly * self.num_experts + e for ly, e in cleared]])[0], -1)
        if stream is not None and slots:
            freed = torch.cuda.Event()
            freed.record(stream)
            for slot in slots:
                self._freed[slot] = freed
            for key in cleared:
                self._key_cleared[key] = freed
        return slots

    def load_many(self, items: Sequence[tuple[Key, int, torch.Tensor]], wait_for: Sequence = ()) -> tuple:
        """`load` for several (key, slot, pinned source) on the copy stream: waits (each slot's last clear,
        each key's last clear, `wait_for`), the copies, the map entries, then one event.

        Returns (start, done) events (timing-enabled; both None on CPU, where the copies are done)."""
        for key, slot, src in items:
            layer, expert = self._check(key, slot)
            if self.owner(slot) is not None or self.slot_of_host[layer, expert] >= 0:
                raise ValueError(f"cannot load {key} into slot {slot}: one of them is taken; clear it first")
            if src.dtype != torch.uint8 or src.dim() != 1 or src.numel() > self.slot_bytes:
                raise ValueError(f"src must be a 1-D uint8 tensor of <= {self.slot_bytes} bytes")
        if not self.is_cuda:
            for key, slot, src in items:
                self.slab[slot, : src.numel()].copy_(src)
                self.assign(key, slot)
            return None, None
        stream = self.copy_stream
        with torch.cuda.stream(stream):
            seen: set[int] = set()
            waits = [self._freed.pop(slot, None) for _, slot, _ in items]
            waits += [self._key_cleared.pop((int(k[0]), int(k[1])), None) for k, _, _ in items]
            for ev in (*waits, *wait_for):
                if ev is not None and id(ev) not in seen:
                    seen.add(id(ev))
                    stream.wait_event(ev)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._copy_rows([(slot, src) for _, slot, src in items])
            for key, slot, _ in items:  # published only after every copy of the batch has landed
                layer, expert = int(key[0]), int(key[1])
                self.slot_of_host[layer, expert] = slot
                self.key_of_slot[slot] = (layer, expert)
            idx_val = self._device_ints([[int(k[0]) * self.num_experts + int(k[1]) for k, _, _ in items],
                                         [slot for _, slot, _ in items]])
            self.slot_of.view(-1).index_copy_(0, idx_val[0], idx_val[1].to(torch.int32))
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        for _, slot, _ in items:
            self._published[slot] = done
        return start, done

    def stream_in(self, items: Sequence[tuple[int, torch.Tensor]], wait_for: Sequence = ()) -> tuple:
        """Copy (slot, pinned source) pairs on the copy stream, after the events `wait_for`, leaving the map
        alone (the slots hold one step's copies, addressed by the step itself). Returns timing (start, done) events
        (both None on CPU, where the copies are done)."""
        if not self.is_cuda:
            self._copy_rows(items)
            return None, None
        stream = self.copy_stream
        with torch.cuda.stream(stream):
            for ev in wait_for:
                stream.wait_event(ev)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._copy_rows(items)
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        return start, done

    def _copy_rows(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Copy each (slot, source) into its slot on the current stream (asynchronous on CUDA)."""
        rows = self._rows()
        for slot, src in items:
            n = src.numel()
            (rows[slot] if n == self.slot_bytes else rows[slot][:n]).copy_(src, non_blocking=self.is_cuda)

    def _rows(self) -> tuple[torch.Tensor, ...]:
        """The slab's slots as uint8 [slot_bytes] views, made once (indexing the slab costs microseconds a copy)."""
        if self._row_views is None:
            self._row_views = self.slab.unbind(0)
        return self._row_views

    def _device_ints(self, rows: list[list[int]]) -> torch.Tensor:
        """Small int64 rows on the device, uploaded on the current stream without a host sync."""
        t = torch.tensor(rows, dtype=torch.int64)
        if not self.is_cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)  # the caching host allocator keeps it until copied

    def __repr__(self) -> str:
        return (f"GpuSlots({self.num_slots} x {self.slot_bytes} B = {self.nbytes / 2**30:.2f} GiB on {self.device}, "
                f"{self.num_resident} resident)")
