"""The expert-parallel layout of one model over several GPUs: every card works on every MoE layer.

    shares = place_expert_parallel(sizes, cards, context=4096, reserve=2 * GiB, slot_bytes=expert_bytes)
    shares.cards[1].owned    # experts of every MoE layer whose pairs card 1 computes

The first card listed holds everything that is not a routed expert (attention, dense MLPs, shared experts,
routers, norms, embeddings, the LM head) and the KV cache, as one card would; every card, the first included,
gives what else it has to expert slots spread over all MoE layers. Each layer's experts are split into
contiguous id ranges, one per card: a card computes the pairs routed to its range, from its slots or read in
place over its own PCIe link, and its partial sum goes back to the first card. One token's cold experts then
cross every card's link at once, where contiguous stages (strata.runtime.plan.stages) use one link at a time.

Ownership under uniform routing: a card owns its residents plus an equal share of the experts no card holds, so
every link carries the same cold bytes a token (the links are taken as equal: the planner cannot measure them
on cards it simulates). `cold_bytes_per_link` and `stage_cold_bytes` give the comparison `strata plan` shows.
"""

from __future__ import annotations

import torch

from strata.runtime.plan.checkpoints.inspect import format_bytes
from strata.runtime.plan.host import GpuInfo, HostInfo
from strata.runtime.plan.layout import CardShare, ExpertParallelPlan, GpuPlan, PlanError
from strata.runtime.plan.stages import MIN_CONTEXT, LayerSizes, select_devices

__all__ = ["CardShare", "ExpertParallelPlan", "ExpertParallelError", "place_expert_parallel", "plan_expert_parallel",
           "stage_cold_bytes"]


class ExpertParallelError(PlanError):
    """These cards cannot hold the expert-parallel layout; the message names the card and the fix."""


