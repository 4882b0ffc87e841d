"""From a path to a runnable model: store on first use, plan, tier manager, model with tiered experts.

    checkpoint dir --(convert, once)--> store dir --(plan)--> budgets --> TierManager
                                             \\--> dense weights --> MoETransformer (experts from tiers)

With `runtime.experts = "memory"` every expert is loaded up front instead (the reference path). A model split
over several cards is built by strata.runtime.plan.multi_device; what both builds share is in
strata.runtime.plan.loaded (the result, settings) and strata.runtime.plan.card (one card's tiers and executor).
"""

from __future__ import annotations

from pathlib import Path

import torch

from strata.config import StrataConfig
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.deepseek_v4.tables import attach_hash_tables, drop_hash_tables
from strata.runtime.model.engram.store import attach_row_store, drop_tables
from strata.runtime.model.graphs import MAX_GRAPH_BATCH
from strata.runtime.model.hugepages import use_huge_pages
from strata.runtime.model.loader import load_model
from strata.runtime.model.moe import router_predictors
from strata.runtime.offload.tiered_moe import use_tiered_experts
from strata.runtime.plan.card import (
    close_loaded,
    expert_tiers,
    hot_order,
    prepare_cpu_experts,
    start_placement,
    step_copy_slots,
)
from strata.runtime.plan.checkpoints.in_place import open_in_place
from strata.runtime.plan.checkpoints.store_cache import ensure_store
from strata.runtime.plan.context import check_kv_fits, check_whole_fits, loaded_context
from strata.runtime.plan.loaded import (
    DTYPES,
    LoadedModel,
    grouped_on,
    kernel_options_of,
    resolve_device,
    use_grouped_prefill,
)
from strata.runtime.plan.planner import plan_for
from strata.tiers.manager import TierBudgets

__all__ = ["LoadedModel", "build_model", "ensure_store", "hot_order", "resolve_device", "step_copy_slots"]


def build_model(path: Path, cfg: StrataConfig, progress: bool = False) -> LoadedModel:
    """Load `path` (a checkpoint or a store) as `cfg` says."""
    if str(path).endswith(".gguf"):  # a GGUF file runs from its store, converted into the cache on first use
        from strata.runtime.plan.checkpoints.store_cache import gguf_store

        path = gguf_store(path, cfg, progress)
    if len(cfg.runtime.devices) > 1:  # one model over several GPUs: stages of layers, one per card
        from strata.runtime.plan.multi_device import build_multi_device

        return build_multi_device(path, cfg, progress)
    if cfg.runtime.experts == "memory":
        device = resolve_device(cfg.runtime.primary_device)
        checkpoint = Checkpoint.open(path)
        # "auto": bf16 on CUDA; on the CPU a bf16 checkpoint's bf16, else fp32 (ModelFootprint.cpu_dtype)
        auto = torch.bfloat16 if device.type == "cuda" or checkpoint.dtype == torch.bfloat16 else torch.float32
        dtype = DTYPES.get(cfg.runtime.dtype) or auto
        check_whole_fits(cfg, checkpoint, device, dtype)  # before a GPU runs out part-way
        model = load_model(checkpoint, dtype, device, progress=progress)
        model.kernel_options = kernel_options_of(cfg)
        if device.type == "cpu":
            use_huge_pages(model)  # the weights a CPU decode streams, in 2 MiB pages
        use_grouped_prefill(model, grouped_on(cfg.debug.grouped_prefill, device))
        max_context = loaded_context(cfg, checkpoint.config, device, dtype)
        check_kv_fits(cfg, checkpoint.config, device, dtype, max_context)
        if device.type == "cuda":
            model.enable_decode_graphs(lambda: "full" if cfg.debug.cuda_graphs else None)
        return LoadedModel(checkpoint, model, device, dtype, max_context)

    the_plan = plan_for(path, cfg)  # refuses before a store is built or anything is loaded
    host = the_plan.host
    if the_plan.store_mode == "in_place":  # the checkpoint's own files, through an index in the cache
        checkpoint = Checkpoint.open(path)
        store = open_in_place(path, cfg, checkpoint)
    else:
        checkpoint = Checkpoint.open(ensure_store(path, cfg, progress))
        store = checkpoint.store
    device = resolve_device(the_plan.compute_device)
    dtype = DTYPES[the_plan.compute_dtype]
    budgets = TierBudgets(**the_plan.budgets())
    device_tier = "gpu" if the_plan.expert_compute == "gpu" and budgets.gpu_slots else "cpu"
    compute = expert_tiers(store, budgets, device, device_tier, cfg)
    model = None
    try:
        compute.grouped_prefill = grouped_on(cfg.debug.grouped_prefill, device)
        compute.prefill_keeps_resident = cfg.runtime.prefill_keeps_resident
        manager = compute.manager
        prepare_cpu_experts([compute])
        model = load_model(checkpoint, dtype, device, progress=progress, prepare=lambda m: (
            use_tiered_experts(m, compute), drop_tables(m), drop_hash_tables(m, store)))
        model.kernel_options = kernel_options_of(cfg)
        if device.type == "cpu":
            use_huge_pages(model)  # the dense weights a CPU decode streams, in 2 MiB pages
        attach_hash_tables(model, store, device, cfg.tiers.tmpfs.path)  # DeepSeek-V4's tid2eid: store tables
        if model.engram is not None:  # Engram tables: served by the tiered row store, checked before serving
            attach_row_store(model, checkpoint.store, cfg, device, host.ram_available,
                             tier=the_plan.engram.tier if the_plan.engram is not None else None)
        if device.type == "cuda":
            # one graph per step once every expert is resident; until then, graphs between host steps (Engram rows
            # the device cannot read in place also need a host step, at their layer: waiting there for a layer's
            # reads, not before the step, lets them overlap the layers before it)
            d = cfg.debug
            if model.engram is not None and d.engram_graph_wait and d.engram_prefetch and d.cuda_graphs:
                # disk rows served to one graph a step as soon as it has hashed its tokens (that is the prefetch:
                # without it a layer's rows are fetched when the layer runs, at a host step between graph segments)
                model.engram.enable_handshake(MAX_GRAPH_BATCH)
            host_rows = model.engram is not None and not model.engram.device_steps(model.layers, 1)
            # (FP8 / MXFP4 experts the pair kernels do not read: decode groups tokens by expert on the host, eagerly)
            model.enable_decode_graphs(lambda: None if not (cfg.debug.cuda_graphs and the_plan.decode_graphs)
                                       else "full" if compute.all_resident() and not host_rows
                                       else "mailbox" if not host_rows and compute.mailbox_ready() else "segmented",
                                       hooks=compute)  # its mailbox books run around each graph step
        if cfg.prefetch.lookahead > 0:
            compute.start_prefetching(router_predictors(model), cfg.prefetch.lookahead)
            model.observe_layers(compute)  # its prefetcher predicts after each layer
        start_placement(manager, cfg)
    except BaseException:
        close_loaded(compute, compute.manager, model)
        raise
    return LoadedModel(checkpoint, model, device, dtype, the_plan.max_context, the_plan, manager, compute)
