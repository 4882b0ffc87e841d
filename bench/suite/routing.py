"""How a model routes: per-layer expert popularity counted by forward hooks on the routers.

Works on strata's model (`strata.runtime.moe.Router`, which returns `(weights, ids, used)`) and on a
transformers model (its `mlp.gate` routers return `(logits, scores, ids)`), so the same prompt can
be checked in both engines. Used by the suite to state the skew it measured, and by the tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


@contextmanager
def count_routing(model: torch.nn.Module, num_experts: int) -> Iterator[dict[int, torch.Tensor]]:
    """Count routed (token, expert) pairs per MoE layer while the block runs: {layer: int64 [E]}.

    Finds the routers by type (strata's `Router`) or by name (transformers' `...mlp.gate`).
    """
    from strata.runtime.moe import Router

    counts: dict[int, torch.Tensor] = {}
    hooks = []

    def hook(layer: int):
        def fn(_module, _inputs, out) -> None:
            ids = out[1] if isinstance(_module, Router) else out[-1]  # strata: (weights, ids, used); transformers:
            # (logits, scores, ids)
            counts[layer] += torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts)
        return fn

    for name, module in model.named_modules():
        m = _LAYER.search(name)
        if m and (isinstance(module, Router) or name.endswith("mlp.gate")):
            layer = int(m[1])
            counts[layer] = torch.zeros(num_experts, dtype=torch.long)
            hooks.append(module.register_forward_hook(hook(layer)))
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def popularity_summary(counts: dict[int, torch.Tensor], fractions: tuple[float, ...] = (0.1, 0.25, 0.4)) -> dict:
    """Share of lookups on each layer's most popular experts (mean over layers), and the top expert's
    share relative to a uniform router (1.0 = uniform)."""
    if not counts:
        return {}
    out: dict = {}
    rows = [c.double() / c.sum() for c in counts.values() if c.sum() > 0]
    e = rows[0].numel()
    for f in fractions:
        n = max(1, round(f * e))
        out[f"top{round(100 * f)}pct_share"] = round(sum(float(r.sort(descending=True).values[:n].sum()) for r in rows)
                                                      / len(rows), 4)
    out["top1_vs_uniform"] = round(sum(float(r.max()) * e for r in rows) / len(rows), 2)
    return out
