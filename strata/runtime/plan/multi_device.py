"""Building a model split over several GPUs (`runtime.devices = [0, 1]`, `--gpus 0,1`).

    plan (one stage of contiguous layers per card) --> per card: TierManager over its layers' experts
                                                        (StoreView), ExpertCompute, LookaheadPrefetcher
    weights loaded once on the host --> each stage's modules moved to its card --> stage hooks (stages.py)
                                     --> the model observed after each layer by `StagedPrefetcher`

Each card has its own GPU expert slots, copy stream and pinned pool for its own layers; the CPU expert
worker and the measured CPU rate are shared (one host). `runtime.experts = "memory"` splits layers with
their experts, sized by the same placement. The engine sees one model, one tier manager (`DeviceTiers`)
and one expert-compute object (`StagedCompute`), as on one card.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from strata.config import StrataConfig
from strata.kernels.quant import reads
from strata.runtime.model.capture import current_recorder
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.engram.store import attach_row_store, drop_tables
from strata.runtime.model.loader import load_model
from strata.runtime.model.moe import MoEBlock, router_predictors
from strata.runtime.model.stages import Bounds, stage_model
from strata.runtime.model.transformer import MoETransformer
from strata.runtime.offload.cost_model import Rates
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.runtime.plan.card import close_loaded, expert_tiers, prepare_cpu_experts, start_placement
from strata.runtime.plan.checkpoints.store_cache import ensure_store
from strata.runtime.plan.context import loaded_context
from strata.runtime.plan.device_tiers import DeviceTiers, StoreView
from strata.runtime.plan.host import probe_host
from strata.runtime.plan.loaded import DTYPES, LoadedModel, kernel_options_of, resolve_device
from strata.runtime.plan.planner import plan_for
from strata.runtime.plan.stages import layer_sizes, place_stages, select_devices
from strata.tiers.prefetch import LookaheadPrefetcher
from strata.tiers.slots import TierBudgets

if TYPE_CHECKING:
    from strata.runtime.offload.gpu_share import GpuShare
    from strata.runtime.offload.mailbox import CpuMailbox
    from strata.runtime.offload.mailbox_books import MailboxBooks
    from strata.runtime.offload.warm_ahead import WarmAhead


class StagedCompute:
    """The per-card `ExpertCompute`s of a staged model, read and set by the engine as one (an `ExpertExecutor`,
    strata.runtime.offload.executor): counts summed over the cards where the engine's figures were summed, the
    first card's object where they share one (the CPU worker's rates) or its state alone is shown. A staged model
    decodes in "full" or "segmented" graphs only, so no card opens a mailbox."""

    def __init__(self, computes: list[ExpertCompute], manager: DeviceTiers):
        self.computes, self.manager = computes, manager
        self.first = computes[0]

    @property
    def cpu_experts(self) -> int:
        return sum(c.cpu_experts for c in self.computes)

    @property
    def reproducible(self) -> bool:
        return self.first.reproducible

    @reproducible.setter
    def reproducible(self, value: bool) -> None:
        for c in self.computes:
            c.reproducible = value

    def all_resident(self) -> bool:
        return all(c.all_resident() for c in self.computes)

    # ---- the first card's (see the class docstring) -------------------------------------------------------
    @property
    def rates(self) -> Rates:
        return self.first.rates  # one object for every card (`_share_cpu_worker`)

    @property
    def promotions(self) -> int:
        return self.first.promotions

    @property
    def host_seconds(self) -> Counter[str]:
        return self.first.host_seconds

    @property
    def cpu_async(self) -> bool | None:
        return self.first.cpu_async

    @property
    def cpu_threads(self) -> int | None:
        return self.first.cpu_threads

    @property
    def prefetcher(self) -> LookaheadPrefetcher | None:
        return self.first.prefetcher

    @property
    def mailbox(self) -> CpuMailbox | None:
        return self.first.mailbox

    @property
    def books(self) -> MailboxBooks | None:
        return self.first.books

    @property
    def gpu_share(self) -> GpuShare | None:
        return self.first.gpu_share

    @property
    def warm_ahead(self) -> WarmAhead | None:
        return self.first.warm_ahead

    def mailbox_stats(self) -> dict:
        return self.first.mailbox_stats()

    def close_mailbox(self) -> None:
        for c in self.computes:
            c.close_mailbox()


class StagedPrefetcher:
    """After layer l, predict the next `lookahead` MoE layers' experts on the cards that run them: the model's
    `LayerObserver` (strata.runtime.model.hooks) over several cards."""

    def __init__(self, prefetchers: list[LookaheadPrefetcher | None], stage_of: dict[int, int],
                 devices: list[torch.device], lookahead: int):
        self.prefetchers, self.stage_of, self.devices = prefetchers, stage_of, devices
        self.lookahead = lookahead
        self._moe_layers = sorted(stage_of)

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """Layer `layer` ran, hidden [N, H] its output: each card's prefetcher predicts its layers among the next
        `lookahead` MoE layers (in a segmented capture, only the card being captured)."""
        ahead = [j for j in self._moe_layers if j > layer][: self.lookahead]
        capture = current_recorder()
        for s, n in Counter(self.stage_of[j] for j in ahead).items():
            p, device = self.prefetchers[s], self.devices[s]
            if p is None or (capture is not None and device != hidden.device):
                continue  # a graph is captured on one card: predictions for another card's layers are skipped
            p.lookahead = n  # its own window: exactly the layers of `ahead` on card s (stages are contiguous)
            h = hidden if hidden.device == device else hidden.to(device, non_blocking=hidden.is_cuda and device.type == "cuda")
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                p(layer, h, capture=capture)


def build_multi_device(path: Path, cfg: StrataConfig, progress: bool = False) -> LoadedModel:
    """Load `path` split over `cfg.runtime.devices` (at least two CUDA cards)."""
    if cfg.runtime.experts == "memory":
        checkpoint = Checkpoint.open(path)
        dtype = DTYPES.get(cfg.runtime.dtype) or torch.bfloat16
        # "auto" against the first card (the weights are not on the cards yet: its free memory bounds the KV share)
        max_context = loaded_context(cfg, checkpoint.config, resolve_device(f"cuda:{cfg.runtime.devices[0]}"), dtype)
        sizes = layer_sizes(checkpoint.config, dtype, cfg.planner.max_batch + cfg.runtime.prefix_only_slots,
                            experts=True)
        host = probe_host(cfg.tiers.tmpfs.path, cfg.tiers.disk.path)
        stages = place_stages(sizes, select_devices(host.gpus, cfg.runtime.devices), context=max_context,
                              reserve=cfg.planner.activation_reserve_bytes, slot_bytes=0, budget=0)
        bounds = [(resolve_device(s.device), s.start, s.end) for s in stages]
        model = load_model(checkpoint, dtype, "cpu", progress=progress)  # then each stage to its card
        model.kernel_options = kernel_options_of(cfg)
        stage_model(model, bounds)
        if all(d.type == "cuda" for d, _, _ in bounds) and model.engram is None:  # Engram over cards: eager
            model.enable_decode_graphs(lambda: "full" if cfg.debug.cuda_graphs else None, devices=[d for d, _, _ in bounds])
        return LoadedModel(checkpoint, model, bounds[0][0], dtype, max_context)

    the_plan = plan_for(path, cfg)  # refuses before a store is built or anything is loaded
    host = the_plan.host
    store_dir = ensure_store(path, cfg, progress)
    checkpoint = Checkpoint.open(store_dir)
    bounds = [(resolve_device(g.device), g.layers[0], g.layers[1]) for g in the_plan.gpus]
    loaded = assemble_tiered(checkpoint, bounds, [g.slots for g in the_plan.gpus], TierBudgets(**the_plan.budgets()),
                             cfg, DTYPES[the_plan.compute_dtype], progress, max_context=the_plan.max_context,
                             ram_available=host.ram_available,
                             engram_tier=the_plan.engram.tier if the_plan.engram is not None else None)
    loaded.plan = the_plan
    return loaded


def assemble_tiered(checkpoint: Checkpoint, bounds: Bounds, gpu_slots: list[int], budgets: TierBudgets,
                    cfg: StrataConfig, dtype: torch.dtype, progress: bool = False, time_hops: bool = False,
                    max_context: int | None = None, ram_available: int | None = None,
                    engram_tier: str | None = None) -> LoadedModel:
    """The tiered model over `bounds` (device, first, end layer per stage) with `gpu_slots[s]` expert slots on
    stage s's device. Stages may be CPU devices (the GPU tier is then simulated in RAM): tests run it there."""
    store = checkpoint.store
    moe = [i for i, m in enumerate(checkpoint.config.moe_layers) if m]
    per_stage = [[i for i in moe if s <= i < e] for _, s, e in bounds]
    computes, tmpfs_marker = [], None
    model = None
    try:
        for (device, _, _), layers, slots in zip(bounds, per_stage, gpu_slots, strict=True):
            share = len(layers) / max(1, len(moe))  # host tiers: each card gets its layers' share of the budget
            view = StoreView(store, set(layers))
            stage_budgets = TierBudgets(gpu_slots=slots, pinned_slots=int(budgets.pinned_slots * share),
                                        tmpfs_bytes=int(budgets.tmpfs_bytes * share), per_layer=budgets.per_layer)
            if tmpfs_marker is not None:
                _wait_for(tmpfs_marker)  # mirrors share a directory: let the first one write its marker alone
            compute = expert_tiers(view, stage_budgets, device, "gpu" if slots else "cpu", cfg,
                                   io_threads=max(2, 8 // len(bounds)))
            if compute.manager.tmpfs is not None and tmpfs_marker is None:
                tmpfs_marker = compute.manager.tmpfs.root / "mirror.json"
            computes.append(compute)
        managers = [c.manager for c in computes]
        _share_cpu_worker(computes)
        prepare_cpu_experts(computes)
        stage_of = {i: s for s, layers in enumerate(per_stage) for i in layers}
        model = load_model(checkpoint, dtype, "cpu", progress=progress,
                           prepare=lambda m: (_use_stage_experts(m, computes, stage_of), drop_tables(m)))
        model.kernel_options = kernel_options_of(cfg)
        stage_map = stage_model(model, bounds, time_hops=time_hops)
        if model.engram is not None:  # each Engram layer's rows are served to the card that runs it
            ram = ram_available if ram_available is not None else psutil.virtual_memory().available
            attach_row_store(model, store, cfg, bounds[0][0], ram, tier=engram_tier,
                             layer_devices={i: stage_map.layer_device[i] for i in model.cfg.engram.layer_ids})
        tiers = DeviceTiers(store, managers, [str(d) for d, _, _ in bounds], [(s, e) for _, s, e in bounds],
                            hops=stage_map.stats.snapshot)
        compute = StagedCompute(computes, tiers)
        cards = all(d.type == "cuda" for d, _, _ in bounds)
        if cards and model.engram is None and reads("gpu_pairs", store.expert_format):
            # decode steps in CUDA graphs, one per card's stretch of layers (and between host steps while experts
            # are cold); Engram models split over cards decode eagerly, and so do FP8 / MXFP4 experts the pair
            # kernels do not read (each layer groups its tokens by expert on the host)
            model.enable_decode_graphs(lambda: None if not cfg.debug.cuda_graphs
                                       else "full" if compute.all_resident() else "segmented",
                                       devices=[d for d, _, _ in bounds])
        if cfg.prefetch.lookahead > 0:
            predictors = router_predictors(model)
            prefetchers = [c.start_prefetching({i: predictors[i] for i in layers}, cfg.prefetch.lookahead) if layers
                           else None for c, layers in zip(computes, per_stage, strict=True)]
            model.observe_layers(StagedPrefetcher(prefetchers, stage_of, [d for d, _, _ in bounds],
                                                  cfg.prefetch.lookahead))
        for m in managers:
            start_placement(m, cfg)
    except BaseException:
        for c in computes:
            close_loaded(c, c.manager, None)
        close_loaded(None, None, model)
        raise
    context = max_context or loaded_context(cfg, checkpoint.config, bounds[0][0], dtype)
    return LoadedModel(checkpoint, model, bounds[0][0], dtype, context, None, tiers, compute)


def _use_stage_experts(model: MoETransformer, computes: list[ExpertCompute], stage_of: dict[int, int]) -> None:
    """Each MoE layer's experts served by the tiers of the card that runs it (before weights are loaded)."""
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp.experts = TieredExperts(i, model.cfg.num_experts, computes[stage_of[i]])


def _share_cpu_worker(computes: list[ExpertCompute]) -> None:
    """One CPU expert worker and one measured CPU rate for all cards: the host's cores are one resource."""
    pool = next((c.pool for c in computes if c.pool is not None), None)
    for c in computes[1:]:
        if c.pool is not None and c.pool is not pool:
            c.pool.shutdown(wait=False)
        c.pool = pool if c.pool is not None else None
        c.rates = computes[0].rates


def _wait_for(path: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
