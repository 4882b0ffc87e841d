"""Router-driven prefetch: after layer l, predict the experts of layers l+1 .. l+lookahead and fetch them.

The residual stream changes slowly from layer to layer, so applying layer l+1's router to the
hidden state leaving layer l predicts most of the experts layer l+1 will ask for (mixtral-offloading
and Pre-gated MoE rely on this). The tier manager counts how many prefetches were used, late or
wasted, which is the measured precision and recall of the prediction.

On a GPU the prediction never stalls the host: `__call__` enqueues the predictor kernels and an
asynchronous copy of the predicted ids into pinned memory; `poll()` (called by the MoE executor at its
own synchronisation point, on the compute thread, so evictions stay in stream order) issues the
prefetches whose ids have arrived.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from strata.tiers.manager import TierManager

Predictor = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> expert ids [N, k]


class Capture(Protocol):
    """A CUDA-graph capture in progress (strata.runtime.model.capture.SegmentRecorder)."""

    def defer(self, fn: Callable[[], None]) -> None:
        """Run `fn` at each replay of the captured step, at its next host step."""


class LookaheadPrefetcher:
    """Called after each layer with its output hidden state; prefetches predicted experts ahead.

    A prediction that is mostly wrong costs PCIe bandwidth and evicts useful experts, so the prefetcher
    watches its own measured precision: when fewer than `MIN_PRECISION` of a window of `WINDOW`
    prefetches were used, it pauses for `PAUSE_CALLS` layers, then measures again. (On the suite's
    checkpoints, whose skew channel keeps the stream nearly unchanged from layer to layer, the next layer's
    experts are named with 0.99 recall, `bench/probes/lookahead_probe.py`; on plain random weights about 0.7.)
    """

    WINDOW = 256
    MIN_PRECISION = 0.25
    PAUSE_CALLS = 2000

    def __init__(self, manager: TierManager, predictors: dict[int, Predictor], lookahead: int, device_tier: str,
                 idle: Callable[[], bool] | None = None):
        self.manager, self.predictors = manager, predictors
        # True once there is nothing left to fetch, for good (every expert resident in the target tier and none
        # evictable): a decode step captured from then on leaves the prediction out of its graph
        self.idle = idle
        self.lookahead, self.device_tier = lookahead, device_tier
        self._moe_layers = sorted(predictors)
        self._mark = (0, 0)  # (issued, used) when the current precision window started
        self._paused = 0  # layers left to skip
        self.pauses = 0
        self._pending: list[tuple[list[int], torch.Tensor, torch.cuda.Event]] = []  # (layers, ids [J, N*k] pinned, ready)

    def __call__(self, layer: int, hidden: torch.Tensor, capture: Capture | None = None) -> None:
        """After `layer`: predict the next layers' experts from its output hidden [N, H] and fetch them. Inside a
        graph `capture`, the prediction is part of the graph and the gates and fetches run at each replay."""
        ahead = [j for j in self._moe_layers if j > layer][: self.lookahead]
        if not ahead:
            return
        if self.idle is not None and self.idle():  # idle for good (the target tier holds every expert)
            return
        if capture is not None:  # inside a graph capture: predict in the graph, gate and issue at every replay
            ids = torch.stack([self.predictors[j](hidden).reshape(-1) for j in ahead])  # [J, N*k], static
            capture.defer(lambda: self._replayed(ahead, ids))
            return
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            # a one-graph step ("full": every expert resident; "mailbox": every cold one read from pinned RAM) has
            # nothing to fetch ahead, and an event recorded inside a capture cannot be queried after it (CUDA says
            # "invalid argument"), nor may the graph copy ids into a host buffer freed after the capture
            return
        if not self._precise_enough():
            return
        ids = torch.stack([self.predictors[j](hidden).reshape(-1) for j in ahead])  # [J, N*k]
        if not ids.is_cuda:
            self._issue(ahead, ids)
            return
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._pending.append((ahead, host, ready))

    def _precise_enough(self) -> bool:
        if self._paused > 0:
            self._paused -= 1
            if self._paused == 0:
                self._mark = (self.manager.stats_.prefetch_issued, self.manager.stats_.prefetch_used)
            return False
        st = self.manager.stats_
        issued = st.prefetch_issued - self._mark[0]
        if issued < self.WINDOW:
            return True
        used = st.prefetch_used - self._mark[1]
        self._mark = (st.prefetch_issued, st.prefetch_used)
        if used / issued >= self.MIN_PRECISION:
            return True
        self._paused, self.pauses = self.PAUSE_CALLS, self.pauses + 1
        return False

    def poll(self, wait: bool = False) -> None:
        """Issue the prefetches whose predictions have reached the host (all of them with `wait`)."""
        while self._pending:
            ahead, host, ready = self._pending[0]
            if not wait and not ready.query():
                return
            ready.synchronize()
            self._pending.pop(0)
            self._issue(ahead, host)

    def _replayed(self, ahead: list[int], ids: torch.Tensor) -> None:
        """A captured prediction at replay time: the same gates as an eager call, then the prefetches."""
        if (self.idle is None or not self.idle()) and self._precise_enough():
            self._issue(ahead, ids.cpu())

    def _issue(self, ahead: list[int], ids: torch.Tensor) -> None:
        for j, row in zip(ahead, ids, strict=True):
            self.manager.prefetch([(j, int(e)) for e in torch.unique(row).tolist()], self.device_tier)
