"""Routed experts served by the tier manager instead of held in memory.

`TieredExperts` replaces a layer's stacked `Experts`. Per step it groups tokens by expert, then:
- experts resident in VRAM (and those the cost model sends over PCIe) are acquired on the GPU tier
  and computed there; the compute stream waits on each copy's event, the host does not;
- with CPU compute allowed (`runtime.cpu_numerics = "fork"`), part of the cold experts are computed
  on CPU threads straight from pinned RAM, concurrently with the GPU's work, with only the small
  activations crossing PCIe each way; the split keeps both paths busy and finishing together;
- on CPU-only hosts every expert is computed from RAM.
`router_predictors` gives the prefetcher each MoE layer's router, so the hidden state after layer l
predicts the experts of the layers ahead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from strata.kernels.experts import apply_experts, group_by_expert
from strata.runtime.cost_model import Rates, split_cold
from strata.runtime.model import MoETransformer
from strata.runtime.moe import MoEBlock
from strata.tiers.manager import TierManager


class ExpertCompute:
    """What all tiered layers of a model share: the manager, the CPU worker, the measured rates."""

    def __init__(self, manager: TierManager, device_tier: str, cpu_numerics: str = "fork"):
        self.manager, self.device_tier = manager, device_tier
        self.fast_cpu = cpu_numerics == "fork"  # compiled CPU kernel; "gpu": the reference math only
        # CPU compute next to a GPU tier only in "fork" mode: "gpu" numerics force cold experts onto the GPU
        self.split = device_tier == "gpu" and self.fast_cpu
        self.rates = Rates()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-experts") if self.split else None
        self.cpu_experts = 0  # experts computed on the CPU (statistics)
        # set by the scheduler around a step of reproducible requests: cold experts go to the GPU
        # (GPU hosts) or through the reference math (CPU hosts), never through the forked CPU kernel
        self.reproducible = False

    @property
    def use_split(self) -> bool:
        return self.split and not self.reproducible

    @property
    def use_fast_cpu(self) -> bool:
        return self.fast_cpu and not self.reproducible

    def cpu_forward(self, layer: int, x: torch.Tensor, weights: torch.Tensor, k: int, groups) -> torch.Tensor:
        """Experts of `groups` from host RAM on the CPU: x [N, H] on the CPU -> partial sum [N, H] fp32."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        chunk = self.manager.max_acquire("cpu")
        t0, nbytes = time.perf_counter(), 0
        for i in range(0, len(groups), chunk):
            part = groups[i : i + chunk]
            handles = self.manager.acquire([(layer, e) for e, _ in part], "cpu")
            try:
                by_expert = {h.key[1]: (h.gate_up, h.down) for h in handles}
                nbytes += sum(h.gate_up.nbytes + h.down.nbytes for h in handles)
                _cpu_apply(x, weights, k, part, by_expert, out, self.use_fast_cpu)
            finally:
                self.manager.release(handles)
        self.cpu_experts += len(groups)
        self.rates.observe_cpu(nbytes, time.perf_counter() - t0)
        return out


def _cpu_apply(x, weights, k, groups, by_expert, out, fast: bool) -> None:
    """One chunk of CPU experts, added into out: the compiled kernel, or the reference math."""
    if fast:
        from strata.kernels.cpu_experts import cpu_experts_forward

        flat_w = weights.reshape(-1).float()
        cpu_experts_forward(x, [by_expert[e] for e, _ in groups], [sel // k for _, sel in groups],
                            [flat_w[sel] for _, sel in groups], out=out)
        return
    apply_experts(x.float(), weights.float(), k, groups, lambda e: tuple(w.float() for w in by_expert[e]), out=out)


class TieredExperts(nn.Module):
    """One MoE layer's routed experts, fetched from tiers; same math as `Experts`."""

    def __init__(self, layer: int, num_experts: int, compute: ExpertCompute):
        super().__init__()
        self.layer, self.num_experts, self.compute = layer, num_experts, compute

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c, k = self.compute, ids.shape[1]
        groups = group_by_expert(ids, self.num_experts)
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

    def _plan_split(self, groups):
        """Resident experts stay on the GPU; cold ones are split between CPU compute and copies."""
        c = self.compute
        resident = c.manager.resident_experts(self.layer, "gpu")
        cold = {e: len(sel) for e, sel in groups if e not in resident}
        if not cold:
            return [], groups
        c.rates.pcie_bytes_per_s = c.manager.observed_rate("pinned->gpu", c.rates.pcie_bytes_per_s)
        s = split_cold(cold, c.manager.store.payload_bytes, c.rates)
        on_cpu = set(s.cpu)
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
                    h.wait()  # the compute stream waits for the copy; the host does not
                    by_expert[h.key[1]] = (h.gate_up.to(x.dtype), h.down.to(x.dtype))
                apply_experts(x, weights, k, part, by_expert.__getitem__, out=out)
            finally:
                manager.release(handles)
        return out


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
