"""Routed experts served by the tier manager instead of held in memory.

`TieredExperts` replaces a layer's stacked `Experts`. Two paths, chosen by the step's shape:

Decode (a few tokens, GPU tier): the pair kernels (`strata.kernels.grouped`) compute every
(token, expert) pair whose expert is resident, finding its slot through the device map, in one
launch per projection. When every expert is resident that is the whole layer: no host round trip,
so the step can be captured in a CUDA graph. Otherwise one small copy of the step's slots tells the
host which pairs are cold; the cost model splits those between
- CPU threads computing straight from pinned RAM, concurrently with the GPU (`cpu_numerics = "fork"`),
  with only the activations crossing PCIe, and
- copies into GPU slots, computed by the same pair kernels once the copy has landed.
Pair outputs are combined in one fixed order, so which tier served an expert never changes the result
(except the forked CPU kernel's rounding).

Prefill and large batches: tokens are grouped by expert and each expert acquired on the GPU runs as
one GEMM over its tokens; every cold expert crosses PCIe once per forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch
from torch import nn

from strata.kernels.experts import apply_experts, group_by_expert
from strata.kernels.grouped import combine_pairs, pair_experts, use_pair_kernels
from strata.runtime.cost_model import split_cold
from strata.runtime.expert_compute import ExpertCompute
from strata.runtime.graphs import current_recorder
from strata.runtime.model import MoETransformer
from strata.runtime.moe import MoEBlock

__all__ = ["ExpertCompute", "TieredExperts", "use_tiered_experts", "router_predictors"]


class TieredExperts(nn.Module):
    """One MoE layer's routed experts, fetched from tiers; same math as `Experts`."""

    def __init__(self, layer: int, num_experts: int, compute: ExpertCompute):
        super().__init__()
        self.layer, self.num_experts, self.compute = layer, num_experts, compute

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c, k = self.compute, ids.shape[1]
        if use_pair_kernels(x, ids.numel()) if c.pair_path is None else c.pair_path:
            return self._decode_forward(x, ids, weights)
        groups = group_by_expert(ids, self.num_experts)  # syncs: predictions have arrived too
        if c.prefetcher is not None:
            c.prefetcher.poll()
        if c.device_tier == "cpu":
            if x.device.type == "cpu" and not c.use_fast_cpu:
                return self._tier_forward(x, weights, k, groups, "cpu")
            y = c.cpu_forward(self.layer, x.cpu(), weights.cpu(), k, [(e, s.cpu()) for e, s in groups])
            return y.to(x.device, x.dtype)
        cpu_part: Future | None = None
        if c.use_split:
            cpu_groups, groups = self._plan_split(groups)
            if cpu_groups:  # activations cross PCIe (small); weights stay in host RAM
                x_host, w_host = x.float().cpu(), weights.cpu()
                cpu_groups = [(e, s.cpu()) for e, s in cpu_groups]
                cpu_part = c.pool.submit(c.cpu_forward, self.layer, x_host, w_host, k, cpu_groups)
        out = self._tier_forward(x, weights, k, groups, "gpu")
        if cpu_part is not None:
            out = out + cpu_part.result().to(out.device, out.dtype)
        return out

    # ---- decode: pair kernels over slots -------------------------------------------------------
    def _decode_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c = self.compute
        flat = ids.reshape(-1)  # [P] pair p = token p // k, its (p % k)-th expert
        y = torch.zeros((flat.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
        if c.slots is not None:
            used = pair_experts(x, c.slots, c.slot_of[self.layer], flat, y)  # resident pairs, no host sync
            if c.all_resident():
                c.count_lookups(self.layer, flat)
                return combine_pairs(y, weights).to(x.dtype)
        else:  # no GPU tier: every pair is computed on the CPU
            used = torch.full_like(flat, -1, dtype=torch.int32)
        both = torch.stack((flat.to(torch.int32), used))  # [2, P] expert and slot used per pair
        cpu_out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # the CPU's weighted partial sum
        cold = lambda: self._cold_stage(x, weights, y, both, cpu_out)  # noqa: E731
        recorder = current_recorder()
        if recorder is None:
            cold()
        else:  # inside a segmented CUDA-graph capture: the host work runs between replays
            recorder.host_step(cold)
        return (combine_pairs(y, weights) + cpu_out).to(x.dtype)

    def _cold_stage(self, x, weights, y, both, cpu_out) -> None:
        """Host work of a decode layer: learn which pairs were cold, serve them, count the lookups."""
        c = self.compute
        experts, slots = _to_host(both).numpy()  # one small copy; the GPU keeps computing meanwhile
        if c.slots is not None:
            c.manager.note_hits(self.layer, np.unique(experts[slots >= 0]))  # before evictions: recency counts
        cold: dict[int, list[int]] = {}
        for p in np.flatnonzero(slots < 0):
            cold.setdefault(int(experts[p]), []).append(int(p))
        cpu_part = self._cold_decode(x, weights, y, {e: np.asarray(v) for e, v in sorted(cold.items())}) if cold else None
        if c.prefetcher is not None:
            c.prefetcher.poll()  # after the layer's own misses, so they go first
        if cpu_part is not None:
            cpu_out.copy_(cpu_part.result())

    def _cold_decode(self, x, weights, y, cold: dict[int, np.ndarray]) -> Future | None:
        """Cold pairs: part on CPU threads (returns their partial sum), the rest copied and computed here."""
        c, k = self.compute, weights.shape[1]
        on_cpu: set[int] = set(cold) if c.slots is None else set()
        if c.use_split and c.slots is not None:
            on_cpu = self._cpu_share({e: len(p) for e, p in cold.items()})
        cpu_part = None
        if on_cpu:
            groups = [(e, torch.from_numpy(cold[e])) for e in sorted(on_cpu)]
            args = (self.layer, x.float().cpu(), weights.cpu(), k, groups)
            cpu_part = c.pool.submit(c.cpu_forward, *args) if c.pool is not None else _done(c.cpu_forward(*args))
        to_copy = [e for e in cold if e not in on_cpu]
        if not to_copy:
            return cpu_part
        chunk = c.manager.max_acquire("gpu")
        for i in range(0, len(to_copy), chunk):
            part = to_copy[i : i + chunk]
            handles = c.manager.acquire([(self.layer, e) for e in part], "gpu")
            try:
                pair_slots, pair_rows = [], []
                for h in handles:
                    h.wait()  # the compute stream waits for the copy; the host does not
                    rows = cold[h.key[1]]
                    pair_rows.append(rows)
                    pair_slots.append(np.full(len(rows), h.slot, dtype=np.int32))
                slots_t = torch.from_numpy(np.concatenate(pair_slots)).to(x.device, non_blocking=True)
                rows_t = torch.from_numpy(np.concatenate(pair_rows).astype(np.int32)).to(x.device, non_blocking=True)
                pair_experts(x, c.slots, c.identity, slots_t, y, rows=rows_t)
            finally:
                c.manager.release(handles)  # later copies into these slots wait for the kernels above
        return cpu_part

    # ---- prefill: experts grouped by token ------------------------------------------------------
    def _cpu_share(self, tokens: dict[int, int]) -> set[int]:
        """Which cold experts (expert -> tokens routed to it) the cost model sends to the CPU: measured rates,
        and copies already queued (e.g. prefetches) counted against the copy path."""
        c = self.compute
        c.rates.pcie_bytes_per_s = c.manager.observed_rate("pinned->gpu", c.rates.pcie_bytes_per_s)
        nbytes = c.manager.store.payload_bytes
        backlog = c.manager.gpu_transfers_in_flight() * nbytes / c.rates.pcie_bytes_per_s
        return set(split_cold(tokens, nbytes, c.rates, in_flight_copy_s=backlog).cpu)

    def _plan_split(self, groups):
        """Resident experts stay on the GPU; cold ones are split between CPU compute and copies."""
        resident = self.compute.manager.resident_experts(self.layer, "gpu")
        cold = {e: len(sel) for e, sel in groups if e not in resident}
        if not cold:
            return [], groups
        on_cpu = self._cpu_share(cold)
        return [g for g in groups if g[0] in on_cpu], [g for g in groups if g[0] not in on_cpu]

    def _tier_forward(self, x, weights, k, groups, device_tier: str) -> torch.Tensor:
        """Experts acquired on `device_tier` and computed where x lives, in ascending order."""
        manager = self.compute.manager
        chunk = manager.max_acquire(device_tier)  # a budget smaller than the step is served in chunks
        out = torch.zeros_like(x)
        for i in range(0, len(groups), chunk):
            part = groups[i : i + chunk]
            handles = manager.acquire([(self.layer, e) for e, _ in part], device_tier)
            try:
                by_expert = {}
                for h in handles:
                    h.wait()
                    by_expert[h.key[1]] = (h.gate_up.to(x.dtype), h.down.to(x.dtype))
                apply_experts(x, weights, k, part, by_expert.__getitem__, out=out)
            finally:
                manager.release(handles)
        return out


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host: one asynchronous copy into pinned memory, then wait for that copy only."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    ready.synchronize()
    return host


def use_tiered_experts(model: MoETransformer, compute: ExpertCompute) -> None:
    """Swap every MoE layer's stacked experts for tier-served ones (before weights are loaded)."""
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp.experts = TieredExperts(i, model.cfg.num_experts, compute)


def router_predictors(model: MoETransformer) -> dict[int, Callable[[torch.Tensor], torch.Tensor]]:
    """layer -> f(hidden [N, H]) -> predicted expert ids [N, k], applying that layer's norm and router early."""
    out = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            norm, router = layer.post_attention_layernorm, layer.mlp.gate
            out[i] = lambda h, norm=norm, router=router: router(norm(h))[1]
    return out
