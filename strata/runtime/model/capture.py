"""The CUDA-graph capture in progress on this thread, if any, and the recorder of a segmented capture.

While `DecodeGraphs` (strata.runtime.model.graphs) captures a decode step, code several calls deep in the forward
pass acts differently from an eager pass:
- a tiered MoE layer's cold path (strata.runtime.offload.tiered_decode) becomes a host step between two graphs
  (`SegmentRecorder.host_step`), or takes the one-graph mailbox path (mode "mailbox");
- an Engram layer's row buffers (strata.runtime.model.engram.decode) are refilled in host steps at their layers;
- a model split over cards (strata.runtime.model.stages) ends one card's graph and goes on on the next;
- the lookahead prefetch (strata.tiers.prefetch) predicts inside the graph and issues at replay (`defer`).

Why a thread-local, the one of the decode path: that forward pass (model -> decoder layer -> MoE block ->
experts) is the same code for prefill chunks, eager decode and captures, and its signatures carry tensors, not
capture state; a capture is itself bound to the capturing thread (CUDA's "thread_local" capture error mode), and
another thread running a forward pass meanwhile (a second engine, a test) must see none. `capturing()` is the
only writer; `current_recorder()` and `current_capture_mode()` are the readers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch


class _CaptureState(threading.local):
    """This thread's capture: its mode ("full", "mailbox", "segmented") and, segmented, its recorder."""

    mode: str | None = None
    recorder: SegmentRecorder | None = None


_state = _CaptureState()


def current_recorder() -> SegmentRecorder | None:
    """The segmented capture in progress on this thread, if any (modules then defer host work to it)."""
    return _state.recorder


def current_capture_mode() -> str | None:
    """The mode of the decode step being captured on this thread (its eager warm-up run included), else None."""
    return _state.mode


@contextlib.contextmanager
def capturing(mode: str, recorder: SegmentRecorder | None = None) -> Iterator[None]:
    """While the block runs, this thread captures a decode step in `mode` (or runs its eager warm-up), recorded
    by `recorder` when segmented; the state before is restored after."""
    saved = _state.mode, _state.recorder
    _state.mode, _state.recorder = mode, recorder if recorder is not None else saved[1]
    try:
        yield
    finally:
        _state.mode, _state.recorder = saved


class SegmentRecorder:
    """Captures a step as graphs separated by host steps; `replay()` runs them in order."""

    def __init__(self, pool, device: torch.device | None = None):
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.steps: list[tuple[Callable[[], None], list[Callable[[], None]]]] = []
        self.deferred: list[Callable[[], None]] = []
        self.tail: list[Callable[[], None]] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        # a model split over cards: the card being captured, the first one, and each later card's
        # capture stream with the stream it replaced (restored when the capture ends)
        self.device = self.first = device
        self._cards: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._hop_copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, buffer) of the current boundary

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def host_step(self, fn: Callable[[], None]) -> None:
        """End the current graph here; at replay `fn` (then the work deferred so far) runs before the next one."""
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self.steps.append((fn, self.deferred))
        self.deferred = []
        self.begin()

    def switch_device(self, device: torch.device, on_replay: Callable[[], None] | None = None) -> None:
        """A stage boundary of a model split over cards: end the graph captured on the current card and go
        on capturing on `device` (on a capture stream of its own). At replay, `device`'s stream first waits
        for everything queued on the previous card (one event), the boundary's tensors are copied over
        (`mirror`), then `on_replay` runs (hop statistics)."""
        if device == self.device:
            return
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self._hop_copies = []
        self.steps.append((_card_hop(self.device, device, self._hop_copies, on_replay), self.deferred))
        self.deferred = []
        torch.cuda.set_device(device)
        if device not in self._cards:
            self._cards[device] = (torch.cuda.Stream(device), torch.cuda.current_stream(device))
        torch.cuda.set_stream(self._cards[device][0])
        self.device = device
        self.begin()

    def mirror(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`t`, made on the previous card, as a buffer on `device` (the card now captured) that the card hop
        fills at replay. A graph cannot hold a copy between cards (PyTorch orders one on both cards'
        streams), so the copy runs eagerly between the two cards' replays; `t` is kept alive with it."""
        dst = torch.empty_like(t, device=device)
        self._hop_copies.append((t, dst))
        return dst

    def _restore(self) -> None:
        for _, saved in self._cards.values():
            torch.cuda.set_stream(saved)
        if self.first is not None:
            torch.cuda.set_device(self.first)

    def defer(self, fn: Callable[[], None]) -> None:
        """Host work that may wait until the next host step (e.g. issuing predicted prefetches)."""
        self.deferred.append(fn)

    def abort(self) -> None:
        """End a capture that failed midway (the stream must not stay in capture mode)."""
        try:
            self._graph.capture_end()
        except Exception:  # noqa: BLE001 - already invalidated
            pass
        self._restore()

    def end(self) -> None:
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self.tail, self.deferred = self.deferred, []
        self._restore()

    def replay(self) -> None:
        if self.first is not None:
            torch.cuda.set_device(self.first)
        for graph, (fn, deferred) in zip(self.graphs[:-1], self.steps, strict=True):
            graph.replay()
            fn()
            for d in deferred:
                d()
        self.graphs[-1].replay()
        if self.tail:
            torch.cuda.current_stream().synchronize()
            for d in self.tail:
                d()
        if self.first is not None:
            torch.cuda.set_device(self.first)


def _card_hop(prev: torch.device, nxt: torch.device, copies: list[tuple[torch.Tensor, torch.Tensor]],
              on_replay: Callable[[], None] | None) -> Callable[[], None]:
    """The replay step between two cards' graphs: `nxt` waits for `prev`'s work, the boundary's tensors are
    copied to `nxt` (peer-to-peer where the cards allow it), and `nxt` becomes current."""
    def hop() -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(prev))
        torch.cuda.current_stream(nxt).wait_event(ready)
        for src, dst in copies:
            dst.copy_(src, non_blocking=True)  # ordered on both cards' current streams by PyTorch
        torch.cuda.set_device(nxt)
        if on_replay is not None:
            on_replay()
    return hop
