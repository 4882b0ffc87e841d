"""Warm-ahead in one-graph split decode: the CPU worker reads the next layer's predicted cold experts into its
threads' caches while the GPU runs the serial part of each layer (`[debug] warm_ahead`, on by default).

A split decode layer has two phases: serial GPU work (the combine, the next layer's attention and routing, the
mailbox pack), during which the CPU worker idles, then the cold phase, where the worker and the GPU's in-place reads
(`GpuShare`) share the layer's cold expert bytes. With the next layer's experts predicted (its norm and router
applied to this layer's residual stream, as `router_predictors` does), the plan kernel (`strata.kernels.gpu.warm_plan`)
lists the predicted cold ones in page-locked host memory, and once the worker has answered layer l it reads the
gate/up rows of l+1's listed experts into its threads' caches, each thread the rows the kernel will give it, until
the GPU posts l+1 (csrc/cpu_mailbox.cpp, WarmCfg). The next cold phase reads those rows from L2 instead of RAM. A
wrong prediction costs only the read, and which thread computes which rows changes no result.

Per MoE layer l, inside the step's graph: `predict(l, hidden)` at l's MoE block plans l+1 on a stream of its own
(the step's stream does not wait for it there); `join(l+1)` at l+1's MoE block makes the step's stream wait for
that plan, so a capture sees every fork joined.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.kernels.gpu import warm_plan

if TYPE_CHECKING:
    from strata.runtime.offload.mailbox import CpuMailbox

Predictor = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> expert ids [N, k]


class WarmAhead:
    """The plans, stream and events of warm-ahead for the MoE layers `moe_layers`, and the worker's counters.

    addresses [L, E] int64: each expert's page-locked slot (its gate_up rows first); slot_of [L, E] int32: the GPU
    tier's map (-1: cold); `predictors`: layer -> ids from the hidden state entering that layer's MoE block one layer
    early. `warm_bytes`: gate/up bytes the worker reads a layer at most (None: `warm_budget`)."""

    MAX_EXPERTS = 8  # predicted cold experts a plan lists at most (a token's top-8)
    WARM_BYTES = 8 << 20  # the default's cap: more than the worker's threads read in a serial phase (the worker
    # stops reading when the GPU posts the layer)

    def __init__(self, addresses: np.ndarray, slot_of: torch.Tensor, predictors: dict[int, Predictor],
                 moe_layers: list[int], device: torch.device, mailbox: CpuMailbox, warm_bytes: int | None = None):
        self.slot_of, self.device, self.mailbox = slot_of, device, mailbox
        self.table = torch.from_numpy(np.ascontiguousarray(addresses)).to(device)  # [L, E] int64
        layers = sorted(moe_layers)
        # layer l plans l + 1 when both are MoE layers with a predictor: the pairs (l, l + 1)
        self.next_of = {a: b for a, b in zip(layers, layers[1:], strict=False) if b == a + 1 and b in predictors}
        self.predictors = predictors
        # the lists the worker reads, by the planned layer's parity: [tag, address[S]] (page-locked host memory)
        self.plans = torch.zeros((2, 1 + self.MAX_EXPERTS), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.warm_bytes = int(warm_bytes) if warm_bytes is not None else warm_budget(self.WARM_BYTES, mailbox.threads)
        # the plan on a high-priority stream: the worker reads it as soon as it answers a layer (and waits for a plan
        # that lands after its answer, until the GPU posts the planned layer)
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._planned_ev: dict[int, torch.cuda.Event] = {}
        self._hold: list[torch.Tensor] = []  # tensors the stream reads, kept alive until the next step starts
        self._first = layers[0] if layers else -1
        self.worker = mailbox.warm_ahead(self.next_of, self.plans, self.MAX_EXPERTS, self.warm_bytes)
        if self.worker is None:
            raise RuntimeError("the mailbox worker cannot read ahead (no compiled CPU kernel, or already set)")

    # ---- inside the step (captured) -----------------------------------------------------------------
    def predict(self, layer: int, hidden: torch.Tensor) -> None:
        """At MoE layer `layer`, with its residual stream hidden [N, H]: predict the next layer's experts and plan
        their read, on the plan's stream (the step's own stream does not wait for it here)."""
        if layer == self._first:  # a new step: the last one is captured or queued, its tensors and events may go
            self._hold.clear()
            self._planned_ev.clear()
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
        warm_plan.plan_warm(ids.reshape(-1), self.slot_of[nxt], self.table[nxt], self.plans[nxt % 2],
                            self.mailbox.gen, nxt)

    def join(self, layer: int) -> None:
        """At `layer`'s MoE block: the step's stream waits for the plan made for it (none: nothing to join)."""
        ev = self._planned_ev.get(layer)  # (this step's: the first layer's `predict` clears them)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    # ---- between steps ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """The worker's counts: plans used and late, bytes read ahead and the seconds it took, bytes of read rows the
        kernel computed, pieces another thread computed, the time (and the longest) a read waited for a thread of an
        earlier read still inside (descheduled mid-piece; a stopped read itself waits for none)."""
        w = [int(v) for v in self.worker]
        return {"warm_bytes": self.warm_bytes, "plans_used": w[0], "plans_late": w[1], "read_bytes": w[2],
                "read_s": round(w[3] / 1e9, 4), "computed_bytes": w[4], "pieces_stolen": w[5],
                "held_s": round(w[6] / 1e9, 4), "held_us_max": round(w[7] / 1e3, 1)}


def warm_budget(cap: int, threads: int, l2: int | None = None) -> int:
    """Warm-ahead's default bytes a layer: `cap`, or less where the kernel's threads' L2 caches hold less (three
    quarters of threads x L2, from sysfs unless given; rows read past that would be evicted before they are used:
    12 threads of 2 MiB leave an 8 MB cap whole, 4 threads of 1 MiB keep 3 MiB)."""
    from strata.runtime.plan.host import l2_cache_bytes

    l2 = l2 if l2 is not None else l2_cache_bytes()
    return cap if not l2 else min(cap, max(1, threads) * l2 * 3 // 4)
