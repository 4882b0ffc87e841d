"""What the planner decides for a model on a host: `Plan` (per tier and GPU, `TierPlan` and `GpuPlan`), and
`PlanError` when the model does not fit. Made by strata.runtime.plan.planner (one GPU) with
strata.runtime.plan.stages (several)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from strata.errors import StrataError
from strata.runtime.plan.checkpoints.inspect import format_bytes
from strata.runtime.plan.engram import EngramPlan
from strata.runtime.plan.host import HostInfo


class PlanError(StrataError):
    """The model does not fit this host with this configuration; the message names the fix."""


@dataclass
class GpuPlan:
    """One GPU's memory: what is resident before experts, and the expert slots after."""

    device: str  # "cuda:N"
    name: str
    free_bytes: int
    non_expert_bytes: int  # in the compute dtype
    kv_bytes: int
    reserve_bytes: int
    expert_room_bytes: int  # free - non-expert - KV - reserve
    slot_bytes: int  # one expert in the compute dtype
    slots: int
    expert_bytes: int  # slots * slot_bytes
    layers: list[int] = field(default_factory=list)  # [first, end) of its stage over several GPUs; [] = all


@dataclass
class CardShare:
    """One card's part of the expert-parallel layout."""

    device: str  # "cuda:N"
    name: str
    free_bytes: int
    non_expert_bytes: int  # the first card: every non-expert weight; the others: none
    kv_bytes: int  # the first card only
    reserve_bytes: int
    expert_room_bytes: int  # free - non-expert - KV - reserve
    slots: int  # expert slots on this card, shared out over every MoE layer
    owned: int  # experts of each MoE layer (one contiguous id range) whose pairs this card computes
    first_expert: int  # the range's first id: experts [first_expert, first_expert + owned)
    resident: float  # slots / MoE layers: the owned experts a layer finds on this card (the rest are cold)


@dataclass
class ExpertParallelPlan:
    """Every card's share, and the cold expert bytes one token moves over each card's link."""

    cards: list[CardShare]
    moe_layers: int
    experts_per_layer: int
    experts_per_token: int
    slot_bytes: int
    stage_cold_bytes: int = 0  # the same token's cold bytes in the stages layout, over one link at a time (0: unknown)

    @classmethod
    def from_dict(cls, d: dict) -> ExpertParallelPlan:
        """Rebuild from `dataclasses.asdict` output."""
        return cls(**{**d, "cards": [CardShare(**c) for c in d["cards"]]})

    def cold_bytes_per_link(self) -> int:
        """Expected bytes of cold experts one token moves over the busiest card's link (uniform routing): each card
        reads its owned experts that it does not hold, with odds k / E each, in every MoE layer."""
        k_over_e = self.experts_per_token / self.experts_per_layer
        return int(max(self.moe_layers * k_over_e * max(0.0, c.owned - c.resident) * self.slot_bytes
                       for c in self.cards))

    def describe(self) -> list[str]:
        """`strata plan`'s lines for this layout, with the stages' cold bytes beside its own where known."""
        f = format_bytes
        lines = [f"{self.cards[0].device} holds every non-expert weight and the KV cache; each MoE layer's "
                 f"{self.experts_per_layer} experts are split over the {len(self.cards)} cards:"]
        for c in self.cards:
            lines.append(f"  {c.device} {c.name}: experts {c.first_expert}-{c.first_expert + c.owned - 1} of each layer, "
                         f"{c.slots} slots ({f(c.slots * self.slot_bytes)}, {c.resident:.1f} a layer)")
        per_link = self.cold_bytes_per_link()
        line = f"one token's cold experts: {f(per_link)} over each card's link at once"
        if self.stage_cold_bytes:
            ratio = f" ({self.stage_cold_bytes / per_link:.2f}x)" if per_link else ""
            line += f", against {f(self.stage_cold_bytes)} over one link at a time in stages{ratio}"
        return lines + [line]


@dataclass
class TierPlan:
    """One tier: the bytes it may use, the experts it holds, the share of lookups it serves."""

    name: str  # gpu | pinned | tmpfs | disk
    budget_bytes: int
    slots: int  # experts held (tmpfs: whole layers; disk: all)
    bytes: int  # bytes used, <= budget_bytes
    fraction: float  # expected share of expert lookups under uniform routing, hottest tier first
    path: str = ""


