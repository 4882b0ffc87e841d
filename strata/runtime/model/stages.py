"""Running one `MoETransformer` whose layers live on several devices: module placement and stage hops.

`stage_model(model, bounds)` moves each decoder layer to its stage's device (embeddings with the first
stage, final norm and lm_head with the last) and installs forward hooks, so `model(ids, batch, cache)`
and `model.logits(hidden)` keep their single-device contract:
- on entry, the KV cache's per-layer slabs are moved once to their layer's device (`KVCache` allocates
  them on one device), and the token ids to the first device;
- before each layer the CUDA current device is set to the layer's card, so code that uses "the current
  stream" (expert handles, events) orders work on the card that computes it; at a stage boundary the
  activations (and rotary cos/sin) are copied with `x.to(next, non_blocking=True)`, which PyTorch orders
  on both cards' streams without a host sync (peer-to-peer when the cards can reach each other, staged
  through host memory by the driver when they cannot);
- logits are copied back to the first device, where the engine samples.
Stages may share a device (e.g. two "cpu" stages), which exercises all of this on CPU-only hosts.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from strata.runtime.model.capture import current_recorder
from strata.runtime.model.kv_cache import DecodeBatch
from strata.runtime.model.transformer import MoETransformer

Bounds = list[tuple[torch.device, int, int]]  # (device, first layer, end layer) per stage, contiguous


@dataclass
class HopStats:
    """Activation copies between cards: count, bytes, and (when timed) copy time measured by CUDA events."""

    hops: int = 0
    bytes: int = 0
    seconds: float = 0.0
    timed: int = 0
    _pending: list = field(default_factory=list)  # (start, end) CUDA events not yet read

    def add(self, nbytes: int, timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> None:
        """A hop of `nbytes`: replayed inside a CUDA graph (counted, not timed), or copied eagerly, then timed
        by `timing` (its start and end CUDA events, read at the next `snapshot`) when given."""
        self.hops += 1
        self.bytes += nbytes
        if timing is not None:
            self._pending.append(timing)

    def snapshot(self) -> dict:
        """JSON-ready totals (reading the timing events waits for the copies they bracket)."""
        for start, end in self._pending:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
            self.timed += 1
        self._pending.clear()
        return {"hops": self.hops, "bytes": self.bytes, "seconds": round(self.seconds, 6), "timed": self.timed}


class StageMap:
    """Which device runs each layer of a staged model, and the hooks that move tensors between them."""

    def __init__(self, model: MoETransformer, bounds: Bounds, time_hops: bool = False):
        n = len(model.layers)
        if not bounds or bounds[0][1] != 0 or bounds[-1][2] != n or any(
                a[2] != b[1] for a, b in itertools.pairwise(bounds)) or any(s >= e for _, s, e in bounds):
            raise ValueError(f"stage bounds {[(str(d), s, e) for d, s, e in bounds]} must cover layers 0-{n - 1} "
                             "contiguously, each stage with at least one layer")
        self.bounds = [(torch.device(d), s, e) for d, s, e in bounds]
        self.layer_device = [d for d, s, e in self.bounds for _ in range(s, e)]
        self.first, self.last = self.bounds[0][0], self.bounds[-1][0]
        self.time_hops = time_hops  # bracket each boundary copy with CUDA events (for the benchmark)
        self.stats = HopStats()
        self._memo: dict = {}
        self._handles = [model.register_forward_pre_hook(self._enter, with_kwargs=True),
                         model.register_forward_hook(self._leave),
                         model.lm_head.register_forward_hook(self._logits_back)]
        for i, layer in enumerate(model.layers):
            self._handles.append(layer.register_forward_pre_hook(self._before_layer(i), with_kwargs=True))
        self._handles.append(model.norm.register_forward_pre_hook(self._before_norm))

    def stage_of(self, layer: int) -> int:
        """Index of the stage running `layer`."""
        return next(k for k, (_, s, e) in enumerate(self.bounds) if s <= layer < e)

    def remove(self) -> None:
        """Uninstall the hooks (the modules stay where they are)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- hooks -----------------------------------------------------------------------------------
    def _enter(self, module, args, kwargs):
        self._memo: dict = {}
        cache = args[2] if len(args) > 2 else kwargs.get("cache")
        if cache is not None:
            relocate_cache(cache, self.layer_device)
        _set_device(self.first)
        ids = args[0]
        if ids.device != self.first:
            return (ids.to(self.first), *args[1:]), kwargs
        return None

    def _leave(self, module, args, output):
        self._memo = {}
        _set_device(self.first)  # the engine's device again for whatever runs next on this thread

    def _before_layer(self, i: int):
        device = self.layer_device[i]

        def hook(module, args, kwargs):
            rec = current_recorder()
            mirror = None
            if rec is not None and rec.device is not None and device.type == "cuda":
                if device != rec.device and args:
                    # capturing a decode step: this card's layers go in a graph of their own; what crosses
                    # the boundary becomes that graph's buffers, filled at replay (SegmentRecorder.mirror)
                    nbytes = args[0].numel() * args[0].element_size()
                    rec.switch_device(device, on_replay=lambda: self.stats.add(nbytes))
                mirror = rec.mirror
            _set_device(device)
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            # the hidden state is the hop that counts; rotary cos/sin (computed once, on the first card,
            # and passed to every layer) follow it uncounted, copied once per card per step
            rest = tuple(self._moved(a, device, mirror) for a in args[1:])
            return ((self._hop(args[0], device, mirror), *rest),
                    {k: self._moved(v, device, mirror) for k, v in kwargs.items()})

        return hook

    def _before_norm(self, module, args):
        if args[0].device != self.last:
            return (self._hop(args[0], self.last), *args[1:])
        return None

    def _logits_back(self, module, args, output):
        return _to(output, self.first) if output.device != self.first else None

    def _moved(self, t, device: torch.device, mirror=None):
        """`t` on `device`, copied at most once per forward pass (memoised until the next `_enter`); while
        a decode step is captured, `mirror` makes the copy a buffer the card hop fills at replay."""
        if isinstance(t, DecodeBatch):
            t_device = t.slots_t.device
        elif isinstance(t, torch.Tensor):
            t_device = t.device
        else:
            return _to(t, device)
        if t_device == device:
            return t
        key = (id(t), device)
        if key not in self._memo:
            self._memo[key] = (t, _to(t, device, mirror))  # keep t alive so its id stays unique this step
        return self._memo[key][1]

    def _hop(self, t: torch.Tensor, device: torch.device, mirror=None) -> torch.Tensor:
        """The hidden state `t` on `device`; the copy is counted (and timed). While a decode step is
        captured, the copy is the card hop's at replay (`mirror`), counted there."""
        if t.device == device:
            return t
        if mirror is not None:
            return mirror(t, device)
        timed = self.time_hops and t.is_cuda and device.type == "cuda"
        if timed:  # the copy runs on the source card's current stream: bracket it there
            stream = torch.cuda.current_stream(t.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        out = _to(t, device)
        if timed:
            end.record(stream)
        self.stats.add(t.numel() * t.element_size(), (start, end) if timed else None)
        return out


def _to(t, device: torch.device, mirror=None):
    """`t` (a tensor, a tuple/list of them, a DecodeBatch, or anything else, returned as is) on `device`;
    `mirror(tensor, device)` replaces the copies while a decode step is captured."""
    if isinstance(t, (tuple, list)):
        return type(t)(_to(x, device, mirror) for x in t)
    if isinstance(t, DecodeBatch) and t.slots_t.device != device:
        return dataclasses.replace(t, slots_t=_to(t.slots_t, device, mirror), pos_t=_to(t.pos_t, device, mirror))
    if isinstance(t, torch.Tensor) and t.device != device:
        if mirror is not None:
            return mirror(t, device)
        return t.to(device, non_blocking=t.is_cuda and device.type == "cuda")  # to the CPU: synchronous
    return t


def relocate_cache(cache, layer_device: list[torch.device]) -> None:
    """Move each layer's KV slabs (and an Engram layer's convolution ring) to that layer's device, once
    (later calls find them in place)."""
    for i, pair in enumerate(cache.layers):
        if pair[0].device != layer_device[i]:
            cache.layers[i] = tuple(t.to(layer_device[i]) for t in pair)
    rings = cache.engram.conv if getattr(cache, "engram", None) is not None else {}
    for i, ring in rings.items():
        if ring.device != layer_device[i]:
            rings[i] = ring.to(layer_device[i])


def _set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def move_modules(model: MoETransformer, bounds: Bounds) -> None:
    """Put each layer on its stage's device, embeddings (and rotary tables) on the first, norm + lm_head on
    the last. A tied lm_head gets its own copy on the last device."""
    first, last = torch.device(bounds[0][0]), torch.device(bounds[-1][0])
    for device, start, end in bounds:
        for i in range(start, end):
            model.layers[i].to(device)
    tied = model.lm_head.weight is model.embed_tokens.weight or (
        model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr())
    model.embed_tokens.to(first)
    model.rotary.to(first)
    model.norm.to(last)
    if tied and first != last:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().to(last), requires_grad=False)
    else:
        model.lm_head.to(last)


def stage_model(model: MoETransformer, bounds: Bounds, time_hops: bool = False) -> StageMap:
    """Place `model`'s modules by `bounds` and install the stage hooks; the map is also `model.stage_map`."""
    move_modules(model, bounds)
    stage_map = StageMap(model, bounds, time_hops)
    model.stage_map = stage_map
    return stage_map
