"""One model over several GPUs of a host: contiguous stages of layers, one per card, sized by free memory.

    sizes = layer_sizes(model_config, torch.bfloat16, batch=1)            # bytes per layer, from shapes alone
    stages = place_stages(sizes, [DeviceInfo(0, "A", 96 * GiB, 96 * GiB), DeviceInfo(1, "B", 24 * GiB, 24 * GiB)],
                          context=4096, reserve=2 * GiB, slot_bytes=expert_bytes, budget=None)

Every card holds the non-expert weights of its stage's layers (attention, dense MLPs, shared experts,
routers, norms), their KV cache and `planner.activation_reserve`; the first card also holds the
embeddings, the last one the final norm and lm_head. What is left on a card is its GPU expert-slot
budget, for its own layers only. The split maximises the smallest expert budget per MoE layer over the
cards (uniform routing: every layer is worth the same), so a 96 GB card takes more layers than a
24 GB one. Activations cross a stage boundary once per step: peer-to-peer where the cards can reach
each other, through host memory where they cannot (`link_kind` tells which; nothing is assumed).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from strata.runtime.model.config import ModelConfig
from strata.runtime.plan.checkpoints.inspect import format_bytes
from strata.runtime.plan.host import GpuInfo, HostInfo
from strata.runtime.plan.layout import GpuPlan, PlanError

DeviceInfo = GpuInfo  # one CUDA card: index, name, total_bytes, free_bytes (real, or simulated for planning)
MIN_CONTEXT = 16


class PlacementError(PlanError):
    """The layers cannot be split over these cards; the message names the card and the fix."""


@dataclass
class LayerSizes:
    """Bytes each part of a model takes on its card, in the compute dtype."""

    layer_bytes: list[int]  # [L] non-expert weights of each decoder layer (plus its experts when resident)
    moe: list[bool]  # [L] the layer has routed experts (served from expert slots)
    kv_bytes_per_token: list[int]  # [L] KV cache bytes of one token position, all batch sequences
    embed_bytes: int  # embed_tokens: on the first card
    head_bytes: int  # final norm + lm_head: on the last card
    num_experts: int = 0  # routed experts per MoE layer

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)


def layer_sizes(cfg: ModelConfig, dtype: torch.dtype, batch: int = 1, experts: bool = False) -> LayerSizes:
    """Per-layer bytes of `cfg`'s model as strata loads it (shapes from a meta-device build, no weights).

    `experts=True` counts routed experts and Engram tables inside their layers (`runtime.experts = "memory"`).
    """
    from strata.runtime.model.kv_cache import KVCache
    from strata.runtime.model.loader import FP32_SUFFIXES
    from strata.runtime.model.transformer import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(cfg)
    item = torch.empty((), dtype=dtype).element_size()
    fp32_router = cfg.fp32_router  # kept in fp32 by the loader

    def nbytes(prefix: str, module: torch.nn.Module) -> int:
        total = 0
        for name, p in module.named_parameters(prefix=prefix):
            if (".mlp.experts." in name or ".engram.multi_head_embedding." in name) and not experts:
                continue  # tiered: experts and Engram tables live in the tiers, not with the layer
            total += p.numel() * (4 if fp32_router and name.endswith(FP32_SUFFIXES) else item)
        return total

    kv = KVCache.bytes_per_token(cfg, dtype) // max(1, cfg.num_layers) * batch
    return LayerSizes(
        layer_bytes=[nbytes(f"layers.{i}", layer) for i, layer in enumerate(model.layers)],
        moe=[bool(m) for m in cfg.moe_layers], kv_bytes_per_token=[kv] * cfg.num_layers,
        embed_bytes=nbytes("embed_tokens", model.embed_tokens),
        head_bytes=nbytes("norm", model.norm) + nbytes("lm_head", model.lm_head), num_experts=cfg.num_experts,
    )  # fmt: skip


@dataclass
class Stage:
    """One card's share of the model: layers [start, end) and what is left for its expert slots."""

    device: str  # "cuda:N"
    index: int
    name: str
    free_bytes: int
    start: int
    end: int
    moe_layers: int  # MoE layers in [start, end)
    non_expert_bytes: int  # the stage's weights, with embeddings (first) or norm + lm_head (last)
    kv_bytes: int
    reserve_bytes: int
    expert_room_bytes: int  # free - weights - KV - reserve
    expert_budget_bytes: int  # tiers.gpu.budget, or the room when "auto"
    slot_bytes: int  # one expert in the compute dtype
    slots: int  # expert slots on this card, for this stage's layers only

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


