"""Routing statistics: which experts a model's routers pick, counted by forward hooks while a block runs.

Works on strata's model (`strata.runtime.model.moe.Router`, which returns `(weights, ids, used)`) and, for
`count_routing`, on a transformers model (its `mlp.gate` routers return `(logits, scores, ids)`), so the same text
can be checked in both engines. `popularity_summary` states a count's skew (how much of the routing the most popular
experts take), `record_lookahead` and `lookahead_recall` how well the lookahead predictor names a layer's experts
ahead of it, `record_choices` and `temporal_overlap` how much consecutive tokens share their experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from strata.runtime.model.moe import MoEBlock, Router, router_predictors

_LAYER = re.compile(r"layers\.(\d+)\.")


@contextmanager
def count_routing(model: torch.nn.Module, num_experts: int) -> Iterator[dict[int, torch.Tensor]]:
    """Count routed (token, expert) pairs per MoE layer while the block runs: {layer: int64 [E]}.

    Finds the routers by type (strata's `Router`) or by name (transformers' `...mlp.gate`).
    """
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


@contextmanager
def record_lookahead(model: torch.nn.Module, distances: tuple[int, ...] = (1,),
                     rows: int | None = None) -> Iterator[dict]:
    """Record, for each forward pass of strata's `model` while the block runs, every MoE layer's expert ids and
    the ids its lookahead predictor (`router_predictors`: layer j's norm and router applied to the hidden state
    leaving layer j - d) named for it d layers earlier. Yields {"actual": {layer: [ids [N, k], ...]},
    "predicted": {(layer, d): [ids [N, k], ...]}}, one entry a pass; `rows`: only passes of that many token rows
    (1: decode steps). Observes the model's layers (`observe_layers`; its observer is kept, told first, and
    restored after)."""
    predictors = router_predictors(model)
    rec: dict = {"actual": {}, "predicted": {}}
    predicting = [False]  # the predictors call the layers' own routers: those calls are not the layers' choices
    hooks = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            def gate_hook(_mod, _inp, out, i=i) -> None:
                if not predicting[0] and (rows is None or out[1].shape[0] == rows):
                    rec["actual"].setdefault(i, []).append(out[1].cpu())
            hooks.append(layer.mlp.gate.register_forward_hook(gate_hook))
    before = model.layer_observer

    class Predictions:
        """The model's layer observer while recording: the one it had is told first."""

        def after_layer(self, i: int, hidden: torch.Tensor) -> None:
            if before is not None:
                before.after_layer(i, hidden)
            if rows is not None and hidden.shape[0] != rows:
                return
            predicting[0] = True
            try:
                for d in distances:
                    if i + d in predictors:
                        rec["predicted"].setdefault((i + d, d), []).append(predictors[i + d](hidden).cpu())
            finally:
                predicting[0] = False

    model.observe_layers(Predictions())
    try:
        yield rec
    finally:
        model.observe_layers(before)
        for h in hooks:
            h.remove()


def lookahead_recall(rec: dict, num_experts: int, distance: int, hot_fraction: float = 0.25) -> dict:
    """From `record_lookahead`'s record: the share of lookups (token, expert) whose expert the prediction made
    `distance` layers earlier named for that token (`recall`), and the same over lookups of experts outside each
    layer's `hot_fraction` most used in the record (`cold_recall`: what a GPU budget of that fraction leaves cold
    at best, the lookups a prediction must bring up)."""
    hit = n = cold_hit = cold_n = 0
    for (layer, d), preds in rec["predicted"].items():
        if d != distance:
            continue
        acts = rec["actual"][layer][-len(preds):]  # a pass's prediction and choice share its index from the end
        counts = torch.bincount(torch.cat(acts).reshape(-1), minlength=num_experts)
        hot = torch.zeros(num_experts, dtype=torch.bool)
        hot[counts.argsort(descending=True)[: max(1, round(num_experts * hot_fraction))]] = True
        for p, a in zip(preds, acts, strict=True):
            named = (a.unsqueeze(-1) == p.unsqueeze(-2)).any(-1)  # [N, k]: each chosen expert among the predicted
            cold = ~hot[a]
            hit, n = hit + int(named.sum()), n + named.numel()
            cold_hit, cold_n = cold_hit + int(named[cold].sum()), cold_n + int(cold.sum())
    return {"distance": distance, "lookups": n, "recall": round(hit / max(1, n), 4), "cold_lookups": cold_n,
            "cold_recall": round(cold_hit / max(1, cold_n), 4)}


@contextmanager
def record_choices(model: torch.nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Every MoE layer's expert ids of each forward pass while the block runs: {layer: [ids [N, k], ...]} (strata's
    `Router` modules)."""
    choices: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        m = _LAYER.search(name)
        if m and isinstance(module, Router):
            hooks.append(module.register_forward_hook(
                lambda _mod, _inp, out, layer=int(m[1]): choices.setdefault(layer, []).append(out[1].cpu())))
    try:
        yield choices
    finally:
        for h in hooks:
            h.remove()


def temporal_overlap(passes: list[torch.Tensor], num_experts: int) -> dict:
    """Temporal locality of one layer's routing over `passes` (ids [N, k] of consecutive tokens, one per sequence):
    `consecutive`, the share of a token's experts its predecessor also used, against `independent`, the same if
    tokens drew their experts independently at the measured popularity (sum of p_e^2 / k, p_e the share of
    tokens using expert e). Equal: popularity explains all reuse; above: temporal locality."""
    hot = [torch.zeros(ids.shape[0], num_experts).scatter_(1, ids.long(), 1.0) for ids in passes]
    k = passes[0].shape[1]
    p = torch.cat(hot).mean(0)
    pairs = sum(h.shape[0] - 1 for h in hot)
    shared = sum(float((h[1:] * h[:-1]).sum()) for h in hot)
    return {"consecutive": round(shared / max(1, pairs * k), 4), "independent": round(float((p * p).sum()) / k, 4)}
