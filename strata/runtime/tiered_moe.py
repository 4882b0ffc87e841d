"""Routed experts served by the tier manager instead of held in memory.

`TieredExperts` replaces a layer's stacked `Experts`: per step it acquires the experts the router
picked (from the GPU tier on CUDA, from pinned/host RAM on CPU), waits only for what is not resident,
computes them, and releases them. `router_predictors` gives the prefetcher each MoE layer's router,
so the hidden state after layer l predicts the experts of the layers ahead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.kernels.experts import apply_experts, group_by_expert
from strata.runtime.model import MoETransformer
from strata.runtime.moe import MoEBlock
from strata.tiers.manager import TierManager


class TieredExperts(nn.Module):
    """One MoE layer's routed experts, fetched from tiers; same math as `Experts`."""

    def __init__(self, layer: int, num_experts: int, manager: TierManager, device_tier: str):
        super().__init__()
        self.layer, self.num_experts = layer, num_experts
        self.manager, self.device_tier = manager, device_tier

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(ids, self.num_experts)
        # a budget smaller than this step's experts is served in chunks the tier can hold at once
        chunk = self.manager.max_acquire(self.device_tier)
        host = self.device_tier == "cpu" and x.device.type != "cpu"
        # experts in host RAM under a GPU model: compute on the CPU in fp32, move only activations
        xs, ws = (x.float().cpu(), weights.cpu()) if host else (x, weights)
        if host:
            groups = [(e, sel.cpu()) for e, sel in groups]
        out = torch.zeros_like(xs)
        for i in range(0, len(groups), chunk):
            part = groups[i : i + chunk]
            handles = self.manager.acquire([(self.layer, e) for e, _ in part], self.device_tier)
            try:
                by_expert = {}
                for h in handles:
                    h.wait()  # the compute stream waits for the copy; the host does not
                    by_expert[h.key[1]] = (h.gate_up.to(xs.dtype), h.down.to(xs.dtype))
                apply_experts(xs, ws, ids.shape[1], part, by_expert.__getitem__, out=out)
            finally:
                self.manager.release(handles)
        return out.to(x.device, x.dtype) if host else out


def use_tiered_experts(model: MoETransformer, manager: TierManager, device_tier: str) -> None:
    """Swap every MoE layer's stacked experts for tier-served ones (before weights are loaded)."""
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp.experts = TieredExperts(i, model.cfg.num_experts, manager, device_tier)


def router_predictors(model: MoETransformer) -> dict[int, Callable[[torch.Tensor], torch.Tensor]]:
    """layer -> f(hidden [N, H]) -> predicted expert ids [N, k], applying that layer's norm and router early."""
    out = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            norm, router = layer.post_attention_layernorm, layer.mlp.gate
            out[i] = lambda h, norm=norm, router=router: router(norm(h))[1]
    return out