@dataclass
class _Split:
    """Prefix sums of a LayerSizes at one context length, and the per-stage arithmetic."""

    sizes: LayerSizes
    devices: list[DeviceInfo]
    context: int
    reserve: int
    slot: int
    budget: int | None  # per card; None = auto, 0 = no expert slots

    def __post_init__(self) -> None:
        s, self.w, self.kv, self.m = self.sizes, [0], [0], [0]
        for b, t, moe in zip(s.layer_bytes, s.kv_bytes_per_token, s.moe, strict=True):
            self.w.append(self.w[-1] + b)
            self.kv.append(self.kv[-1] + t * self.context)
            self.m.append(self.m[-1] + int(moe))

    def fixed(self, p: int) -> int:
        """Bytes card `p` needs whatever its layers: reserve, embeddings (first), norm + lm_head (last)."""
        k = len(self.devices)
        return self.reserve + (self.sizes.embed_bytes if p == 0 else 0) + (self.sizes.head_bytes if p == k - 1 else 0)

    def need(self, p: int, a: int, b: int) -> int:
        """Bytes card `p` needs before experts for layers [a, b)."""
        return self.fixed(p) + self.w[b] - self.w[a] + self.kv[b] - self.kv[a]

    def minimum_experts(self, a: int, b: int) -> int:
        """One slot per MoE layer (the layer being computed needs somewhere to put an expert), or none."""
        return 0 if self.budget == 0 else (self.m[b] - self.m[a]) * self.slot

    def score(self, p: int, a: int, b: int) -> float | None:
        """Expert bytes per MoE layer card `p` gives layers [a, b) (None: they do not fit)."""
        room = self.devices[p].free_bytes - self.need(p, a, b)
        m = self.m[b] - self.m[a]
        if room < self.minimum_experts(a, b) or (m and self.budget and room < self.budget) or room < 0:
            return None
        if not self.slot or self.budget == 0:
            return float(room)  # no expert slots: balance the headroom
        if not m:
            return float("inf")
        # uncapped even when every expert would fit: the spare room then balances like the slots would
        return (room if self.budget is None else self.budget) / m

    def greedy(self, t: float) -> list[int] | None:
        """Stage ends giving every card a score >= t, each card taking as many layers as it can (None: none)."""
        n, k, ends, a = self.sizes.num_layers, len(self.devices), [], 0
        for p in range(k - 1):
            best = None
            for b in range(a + 1, n - (k - 1 - p) + 1):  # leave at least one layer to each later card
                s = self.score(p, a, b)
                if s is None or s < t:
                    break  # adding layers only lowers the score
                best = b
            if best is None:
                return None
            ends.append(best)
            a = best
        s = self.score(k - 1, a, n)
        return ends + [n] if s is not None and s >= t else None


