"""The planner: where every expert of a model lives on a host, decided from headers alone.

    plan = plan("path/to/model", probe_host(...), config)      # or `strata plan MODEL --json`
    plan.budgets()   # {"gpu_slots", "pinned_slots", "tmpfs_bytes", "per_layer"} for the tier manager

The compute device first holds everything that is not a routed expert: non-expert weights (attention,
dense MLPs, shared experts, routers, norms, embeddings, lm_head) in the compute dtype, the KV cache for
`runtime.max_context` x `planner.max_batch` tokens ("auto": strata.runtime.plan.context) and
`planner.activation_reserve`. What remains of the
GPU becomes expert slots. Pinned RAM takes the next experts, tmpfs mirrors whole layer files of the
store, and the store on disk holds everything.

The minimum valid layout is one expert slot per MoE layer on the GPU (the layer being computed needs
somewhere to put an expert), or none with `tiers.gpu.budget = "0"`, where experts compute on the CPU.
When even that does not fit, `plan` raises `PlanError` naming the smallest change that would.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from strata.config import StrataConfig, load_config
from strata.config_values import parse_gpus, parse_size
from strata.runtime.generation.prefill_chunk import resolve_prefill_chunk
from strata.runtime.model.qwen3_5.cache import reuses_prefixes
from strata.runtime.plan.checkpoints.in_place import store_mode
from strata.runtime.plan.checkpoints.inspect import format_bytes
from strata.runtime.plan.checkpoints.store_cache import store_dir_for
from strata.runtime.plan.context import plan_context
from strata.runtime.plan.decode_modes import decode_mode
from strata.runtime.plan.engram import EngramPlanError, plan_engram
from strata.runtime.plan.expert_parallel import plan_expert_parallel
from strata.runtime.plan.footprint import read_footprint
from strata.runtime.plan.host import GpuInfo, HostInfo, probe_host
from strata.runtime.plan.kv_size import kv_cache_bytes, kv_growth_of
from strata.runtime.plan.layout import GpuPlan, Plan, PlanError, TierPlan
from strata.runtime.plan.stages import layer_sizes, plan_stages, select_devices, simulate_gpus
from strata.tiers.store import format as store_format

GiB, MiB = 1 << 30, 1 << 20
RAM_MARGIN_MIN = 4 * GiB  # RAM never planned: the OS, page cache for the disk tier, other processes
RAM_MARGIN_FRACTION = 0.10
MIN_CONTEXT = 16  # runtime.max_context's lower bound
__all__ = ["GpuPlan", "Plan", "PlanError", "TierPlan", "add_plan_arguments", "cmd_plan", "override_host", "plan",
           "plan_for"]
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plan(model_dir: str | Path, host: HostInfo, config: StrataConfig | dict | str | None = None,
         gpu_mem: int | None = None, ram: int | None = None, store_dir: str | Path | None = None,
         refuse: bool = True) -> Plan:
    """Plan `model_dir` (checkpoint or store) on `host`; `gpu_mem`/`ram` replace the probed values.

    `store_dir` is where the checkpoint's store is (or will be); when it already holds a store, the
    disk needs no room to build one. Raises `PlanError` when the minimum layout does not fit; with
    `refuse=False` (`strata plan`) what does not fit (a card or a host too small for the weights, KV cache and one
    expert per layer, a GPU or pinned budget larger than the memory left or a GPU one below that minimum, a packed
    store larger than the disk's free space) is listed in `Plan.does_not_fit` instead, each with the smallest change
    that fits, and the layout is planned as if that change were made.
    """
    does_not_fit: list[str] = []

    def refused(message: str) -> None:
        if refuse:
            raise PlanError(message)
        does_not_fit.append(message)

    cfg = load_config(config)
    fp = read_footprint(model_dir, cfg.store.experts)
    host = override_host(host, gpu_mem, ram)
    if len(cfg.runtime.devices) > 1:  # one model over several cards (strata.runtime.plan.stages)
        gpu = select_devices(host.gpus, cfg.runtime.devices)[0]
    else:
        gpu = _select_gpu(host, cfg.runtime.primary_device)
    dtype = cfg.runtime.dtype if cfg.runtime.dtype != "auto" else ("bfloat16" if gpu else fp.cpu_dtype)
    itemsize = _TORCH_DTYPES[dtype].itemsize
    non_expert = fp.non_expert_bytes_in(itemsize)  # weights are converted (FP8 ones dequantized) to it on load
    slots = cfg.planner.max_batch + cfg.runtime.prefix_only_slots  # the batch's, and those only keeping prefixes
    if not reuses_prefixes(fp.config):  # a recurrent state per sequence (Qwen3.5-MoE): no prefix cache, no such slots
        slots = cfg.planner.max_batch
    # one sequence's cache: a fixed part (DeepSeek-V4's sliding windows) and bytes per token of context
    kv_fixed, kv_rate = kv_growth_of(fp.config, _TORCH_DTYPES[dtype])
    kv_per_token = math.ceil(kv_rate) * slots
    if fp.config.deepseek_v4 is not None and len(cfg.runtime.devices) > 1:
        raise PlanError("DeepSeek-V4 runs on one device; set runtime.devices to a single GPU (or drop --gpus)")
    if fp.config.gpt_oss is not None and len(cfg.runtime.devices) > 1:
        raise PlanError("gpt-oss runs on one device; set runtime.devices to a single GPU (or drop --gpus)")
    if fp.config.qwen3_5 is not None and len(cfg.runtime.devices) > 1:
        raise PlanError("Qwen3.5-MoE runs on one device; set runtime.devices to a single GPU (or drop --gpus)")
    reserve = cfg.planner.activation_reserve_bytes
    # the memory the KV cache shares with experts: the cards' after their weights, or the host's RAM on the CPU
    if len(cfg.runtime.devices) > 1:
        cards = select_devices(host.gpus, cfg.runtime.devices)
        room = sum(g.free_bytes for g in cards) - non_expert - reserve * len(cards)
    elif gpu is not None:
        room = gpu.free_bytes - non_expert - reserve
    else:
        room = host.ram_available - max(RAM_MARGIN_MIN, int(RAM_MARGIN_FRACTION * host.ram_total)) - non_expert - reserve
    context, context_note = plan_context(cfg.runtime.max_context, fp.config.max_position_embeddings, kv_per_token,
                                         room - kv_fixed * slots)
    kv = kv_cache_bytes(fp.config, _TORCH_DTYPES[dtype], context) * slots
    total, per_layer = fp.total_experts, cfg.policy.budget_scope == "per_layer"
    notes: list[str] = [context_note]

    def scoped(slots: int) -> int:  # per_layer budgets split evenly, so only whole rounds of layers count
        slots = min(slots, total)
        return slots - slots % fp.moe_layers if per_layer and fp.moe_layers else slots

    margin = max(RAM_MARGIN_MIN, int(RAM_MARGIN_FRACTION * host.ram_total))
    ram_other = 0 if gpu is not None else non_expert + kv + reserve
    if host.tmpfs_problem and cfg.tiers.tmpfs.budget_bytes:
        raise PlanError(f"{host.tmpfs_problem}; use a tmpfs path such as /dev/shm or set tiers.tmpfs.budget = 0")
    if host.tmpfs_problem and fp.engram_table_bytes and cfg.engram.tier == "tmpfs":
        raise PlanError(f'{host.tmpfs_problem}; use a tmpfs path such as /dev/shm or set engram.tier = "disk" (or "auto")')
    tmpfs_budget = min(cfg.tiers.tmpfs.budget_bytes, host.tmpfs_free)
    engram = None
    if fp.config.engram is not None and fp.engram_table_bytes:  # whole tables come before the expert tiers
        try:
            engram = plan_engram(fp.engram_table_bytes, cfg, gpu is not None, len(cfg.runtime.devices) > 1,
                                 max(0, host.ram_available - margin - ram_other), tmpfs_budget, host.tmpfs_free)
        except EngramPlanError as e:
            raise PlanError(str(e)) from None
    engram_gpu = engram.gpu_bytes if engram is not None else 0
    need = _Need(non_expert + engram_gpu, kv, kv_per_token, context, cfg.planner.max_batch, reserve)
    gpus: list[GpuPlan] = []
    gpu_slots, gpu_budget, expert_parallel = 0, 0, None
    if len(cfg.runtime.devices) > 1:  # contiguous stages of layers, one per card
        sizes = layer_sizes(fp.config, _TORCH_DTYPES[dtype], cfg.planner.max_batch + cfg.runtime.prefix_only_slots)
        gpus, gpu_budget = plan_stages(fp, cfg, host, sizes, _TORCH_DTYPES[dtype], context, notes)
        expert_parallel = plan_expert_parallel(fp, cfg, host, sizes, _TORCH_DTYPES[dtype], context, gpus, notes)
        gpu_slots = sum(g.slots for g in gpus)
    elif gpu is not None:
        device = f"cuda:{gpu.index}"
        slot = fp.gpu_slot_bytes(itemsize)
        budget = cfg.tiers.gpu.budget_bytes
        minimum = 0 if budget == 0 else fp.moe_layers * slot
        left = gpu.free_bytes - non_expert - kv - reserve - minimum
        if engram is not None and engram.tier == "gpu" and engram.gpu_bytes > left:
            raise PlanError(
                f"the Engram tables ({format_bytes(engram.table_bytes)}) do not fit in {device}'s VRAM: "
                f"{format_bytes(max(0, left))} is left after the non-expert weights, KV cache, reserve and one expert "
                'per MoE layer; set engram.tier = "pinned" or "auto"')
        if (short := need.shortfall(gpu.free_bytes, minimum, f"{device} has {format_bytes(gpu.free_bytes)} free",
                                    f"use a GPU with {_gib_up(need.total(minimum))} free",
                                    gpu_budget_zero_fits=minimum > 0)) is not None:
            refused(short)  # `strata plan`: the layout as if the card held the minimum
        room = max(gpu.free_bytes - non_expert - engram_gpu - kv - reserve, minimum)
        if budget is None:
            budget = room
        elif budget > room:
            refused(
                f"tiers.gpu.budget ({format_bytes(budget)}) is more than the {format_bytes(room)} {device} has left for "
                f"experts after non-expert weights, KV cache and reserve; set tiers.gpu.budget = "
                f'"{room // MiB}MiB" or "auto"')
            budget = room
        elif budget < minimum:
            refused(
                f"tiers.gpu.budget ({format_bytes(budget)}) holds {budget // slot} expert slots but the minimum is one "
                f'per MoE layer ({fp.moe_layers}); set it to at least "{-(-minimum // MiB)}MiB", or "0" to compute '
                "experts on the CPU")
            budget = minimum
        gpu_slots, gpu_budget = scoped(budget // slot if slot else 0), budget
        if slot and budget // slot > total:
            notes.append(f"the GPU holds all {total} experts; {format_bytes(budget - total * slot)} of its budget is unused")
        gpus.append(GpuPlan(device, gpu.name, gpu.free_bytes, non_expert + engram_gpu, kv, reserve, room, slot,
                            gpu_slots, gpu_slots * slot))
    else:
        # CPU-only: weights, KV cache and activations live in RAM, next to at least one expert per layer
        if (short := need.shortfall(host.ram_available, fp.moe_layers * fp.slot_bytes,
                                    f"the host has {format_bytes(host.ram_available)} of RAM available",
                                    f"use a host with {_gib_up(need.total(fp.moe_layers * fp.slot_bytes))} of RAM "
                                    "available")) is not None:
            refused(short)
        notes.append("no CUDA GPU planned: every layer runs on the CPU and experts compute from RAM "
                     "(the pinned tier is plain RAM)")

    # tmpfs mirrors whole layer files (RAM-backed, so they count against RAM too)
    layer_bytes = fp.experts_per_layer * fp.slot_bytes
    if tmpfs_budget < cfg.tiers.tmpfs.budget_bytes:
        notes.append(f"tiers.tmpfs.budget is capped at the {format_bytes(host.tmpfs_free)} free in {host.tmpfs_path}")
    engram_ram = (engram.ram_bytes + engram.tmpfs_bytes) if engram is not None else 0
    tmpfs_budget = max(0, tmpfs_budget - (engram.tmpfs_bytes if engram is not None else 0))
    tmpfs_layers = min(tmpfs_budget // layer_bytes, fp.moe_layers) if layer_bytes else 0

    ram_room = max(0, host.ram_available - margin - ram_other - engram_ram - tmpfs_layers * layer_bytes)
    pinned_budget = cfg.tiers.pinned.budget_bytes
    if pinned_budget is None:
        pinned_budget = ram_room
    elif pinned_budget > ram_room:
        refused(
            f"tiers.pinned.budget ({format_bytes(pinned_budget)}) is more than the {format_bytes(ram_room)} of RAM left "
            f"after the {format_bytes(margin)} safety margin" + (" and the model's RAM" if ram_other else "")
            + (" and tmpfs" if tmpfs_layers else "") + f'; set tiers.pinned.budget = "{ram_room // MiB}MiB" or "auto"')
        pinned_budget = ram_room
    # inclusive of the GPU's experts: the pinned copy is the source of every GPU copy and of CPU compute,
    # so an expert evicted from the GPU must not fall back to disk (uniform routing evicts constantly)
    pinned_slots = scoped(min(0 if gpu_slots >= total else total, pinned_budget // fp.slot_bytes if fp.slot_bytes else 0))
    if pinned_slots == 0 and total > gpu_slots:
        notes.append(f"RAM leaves no room for experts after the {format_bytes(margin)} safety margin; experts "
                     "outside the GPU are read from tmpfs or disk at every use")

    mode, why = ("packed", "the path is a packed store") if fp.source == "store" else store_mode(fp.path, cfg)
    store_exists = fp.source == "store" or (store_dir is not None and store_format.is_store(store_dir))
    if mode == "packed" and not store_exists and host.disk_free < fp.store_bytes:
        refused(
            f"the expert store ({format_bytes(fp.store_bytes)}) is built in {store_dir or host.disk_path} but that "
            f"disk has {format_bytes(host.disk_free)} free; free {_gib_up(fp.store_bytes - host.disk_free)} there or "
            f"set tiers.disk.path to a disk with {_gib_up(fp.store_bytes)} free")

    # uniform routing: an expert outside GPU and pinned is in a mirrored layer with odds tmpfs_layers / layers
    pinned_only = max(0, pinned_slots - gpu_slots)  # experts answered by pinned RAM and not by the GPU
    rest = max(0, total - gpu_slots - pinned_only)
    shares = [gpu_slots / total, pinned_only / total, rest * tmpfs_layers / fp.moe_layers / total] if total else [0.0] * 3
    tiers = [
        TierPlan("gpu", gpu_budget, gpu_slots, sum(g.expert_bytes for g in gpus), shares[0]),
        TierPlan("pinned", pinned_budget, pinned_slots, pinned_slots * fp.slot_bytes, shares[1]),
        TierPlan("tmpfs", tmpfs_budget, tmpfs_layers * fp.experts_per_layer, tmpfs_layers * layer_bytes, shares[2],
                 host.tmpfs_path),
        TierPlan("disk", fp.store_bytes, total, fp.store_bytes, max(0.0, 1.0 - sum(shares)) if total else 0.0,
                 host.disk_path),
    ]
    expert_compute = "gpu" if gpu_slots else "cpu"
    decode = decode_mode(fp.expert_format, expert_compute, bool(total) and gpu_slots >= total, cfg, dtype)
    if fp.config.qwen3_5 is not None:
        notes.append("prefix cache off: the linear-attention layers keep a recurrent state per sequence, not rows per "
                     "position, so every prompt is computed whole")
    notes += decode.fallbacks
    if fp.dense_fp8_bytes:
        notes.append(f"dense FP8 weights ({format_bytes(fp.dense_fp8_bytes)}) are dequantized to {dtype} as they load")
    return Plan(
        model_dir=fp.path, source=fp.source, model_type=fp.config.model_type, moe_layers=fp.moe_layers,
        experts_per_layer=fp.experts_per_layer, experts_per_token=fp.config.num_experts_per_tok,
        expert_bytes=fp.expert_bytes, slot_bytes=fp.slot_bytes,
        compute_device=f"cuda:{gpu.index}" if gpu is not None else "cpu", compute_dtype=dtype,
        expert_compute=expert_compute, max_context=context, max_batch=cfg.planner.max_batch,
        kv_bytes=kv, kv_bytes_per_1k=round(kv_rate * 1024), non_expert_bytes=non_expert, ram_margin_bytes=margin, budget_scope=cfg.policy.budget_scope,
        store_bytes=fp.store_bytes, store_exists=store_exists, gpus=gpus, tiers=tiers, host=host, notes=notes,
        engram=engram, prefill_chunk=resolve_prefill_chunk(cfg.runtime.prefill_chunk, fp.config,
                                                            torch.device("cuda" if gpu is not None else "cpu"),
                                                            cfg.planner.activation_reserve_bytes, context),
        store_dir=str(store_dir) if store_dir is not None else fp.path if fp.source == "store" else "",
        expert_format=fp.expert_format.name, dense_format=fp.dense_format, decode=decode.mode,
        decode_graphs=decode.graphs, store_mode=mode, store_why=why, does_not_fit=does_not_fit,
        expert_parallel=expert_parallel,
    )  # fmt: skip


def plan_for(path: str | Path, cfg: StrataConfig) -> Plan:
    """The plan loading `path` with `cfg` makes on this host (`Engine.from_pretrained`, `strata serve`'s
    preflight): the disk's free space is measured where `path`'s store is, or will be built (`store_dir_for`)."""
    store_dir = store_dir_for(path, cfg)
    return plan(path, probe_host(cfg.tiers.tmpfs.path, str(store_dir)), cfg, store_dir=store_dir)


@dataclass
class _Need:
    """The memory the compute device needs before experts, and the refusal when it is not there."""

    non_expert: int
    kv: int
    kv_per_token: int  # all max_batch sequences
    context: int
    batch: int
    reserve: int

    def total(self, experts: int) -> int:
        return self.non_expert + self.kv + self.reserve + experts

    def shortfall(self, have: int, experts: int, have_text: str, bigger: str,
                  gpu_budget_zero_fits: bool = False) -> str | None:
        """None when `have` bytes hold the weights, KV cache, reserve and `experts` bytes; else what does not fit
        and the smallest change that would, in one line."""
        if self.total(experts) <= have:
            return None
        seqs = f"{self.batch} x " if self.batch > 1 else ""
        parts = (f"non-expert weights ({format_bytes(self.non_expert)}) + KV cache for {seqs}{self.context} tokens "
                 f"({format_bytes(self.kv)}) + reserve ({format_bytes(self.reserve)})")
        if experts:
            parts += f" + one expert per MoE layer ({format_bytes(experts)})"
        fits = (have - self.total(experts) + self.kv) // self.kv_per_token if self.kv_per_token else 0
        fits = fits // 1024 * 1024 if fits >= 1024 else fits // 16 * 16  # a round number users would type
        if fits >= MIN_CONTEXT:
            fix = f"lower runtime.max_context to {fits} or {bigger}"
        elif gpu_budget_zero_fits and self.total(0) <= have:
            fix = f'set tiers.gpu.budget = "0" (experts compute on the CPU) or {bigger}'
        else:
            fix = bigger
        return f"{parts} need {format_bytes(self.total(experts))} but {have_text}; {fix}"


def _gib_up(n: int) -> str:
    """`n` bytes rounded up to 0.1 GiB, for "use a device with ..." suggestions that must suffice."""
    return f"{-(-n * 10 // GiB) / 10:.1f} GiB"


def override_host(host: HostInfo, gpu_mem: int | None = None, ram: int | None = None) -> HostInfo:
    """`host` with every GPU's VRAM set to `gpu_mem` (0: no GPU; one is assumed when none was probed)
    and RAM set to `ram`, for planning another machine."""
    gpus = list(host.gpus)
    if gpu_mem is not None:
        gpus = [GpuInfo(g.index, g.name, gpu_mem, gpu_mem) for g in gpus] or [GpuInfo(0, "--gpu-mem", gpu_mem, gpu_mem)]
        gpus = gpus if gpu_mem > 0 else []
    if ram is not None:
        host = replace(host, ram_total=ram, ram_available=ram)
    return replace(host, gpus=gpus)


def _select_gpu(host: HostInfo, device: str) -> GpuInfo | None:
    """The GPU the engine will use for `runtime.device` (None: the CPU), as `Engine` resolves it."""
    if device == "cpu" or (device == "auto" and not host.gpus):
        return None
    if not host.gpus:
        raise PlanError(f'runtime.device = "{device}" but this host has no CUDA GPU; plan for one with '
                        '--gpu-mem SIZE or set runtime.device = "cpu"')
    if device in ("auto", "cuda"):
        return host.gpus[0]
    index = int(device.split(":")[1])
    for g in host.gpus:
        if g.index == index:
            return g
    have = ", ".join(f"cuda:{g.index}" for g in host.gpus)
    raise PlanError(f'runtime.device = "{device}" but this host has {have}; use one of those')


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `strata plan`."""
    p.add_argument("model", help="checkpoint or store directory, or a .gguf file")
    p.add_argument("--gpu-mem", default=None, help='plan for this much free VRAM per GPU, e.g. "24GiB" (0: no GPU), '
                   'or one size per GPU of --gpus, e.g. "96GiB,24GiB,24GiB"')
    p.add_argument("--gpus", default=None, help="split the model over these GPUs, e.g. 0,1 (sets runtime.devices)")
    p.add_argument("--ram", default=None, help='plan for this much available RAM, e.g. "64GiB"')
    p.add_argument("--config", default=None, help="config.toml with overrides")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def cmd_plan(args: argparse.Namespace) -> int:
    """`strata plan MODEL [--gpu-mem SIZE] [--ram SIZE] [--config PATH] [--json]`: the layout, always where it can
    be planned; 1 when part of it does not fit (listed with the change that would), a PlanError otherwise."""
    cfg = load_config(args.config)
    if getattr(args, "gpus", None):
        cfg.runtime.devices = parse_gpus(args.gpus)
        cfg.runtime.__post_init__()
    mems = [parse_size(m, "--gpu-mem") for m in args.gpu_mem.split(",")] if args.gpu_mem is not None else []
    gpu_mem = mems[0] if len(mems) == 1 and len(cfg.runtime.devices) < 2 else None
    ram = parse_size(args.ram, "--ram") if args.ram is not None else None
    store_dir = store_dir_for(args.model, cfg)
    host = probe_host(cfg.tiers.tmpfs.path, str(store_dir))
    if mems and gpu_mem is None:  # several cards simulated, one size each (or one size for all)
        host = simulate_gpus(host, cfg.runtime.devices, mems)
    p = plan(args.model, host, cfg, gpu_mem=gpu_mem, ram=ram, store_dir=store_dir, refuse=False)
    print(json.dumps(p.to_dict(), indent=2) if args.json else p.format())
    return 1 if p.does_not_fit else 0  # the layout is shown, but serve and from_pretrained would refuse it

