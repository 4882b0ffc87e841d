"""What the tests of models split over several stages share: the prompt they score and how they score it."""

from __future__ import annotations

import torch

CPU = torch.device("cpu")
IDS = torch.tensor([1, 5, 9, 200, 17, 3, 3, 8, 44, 2])


def score_in_chunks(model, cfg, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Every position's log-probabilities of `ids` [T] through `model`, prefilled in chunks of 3 tokens (so stage
    hooks see the cache reused): [T, vocab]."""
    from strata.runtime.generation.prefill import prefill
    from strata.runtime.model.kv_cache import KVCache

    cache = KVCache(cfg, 1, 64, dtype, "cpu")
    return prefill(model, cache, 0, ids, 3, all_logits=True)