def place_stages(sizes: LayerSizes, devices: list[DeviceInfo], *, context: int, reserve: int, slot_bytes: int,
                 budget: int | None = None, per_layer: bool = False) -> list[Stage]:
    """Split `sizes`' layers into one contiguous stage per card of `devices` (in that order).

    `budget` is `tiers.gpu.budget` per card (None: "auto", 0: no expert slots); `slot_bytes` one expert
    in the compute dtype (0: experts are not slotted). Raises `PlacementError` naming the card that
    cannot hold its stage and the smallest fix.
    """
    if len(devices) < 2:
        raise PlacementError("a split needs at least two GPUs; list them in runtime.devices or --gpus")
    if sizes.num_layers < len(devices):
        raise PlacementError(f"the model has {sizes.num_layers} layers, fewer than the {len(devices)} GPUs listed; "
                             f"list at most {sizes.num_layers} in --gpus")
    split = _Split(sizes, devices, context, reserve, slot_bytes, budget)
    if split.greedy(0.0) is None:
        raise PlacementError(_refusal(split))
    lo, hi = 0.0, float(max(d.free_bytes for d in devices))
    for _ in range(60):  # the best smallest score, to within a byte
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if split.greedy(mid) is not None else (lo, mid)
        if hi - lo < 1:
            break
    ends = split.greedy(lo)
    stages, a = [], 0
    for p, (dev, b) in enumerate(zip(devices, ends, strict=True)):
        need, m = split.need(p, a, b), split.m[b] - split.m[a]
        room = dev.free_bytes - need
        kv = split.kv[b] - split.kv[a]
        expert_budget = room if budget is None else budget if m else 0
        slots = min(expert_budget // slot_bytes, m * sizes.num_experts) if slot_bytes and budget != 0 else 0
        if per_layer and m:
            slots -= slots % m  # per-layer budgets split evenly: only whole rounds of layers count
        stages.append(Stage(f"cuda:{dev.index}", dev.index, dev.name, dev.free_bytes, a, b, m, need - reserve - kv,
                            kv, reserve, room, expert_budget, slot_bytes, slots))
        a = b
    return stages


def _refusal(split: _Split) -> str:
    """Why the cards cannot hold the model even with one expert per layer, and the smallest fix."""
    n, k, a = split.sizes.num_layers, len(split.devices), 0
    p, b = k - 1, n
    for q in range(k - 1):  # where the greedy split breaks: a card that cannot take another layer
        fits = [b for b in range(a + 1, n - (k - 1 - q) + 1) if split.score(q, a, b) is not None]
        if not fits:
            p, b = q, a + 1
            break
        a = max(fits)
    dev = split.devices[p]
    kv = split.kv[b] - split.kv[a]
    extra = " + embeddings" if p == 0 else ""
    extra += " + norm and lm_head" if p == k - 1 else ""
    budgeted = bool(split.budget) and split.m[b] > split.m[a]  # an explicit budget must fit next to the layers
    experts = split.budget if budgeted else split.minimum_experts(a, b)
    span = f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}"
    need = split.need(p, a, b) + experts
    msg = (f"cuda:{dev.index} ({format_bytes(dev.free_bytes)} free) cannot hold its stage, {span}: non-expert "
           f"weights{extra} ({format_bytes(split.need(p, a, b) - split.reserve - kv)}) + KV cache ({format_bytes(kv)}) "
           f"+ reserve ({format_bytes(split.reserve)})")
    if experts:
        msg += f" + {'tiers.gpu.budget' if budgeted else 'one expert per MoE layer'} ({format_bytes(experts)})"
    total = sum(d.free_bytes for d in split.devices)
    return f"{msg} = {format_bytes(need)} (the {k} cards have {format_bytes(total)} free in all); {_fix(split)}"


def _fix(split: _Split) -> str:
    """The smallest change that makes the split fit: a shorter context, no GPU expert slots, more cards."""
    lo, hi = MIN_CONTEXT, split.context
    if _Split(split.sizes, split.devices, lo, split.reserve, split.slot, split.budget).greedy(0.0) is not None:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = _Split(split.sizes, split.devices, mid, split.reserve, split.slot, split.budget).greedy(0.0)
            lo, hi = (mid, hi) if ok is not None else (lo, mid - 1)
        fits = lo // 1024 * 1024 if lo >= 1024 else lo // 16 * 16  # a round number users would type
        return f"lower runtime.max_context to {fits}, add a GPU to --gpus, or free memory on the cards"
    if split.budget != 0 and _Split(split.sizes, split.devices, split.context, split.reserve, split.slot, 0).greedy(0.0):
        return 'set tiers.gpu.budget = "0" (experts compute on the CPU), add a GPU to --gpus, or free memory on the cards'
    return "add a GPU to --gpus, use cards with more free memory, or lower planner.activation_reserve"


