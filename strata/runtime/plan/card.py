"""One card's share of a tiered model: its tier manager and expert executor, the CPU kernel they use, and the
background placement that fills the tiers (one card: strata.runtime.plan.build; one a stage over several cards:
strata.runtime.plan.multi_device)."""

from __future__ import annotations

import contextlib

import torch

from strata.config import StrataConfig
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore

STREAM_SLOTS = 16  # most GPU slots set aside for one step's copied cold experts (split mode)


def step_copy_slots(gpu_slots: int, experts: int) -> int:
    """GPU slots set aside for one step's copies in split mode: a sixteenth of the budget, at most
    `STREAM_SLOTS`; none when the budget holds all `experts`, where
    nothing is ever cold (carved out anyway, they would leave the cached tier short of the store, so
    decode steps would never become one graph)."""
    if gpu_slots >= experts:
        return 0
    return min(STREAM_SLOTS, gpu_slots // 16)


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
    `computes[0]`'s rates: cards of one host share them (`multi_device.assemble_tiered`)."""
    if any(c.use_fast_cpu and (c.split or c.device_tier == "cpu") for c in computes):
        from strata.kernels.cpu.experts import backend

        backend()
        computes[0].calibrate_cpu()  # the cost model starts from the kernel's measured rate


def close_loaded(compute, tiers, model) -> None:
    """Stop what loading a tiered model started (each may be None): the CPU worker (`compute`'s mailbox), the tier
    manager's threads and memory (`tiers`), the Engram row store (`model`'s). `Engine.close` runs it, and so does a
    load that fails or is interrupted: left running they leak in a process that goes on (a server, an app), and at
    exit the interpreter stops them inside torch, which aborts the process."""
    if compute is not None:
        compute.close_mailbox()  # the CPU worker of one-graph decode steps reads the pinned pool freed below
    if tiers is not None:
        tiers.close()
    rows = getattr(getattr(model, "engram", None), "source", None)  # the Engram row store's readers
    if rows is not None and hasattr(rows, "close"):
        rows.close()


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