@dataclass
class Plan:
    """Where a model's experts live on a host. `to_dict()` for JSON, `format()` for people."""

    model_dir: str
    source: str
    model_type: str
    moe_layers: int
    experts_per_layer: int
    experts_per_token: int
    expert_bytes: int  # one expert as stored
    slot_bytes: int  # one expert's slot in the host tiers
    compute_device: str  # "cuda:N" | "cpu"
    compute_dtype: str
    expert_compute: str  # "gpu" | "cpu": where routed experts are computed
    max_context: int
    max_batch: int
    kv_bytes: int
    non_expert_bytes: int  # in the compute dtype
    ram_margin_bytes: int
    budget_scope: str
    store_bytes: int
    store_exists: bool
    gpus: list[GpuPlan]
    tiers: list[TierPlan]
    host: HostInfo
    notes: list[str] = field(default_factory=list)
    engram: EngramPlan | None = None  # models with Engram tables: their tier and what they take
    prefill_chunk: int = 512  # prompt tokens a prefill pass takes (runtime.prefill_chunk, "auto" resolved)
    store_dir: str = ""  # where the store is, or will be built ("" when not given)
    expert_format: str = "bf16"  # the routed experts' format in the store: "bf16", "fp8 128x128", "mxfp4"
    dense_format: str = ""  # the resident weights' formats as stored, e.g. "bf16 + fp8 128x128"
    store_mode: str = "packed"  # "in_place": experts read from the checkpoint's own files; "packed": a store
    store_why: str = ""  # why that mode ([store] mode, or what ruled in place out)
    decode: str = ""  # how decode steps compute the experts (strata.runtime.plan.decode_modes)
    decode_graphs: bool = True  # whether they may run as CUDA graphs (False: a fallback that needs the host)
    kv_bytes_per_1k: int = 0  # one sequence's KV cache growth per 1,024 tokens of context
    # what `strata plan` found not to fit, each with the smallest change that would (serve refuses these)
    does_not_fit: list[str] = field(default_factory=list)
    # several GPUs: every card on every MoE layer (strata.runtime.plan.expert_parallel), beside the stages run today
    expert_parallel: ExpertParallelPlan | None = None

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.experts_per_layer

    def tier(self, name: str) -> TierPlan:
        """The plan of tier `name` (gpu, pinned, tmpfs, disk)."""
        return next(t for t in self.tiers if t.name == name)

    def budgets(self) -> dict[str, Any]:
        """The tier manager's budgets: `TierBudgets(**plan.budgets())`."""
        return {"gpu_slots": self.tier("gpu").slots, "pinned_slots": self.tier("pinned").slots,
                "tmpfs_bytes": self.tier("tmpfs").bytes, "per_layer": self.budget_scope == "per_layer"}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`Plan.from_dict` reverses it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Rebuild a plan from `to_dict()` output (e.g. after a JSON round trip)."""
        return cls(**{**d, "gpus": [GpuPlan(**g) for g in d["gpus"]], "tiers": [TierPlan(**t) for t in d["tiers"]],
                      "host": HostInfo.from_dict(d["host"]),
                      "engram": EngramPlan(**d["engram"]) if d.get("engram") else None,
                      "expert_parallel": (ExpertParallelPlan.from_dict(d["expert_parallel"])
                                          if d.get("expert_parallel") else None)})

    def format(self) -> str:
        """A multi-line report for the terminal."""
        f = format_bytes
        lines = [f"plan for {self.model_dir} ({self.model_type} {self.source})"]
        lines.append(f"  experts      {self.moe_layers} MoE layers x {self.experts_per_layer} = {self.total_experts} "
                     f"of {f(self.expert_bytes)} ({self.expert_format}), {self.experts_per_token} per token")
        dense = f"dense {self.dense_format}: " if self.dense_format else "dense: "
        lines.append(f"  formats      experts {self.expert_format}: {f(self.total_experts * self.expert_bytes)}, {dense}"
                     f"{f(self.non_expert_bytes)} in {self.compute_dtype} once loaded")
        where = "the GPU" if self.expert_compute == "gpu" else "the CPU, from RAM"
        lines.append(f"  compute      {self.compute_device} in {self.compute_dtype}; experts compute on {where}")
        if self.decode:
            lines.append(f"  decode       {self.decode}")
        for g in self.gpus:
            lines.append(f"  {g.device:<12} {g.name}: {f(g.free_bytes)} free = non-expert weights {f(g.non_expert_bytes)}"
                         f" + KV cache {f(g.kv_bytes)} + reserve {f(g.reserve_bytes)} + experts {f(g.expert_room_bytes)}")
            if g.layers:
                lines.append(f"  {'':<12} layers {g.layers[0]}-{g.layers[1] - 1}: {g.slots} expert slots ({f(g.expert_bytes)})")
        per_1k = f" ({f(self.kv_bytes_per_1k)} per 1K tokens a sequence)" if self.kv_bytes_per_1k else ""
        lines.append(f"  KV cache     {self.max_batch} x {self.max_context} tokens, {f(self.kv_bytes)}{per_1k}")
        lines.append(f"  prefill      chunks of up to {self.prefill_chunk} prompt tokens (each cold expert moves once a chunk)")
        if self.engram is not None:
            lines.append(f"  engram       {self.engram.describe()}")
        lines.append(f"  {'tier':<12} {'experts':>8} {'bytes':>12} {'budget':>12} {'lookups':>8}")
        for t in self.tiers:
            lines.append(f"  {t.name:<12} {t.slots:>8} {f(t.bytes):>12} {f(t.budget_bytes):>12} {100 * t.fraction:>7.1f}%"
                         + (f"  {t.path}" if t.path else ""))
        if self.store_mode == "in_place":
            lines.append(f"  store        in place: the checkpoint's own files, no extra disk ({self.store_why})")
        else:
            at = f" at {self.store_dir}" if self.store_dir else ""
            state = f"existing{at}" if self.store_exists else f"built on first use{at} ({f(self.host.disk_free)} free there)"
            why = f"; packed: {self.store_why}" if self.store_why else ""
            lines.append(f"  store        {f(self.store_bytes)}, {state}{why}")
        lines.append(f"  RAM          {f(self.host.ram_available)} available of {f(self.host.ram_total)}, "
                     f"{f(self.ram_margin_bytes)} kept free")
        if self.expert_parallel is not None:
            lines.append("  split        stages: contiguous layers, one card at a time (the runtime's layout)")
            lines += [f"  {'':<12} {x}" for x in ["expert-parallel, planned (not run yet): " + self.expert_parallel.describe()[0],
                                              *self.expert_parallel.describe()[1:]]]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes]
                         + [f"  does not fit: {n}" for n in self.does_not_fit])
