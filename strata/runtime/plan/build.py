"""From a path to a runnable model: store on first use, plan, tier manager, model with tiered experts.

    checkpoint dir --(convert, once)--> store dir --(plan)--> budgets --> TierManager
                                             \\--> dense weights --> MoETransformer (experts from tiers)

With `runtime.experts = "memory"` every expert is loaded up front instead (the reference path).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.config import StrataConfig
from strata.errors import StrataError
from strata.kernels.options import KernelOptions
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.engram.store import attach_row_store, drop_tables
from strata.runtime.model.graphs import MAX_GRAPH_BATCH, current_recorder
from strata.runtime.model.loader import load_model
from strata.runtime.model.moe import router_predictors
from strata.runtime.model.transformer import MoETransformer
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import use_tiered_experts
from strata.runtime.plan.planner import Plan, plan_for
from strata.runtime.plan.store_cache import ensure_store
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.prefetch import LookaheadPrefetcher
from strata.tiers.store.store import ExpertStore

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """Everything `Engine` runs: the model, where it runs, and (tiered) its plan and tier manager."""

    checkpoint: Checkpoint
    model: MoETransformer
    device: torch.device
    dtype: torch.dtype
    max_context: int
    plan: Plan | None = None
    manager: TierManager | None = None
    compute: ExpertCompute | None = None


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; a CUDA request without CUDA is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise StrataError(f"device {device!r} requested but no CUDA GPU is available; use --device cpu")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise StrataError(f"device {device!r} does not exist: this host has {torch.cuda.device_count()} GPU(s)")
    elif device != "cpu":
        raise StrataError(f"device {device!r} is invalid; use auto, cpu, cuda or cuda:N")
    return torch.device(device)


def build_model(path: Path, cfg: StrataConfig, progress: bool = False) -> LoadedModel:
    """Load `path` (a checkpoint or a store) as `cfg` says."""
    if len(cfg.runtime.devices) > 1:  # one model over several GPUs: stages of layers, one per card
        from strata.runtime.plan.multi_device import build_multi_device

        return build_multi_device(path, cfg, progress)
    if cfg.runtime.experts == "memory":
        device = resolve_device(cfg.runtime.primary_device)
        dtype = _DTYPES.get(cfg.runtime.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        checkpoint = Checkpoint.open(path)
        model = load_model(checkpoint, dtype, device, progress=progress)
        model.kernel_options = kernel_options_of(cfg)
        use_grouped_prefill(model, grouped_on(cfg.debug.grouped_prefill, device))
        max_context = min(cfg.runtime.max_context, checkpoint.config.max_position_embeddings)
        if device.type == "cuda":
            model.enable_decode_graphs(lambda: "full" if cfg.debug.cuda_graphs else None)
        return LoadedModel(checkpoint, model, device, dtype, max_context)

    the_plan = plan_for(path, cfg)  # refuses before a store is built or anything is loaded
    host = the_plan.host
    store_dir = ensure_store(path, cfg, progress)
    device = resolve_device(the_plan.compute_device)
    dtype = _DTYPES[the_plan.compute_dtype]
    checkpoint = Checkpoint.open(store_dir)
    budgets = TierBudgets(**the_plan.budgets())
    device_tier = "gpu" if the_plan.expert_compute == "gpu" and budgets.gpu_slots else "cpu"
    compute = expert_tiers(checkpoint.store, budgets, device, device_tier, cfg)
    compute.grouped_prefill = grouped_on(cfg.debug.grouped_prefill, device)
    compute.prefill_keeps_resident = cfg.runtime.prefill_keeps_resident
    manager = compute.manager
    prepare_cpu_experts([compute])
    model = load_model(checkpoint, dtype, device, progress=progress,
                       prepare=lambda m: (use_tiered_experts(m, compute), drop_tables(m)))
    model.kernel_options = kernel_options_of(cfg)
    if model.engram is not None:  # Engram tables: served by the tiered row store, checked before serving
        attach_row_store(model, checkpoint.store, cfg, device, host.ram_available,
                         tier=the_plan.engram.tier if the_plan.engram is not None else None)
    if device.type == "cuda":  # one graph per step once every expert is resident; until then, graphs between host steps
        # (Engram rows the device cannot read in place also need a host step, at their layer: waiting there
        # for a layer's reads, not before the step, lets them overlap the layers before it)
        d = cfg.debug
        if model.engram is not None and d.engram_graph_wait and d.engram_prefetch and d.cuda_graphs:
            # disk rows served to one graph a step as soon as it has hashed its tokens (that is the prefetch: without
            # it a layer's rows are fetched when the layer runs, at a host step between graph segments)
            model.engram.enable_handshake(MAX_GRAPH_BATCH)
        host_rows = model.engram is not None and not model.engram.device_steps(model.layers, 1)
        model.enable_decode_graphs(lambda: None if not cfg.debug.cuda_graphs
                                   else "full" if compute.all_resident() and not host_rows
                                   else "mailbox" if not host_rows and compute.mailbox_ready() else "segmented")
        model.graphs.before_step, model.graphs.after_queued = compute.mailbox_step, compute.mailbox_queued
    if cfg.prefetch.lookahead > 0:
        model.after_layer = attach_prefetcher(compute, router_predictors(model), cfg)
    start_placement(manager, cfg)
    return LoadedModel(checkpoint, model, device, dtype, the_plan.max_context, the_plan, manager, compute)


def kernel_options_of(cfg: StrataConfig) -> KernelOptions:
    """The kernels' options an engine's forward passes run with (`[debug] fused_kernels`, `[debug] pdl`)."""
    return KernelOptions(fused=cfg.debug.fused_kernels, pdl=cfg.debug.pdl)


def grouped_on(setting: bool | str, device: torch.device) -> bool:
    """[debug] grouped_prefill resolved for `device`: "auto" means on CUDA only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def use_grouped_prefill(model, on: bool) -> None:
    """[debug] grouped_prefill for a model whose experts are all in memory: each layer's `Experts`."""
    from strata.runtime.model.moe import Experts

    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped = on


