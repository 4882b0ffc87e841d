"""What all tiered MoE layers of a model share: the tier manager, the CPU worker, measured rates, and
the device-side tables of the decode fast path.

CPU expert compute (`cpu_forward`) runs cold experts straight from pinned/host RAM on CPU threads;
`runtime.cpu_numerics = "fork"` uses the compiled kernel (fastest, within the mode's tolerance),
"gpu" keeps CPU compute off GPU hosts so cold experts are copied and computed by the GPU kernels,
bit-identical to the all-in-VRAM run.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
from strata.kernels.gpu.experts.grouped import HostExperts, SlotWeights, in_place_ok, slot_weights
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights
from strata.kernels.quant import reads
from strata.runtime.model.capture import current_recorder
from strata.runtime.offload.cost_model import Rates
from strata.runtime.offload.cpu_compute import CpuCompute, PinnedSums
from strata.tiers.manager import TierManager
from strata.tiers.prefetch import LookaheadPrefetcher, Predictor

log = logging.getLogger(__name__)


MAILBOX_SPARE_CORES = 4  # cores the one-graph decode's CPU kernel leaves to other threads (hosts of 8+ cores)


class ExpertCompute(CpuCompute):
    """Shared state of the tiered executor (one per model); its CPU expert compute comes from `CpuCompute`.

    The `[debug]` switches it takes: split_decode ("graph": one-graph steps with the mailbox worker; "host"),
    warm_ahead, gpu_share (a fixed share of the cold rows the GPU reads in place in a mailbox step; None: balanced
    on the GPU's waits), cpu_threads (the CPU kernel's threads; 0: chosen from the cores) and cpu_kernel (its
    instruction set, or "torch").

    It is also the model's collaborator on one card (strata.runtime.model.hooks): its `after_layer` runs the
    lookahead prefetch (`start_prefetching`), and `before_step` / `after_queued` keep one-graph decode's books."""

    def __init__(self, manager: TierManager, device_tier: str, cpu_numerics: str = "fork", promote: bool = True,
                 split_decode: str = "host", device: torch.device | None = None, warm_ahead: bool = False,
                 gpu_share: float | None = None, cpu_threads: int = 0, cpu_kernel: str = "auto"):
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
        # predicts after each layer (`after_layer`), polled at each layer's synchronisation point (`start_prefetching`)
        self.prefetcher: LookaheadPrefetcher | None = None
        self._all_resident = False
        self.pair_path: bool | None = None  # None: pair kernels for small CUDA steps; tests force either way
        self.slots: SlotWeights | QuantSlotWeights | None = None
        self.slot_of: torch.Tensor | None = None  # [L, E] int32 on the GPU, -1 = not resident
        self.identity: torch.Tensor | None = None  # [S] int32: slot -> slot, to address slots directly
        self.late_slot: torch.Tensor | None = None  # [S + 1] int32: slot + 1 -> slot, 0 -> -1 (skip)
        self.staged: list = []  # StagedExperts copied for a decode layer, held until their readers are enqueued
        self.lookups: torch.Tensor | None = None  # [L, E] int64 device-side lookup counts (graph steps)
        # host time of the decode cold path: waiting for the GPU to reach a layer, issuing copies and CPU
        # work, waiting for the CPU's partial sum (where a split step's time goes; see bench/tools/hotpath.py)
        self.host_seconds: Counter[str] = Counter()
        self.pin_results = False  # CPU partial sums in pinned memory, so their upload never waits for the GPU
        self.pinned_sums = PinnedSums()  # the scheduler thread's CPU shares' pinned partial sums, reused
        # True: a decode layer's CPU share starts on the kernel's launcher thread before this thread stages
        # the copies; False: it runs here after them. None: started first in the layers where the cost model
        # copies some experts (the copies' host work then overlaps the CPU's), run here in the others (no
        # hand-off): always first won where many experts were cold and lost where few were. Tests force either.
        self.cpu_async: bool | None = None
        self.cpu_kernel = cpu_kernel  # the CPU kernel's instruction set ("auto": the best this CPU runs)
        self.fixed_threads = cpu_threads > 0  # [debug] cpu_threads: one count everywhere, none chosen here
        # the kernel's thread count: next to a GPU, a quarter of the cores stay with the threads driving it
        # (this one, the copy workers, CUDA's own). One count for every call: a different one rebuilds the pool.
        self.cpu_threads: int | None = cpu_threads or None
        if self.split and not self.fixed_threads:
            from strata.kernels.cpu import experts as ce

            n = ce.default_threads()
            self.cpu_threads = n - n // 4 if n > 4 else n
        # the decode pair kernels read the store's expert format from the GPU slots; else (FP8 or MXFP4 they do not
        # read yet) no slot views: every layer groups its tokens by expert and each expert is dequantized as it runs
        self.pairs_read_format = reads("gpu_pairs", manager.store.expert_format)
        if device_tier == "gpu" and manager.slots is not None:
            if not self.pairs_read_format:
                self.slots = None
            elif manager.store.expert_format.quantized:  # FP8 / MXFP4: the slab and the blobs' layout
                self.slots = slot_weights(manager.slots.slab, manager.store.layout)
            else:
                self.slots = manager.slot_weights()
            self.slot_of = manager.slots.slot_of
            dev = manager.slots.slab.device
            self.identity = torch.arange(manager.slots.num_slots, dtype=torch.int32, device=dev)
            self.late_slot = torch.arange(-1, manager.slots.num_slots, dtype=torch.int32, device=dev)
            self.lookups = torch.zeros(self.slot_of.shape, dtype=torch.int64, device=dev)
            manager.add_lookup_source(self._drain_lookups)
            self.pin_results = dev.type == "cuda"
        # decode steps as one graph with the native CPU worker (`mailbox_ready`, strata.runtime.offload.mailbox)
        self.split_decode, self.device = split_decode, device or torch.device("cpu")
        self.moe_layers: list[int] = []  # set by use_tiered_experts, with the routing's top-k
        self.grouped_prefill = False  # prefill's GPU experts through grouped GEMMs ([debug] grouped_prefill)
        self.prefill_keeps_resident = False  # a prompt's cold experts through the step-copy slots (runtime.*)
        self.prefill_ahead: dict = {}  # MoE layer -> StagedExperts a prompt's previous layer staged for it
        self.top_k = 0
        # the experts' SwiGLU (DeepSeek-V4's clip, gpt-oss's clamped form) and, gpt-oss, each MoE layer's expert
        # biases (a module with gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]: it is loaded after this is made;
        # the CPU's fp32 copy and the mailbox's tables are taken on first use), both set by use_tiered_experts. Every
        # path leaves the down bias out; the layer adds it once
        self.form: SwiGLUForm = PLAIN_SWIGLU
        self.expert_biases: dict[int, torch.nn.Module] = {}
        self._cpu_biases: dict[int, torch.Tensor] = {}  # layer -> gate_up bias fp32 on the CPU (the CPU's share)
        self.mailbox = None  # CpuMailbox, made once every expert sits in pinned RAM for good
        # a CPU-only host's layers on experts pinned for good, by address, and the tokens a call takes (`cpu_rows`;
        # None until every expert is pinned for good, no layers where the compiled call does not apply)
        self._pinned_layers: tuple[dict, int] | None = None
        self.gpu_share = None  # GpuShare: the cold experts the GPU reads in place during a mailbox step
        self.fixed_share = gpu_share  # [debug] gpu_share: a fixed share (None: balanced on the GPU's waits)
        # WarmAhead: the worker reads the next layer's predicted cold experts into its caches during a layer's
        # serial GPU work
        self.warm_ahead_on, self.warm_ahead = warm_ahead, None
        self.predictors: dict = {}  # layer -> its router applied one layer early (set by use_tiered_experts)
        self.books = None  # MailboxBooks: the mailbox steps' statistics, policy history and promotions
        self._mailbox_off: str | None = None  # why this engine never uses the mailbox
        self._side: dict = {}  # device -> the second stream of a mailbox layer's GPU work (its in-place share)
        self._pair_index: dict = {}  # (P, device) -> int32 [P] 0..P-1: pairs addressed by a per-pair slot table

    @property
    def use_split(self) -> bool:
        return self.split and not self.reproducible

    @property
    def use_fast_cpu(self) -> bool:
        return self.fast_cpu and not self.reproducible

    @property
    def plain_math(self) -> bool:
        """Whether the experts are the plain SwiGLU without biases (every kernel path computes those); else their
        sums are kept in fp32 until the layer adds the down biases and rounds once."""
        return self.form.plain and not self.expert_biases

    @property
    def pairs_read_form(self) -> bool:
        """Whether the GPU's decode pair kernels compute this form on this format (GGUF blobs hold gate and up as
        separate tensors: no interleaved form)."""
        return not (self.form.interleaved and self.manager.store.expert_format.kind == "gguf")

    def gate_up_bias(self, layer: int, device: torch.device | None = None) -> torch.Tensor | None:
        """MoE layer `layer`'s gate_up biases [E, 2I] (gpt-oss; None: none): as loaded, or fp32 on the CPU (made
        once) for `device` cpu."""
        biases = self.expert_biases.get(layer)
        if biases is None:
            return None
        if device is None or device.type != "cpu":
            return biases.gate_up_proj_bias
        if layer not in self._cpu_biases:
            self._cpu_biases[layer] = biases.gate_up_proj_bias.detach().float().cpu()
        return self._cpu_biases[layer]

    def down_bias(self, layer: int) -> torch.Tensor | None:
        """MoE layer `layer`'s down biases [E, H] (gpt-oss; None: none), as loaded."""
        biases = self.expert_biases.get(layer)
        return None if biases is None else biases.down_proj_bias

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
        from strata.kernels.cpu import experts as ce
        from strata.kernels.gpu import host_signal

        if self.split_decode != "graph":
            return "debug.split_decode is not \"graph\""
        if not self.fast_cpu or not (self.split or self.device_tier == "cpu") or self.device.type != "cuda":
            return "no forked CPU compute beside a CUDA device"
        fmt = self.manager.store.expert_format
        if not (reads("cpu_mailbox", fmt) and self.pairs_read_format):
            return f"the CPU worker or the GPU pair kernels do not read {fmt.name} experts"
        # plain experts must be bf16 (the worker's kernel reads no other plain dtype); a quantized format is read as
        # stored, in bf16 arithmetic
        plain_not_bf16 = not fmt.quantized and self.manager.store.dtype != torch.bfloat16
        if plain_not_bf16 or ce.backend(self.cpu_kernel, fmt) == "torch" or not host_signal.available():
            return "no compiled bf16 CPU kernel or no Triton"
        if not self.moe_layers or self.top_k <= 0:
            return "no MoE layers"
        return None

    def _open_mailbox(self) -> None:
        from strata.kernels.cpu import experts as ce
        from strata.runtime.model.graphs import MAX_GRAPH_BATCH
        from strata.runtime.offload.cost_model import IN_PLACE_RATE
        from strata.runtime.offload.gpu_share import GpuShare
        from strata.runtime.offload.mailbox import CpuMailbox
        from strata.runtime.offload.mailbox_books import MailboxBooks

        m, store = self.manager, self.manager.store
        addresses = np.zeros((max(self.moe_layers) + 1, store.index.num_experts), dtype=np.int64)
        for (layer, e), address in m.pinned_addresses().items():
            addresses[layer, e] = address
        (_, hidden), (_, inter) = store.expert_shapes
        if not self.fixed_threads:
            # cores left to the decoding thread (its books, its spin in the step's sync) and the transfer threads:
            # on the H200 box (16 cores) the worker's kernel ran 1.28x faster in decode with 12 threads than with 15
            n = ce.default_threads()
            self.cpu_threads = max(1, n - (MAILBOX_SPARE_CORES if n >= 2 * MAILBOX_SPARE_CORES else 1))
        with torch.cuda.device(self.device):
            self.mailbox = CpuMailbox(self.moe_layers, addresses, hidden=hidden, inter=inter,
                                      gu_bytes=store.index.gate_up_bytes, payload=store.payload_bytes, top_k=self.top_k,
                                      max_tokens=MAX_GRAPH_BATCH, threads=self.cpu_threads or ce.default_threads(),
                                      device=self.device, cpu_kernel=self.cpu_kernel,
                                      layout=store.layout if store.expert_format.quantized else None, form=self.form,
                                      gate_up_bias={layer: self.gate_up_bias(layer, torch.device("cpu"))
                                                    for layer in self.expert_biases} or None)
        if (failed := self.mailbox.self_test()) is not None:
            log.warning("strata: one-graph decode steps off (%s); decode takes host steps", failed)
            self._mailbox_off = failed
            self.mailbox.close()
            self.mailbox = None
            return
        self.gpu_share = None
        # split decode: the GPU reads a share of the cold experts in place meanwhile (not without a GPU tier: there
        # every routed expert is the CPU's, which keeps the suite's CPU-only ablation what it says)
        (gu, dn), fmt = store.expert_shapes, store.expert_format
        experts = HostExperts.of_layout(store.layout) if fmt.quantized else \
            HostExperts(store.dtype, gu, dn, store.index.gate_up_bytes)
        if self.split and reads("gpu_in_place", fmt) and in_place_ok(experts) and m.pool.pinned:
            fixed = self.fixed_share
            share = fixed if fixed is not None else IN_PLACE_RATE / (IN_PLACE_RATE + self.rates.cpu_bytes_per_s)
            if share > 0:
                self.gpu_share = GpuShare(addresses, experts, self.device, share, adaptive=fixed is None,
                                          gpu_rate=IN_PLACE_RATE)
        self.warm_ahead = self._open_warm_ahead(addresses) if self.gpu_share is not None else None
        self.books = MailboxBooks(self.mailbox, m, self, self.gpu_share)  # reports to `pick_promotion`, `count_mailbox_work`
        self._mailbox_kernel = (0, 0, 0.0)

    def _open_warm_ahead(self, addresses: np.ndarray):
        """The warm-ahead of a mailbox with a GPU share (`[debug] warm_ahead`; None where it is off or cannot run:
        no predictors, no CUDA with Triton for its plan, or a worker that cannot read ahead)."""
        from strata.kernels.gpu import warm_plan
        from strata.runtime.offload.warm_ahead import WarmAhead

        if not self.warm_ahead_on or not self.predictors or not warm_plan.available(self.slot_of):
            return None
        try:
            return WarmAhead(addresses, self.slot_of, self.predictors, self.moe_layers, self.device, self.mailbox)
        except RuntimeError as e:
            log.warning("strata: warm-ahead is not available (%s); decoding without it", e)
            return None

    def count_mailbox_work(self, experts: int, nbytes: int, seconds: float) -> None:
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

    # ---- the model's hooks (strata.runtime.model.hooks: `LayerObserver` and `GraphStepHooks`) ------------------
    def start_prefetching(self, predictors: dict[int, Predictor], lookahead: int) -> LookaheadPrefetcher:
        """Predict the experts of the next `lookahead` MoE layers of `predictors` after each layer (`after_layer`)
        and fetch them ahead, until the target tier holds every expert for good. Split decode computes cold experts
        on the CPU from pinned RAM, so there it fetches ahead into pinned RAM (from tmpfs or disk); copies ahead
        into GPU slots there only churned the GPU tier (the suite's skewed split ran 1.27x faster with prefetch
        off), whose adaptation is left to the split's own promotions (`policy.promote`)."""
        if self.split or self.device_tier == "cpu":  # (idle once all pinned: a one-graph step must not predict)
            target, idle = "cpu", self.manager.all_pinned
        else:
            target, idle = self.device_tier, self.all_resident
        self.prefetcher = LookaheadPrefetcher(self.manager, predictors, lookahead, target, idle=idle)
        return self.prefetcher

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """After decoder layer `layer`: the prefetcher predicts the next layers' experts from its output hidden
        [N, H] (in a segmented capture, inside the graph, and issues them at each replay)."""
        if self.prefetcher is not None:
            self.prefetcher(layer, hidden, capture=current_recorder())

    def before_step(self) -> None:
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

    def after_queued(self, until: torch.cuda.Event | None = None) -> None:
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
                       timing=box.timing(), warm_ahead=self.warm_ahead.stats() if self.warm_ahead is not None else None)
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
        self.gpu_share = self.warm_ahead = None

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

