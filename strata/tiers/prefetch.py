"""Router-driven prefetch: after layer l, predict the experts of layers l+1 .. l+lookahead and fetch them.

The residual stream changes slowly from layer to layer, so applying layer l+1's router to the
hidden state leaving layer l predicts most of the experts layer l+1 will ask for (mixtral-offloading
and Pre-gated MoE rely on this). The tier manager counts how many prefetches were used, late or
wasted, which is the measured precision and recall of the prediction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from strata.tiers.manager import TierManager

Predictor = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> expert ids [N, k]


class LookaheadPrefetcher:
    """Called after each layer with its output hidden state; prefetches predicted experts ahead."""

    def __init__(self, manager: TierManager, predictors: dict[int, Predictor], lookahead: int, device_tier: str):
        self.manager, self.predictors = manager, predictors
        self.lookahead, self.device_tier = lookahead, device_tier
        self._moe_layers = sorted(predictors)

    def __call__(self, layer: int, hidden: torch.Tensor) -> None:
        if self.lookahead <= 0:
            return
        ahead = [j for j in self._moe_layers if j > layer][: self.lookahead]
        for j in ahead:
            ids = torch.unique(self.predictors[j](hidden)).tolist()
            self.manager.prefetch([(j, e) for e in ids], self.device_tier)