STREAM_SLOTS = 16  # most GPU slots set aside for one step's copied cold experts (split mode)


def step_copy_slots(gpu_slots: int, experts: int) -> int:
    """GPU slots set aside for one step's copies in split mode: a sixteenth of the budget, at most
    `STREAM_SLOTS`; none when the budget holds all `experts`, where
    nothing is ever cold (carved out anyway, they would leave the cached tier short of the store, so
    decode steps would never become one graph)."""
    if gpu_slots >= experts:
        return 0
    return min(STREAM_SLOTS, gpu_slots // 16)


# ---- the steps of a tiered model, per card (build_model: one card; multi_device.assemble_tiered: one per stage) ----
def expert_tiers(store: ExpertStore, budgets: TierBudgets, device: torch.device, device_tier: str,
                 cfg: StrataConfig, **manager_options) -> ExpertCompute:
    """One card's tier manager over `store` and the expert compute on it (`compute.manager`).

    With the forked CPU kernel beside a GPU tier (the split), a sixteenth of the GPU budget, at most 16
    slots, takes the cold experts the cost model copies for one step only (`TierManager.stream_gpu`);
    none when the budget holds every expert of `store`."""
    split = device_tier == "gpu" and cfg.runtime.cpu_numerics == "fork"
    manager_options.setdefault("stream_slots", step_copy_slots(budgets.gpu_slots, len(store.keys())) if split else 0)
    manager = TierManager(store, budgets, gpu_device=device if device.type == "cuda" else None,
                          policy=cfg.policy.eviction, half_life=cfg.policy.lfu_half_life, hot=hot_order(store),
                          tmpfs_dir=cfg.tiers.tmpfs.path, disk_reader=cfg.tiers.disk.reader, **manager_options)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        d = cfg.debug
        return ExpertCompute(manager, device_tier, cfg.runtime.cpu_numerics, promote=cfg.policy.promote,
                             split_decode=d.split_decode, device=device, warm_ahead=d.warm_ahead,
                             gpu_share=d.fixed_gpu_share, cpu_threads=d.cpu_threads, cpu_kernel=d.cpu_kernel)


def prepare_cpu_experts(computes: list[ExpertCompute]) -> None:
    """Build (or load) the CPU expert kernel and measure it now, not inside the first request. Calibrates
    `computes[0]`'s rates: cards of one host share them (multi_device._share_cpu_worker)."""
    if any(c.fast_cpu and (c.split or c.device_tier == "cpu") for c in computes):
        from strata.kernels.cpu.experts import backend

        backend()
        computes[0].calibrate_cpu()  # the cost model starts from the kernel's measured rate


def attach_prefetcher(compute: ExpertCompute, predictors: dict, cfg: StrataConfig) -> LookaheadPrefetcher:
    """`compute`'s lookahead prefetcher over the MoE layers of `predictors`, idle for good once its target
    tier holds every expert. Split decode computes cold experts on the CPU from pinned RAM, so there it
    fetches ahead into pinned RAM (from tmpfs or disk); copies ahead into GPU slots there only churned the
    GPU tier (the suite's skewed split ran 1.27x faster with prefetch off), whose adaptation is left to the
    split's own promotions (`policy.promote`)."""
    if compute.split or compute.device_tier == "cpu":  # (idle once all pinned: a one-graph step must not predict)
        target, idle = "cpu", compute.manager.all_pinned
    else:
        target, idle = compute.device_tier, compute.all_resident
    compute.prefetcher = LookaheadPrefetcher(compute.manager, predictors, cfg.prefetch.lookahead, target, idle=idle)
    compute.prefetcher.recorder = current_recorder
    return compute.prefetcher


def start_placement(manager: TierManager, cfg: StrataConfig) -> None:
    """Scrub (if configured) and the initial placement, both in the background: RAM first, then the GPU's share."""
    if cfg.tiers.disk.scrub:
        manager.scrub()  # lowest priority: real traffic and initial placement go first
    keys = hot_order(manager.store)
    manager.place(keys[: manager.pinned.capacity], "cpu")
    if manager.gpu is not None:
        manager.place(keys[: manager.gpu.capacity], "gpu")


def hot_order(store: ExpertStore) -> list[tuple[int, int]]:
    """Experts in placement order. Without a popularity profile: round-robin over layers, so every
    layer gets an equal share of each tier (the best guess under uniform routing)."""
    keys = sorted(store.keys(), key=lambda k: (k[1], k[0]))
    return keys
