"""Copy-ahead in one-graph split decode: PCIe kept busy through the GPU's serial part of each layer.

A split decode layer has two phases (bench/RESULTS.md): ~70-80 us of serial GPU work (the combine, the next
layer's attention and routing, the mailbox pack), during which PCIe and the CPU idle, then the cold phase, where
the CPU worker and the GPU's in-place reads (`GpuShare`) share the layer's cold expert bytes. With the next
layer's experts predicted (its norm and router applied to this layer's residual stream, as
`router_predictors` does), the GPU copies the tails (last intermediate rows) of the predicted cold experts into
VRAM staging slots during the serial phase, so the next cold phase has that many fewer bytes to read.

Per MoE layer l, inside the step's graph, on a third stream (`stream`):
- `predict(l, hidden)` at l's MoE block: predict layer l+1's experts, `plan_ahead` deals the layer's budget of
  granules among the cold ones (the maps layer l+1's pack reads, double-buffered by layer parity);
- `copy(l)` once l's cold phase is over (after the stream's wait for the worker): `copy_ahead` copies l+1's
  tails, which layer l+1's in-place share reads (`gpu_work` waits for them: `wait_copied`).
A wrong prediction costs only its copy (link time, and the SMs the copy shares with the serial phase); an expert
staged but not cold by then is ignored.
The budget is a fixed link time a layer (`AHEAD_US`), measured on the H200 box. A budget following the worker's
measured GPU gap was tried and dropped: a copy that runs past the serial phase lengthens the gap measured, so any
budget large enough to overrun sustained itself (8 granules a layer and 301 tok/s against 402 without).
Off by default (`runtime.copy_ahead`): +7.4% on the skewed checkpoint without temporal locality, -9% on average
with it (bench/RESULTS.md, twenty-fourth session).

Two engines move the tails. `"sm"`: the copy kernel above, in the graph (it takes SMs from the serial phase it
hides in, which is what lost on the temporal-locality checkpoint). `"copy"`: the plan goes to page-locked host
memory, and once the mailbox worker has answered layer l, its copier thread issues l+1's tail copies on a stream
of its own (csrc/mailbox_ahead.h): the copy engine moves them while the GPU runs the serial phase, and the next layer's
pack uses them only if the worker's flag says they have landed (`mailbox_pack`'s GATE). Its staging slots are
double-buffered by layer parity (layer l's in-place kernel may still read its tails when l+1's copies start).
The SM kernel is the default engine: on the H200 box the copy engine's tails landed before the next layer's pack
for only 22-38% of layers (issuing 3 copies a tail and the copy itself outlast the ~75 us serial phase), and
either engine was at best neutral on the temporal-locality checkpoint (bench/RESULTS.md, twenty-fifth session).

A third, `"cpu"` (warm-ahead), copies nothing to VRAM: the plan (every predicted cold expert, in ascending order)
goes to page-locked host memory as for `"copy"`, and once the mailbox worker has answered layer l it reads the
gate/up rows of l+1's predicted cold experts into its threads' caches, each thread the rows the kernel will give
it, until the GPU posts l+1 (csrc/cpu_mailbox.cpp, WarmCfg). The CPU idles through the serial phase otherwise;
the next cold phase then reads those rows from L2 instead of RAM. The pack's split is untouched (`maps` is None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.kernels import copy_ahead as kernels
from strata.runtime.gpu_share import GpuShare

if TYPE_CHECKING:
    from strata.runtime.cpu_mailbox import CpuMailbox

Predictor = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> expert ids [N, k]


class CopyAhead:
    """The staging slots, maps, events and budget of copy-ahead for the MoE layers `moe_layers`.

    addresses [L, E] int64: each expert's page-locked slot (gate_up [2I, H], then down [H, I] at the share's
    `experts.down_offset`); slot_of [L, E] int32: the GPU tier's map (-1: cold); `predictors`: layer -> ids from
    the hidden state entering that layer's MoE block one layer early. `budget_bytes`: a fixed budget a layer
    (None: `AHEAD_US` of link time at the share's in-place rate)."""

    MAX_SLOTS = 8  # staged experts a layer at most (a token's top-8; more predicted cold experts share the budget)
    # link time a layer's copy may take, at the share's in-place rate: 35 us is 1.57 MB, 2 granules of the bench
    # model, the best of 2, 3 and 4 on the H200 box (428.6 tok/s against 413.9 and 411.9; 401.7 and 396.4 without):
    # a longer copy lengthens the serial phase it hides in (the GPU gap 68, 77, 86 us against 64)
    AHEAD_US = 35.0
    AHEAD_US_COPY = 55.0  # the copy engine's: most of the ~70 us serial phase (its copies take no SMs from it)
    WARM_BYTES = 8 << 20  # warm-ahead's gate/up bytes a layer at most: more than a ~65 us serial phase lets 12
    # threads read (~6 MB at ~95 GB/s); the worker stops reading when the GPU posts the layer

    def __init__(self, addresses: np.ndarray, slot_of: torch.Tensor, share: GpuShare, predictors: dict[int, Predictor],
                 moe_layers: list[int], device: torch.device, slot_bytes: int, budget_bytes: int | None = None,
                 mailbox: CpuMailbox | None = None, engine: str = "sm"):
        if engine not in ("sm", "copy", "cpu"):
            raise ValueError(f"copy-ahead engine must be 'sm', 'copy' or 'cpu', got {engine!r}")
        if engine != "sm" and mailbox is None:
            raise ValueError(f"copy-ahead's {engine!r} engine runs in the mailbox worker: give the mailbox")
        self.share, self.slot_of, self.device, self.engine, self.mailbox = share, slot_of, device, engine, mailbox
        self.table = torch.from_numpy(np.ascontiguousarray(addresses)).to(device)  # [L, E] int64
        layers = sorted(moe_layers)
        # layer l plans l + 1 when both are MoE layers with a predictor: the pairs (l, l + 1)
        self.next_of = {a: b for a, b in zip(layers, layers[1:], strict=False) if b == a + 1 and b in predictors}
        self.predictors = predictors
        self.num_experts = addresses.shape[1]
        self.slot_bytes = slot_bytes
        ex = share.experts
        self.inter, self.hidden = ex.down_shape[1], ex.down_shape[0]
        self.down_elem = ex.down_offset // ex.dtype.itemsize
        self.granule_bytes = share.rows * 3 * self.hidden * ex.dtype.itemsize
        s = self.MAX_SLOTS
        stages = {"copy": 2, "sm": 1, "cpu": 0}[engine]  # by layer parity, one set (the SM copy starts after l's
        # reads), or none (warm-ahead stages nothing)
        self.stage = torch.empty((max(1, stages), s, slot_bytes if stages else 0), dtype=torch.uint8, device=device)
        self.rows_map = torch.zeros((2, self.num_experts), dtype=torch.int32, device=device)  # by layer parity
        self.addr_map = torch.zeros((2, self.num_experts), dtype=torch.int64, device=device)
        if engine != "sm":  # the lists the worker copies or reads from, by layer parity: [tag, src[S], dst[S], rows[S]]
            self.plans = torch.zeros((2, 1 + 3 * s), dtype=torch.int64, pin_memory=device.type == "cuda")  # host
            self._lists = [(p[1 : 1 + s], p[1 + s : 1 + 2 * s], p[1 + 2 * s :]) for p in self.plans]
        else:  # the SM kernel's copy list, on the device (one at a time: one stream)
            self.copy_src = torch.zeros(s, dtype=torch.int64, device=device)
            self.copy_dst = torch.zeros(s, dtype=torch.int64, device=device)
            self.copy_rows = torch.zeros(s, dtype=torch.int32, device=device)
            self._lists = [(self.copy_src, self.copy_dst, self.copy_rows)] * 2
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # granules staged, granules of them used cold
        self._counts_host = torch.zeros(2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.fixed = budget_bytes is not None
        if engine == "cpu":  # every predicted cold expert listed whole; the worker reads `warm_bytes` of them
            self.warm_bytes = int(budget_bytes) if self.fixed else warm_budget(self.WARM_BYTES, mailbox.threads)
            self.value = share.granules * s
        else:
            link_us = self.AHEAD_US_COPY if engine == "copy" else self.AHEAD_US
            self.value = self._granules(budget_bytes if self.fixed else link_us * 1e-6 * share.gpu_rate)
        self.target = self.value
        self.budget = torch.tensor([self.value], dtype=torch.int32, device=device)  # [1] read by the step
        # warm-ahead's plan on a high-priority stream: the worker reads it as soon as it answers a layer (on the H200
        # box 17-20% of plans still landed after the answer, high priority or not; the worker waits for them now)
        prio = -1 if engine == "cpu" else 0
        self.stream = torch.cuda.Stream(device, priority=prio) if device.type == "cuda" else None
        self._planned_ev: dict[int, torch.cuda.Event] = {}
        self._copied_ev: dict[int, torch.cuda.Event] = {}
        self._hold: list[torch.Tensor] = []  # tensors the stream reads, kept alive until the next step starts
        self._first = layers[0] if layers else -1
        self.worker = None  # the copy engine's counters (csrc/mailbox_ahead.h), read by `stats`
        if engine == "copy":
            self.flags = torch.zeros(max(layers, default=0) + 1, dtype=torch.int64, device=device)  # landed tags
            self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # never captured
            self.worker = mailbox.copy_ahead(self.next_of, self.plans, self.flags, self.copy_stream, s, self.inter,
                                             self.hidden, ex.dtype.itemsize, ex.down_offset)
            if self.worker is None:
                raise RuntimeError("the mailbox worker cannot issue copies here (no CUDA driver entry points)")
        elif engine == "cpu":
            self.worker = mailbox.warm_ahead(self.next_of, self.plans, s, self.warm_bytes)
            if self.worker is None:
                raise RuntimeError("the mailbox worker cannot read ahead (no compiled CPU kernel, or already set)")

    def _granules(self, nbytes: float) -> int:
        return max(0, int(nbytes // self.granule_bytes))

    # ---- inside the step (captured) -----------------------------------------------------------------
    def predict(self, layer: int, hidden: torch.Tensor) -> None:
        """At MoE layer `layer`, with its residual stream hidden [N, H]: predict the next layer's experts and plan
        their staging, on the copy-ahead stream (the step's own stream does not wait for it here)."""
        if layer == self._first:  # a new step: the last one is captured or queued, its tensors and events may go
            self._hold.clear()
            self._planned_ev.clear()
            self._copied_ev.clear()
        nxt = self.next_of.get(layer)
        if nxt is None:
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        self._hold.append(hidden)
        if not torch.cuda.is_current_stream_capturing():
            hidden.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            ids = self.predictors[nxt](hidden)  # [N, k]
            self.plan(nxt, ids)
            self._hold.append(ids)
            self._planned_ev[nxt] = ev = torch.cuda.Event()
            ev.record(self.stream)

    def plan(self, nxt: int, ids: torch.Tensor) -> None:
        """The plan kernel's launch for layer `nxt` on its predicted experts ids [N, k], on the current stream."""
        b = nxt % 2
        # the copy engine's list goes to host memory, tagged for the worker, its tails to this parity's slots
        tag = (self.plans[b, 0:1], self.mailbox.gen, nxt) if self.engine != "sm" else None
        stage = self.stage[b % len(self.stage)]
        kernels.plan_ahead(ids.reshape(-1), self.slot_of[nxt], self.table[nxt], self.budget,
                           stage.data_ptr() if stage.numel() else 0,
                           self.slot_bytes, self.MAX_SLOTS, self.share.granules, self.share.rows,
                           self.rows_map[b], self.addr_map[b], *self._lists[b], self.counts[0:1], tag=tag)

    def maps(self, layer: int) -> tuple | None:
        """For the pack of `layer`: (rows [E], addresses [E], stat [1], gate) of its planned tails, the step's stream
        made to wait for the plan (not the copy); None where nothing was planned for it. gate (the copy engine's):
        (flag [1], gen [1], layer), the tails used only where the worker's flag says they landed; else None."""
        ev = self._planned_ev.get(layer)  # (this step's: the first layer's `predict` clears them)
        if ev is None:
            return None
        torch.cuda.current_stream(self.device).wait_event(ev)  # (joins the fork: a capture must see every one joined)
        if self.engine == "cpu":  # warm-ahead's plan is the worker's alone: the split is untouched
            return None
        b = layer % 2
        gate = (self.flags[layer : layer + 1], self.mailbox.gen, layer) if self.engine == "copy" else None
        return self.rows_map[b], self.addr_map[b], self.counts[1:2], gate

    def copy(self, layer: int) -> None:
        """After `layer`'s cold phase is enqueued on the step's stream: copy the next layer's planned tails once it is
        over (the link is free then), on the copy-ahead stream."""
        nxt = self.next_of.get(layer)
        if nxt is None or nxt not in self._planned_ev or self.engine != "sm":  # (the worker copies or reads those)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            kernels.copy_ahead(self.copy_src, self.copy_dst, self.copy_rows, self.share.experts.typed(self.device),
                               self.inter, self.hidden, self.down_elem)
            self._copied_ev[nxt] = ev = torch.cuda.Event()
            ev.record(self.stream)

    def wait_copied(self, layer: int, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait until `layer`'s tails have landed (before anything reads them)."""
        ev = self._copied_ev.get(layer)
        if ev is not None:
            stream.wait_event(ev)

    # ---- between steps ----------------------------------------------------------------------------
    def set_budget(self, nbytes: int) -> None:
        """A new budget a layer in bytes (whole granules), applied to the device's at the next `apply`."""
        self.target = self._granules(nbytes)

    def apply(self) -> None:
        """On the decoding thread, between steps: the device's budget follows the target (stream-ordered), and the
        counters' snapshot (one step old) is refreshed."""
        with torch.inference_mode():  # (its tensors are made inside a step, in inference mode)
            if self.target != self.value:
                self.value = self.target
                new = torch.tensor([self.value], dtype=torch.int32)
                self.budget.copy_(new.pin_memory() if self.budget.is_cuda else new, non_blocking=True)
            self._counts_host.copy_(self.counts, non_blocking=True)

    def stats(self) -> dict:
        """Granules staged and used so far (as of a step or so ago), the budget a layer, the bytes of a granule; for
        warm-ahead (engine "cpu") the worker's counts: plans used and late, bytes read ahead and the seconds it took,
        bytes of read rows the kernel computed, pieces another thread computed, the time (and the longest) a read waited
        for a thread of an earlier read still inside (descheduled mid-piece; a stopped read itself waits for none)."""
        if self.engine == "cpu":  # nothing staged: the worker's own counts
            w = [int(v) for v in self.worker]
            return {"engine": "cpu", "warm_bytes": self.warm_bytes, "plans_used": w[0], "plans_late": w[1],
                    "read_bytes": w[2], "read_s": round(w[3] / 1e9, 4), "computed_bytes": w[4], "pieces_stolen": w[5],
                    "held_s": round(w[6] / 1e9, 4), "held_us_max": round(w[7] / 1e3, 1)}
        staged, used = (int(v) for v in self._counts_host.tolist())
        out = {"engine": self.engine, "budget_granules": self.value, "granule_bytes": self.granule_bytes,
               "staged_granules": staged, "used_granules": used, "staged_MB": round(staged * self.granule_bytes / 1e6, 1),
               "used_fraction": round(used / staged, 4) if staged else None}
        if self.worker is not None:  # planned is not copied here: a plan the worker found late is skipped
            w = [int(v) for v in self.worker]
            out.update(copied_tails=w[0], copied_MB=round(w[1] / 1e6, 1), plans_late=w[2], copy_errors=w[3])
        return out


def warm_budget(cap: int, threads: int, l2: int | None = None) -> int:
    """Warm-ahead's default bytes a layer: `cap`, or less where the kernel's threads' L2 caches hold less (three
    quarters of threads x L2, from sysfs unless given; rows read past that would be evicted before they are used:
    on the H200 box 12 x 2 MiB leave the 8 MB cap whole, 4 threads of 1 MiB would keep 3 MiB)."""
    from strata.runtime.host import l2_cache_bytes

    l2 = l2 if l2 is not None else l2_cache_bytes()
    return cap if not l2 else min(cap, max(1, threads) * l2 * 3 // 4)
