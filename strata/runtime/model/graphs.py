"""Decode steps as fixed-shape work, replayed from CUDA graphs.

A decode step of B sequences (one new token each) runs with a `DecodeBatch`: device tensors for the
slots and positions, and a power-of-two bucket of cache positions to attend over. Its shapes depend
only on (B, bucket), so it is captured once per (cache, B, bucket, mode) and replayed:
- "full": every expert is resident (or all experts are in memory): the whole step is one graph,
  with no Python per layer, no launch overhead and no host synchronisation;
- "mailbox": some experts may be cold, and every one sits in pinned RAM: still one graph a step; each
  MoE layer hands its cold pairs to a native CPU worker through page-locked memory and the stream waits
  on the device for its answer (strata.runtime.offload.mailbox);
- "segmented": some experts may be cold. Each MoE layer needs the host once (which pairs are cold,
  then copies or CPU compute for them), so the step is captured as one graph per stretch between
  those points, and the host work runs between replays (`SegmentRecorder.host_step`). Everything
  else (attention, routers, resident experts, norms) still replays without Python.
Engram layers: when the device reads every table in place, the step's Engram work is device ops and
is captured with the rest (strata.runtime.model.engram.decode); otherwise the host hashes the step and
starts its row reads before the replay, and a host step at each Engram layer waits for that layer's
rows and copies them into the graph's buffers (`StaticEngramStep`), so reads overlap earlier layers.
Prefill chunks run the same code eagerly, and eager and replayed decode steps give bit-identical results.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.runtime.model.capture import SegmentRecorder, capturing
from strata.runtime.model.engram.static import StaticEngramStep
from strata.runtime.model.hooks import GraphStepHooks
from strata.runtime.model.kv_cache import DecodeBatch, KVCache, StepBatch, kv_bucket

log = logging.getLogger(__name__)
MAX_GRAPH_BATCH = 16  # decode batches up to this size get graphs; bigger ones run eagerly


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | SegmentRecorder
    ids: torch.Tensor  # [B] static inputs
    meta: torch.Tensor  # [2, B] slots, positions
    out: torch.Tensor  # [B, H] static output
    engram: StaticEngramStep | None = None  # Engram models: the step's rows, taps and ring indices


class DecodeGraphs:
    """Captures and replays decode steps of one model; `mode()` says how: "full", "mailbox", "segmented" or None
    (eager). `hooks` (the expert executor's, or None) are told around each graph step (strata.runtime.model.hooks)."""

    def __init__(self, forward: Callable[[torch.Tensor, DecodeBatch, KVCache], torch.Tensor],
                 mode: Callable[[], str | None], devices: list[torch.device] | None = None,
                 hooks: GraphStepHooks | None = None):
        self.forward, self.mode, self.hooks = forward, mode, hooks
        # a model split over several cards: every capture is segmented, with a graph per card's stretch
        self.devices = devices if devices is not None and len(devices) > 1 else None
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = None
        self.replays = 0
        self.captures = 0
        self.failed: dict[str, str] = {}  # mode -> why its capture failed (that mode then runs eagerly)
        # `hooks.after_queued` runs once the caller has queued all of a replayed step's work (`step_queued`), while
        # the GPU works: e.g. the mailbox's books, whose Python would otherwise hold the GIL the launch and the
        # step's LM head, sampling and read-back need, and which stop once the event it is given is reached
        self._launched = False  # a step was replayed and `hooks.after_queued` has not run for it yet
        self._queued_event: torch.cuda.Event | None = None  # what `hooks.after_queued` is given
        self.eager_shapes: dict[tuple, str] = {}  # graph key -> why that shape alone runs eagerly

    def run(self, input_ids: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """hidden [B, H] for a pure decode `batch` (every length 1) on CUDA: replayed, or eager then captured."""
        n = len(batch.slots)
        kv_len = kv_bucket(max(batch.starts), cache.max_len)
        meta = torch.tensor([batch.slots, batch.starts], dtype=torch.int64).pin_memory()
        self.step_queued()  # a caller that did not say so: the last step's hook runs now, before this one
        mode = self.mode() if n <= MAX_GRAPH_BATCH else None
        if mode in self.failed:
            mode = None
        if mode is not None and self.hooks is not None:
            self.hooks.before_step()
        step = batch.engram  # the step's Engram work (hashed, gathers started), or None
        if mode is None:
            dev = meta.to(input_ids.device, non_blocking=True)
            return self.forward(input_ids, DecodeBatch(dev[0], dev[1], kv_len, engram=step), cache)
        key = (id(cache), n, kv_len, mode)
        g = self.graphs.get(key)
        if g is None and key in self.eager_shapes:
            dev = meta.to(input_ids.device, non_blocking=True)
            return self.forward(input_ids, DecodeBatch(dev[0], dev[1], kv_len, engram=step), cache)
        if g is None:
            return self._capture(key, input_ids, meta, kv_len, cache, mode, step)
        if g.engram is not None:  # rows wait in host steps at their layers (segmented), or all now
            try:
                g.engram.bind(step) if isinstance(g.graph, SegmentRecorder) else g.engram.load(step)
            except RuntimeError as e:  # e.g. this step's rows do not fit the host row cache at once: run it eagerly
                log.warning("decode step run eagerly: %s", e)
                dev = meta.to(input_ids.device, non_blocking=True)
                return self.forward(input_ids, DecodeBatch(dev[0], dev[1], kv_len, engram=step), cache)
        g.ids.copy_(input_ids, non_blocking=True)
        g.meta.copy_(meta, non_blocking=True)
        g.graph.replay()
        self._launched = self.hooks is not None
        if g.engram is not None:
            g.engram.replayed()
        self.replays += 1
        return g.out.clone()

    def step_queued(self) -> None:
        """The caller has queued everything of the step it ran last (LM head, sampling, the tokens' read-back) and
        is about to wait for the GPU: `hooks.after_queued` runs now, once per replayed step, with an event recorded after
        that work (so it can stop when the GPU is done). (Run right after the replay, the books' Python held the GIL
        for ~1 ms while the decoding thread still had the step's LM head and sampling to queue.)"""
        if self._launched:
            self._launched = False
            if self._queued_event is None:
                self._queued_event = torch.cuda.Event()  # one, recorded again every step
            self._queued_event.record()
            self.hooks.after_queued(self._queued_event)

    def _capture(self, key, input_ids, meta, kv_len, cache, mode: str, step=None) -> torch.Tensor:
        """Run the step for real on a side stream (warm-up, its result is returned), then capture it."""
        ids = input_ids.clone()
        dev_meta = meta.to(input_ids.device)
        try:
            statics = StaticEngramStep(step) if step is not None else None  # the graph reads Engram inputs from here
        except RuntimeError as e:  # e.g. a host row cache too small for this batch's rows: this shape runs eagerly
            self.eager_shapes[key] = f"{type(e).__name__}: {e}"
            log.warning("decode steps of %d sequences run eagerly: %s", key[1], self.eager_shapes[key])
            return self.forward(input_ids, DecodeBatch(dev_meta[0], dev_meta[1], kv_len, engram=step), cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with capturing(mode), torch.cuda.stream(side):  # the warm-up takes the capture's paths
            result = self.forward(ids, DecodeBatch(dev_meta[0], dev_meta[1], kv_len, engram=statics), cache).clone()
            if statics is not None:
                statics.replayed()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            with capturing(mode):
                graph, out = self._record(ids, dev_meta, kv_len, cache, mode, statics)
        except Exception as e:  # noqa: BLE001 - a step that cannot be captured still runs, eagerly
            frames = traceback.extract_tb(e.__traceback__)
            where = [f for f in frames if "/strata/" in f.filename] or frames  # strata's line that cannot be captured
            self.failed[mode] = f"{type(e).__name__}: {e} (at {Path(where[-1].filename).name}:{where[-1].lineno})"
            if e.__context__ is not None:  # an error while ending the capture hides the one that broke it
                self.failed[mode] += f"; during: {type(e.__context__).__name__}: {e.__context__}"
            log.warning("CUDA-graph capture (%s) failed, running decode steps eagerly: %s", mode, self.failed[mode])
            self._synchronize()
            return result
        if not any(k[0] == key[0] for k in self.graphs):  # a freed cache's id may be reused: drop its graphs
            weakref.finalize(cache, self._forget_id, key[0])
        self.graphs[key] = _Graph(graph, ids, dev_meta, out, statics)
        self.captures += 1
        return result

    def _record(self, ids, dev_meta, kv_len, cache, mode: str, statics=None):
        batch = DecodeBatch(dev_meta[0], dev_meta[1], kv_len, engram=statics)
        if mode in ("full", "mailbox") and self.devices is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self.forward(ids, batch, cache)
            return graph, out
        self._synchronize()
        rec = SegmentRecorder(self.pool, ids.device if self.devices is not None else None)
        with capturing(mode, rec), torch.cuda.stream(torch.cuda.Stream()):
            rec.begin()
            try:
                out = self.forward(ids, batch, cache)
            except BaseException:
                rec.abort()
                raise
            rec.end()
        self._synchronize()
        return rec, out

    def _synchronize(self) -> None:
        for device in self.devices or [None]:
            torch.cuda.synchronize(device)

    def _forget_id(self, cache_id: int) -> None:
        for key in [k for k in self.graphs if k[0] == cache_id]:
            del self.graphs[key]
        for key in [k for k in self.eager_shapes if k[0] == cache_id]:
            del self.eager_shapes[key]
        if not self.graphs:  # no graph holds the shared pool any more: the allocator forgets it, and a capture
            self.pool = None  # into its handle would fail (use_count 0); the next capture makes a fresh one


def is_decode(input_ids: torch.Tensor, batch: StepBatch) -> bool:
    """A batch of sequences that each feed exactly one token, on CUDA."""
    return input_ids.is_cuda and isinstance(batch, StepBatch) and all(n == 1 for n in batch.lengths)
