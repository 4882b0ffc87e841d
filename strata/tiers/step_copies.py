"""One decode layer's cold experts brought to GPU slots in one batch.

`acquire` is general (any tier, any source, waits, per-object futures) and costs a few hundred
microseconds of host time per expert on CUDA: a stream switch, a map-update kernel and an event for
the eviction, the same again for the copy and its map entry, and an event per handle on release. A
decode step pays that for every cold expert of every layer, which makes a split decode step
overhead-bound. `stage_gpu` does the same bookkeeping for a layer's pinned-resident cold experts with one
map-clear batch on the compute stream, one copy-stream batch (waits, copies, map entries, one event) and, in
`release_staged`, one event for all of them.

Objects that are not simply pinned-resident (a copy already in flight, or only on tmpfs/disk) take
the general `acquire` path inside the same call, so the result is the same whatever the residency.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from strata.tiers.copies import GpuCopies
from strata.tiers.eviction import Evictor
from strata.tiers.handles import Handles
from strata.tiers.slot_maps import SlotMaps
from strata.tiers.slots import ExpertHandle, Key, TierFullError
from strata.tiers.stats import PrefetchLedger, TierStats
from strata.tiers.storage.gpu_slots import GpuSlots
from strata.tiers.storage.pinned import PinnedPool


@dataclass
class StagedExperts:
    """Experts of one layer held in GPU slots for a step: `slots[i]` holds `experts[i]`."""

    layer: int
    experts: list[int]
    slots: list[int]
    event: object = None  # torch.cuda.Event after the batch's copies and map entries (None: nothing copied)
    handles: list[ExpertHandle] = field(default_factory=list)  # the ones that took the general path
    events: list = field(default_factory=list)  # copies of already-mapped slots that may still be landing
    batch: list[Key] = field(default_factory=list)  # keys this batch pinned itself (released together)
    owner: int = 0

    def wait(self) -> None:
        """Make the current CUDA stream wait for the batch's copies (no host synchronisation)."""
        stream = torch.cuda.current_stream() if self.event is not None or self.events else None
        if self.event is not None:
            stream.wait_event(self.event)
        for ev in self.events:
            stream.wait_event(ev)
        for h in self.handles:
            h.wait()


