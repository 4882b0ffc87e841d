"""What all tiered MoE layers of a model share: the tier manager, the CPU worker, measured rates, and
the device-side tables of the decode fast path.

CPU expert compute (`cpu_forward`) runs cold experts straight from pinned/host RAM on CPU threads;
`runtime.cpu_numerics = "fork"` uses the compiled kernel (fastest, within the mode's tolerance),
"gpu" keeps CPU compute off GPU hosts so cold experts are copied and computed by the GPU kernels,
bit-identical to the all-in-VRAM run.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from strata.kernels.grouped import HostExperts, SlotWeights, in_place_ok, pair_experts_in_place
from strata.runtime.cost_model import Rates
from strata.runtime.cpu_compute import CpuCompute
from strata.tiers.manager import TierManager

log = logging.getLogger(__name__)


MAILBOX_SPARE_CORES = 4  # cores the one-graph decode's CPU kernel leaves to other threads (hosts of 8+ cores)


class ExpertCompute(CpuCompute):
    """Shared state of the tiered executor (one per model); its CPU expert compute comes from `CpuCompute`."""

    def __init__(self, manager: TierManager, device_tier: str, cpu_numerics: str = "fork", read_in_place: bool = False,
                 promote: bool = True, split_decode: str = "host", device: torch.device | None = None,
                 copy_ahead: bool = False, warm_ahead: bool = False):
        self.manager, self.device_tier = manager, device_tier
        self.fast_cpu = cpu_numerics == "fork"  # compiled CPU kernel; "gpu": the reference math only
        # CPU compute next to a GPU tier only in "fork" mode: "gpu" numerics force cold experts onto the GPU
        self.split = device_tier == "gpu" and self.fast_cpu
        self.rates = Rates()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-experts") if self.split else None
        self.cpu_experts = 0  # experts computed on the CPU (statistics)
        # split decode: copy a CPU-computed expert that became popular into the GPU tier in the background
        # (policy.promote; `ExpertCompute.promote_one`); `promotions` counts those copies
        self.promote = promote
        self.promotions = 0
        # set by the scheduler around a step of reproducible requests: cold experts go to the GPU
        # (GPU hosts) or through the reference math (CPU hosts), never through the forked CPU kernel
        self.reproducible = False
        self.prefetcher = None  # LookaheadPrefetcher, polled at each layer's synchronisation point
        self._all_resident = False
        self.pair_path: bool | None = None  # None: pair kernels for small CUDA steps; tests force either way
        self.slots: SlotWeights | None = None
        self.slot_of: torch.Tensor | None = None  # [L, E] int32 on the GPU, -1 = not resident
        self.identity: torch.Tensor | None = None  # [S] int32: slot -> slot, to address slots directly
        self.late_slot: torch.Tensor | None = None  # [S + 1] int32: slot + 1 -> slot, 0 -> -1 (skip)
        self.staged: list = []  # StagedExperts copied for a decode layer, held until their readers are enqueued
        self.lookups: torch.Tensor | None = None  # [L, E] int64 device-side lookup counts (graph steps)
        # host time of the decode cold path: waiting for the GPU to reach a layer, issuing copies and CPU
        # work, waiting for the CPU's partial sum (where a split step's time goes; see bench/hotpath.py)
        self.host_seconds: Counter[str] = Counter()
        self.pin_results = False  # CPU partial sums in pinned memory, so their upload never waits for the GPU
        # True: a decode layer's CPU share starts on the kernel's launcher thread before this thread stages
        # the copies; False: it runs here after them. None (the default): started first in the layers where
        # the cost model copies some experts (the copies' host work then overlaps the CPU's), run here in
        # the others (no hand-off). H200 box, 12-layer bench model: always first ran uniform routing (~6 cold
        # experts a layer) 72.9 against 65.2 tok/s and skewed routing (~1.4) 97.1 against 110.2.
        # $STRATA_CPU_ASYNC = 1 / 0 forces either.
        env = os.environ.get("STRATA_CPU_ASYNC")
        self.cpu_async: bool | None = None if env is None else env == "1"
        # the kernel's thread count: next to a GPU, a quarter of the cores stay with the threads driving it
        # (this one, the copy workers, CUDA's own): the skewed split ran 132.9 tok/s with 12 kernel threads
        # on 16 cores against 105-110 with 16. One count for every call: a different one rebuilds the pool.
        self.cpu_threads: int | None = None
        if self.split and not os.environ.get("STRATA_CPU_THREADS"):
            from strata.kernels import cpu_experts as ce

            n = ce.default_threads()
            self.cpu_threads = n - n // 4 if n > 4 else n
        if device_tier == "gpu" and manager.slots is not None:
            self.slots = manager.slot_weights()
            self.slot_of = manager.slots.slot_of
            dev = manager.slots.slab.device
            self.identity = torch.arange(manager.slots.num_slots, dtype=torch.int32, device=dev)
            self.late_slot = torch.arange(-1, manager.slots.num_slots, dtype=torch.int32, device=dev)
            self.lookups = torch.zeros(self.slot_of.shape, dtype=torch.int64, device=dev)
            manager.add_lookup_source(self._drain_lookups)
            self.pin_results = dev.type == "cuda"
        # decode steps as one graph with the native CPU worker (`mailbox_ready`, strata.runtime.cpu_mailbox)
        self.split_decode, self.device = split_decode, device or torch.device("cpu")
        self.moe_layers: list[int] = []  # set by use_tiered_experts, with the routing's top-k
        self.grouped_prefill = False  # prefill's GPU experts through grouped GEMMs (runtime.grouped_prefill)
        self.prefill_keeps_resident = False  # a prompt's cold experts through the step-copy slots (runtime.*)
        self.top_k = 0
        self.mailbox = None  # CpuMailbox, made once every expert sits in pinned RAM for good
        self.gpu_share = None  # GpuShare: the cold experts the GPU reads in place during a mailbox step
        # CopyAhead: the next layer's predicted cold experts' tails copied to VRAM during a layer's serial GPU work
        # (or, engine "cpu", warm-ahead: the worker reads them into its caches during that work)
        self.copy_ahead_on, self.warm_ahead_on, self.copy_ahead = copy_ahead, warm_ahead, None
        self.predictors: dict = {}  # layer -> its router applied one layer early (set by use_tiered_experts)
        self.books = None  # MailboxBooks: the mailbox steps' statistics, policy history and promotions
        self._mailbox_off: str | None = None  # why this engine never uses the mailbox
        self._side: dict = {}  # device -> the second stream of a mailbox layer's GPU work (its in-place share)
        self._pair_index: dict = {}  # (P, device) -> int32 [P] 0..P-1: pairs addressed by a per-pair slot table
        # split decode: the GPU's share of cold experts read from pinned RAM in place (None: copied to slots)
        self.host_experts: HostExperts | None = None
        if read_in_place and self.split and self.slots is not None and manager.pool.pinned and in_place_ok():
            (gu, dn), store = manager.store.expert_shapes, manager.store
            self.host_experts = HostExperts(store.dtype, gu, dn, store.index.gate_up_bytes)
            self._compile_in_place(manager.slots.slab.device)

    def _compile_in_place(self, device: torch.device, k: int = 8) -> None:  # any k > 1 shares the compiled code
        """Compile the in-place kernels now, with every pair skipped (address 0: nothing is read): compiled on
        first use instead, their seconds would land inside a decode step and inside the rate the cost model
        measures for the path (whose first events bracket the compilation)."""
        hidden = self.host_experts.gate_up_shape[1]
        x = torch.zeros((1, hidden), dtype=self.host_experts.dtype, device=device)
        y = torch.zeros((k, hidden), dtype=torch.float32, device=device)
        pair_experts_in_place(x, self.host_experts, torch.zeros(k, dtype=torch.int64, device=device), y)

    @property
    def use_split(self) -> bool:
        return self.split and not self.reproducible

    @property
    def use_fast_cpu(self) -> bool:
        return self.fast_cpu and not self.reproducible

    def mailbox_ready(self) -> bool:
        """Whether a decode step can now run as one graph with cold experts on the mailbox worker: graph split
        decode configured, forked CPU numerics, a CUDA device, the compiled kernel, and every expert resident in
        pinned RAM for good (the worker reads them by address). The mailbox is made on the first True."""
        if self.reproducible:
            return False
        if self.mailbox is not None:
            return True
        if self._mailbox_off is not None or not self.manager.all_pinned():
            return False
        self._mailbox_off = self._mailbox_unusable()
        if self._mailbox_off is None:
            self._open_mailbox()
        return self.mailbox is not None

    def _mailbox_unusable(self) -> str | None:
        from strata.kernels import cpu_experts as ce
        from strata.kernels import host_signal

        if self.split_decode != "graph":
            return "runtime.split_decode is not \"graph\""
        if not self.fast_cpu or not (self.split or self.device_tier == "cpu") or self.device.type != "cuda":
            return "no forked CPU compute beside a CUDA device"
        if self.manager.store.dtype != torch.bfloat16 or ce.backend() == "torch" or not host_signal.available():
            return "no compiled bf16 CPU kernel or no Triton"
        if not self.moe_layers or self.top_k <= 0:
            return "no MoE layers"
        return None

    def _open_mailbox(self) -> None:
        from strata.kernels import cpu_experts as ce
        from strata.runtime.cost_model import IN_PLACE_RATE
        from strata.runtime.cpu_mailbox import CpuMailbox
        from strata.runtime.gpu_share import GpuShare
        from strata.runtime.graphs import MAX_GRAPH_BATCH
        from strata.runtime.mailbox_books import MailboxBooks

        m, store = self.manager, self.manager.store
        addresses = np.zeros((max(self.moe_layers) + 1, store.index.num_experts), dtype=np.int64)
        with m._lock:
            for (layer, e), slot in m.pinned.slot_of.items():
                addresses[layer, e] = m.pool.slot_address(slot)
        (_, hidden), (_, inter) = store.expert_shapes
        if not os.environ.get("STRATA_CPU_THREADS"):
            # cores left to the decoding thread (its books, its spin in the step's sync) and the transfer threads:
            # on the H200 box (16 cores) the worker's kernel ran 1.28x faster in decode with 12 threads than with 15
            n = ce.default_threads()
            self.cpu_threads = max(1, n - (MAILBOX_SPARE_CORES if n >= 2 * MAILBOX_SPARE_CORES else 1))
        with torch.cuda.device(self.device):
            self.mailbox = CpuMailbox(self.moe_layers, addresses, hidden=hidden, inter=inter,
                                      gu_bytes=store.index.gate_up_bytes, payload=store.payload_bytes, top_k=self.top_k,
                                      max_tokens=MAX_GRAPH_BATCH, threads=self.cpu_threads or ce.default_threads(),
                                      device=self.device)
        if (failed := self.mailbox.self_test()) is not None:
            log.warning("strata: one-graph decode steps off (%s); decode takes host steps", failed)
            self._mailbox_off = failed
            self.mailbox.close()
            self.mailbox = None
            return
        self.gpu_share = None
        # split decode: the GPU reads a share of the cold experts in place meanwhile (not without a GPU tier: there
        # every routed expert is the CPU's, which keeps the suite's CPU-only ablation what it says)
        if self.split and in_place_ok() and m.pool.pinned:
            fixed = os.environ.get("STRATA_MAILBOX_GPU_SHARE")
            share = float(fixed) if fixed else IN_PLACE_RATE / (IN_PLACE_RATE + self.rates.cpu_bytes_per_s)
            if share > 0:
                (gu, dn) = store.expert_shapes
                whole = os.environ.get("STRATA_MAILBOX_WHOLE_EXPERTS") == "1"  # A/B: no expert split by rows
                self.gpu_share = GpuShare(addresses, HostExperts(store.dtype, gu, dn, store.index.gate_up_bytes),
                                          self.device, share, adaptive=not fixed, gpu_rate=IN_PLACE_RATE,
                                          split=not whole, wait_target=_wait_target())
        self.copy_ahead = self._open_copy_ahead(addresses, store) if self.gpu_share is not None else None
        self.books = MailboxBooks(self.mailbox, m, self.pick_promotion, self._count_mailbox, self.gpu_share,
                                  self.copy_ahead)
        self._mailbox_kernel = (0, 0, 0.0)

    def _open_copy_ahead(self, addresses: np.ndarray, store):
        """The copy-ahead of a mailbox with a GPU share (None where it is off or cannot run): `runtime.copy_ahead`
        (the tails copied by the SM kernel in the graph), else `runtime.warm_ahead` (engine "cpu": the worker reads
        the predicted experts into its threads' caches), unless the environment says otherwise (A/B runs):
        $STRATA_COPY_AHEAD "0" turns both off, a number N > 0 turns copy-ahead on with a fixed budget of N bytes a
        layer (warm-ahead: bytes read); $STRATA_COPY_AHEAD_ENGINE=sm|copy|cpu turns that engine on (copy: the worker's
        copier issues the tails on the copy engine, where the driver's entry points are found; else the SM kernel,
        with a warning)."""
        from strata.kernels import copy_ahead
        from strata.runtime.copy_ahead import CopyAhead

        env = os.environ.get("STRATA_COPY_AHEAD", "")
        engine = os.environ.get("STRATA_COPY_AHEAD_ENGINE") or (
            "sm" if self.copy_ahead_on or env else "cpu" if self.warm_ahead_on else None)
        if env == "0" or engine is None or not self.predictors or not copy_ahead.available(self.slot_of):
            return None
        ex = self.gpu_share.experts
        slot_bytes = ex.down_offset + ex.down_shape[0] * ex.down_shape[1] * ex.dtype.itemsize
        budget = int(float(env)) if env else None
        # "sm": the copy kernel in the graph (+7.4% without temporal locality); "copy": the worker's copy engine,
        # whose tails landed in time for only 22-38% of layers on the H200 box (bench/RESULTS.md, 25th session);
        # "cpu": warm-ahead, +8% on the temporal-locality checkpoint (30th session)
        if engine in ("copy", "cpu"):
            try:
                return CopyAhead(addresses, self.slot_of, self.gpu_share, self.predictors, self.moe_layers,
                                 self.device, slot_bytes, budget_bytes=budget, mailbox=self.mailbox, engine=engine)
            except RuntimeError as e:
                if engine == "cpu":
                    log.warning("strata: warm-ahead is not available (%s); decoding without it", e)
                    return None
                log.warning("strata: copy-ahead's copy engine is not available (%s); copying with SMs", e)
        return CopyAhead(addresses, self.slot_of, self.gpu_share, self.predictors, self.moe_layers, self.device,
                         slot_bytes, budget_bytes=budget)

    def _count_mailbox(self, experts: int, nbytes: int, seconds: float) -> None:
        """The mailbox worker's totals so far: experts it computed, bytes its kernel read and its seconds."""
        e0, b0, s0 = self._mailbox_kernel
        self.cpu_experts += experts - e0
        if seconds > s0:
            self.rates.observe_cpu(nbytes - b0, seconds - s0)
        self._mailbox_kernel = (experts, nbytes, seconds)

    def promote_one(self, layer: int, experts) -> None:
        """Of `experts` (cold in `layer`, computed on the CPU), the one `pick_promotion` picks, copied into the GPU tier
        by a transfer worker, in the background."""
        if (key := self.pick_promotion(layer, experts)) is not None:
            self.manager.promote(key)  # queued for a transfer worker

    def pick_promotion(self, layer: int, experts) -> tuple[int, int] | None:
        """Of `experts` (cold in `layer`, computed on the CPU), the one the GPU tier's history says is used most, if
        it is worth a slot (used over twice as often as the slot's victim, `worth_caching`); None if none is, or
        promotions are off. One per layer and step, so the link stays lightly used. Counted in `promotions`."""
        if not self.promote:
            return None
        m = self.manager
        keep = m.worth_caching(layer, sorted(experts))
        if not keep:
            return None
        score = m.gpu_scores(layer, keep)
        self.promotions += 1
        return layer, max(keep, key=score.__getitem__)

    def mailbox_step(self) -> None:
        """Before each graph step: the mailbox's books (and its GPU share's adjustment). A worker error or a step
        the GPU gave up waiting on is raised once (that step's sums are wrong), and the mailbox is retired:
        later steps take the host steps."""
        if self.books is None:
            return
        try:
            self.books.step()
        except RuntimeError as e:
            self._mailbox_off = f"retired after an error: {e}"
            self.close_mailbox()
            raise

    def mailbox_queued(self, until=None) -> None:
        """Once a graph step and its LM head, sampling and read-back are queued (`DecodeGraphs.step_queued`, `until`
        an event recorded after them): the mailbox's books run now, while the GPU works and the decoding thread waits
        for it, until the event is reached (run before the launch, their Python held the GIL the launch needed;
        right after the replay, the GIL the LM head's enqueue needed)."""
        if self.books is not None:
            self.books.queued(until)

    def mailbox_stats(self) -> dict:
        """One-graph split decode's state: whether it runs (and why not), the worker's own totals, the GPU share."""
        box = self.mailbox
        out = {"on": box is not None, "off_because": self._mailbox_off}
        if box is not None:
            nbytes, seconds = box.kernel_rate()
            out.update(worker_experts=box.experts_computed, worker_GB_per_s=nbytes / seconds / 1e9 if seconds else 0.0,
                       log_lost=box.log_lost, books_s=round(self.books.seconds, 4) if self.books else 0.0,
                       books_deferred=self.books.deferred if self.books else 0,
                       gpu_share=self.gpu_share.value if self.gpu_share is not None else 0.0,
                       gpu_share_mode=(None if self.gpu_share is None else
                                       "balance" if self.gpu_share.adaptive else "fixed"),
                       timing=box.timing(), copy_ahead=self.copy_ahead.stats() if self.copy_ahead is not None else None)
        return out

    def close_mailbox(self) -> None:
        """Stop the mailbox worker and its bookkeeping (the engine is closing; no step may be in flight)."""
        if self.books is not None:
            self.manager.remove_lookup_source(self.books.flush)
            if self.books.error is None:
                self.books.flush()  # what the last steps did still reaches the statistics
            self.books = None
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
        self.gpu_share = self.copy_ahead = None

    def release_staged(self) -> None:
        """Release the decode layers' copied slots held so far (call once their readers are enqueued)."""
        while self.staged:
            self.manager.release_staged(self.staged.pop())

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The second stream a mailbox layer forks onto for its in-place share (one per device, made once)."""
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        return side

    def pair_index(self, p: int, device: torch.device) -> torch.Tensor:
        """int32 [p] 0..p-1 (made in the eager warm-up before a capture, reused by it): `pair_experts` with a
        per-pair slot table `used` [P] in place of slot_of and this in place of the ids runs pair p from
        slot used[p]."""
        key = (p, str(device))
        index = self._pair_index.get(key)
        if index is None:
            index = self._pair_index[key] = torch.arange(p, dtype=torch.int32, device=device)
        return index

    def all_resident(self) -> bool:
        """True once every expert is in a GPU slot for good: decode steps need no host round trip."""
        if not self._all_resident and self.slots is not None:
            self._all_resident = self.manager.all_resident()
        return self._all_resident

    def count_lookups(self, layer: int, ids: torch.Tensor) -> None:
        """Count each expert of `ids` [P] once for this step, on the device (capturable in a graph)."""
        hit = torch.zeros(self.lookups.shape[1], dtype=torch.int64, device=ids.device)
        hit.index_fill_(0, ids, 1)  # a scalar fill: no host tensor, so it can be captured
        self.lookups[layer] += hit

    def _drain_lookups(self):
        snap = self.lookups.clone()
        self.lookups.sub_(snap)  # increments made meanwhile survive
        counts = snap.cpu().numpy()
        layers, experts = np.nonzero(counts)
        return [(int(layer), int(e), int(counts[layer, e])) for layer, e in zip(layers, experts, strict=True)]


def _wait_target() -> float | None:
    """$STRATA_MAILBOX_WAIT_TARGET: the GPU share's balance target, in (0, 1) (None: `GpuShare.WAIT_TARGET`); a bad
    value is refused with the variable's name."""
    raw = os.environ.get("STRATA_MAILBOX_WAIT_TARGET")
    try:
        target = float(raw) if raw else None
    except ValueError:
        target = -1.0
    if target is not None and not 0.0 < target < 1.0:
        raise ValueError(f"STRATA_MAILBOX_WAIT_TARGET must be a number in (0, 1), got {raw!r}")
    return target
