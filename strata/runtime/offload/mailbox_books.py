"""The bookkeeping of one-graph split decode (strata.runtime.offload.mailbox), done while the GPU runs the next step: the
lookups each MoE layer served, the tier policy's history and promotions, and the GPU share's balance, all from the
mailbox worker's log."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from strata.runtime.offload.gpu_share import GpuShare
    from strata.runtime.offload.mailbox import CpuMailbox

BALANCE_WINDOW = 48  # the GPU share follows the GPU's waits over this many layers (4 steps of the 12-layer bench model)
BACKLOG_MAX = 512  # layers left for later when the GPU finished first; beyond this many the books catch up anyway
PENDING_PROMOTIONS_MAX = 16  # promotions picked but not issued yet (the GPU finished first); older picks are dropped


class GpuBusy(Protocol):
    """What the books stop at: `query()` is True once the GPU has done the step's work (a torch.cuda.Event)."""

    def query(self) -> bool: ...


class BooksOwner(Protocol):
    """What the books report to: the tiered executor whose mailbox they keep (`ExpertCompute`)."""

    def pick_promotion(self, layer: int, experts) -> tuple[int, int] | None:
        """Of `experts` (cold in `layer`, computed by the worker), the one to copy into the GPU tier, or None."""

    def count_mailbox_work(self, experts: int, nbytes: int, seconds: float) -> None:
        """The worker's running totals: experts it computed, bytes its kernel read and its seconds."""


class MailboxBooks:
    """What the host step did per layer, done after the step from the worker's log: each lookup counted where it was
    served, the GPU tier's history fed with every expert used, and the most used cold expert of a layer promoted into
    the GPU tier when worth a slot (`owner.pick_promotion(layer, experts)` chooses it, or None).

    The books run on the decoding thread once its step is queued (`queued`), while the GPU works, and issue their
    promotions there; once the GPU has done the step, they stop and leave the rest for the next step (the launch waits
    for nothing but the GPU), unless more than `BACKLOG_MAX` layers wait. A statistics read (`flush`) books every
    layer but leaves the promotions to the decoding thread. (On a thread of their own, with promotions on transfer
    workers, their Python would compete for the GIL with the decoding thread and delay its next launch.)"""

    def __init__(self, mailbox: CpuMailbox, manager, owner: BooksOwner, share: GpuShare | None = None):
        """`owner` picks the promotions and is told the worker's running totals (its kernel's own work only)."""
        self.mailbox, self.manager, self.owner = mailbox, manager, owner
        self.share = share
        self._wait_mark = (0, 0)  # the worker's (layers read, layers the GPU waited in) when the share last moved
        self.error: BaseException | None = None
        self.seconds = 0.0  # spent booking and issuing promotions so far (on whichever thread ran them)
        self._lock = threading.Lock()  # one drain at a time (the decoding thread's `queued`, a statistics `flush`)
        self._backlog: deque = deque()  # (layer, resident, computed) drained from the worker, not booked yet
        self._promote: deque = deque()  # promotions picked, not issued yet (the GPU finished first)
        self.deferred = 0  # passes that stopped at the step's end with layers left
        manager.add_lookup_source(self.flush)

    def step(self) -> None:
        """Before a graph step: raise what the worker or the last step reported; the GPU share's update."""
        self.mailbox.check()
        if self.error is not None:
            raise RuntimeError(f"mailbox bookkeeping failed: {self.error}") from self.error
        if self.share is not None:
            self.share.apply()

    def queued(self, until: GpuBusy | None = None) -> None:
        """Once the step's work is queued: the books (~0.5-1 ms of Python a step on the H200 box) run now, on the
        decoding thread while the GPU works, up to the moment `until` says the GPU is done, then the promotions picked,
        each only while it still works. An error is kept for `step` to raise."""
        try:
            self._book(until)
            self._issue_promotions(until)
        except BaseException as e:  # noqa: BLE001 - surfaced on the decoding thread by `step`
            self.error = e

    def flush(self) -> list:
        """Do the books for every layer served so far: the tier manager's statistics call this first, as a lookup
        source (hence [] and the lock order, the manager's then this one's). Promotions wait for the decoding thread
        (`queued`): a promotion clears its victim's map entry on the issuing thread's stream, which must be decode's."""
        self._book(None)
        return []

    def _book(self, until: GpuBusy | None) -> None:
        """Book the layers served so far: all of them, or (`until` given) until the GPU is done, when the rest waits
        for the next call. In one hold of the GIL: giving it up between layers tripled the books' time on the H200 box
        (3.0 against 0.9 ms a step) for no gain. The cold expert a layer's `pick` chooses joins the promotions."""
        m, t0 = self.manager, time.perf_counter()
        with m.lock, self._lock:
            entries = self.mailbox.drain()
            backlog, chosen = self._backlog, self._promote
            backlog.extend(entries)
            while backlog and (until is None or len(backlog) > BACKLOG_MAX or not until.query()):
                layer, resident, computed = backlog.popleft()
                if resident:
                    m.note_hits(layer, resident)
                if computed:
                    m.note_pinned_reads(layer, computed)  # served from pinned RAM, on the CPU
                    if (key := self.owner.pick_promotion(layer, computed)) is not None:
                        chosen.append(key)
            while len(chosen) > PENDING_PROMOTIONS_MAX:  # the books lag: the newest picks reflect the history best
                chosen.popleft()
            self.deferred += bool(backlog)
            self.owner.count_mailbox_work(self.mailbox.experts_computed, *self.mailbox.kernel_rate())
        if entries and self.share is not None:
            layers, waited = self.mailbox.gpu_waits()
            l0, w0 = self._wait_mark
            if layers - l0 >= BALANCE_WINDOW:
                self.share.balance((waited - w0) / (layers - l0))
                self._wait_mark = (layers, waited)
        self.seconds += time.perf_counter() - t0

    def _issue_promotions(self, until: GpuBusy | None) -> None:
        """Issue the promotions picked, on this thread (~0.3-0.5 ms each on the H200 box), each only while the GPU is
        still busy (`until`); the rest wait for the next call."""
        t0 = time.perf_counter()
        while until is None or not until.query():
            with self._lock:
                if not self._promote:
                    break
                key = self._promote.popleft()
            self.manager.promote(key, now=True)
        self.seconds += time.perf_counter() - t0