@dataclass
class StreamedExperts:
    """Experts of one layer copied into the stream slots for one step only (the GPU tier is left as it is)."""

    layer: int
    experts: list[int]
    slots: list[int]
    event: object = None  # torch.cuda.Event after the copies (None on CPU: done)

    def wait(self) -> None:
        """Make the current CUDA stream wait for the copies (no host synchronisation)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class StepCopies:
    """Batched copies of one layer's cold experts into the GPU tier (`stage_gpu`) or into the stream slots, the
    last `stream_slots` GPU slots, kept outside the cached tier for one step's copies (`stream_gpu`)."""

    def __init__(self, maps: SlotMaps, handles: Handles, evictor: Evictor, copies: GpuCopies, ledger: PrefetchLedger,
                 stats: TierStats, pool: PinnedPool, slots: GpuSlots | None, stream_slots: list[int], slot_bytes: int):
        self._lock, self._released, self._holders = maps.lock, maps.released, maps.holders
        self._gpu, self._pinned = maps.gpu, maps.pinned
        self._handles, self._evictor, self._copies, self._ledger = handles, evictor, copies, ledger
        self._stats, self._pool, self._slots, self._slot_bytes = stats, pool, slots, slot_bytes
        self.stream_slots = stream_slots  # GPU slots outside the cached tier, for `stream_gpu`
        self._stream_free: dict[int, object] = {}  # stream slot -> event after its last readers (absent: free now)
        self._stream_out: set[int] = set()  # stream slots of `stream_gpu` batches out and not released

    def stage_gpu(self, layer: int, experts: list[int]) -> StagedExperts:
        """Pin `experts` of `layer` in GPU slots, copying the pinned-resident ones in one batch.

        Returns at once (copies are asynchronous); call `wait()` before reading the slots and
        `release_staged` when the kernels reading them are enqueued."""
        tier, pinned, stats = self._gpu, self._pinned, self._stats
        staged = StagedExperts(layer, [], [], owner=threading.get_ident())
        slow: list[Key] = []
        copies: list[tuple[Key, int, torch.Tensor]] = []  # (key, GPU slot, pinned source)
        with self._lock:
            clears: list[Key] = []
            waits: list = []
            self._copies.reap()  # once for the batch (each query of a copy's event costs microseconds)
            for e in experts:
                key = (layer, int(e))
                if key in tier.inflight or key in pinned.inflight or key not in tier.slot_of and key not in pinned.slot_of:
                    slow.append(key)
                    continue
                self._ledger.used(tier, key)
                if key in tier.slot_of:  # mapped since the step looked (a prefetch): its copy may still be landing
                    stats.lookup(layer, "gpu", False, 0.0, expert=key[1])
                    if (pending := tier.events.get(tier.slot_of[key])) is not None:
                        staged.events.append(pending)
                else:
                    try:
                        slot = self._evictor.take_slot(tier, key, clears, reap=False)
                    except TierFullError:
                        slow.append(key)
                        continue
                    if (prior := tier.events.get(slot)) is not None:
                        waits.append(prior)
                    pinned.refs[key] = pinned.refs.get(key, 0) + 1  # the source stays put until the copy lands
                    copies.append((key, slot, self._pool.slot(pinned.slot_of[key])))
                    tier.slot_of[key] = slot
                    stats.lookup(layer, "pinned", True, 0.0, expert=key[1])
                tier.policy.touch(key)
                tier.refs[key] = tier.refs.get(key, 0) + 1
                self._holders[staged.owner] += 1
                staged.batch.append(key)
                staged.experts.append(key[1])
                staged.slots.append(tier.slot_of[key])
            if clears:
                self._slots.clear_many(clears)
            if copies:
                t0 = time.perf_counter()
                start, done = self._slots.load_many(copies, waits)
                if done is None:  # CPU-simulated GPU tier: the copies are already done
                    stats.paths["pinned->gpu"].add(self._slot_bytes * len(copies), time.perf_counter() - t0,
                                                   objects=len(copies))
                staged.event = done
                self._copies.add(start, done, [k for k, _, _ in copies])
                for key, slot, _ in copies:
                    tier.events[slot] = done
                    tier.policy.insert(key)
        if slow:
            try:
                staged.handles = self._handles.acquire(tier, slow)
            except BaseException:
                self.release_staged(staged)
                raise
            staged.experts += [h.key[1] for h in staged.handles]
            staged.slots += [h.slot for h in staged.handles]
        return staged

    def stream_gpu(self, layer: int, experts: list[int]) -> StreamedExperts | None:
        """Copy `experts` of `layer` from pinned RAM into the stream slots, for this step only.

        The cheap way to compute a cold expert on the GPU when the cost model would rather not keep it: one
        copy per expert and one event, no eviction, no map entries, no policy order to update (a decode layer
        staged through the cached tier spends ~80 us of host time per copy on those; the stream path well
        under half of that). None, doing nothing, when it cannot serve the batch (too few stream slots free of
        batches out and not released, or an expert not resident in pinned RAM): take `stage_gpu` then. Two
        batches of at most half the stream slots each can be out at once, so a prefill copies its next batch
        while the GPU computes this one.
        Call `wait()` before reading the slots and `release_staged` once their readers are enqueued."""
        pinned = self._pinned
        keys = [(layer, int(e)) for e in experts]
        with self._lock:
            free = [s for s in self.stream_slots if s not in self._stream_out]
            if not keys or len(keys) > len(free) or not self._pinned_now(keys):
                return None
            slots = free[: len(keys)]
            self._hold_for_gpu(keys)  # the sources stay put until the copies land
            copies = [(slot, self._pool.slot(pinned.slot_of[key])) for key, slot in zip(keys, slots, strict=True)]
            # the copies wait for the readers of the slots' earlier contents (one wait per distinct event)
            readers = list({id(ev): ev for s in slots if (ev := self._stream_free.pop(s, None)) is not None}.values())
            t0 = time.perf_counter()
            start, done = self._slots.stream_in(copies, readers)
            if done is None:
                self._stats.paths["pinned->gpu"].add(self._slot_bytes * len(copies), time.perf_counter() - t0,
                                                     objects=len(copies))
            self._copies.add(start, done, keys)  # the pinned refs drop once the copies land
            self._stream_out.update(slots)
        return StreamedExperts(layer, [k[1] for k in keys], list(slots), done)

    def _pinned_now(self, keys: list[Key]) -> bool:
        """Every key resident in pinned RAM (not on its way there); finished copies reaped first, so their
        holds are gone before new ones are taken. Lock held."""
        pinned = self._pinned
        if not all(k in pinned.slot_of and k not in pinned.inflight for k in keys):
            return False
        self._copies.reap()
        return True

    def _hold_for_gpu(self, keys: list[Key]) -> None:
        """Pinned-resident `keys` a GPU step's stream copies read from pinned RAM: held in their slots, counted as
        pinned-tier lookups the GPU tier missed, and seen by both policies (the GPU tier's frequency history decides
        whether a later copy keeps one). Lock held."""
        pinned, gpu = self._pinned, self._gpu
        for key in keys:
            self._ledger.used(pinned, key)
            if not pinned.holds_all:
                pinned.policy.touch(key)
            if gpu is not None:
                gpu.policy.touch(key)
            pinned.refs[key] = pinned.refs.get(key, 0) + 1
            self._stats.lookup(key[0], "pinned", True, 0.0, expert=key[1])

    def release_staged(self, staged: StagedExperts | StreamedExperts) -> None:
        """Unpin a `stage_gpu` batch; later copies into its slots wait for the work queued on them so far."""
        if isinstance(staged, StreamedExperts):
            ev = None
            if self._slots.slab.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self._slots.slab.device))
            with self._lock:
                for slot in staged.slots:
                    self._stream_out.discard(slot)
                    if ev is not None:
                        self._stream_free[slot] = ev
            return
        if staged.handles:
            self._handles.release(staged.handles)
        if not staged.batch:
            return
        ev = None
        if self._slots.slab.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self._slots.slab.device))
        with self._lock:
            gpu = self._gpu
            for key in staged.batch:
                if ev is not None:
                    gpu.events[gpu.slot_of[key]] = ev
                gpu.unref(key)
            self._holders[staged.owner] -= len(staged.batch)
            staged.batch = []
            self._released.notify_all()