def select_devices(gpus: list[DeviceInfo], indices: list[int]) -> list[DeviceInfo]:
    """The cards of `indices`, in that order, from the probed (or simulated) `gpus`."""
    by_index = {g.index: g for g in gpus}
    missing = [i for i in indices if i not in by_index]
    if missing:
        have = f"GPUs {', '.join(str(g.index) for g in gpus)}" if gpus else "no CUDA GPU"
        raise PlacementError(f"runtime.devices lists GPU {missing[0]} but this host has {have}; list GPUs it has "
                             "(`strata plan --gpus ... --gpu-mem SIZE[,SIZE...]` plans another machine)")
    return [by_index[i] for i in indices]


def simulate_gpus(host: HostInfo, indices: list[int], mems: list[int]) -> HostInfo:
    """`host` with cards `indices` of `mems` free bytes each (one size for all, or one per card), for `strata plan`."""
    indices = indices or list(range(len(mems)))
    if len(mems) not in (1, len(indices)):
        raise PlacementError(f"--gpu-mem gives {len(mems)} sizes for {len(indices)} GPUs; give one, or one per GPU")
    sizes = mems * len(indices) if len(mems) == 1 else mems
    gpus = [DeviceInfo(i, "--gpu-mem", m, m) for i, m in zip(indices, sizes, strict=True) if m > 0]
    return replace(host, gpus=gpus)


def link_kind(a: int, b: int) -> str:
    """How activations go from card `a` to card `b`: "peer" (NVLink or PCIe peer-to-peer), "host" (staged
    through host memory by the driver), or "unknown" (not a CUDA device of this process)."""
    if not torch.cuda.is_available() or max(a, b) >= torch.cuda.device_count():
        return "unknown"
    if a == b:
        return "same"
    return "peer" if torch.cuda.can_device_access_peer(a, b) else "host"


def plan_stages(fp, cfg, host: HostInfo, sizes: LayerSizes, dtype: torch.dtype, context: int,
                notes: list[str]) -> tuple[list[GpuPlan], int]:
    """The planner's GPU side for `runtime.devices`: one `GpuPlan` per card, and the summed expert budget.

    `fp` is the planner's `ModelFootprint` (strata.runtime.plan.footprint), `sizes` its `layer_sizes` for the batch's
    sequences; notes about the split and the links are appended to `notes`.
    """
    slot = fp.gpu_slot_bytes(torch.empty((), dtype=dtype).element_size())
    stages = place_stages(sizes, select_devices(host.gpus, cfg.runtime.devices), context=context,
                          reserve=cfg.planner.activation_reserve_bytes, slot_bytes=slot,
                          budget=cfg.tiers.gpu.budget_bytes, per_layer=cfg.policy.budget_scope == "per_layer")
    for x, y in itertools.pairwise(stages):
        kind = link_kind(x.index, y.index)
        how = {"peer": "peer-to-peer", "host": "through host memory (no peer access)"}.get(kind, "link not probed")
        notes.append(f"stage hop {x.device} -> {y.device} after layer {x.end - 1}: {how}")
    gpus = [GpuPlan(s.device, s.name, s.free_bytes, s.non_expert_bytes, s.kv_bytes, s.reserve_bytes,
                    s.expert_room_bytes, s.slot_bytes, s.slots, s.slots * s.slot_bytes, layers=[s.start, s.end])
            for s in stages]
    return gpus, sum(s.expert_budget_bytes for s in stages)
