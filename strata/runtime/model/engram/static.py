"""The Engram inputs of a decode step captured in a CUDA graph, refilled by the host before (or during) each replay.

A decode step whose rows the host fetches (`EngramRuntime.begin`'s path: tables behind the host row cache, no
handshake) cannot hash and gather inside the graph; the graph reads its rows, convolution taps and ring indices from
the buffers of a `StaticEngramStep` instead (strata.runtime.model.graphs captures and replays it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from strata.runtime.model.capture import current_recorder

if TYPE_CHECKING:
    from strata.runtime.model.engram.layer import EngramStep


class StaticEngramStep:
    """The Engram inputs of a captured decode step, in device buffers that replays read.

    Built from the first real step of a graph's shape (all shapes depend only on the batch size). Rows
    reach the graph one of two ways:
    - a host row cache the GPU reads in place (`source.gather_view`, tables on disk or tmpfs): the host
      puts the step's rows in the cache and uploads their slots, in a host step right before each Engram
      layer of a segmented graph (`publish`: the reads of later layers overlap the layers before them)
      or before a whole-step replay (`bind`); the gather itself is part of the graph, so there are no
      staging copies;
    - otherwise a whole-step graph gets the rows before its replay (`load`: waits for the rows still in
      flight), and a segmented graph gets each layer's rows in a host step right before that layer
      (`load_rows`), so the reads overlap the layers before it."""

    def __init__(self, step: EngramStep):
        self.cache, self.source = step.cache, step.source
        self.view = getattr(step.source, "gather_view", None)  # [cache rows, head_dim] the device reads in place
        self.taps, self.ring_dst, self.ring_src = step.taps.clone(), step.ring_dst.clone(), step.ring_src.clone()
        self._step: EngramStep | None = None  # the step being replayed (segmented graphs)
        self._per_layer = False  # a host cache read in place, captured segmented: slots uploaded layer by layer
        if self.view is not None:
            shapes = {layer: t.shape for layer, t in step.tickets.items()}  # (N, heads)
            worst = sum(n * heads for n, heads in shapes.values())  # every row of the step distinct
            if worst >= self.view.shape[0]:  # some later step might not fit the cache at once: no graph
                raise RuntimeError(f"the Engram row cache ({self.view.shape[0]} rows) is smaller than a decode step "
                                   f"of this batch may need ({worst} rows); raise engram.row_cache")
            self._idx = {layer: s.to(self.view.device) for layer, s in step.finish().items()}  # static slot buffers
            self._shape = {layer: (*shape, self.view.shape[-1]) for layer, shape in shapes.items()}
            self._rows = {}
        else:
            self._rows = {layer: step.rows(layer).clone() for layer in list(step.tickets)}  # [B, heads, head_dim]

    def rows(self, layer: int) -> torch.Tensor:
        recorder = current_recorder()
        if self.view is not None:  # gathered from the host cache in place, by slots uploaded before the gather
            if recorder is not None:  # segmented capture: at replay, the host admits this layer's rows right here
                recorder.host_step(lambda: self.publish(layer))
                self._per_layer = True
            return self.view[self._idx[layer]].view(self._shape[layer])
        if recorder is not None:  # segmented capture: at replay, the host fills this buffer right here
            recorder.host_step(lambda: self.load_rows(layer))
        return self._rows[layer]

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.taps, self.ring_dst, self.ring_src  # one card: graphs are not used on staged models

    def bind(self, step: EngramStep) -> None:
        """Before a replay: `step`'s tap map and ring indices now, its rows at their layers (host steps of a
        segmented graph) or, for a whole-step graph from a host cache read in place, its rows' slots now."""
        self._step = step
        for buf, new in ((self.taps, step.taps), (self.ring_dst, step.ring_dst), (self.ring_src, step.ring_src)):
            buf.copy_(new, non_blocking=True)
        if self.view is not None and self._per_layer:
            step.check()  # raises before the replay, not midway, when the cache cannot hold the step's rows
        elif self.view is not None:
            for layer, slots in step.finish().items():
                self._upload(layer, slots)

    def publish(self, layer: int) -> None:
        """A segmented replay's host step before Engram layer `layer`: wait for that layer's reads only (the
        later layers' stay in flight while the GPU runs the layers before them), admit its rows to the host
        cache and upload their slots, stream-ordered before the gather of the next graph segment."""
        self._upload(layer, self._step.finish_layer(layer))

    def _upload(self, layer: int, slots: torch.Tensor) -> None:
        self._idx[layer].copy_(slots.pin_memory() if self.view.is_cuda else slots, non_blocking=True)

    def load_rows(self, layer: int) -> None:
        """Wait for the bound step's rows of `layer` and copy them into the graph's buffer."""
        self._rows[layer].copy_(self._step.rows(layer), non_blocking=True)

    def load(self, step: EngramStep) -> None:
        """Before a whole-step replay: all of `step`'s inputs (waiting for rows still in flight)."""
        self.bind(step)
        for layer in self._rows:
            self.load_rows(layer)

    def replayed(self) -> None:
        """After a run that gathered from the host cache: its slots may be rewritten only after that run."""
        if self.view is not None:
            self.source.replayed()