def place_expert_parallel(sizes: LayerSizes, devices: list[GpuInfo], *, context: int, reserve: int, slot_bytes: int,
                          experts_per_token: int, budget: int | None = None,
                          per_layer: bool = False) -> ExpertParallelPlan:
    """The expert-parallel layout of `sizes` over `devices` (the first one listed holds the non-expert weights).

    `budget` is `tiers.gpu.budget` per card (None: "auto", what is left); `slot_bytes` one expert's GPU slot.
    Raises `ExpertParallelError` naming the card that cannot hold its part and the smallest fix.
    """
    if len(devices) < 2:
        raise ExpertParallelError("expert parallelism needs at least two GPUs; list them in runtime.devices or --gpus")
    moe_layers, experts = sum(sizes.moe), sizes.num_experts
    if not moe_layers or not experts:
        raise ExpertParallelError("the model has no routed experts to share out; split it by stages")
    first = devices[0]
    kv = sum(sizes.kv_bytes_per_token) * context
    dense = sum(sizes.layer_bytes) + sizes.embed_bytes + sizes.head_bytes
    minimum = moe_layers * slot_bytes  # on the first card: the layer being computed needs a slot
    need = dense + kv + reserve + (budget or minimum)
    if need > first.free_bytes:
        raise ExpertParallelError(_first_card_refusal(sizes, devices, context, reserve, dense, kv, budget or minimum))
    rooms = [first.free_bytes - dense - kv - reserve] + [d.free_bytes - reserve for d in devices[1:]]
    for d, room in zip(devices[1:], rooms[1:], strict=True):
        if room < 0 or (budget and room < budget):
            want = reserve + (budget or 0)
            raise ExpertParallelError(
                f"cuda:{d.index} ({format_bytes(d.free_bytes)} free) cannot hold its expert slots: reserve "
                f"({format_bytes(reserve)})" + (f" + tiers.gpu.budget ({format_bytes(budget)})" if budget else "")
                + f" = {format_bytes(want)}; lower tiers.gpu.budget, free memory on it, or drop it from --gpus")
    slots = [min(budget if budget is not None else room, room) // slot_bytes if slot_bytes else 0 for room in rooms]
    owned = _owned(slots, moe_layers, experts)
    # a card holds only experts it computes: where the cards hold every expert, each holds its own and no more
    slots = [min(s, o * moe_layers) for s, o in zip(slots, owned, strict=True)]
    if per_layer:
        slots = [s - s % moe_layers for s in slots]
    cards, start = [], 0
    for i, (d, room, s, o) in enumerate(zip(devices, rooms, slots, owned, strict=True)):
        cards.append(CardShare(f"cuda:{d.index}", d.name, d.free_bytes, dense if i == 0 else 0, kv if i == 0 else 0,
                               reserve, room, s, o, start, s / moe_layers))
        start += o
    return ExpertParallelPlan(cards, moe_layers, experts, experts_per_token, slot_bytes)


def stage_cold_bytes(stages: list[GpuPlan], sizes: LayerSizes, experts_per_token: int) -> int:
    """Expected bytes of cold experts one token moves in the stages layout (`GpuPlan.layers` per card, uniform
    routing), all over one link at a time: a stage's MoE layers miss its slots with odds 1 - slots / (layers x E)."""
    total = 0.0
    for g in stages:
        moe = sum(sizes.moe[g.layers[0]:g.layers[1]])
        if moe:
            hit = min(1.0, g.slots / (moe * sizes.num_experts))
            total += moe * experts_per_token * (1.0 - hit) * g.slot_bytes
    return int(total)


def plan_expert_parallel(fp, cfg, host: HostInfo, sizes: LayerSizes, dtype: torch.dtype, context: int,
                         stages: list[GpuPlan], notes: list[str]) -> ExpertParallelPlan | None:
    """The planner's expert-parallel layout for `runtime.devices`, beside the stages it runs (`stages`, from
    `plan_stages` on the same `sizes`): None, with a note saying why, where the cards cannot hold it. `fp` is the
    planner's `ModelFootprint`."""
    k = fp.config.num_experts_per_tok
    try:
        layout = place_expert_parallel(
            sizes, select_devices(host.gpus, cfg.runtime.devices), context=context,
            reserve=cfg.planner.activation_reserve_bytes, slot_bytes=fp.gpu_slot_bytes(dtype.itemsize),
            experts_per_token=k, budget=cfg.tiers.gpu.budget_bytes, per_layer=cfg.policy.budget_scope == "per_layer")
    except ExpertParallelError as e:
        notes.append(f"expert-parallel layout: {e}")
        return None
    layout.stage_cold_bytes = stage_cold_bytes(stages, sizes, k)
    return layout


def _owned(slots: list[int], moe_layers: int, experts: int) -> list[int]:
    """Experts of each layer each card owns: its residents a layer plus an equal share of the unheld ones (or, when
    the cards could hold every expert, in proportion to their slots, so each holds all it owns); whole numbers
    summing to `experts`, each card >= 1 where there are experts enough."""
    n = len(slots)
    resident = [s / moe_layers for s in slots]
    spare = experts - sum(resident)
    want = [r + spare / n for r in resident] if spare > 0 else [experts * r / sum(resident) for r in resident]
    whole = [int(w) for w in want]
    for i in sorted(range(n), key=lambda i: want[i] - whole[i], reverse=True)[: experts - sum(whole)]:
        whole[i] += 1  # largest remainders first
    if experts >= n:  # every card computes something: its link and cores are why it is listed
        for i in range(n):
            while whole[i] < 1:
                j = max(range(n), key=lambda j: whole[j])
                whole[j] -= 1
                whole[i] += 1
    return whole


def _first_card_refusal(sizes: LayerSizes, devices: list[GpuInfo], context: int, reserve: int, dense: int, kv: int,
                        experts: int) -> str:
    """Why the first card cannot hold the non-expert weights, and the smallest fix."""
    first = devices[0]
    need = dense + kv + reserve + experts
    msg = (f"cuda:{first.index} ({format_bytes(first.free_bytes)} free) cannot hold what the expert-parallel layout "
           f"keeps on the first card: non-expert weights ({format_bytes(dense)}) + KV cache ({format_bytes(kv)}) + "
           f"reserve ({format_bytes(reserve)}) + experts ({format_bytes(experts)}) = {format_bytes(need)}")
    per_token = sum(sizes.kv_bytes_per_token)
    fits = (first.free_bytes - dense - reserve - experts) // per_token if per_token else 0
    bigger = max(devices, key=lambda d: d.free_bytes)
    if fits >= MIN_CONTEXT:
        fits = fits // 1024 * 1024 if fits >= 1024 else fits // 16 * 16
        return f"{msg}; lower runtime.max_context to {fits}, or split by stages"
    if bigger is not first and bigger.free_bytes >= need:
        return f"{msg}; list cuda:{bigger.index} first in --gpus, or split by stages"
    return f"{msg}; split by stages, which spreads the non-expert weights over the cards"
