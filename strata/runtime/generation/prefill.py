"""Chunked prefill of one sequence into one KV-cache slot, outside any scheduler.

For tests and benchmarks that drive a model by hand (a model built without an engine, a step timed by its parts).
Generation itself, with sampling and everything that ends a sequence, runs only on the scheduler
(strata.runtime.generation.scheduler), which `Engine.generate`, `stream`, `chat` and `score` and the server all use.
"""

from __future__ import annotations

import torch

from strata.runtime.model.kv_cache import KVCache, StepBatch
from strata.runtime.model.transformer import MoETransformer


@torch.inference_mode()
def prefill(model: MoETransformer, cache: KVCache, slot: int, ids: torch.Tensor, chunk: int, all_logits: bool = False) -> torch.Tensor:
    """Run prompt `ids` [T] into cache `slot` from position 0, in chunks of `chunk` tokens.

    Returns the next-token logits of the last position [V] fp32, or the log-probabilities of every
    position [T, V] when `all_logits`.
    """
    outs = []
    for start in range(0, ids.shape[0], chunk):
        piece = ids[start : start + chunk]
        hidden = model(piece, StepBatch([slot], [start], [piece.shape[0]]), cache)
        if all_logits:
            outs.append(torch.log_softmax(model.logits(hidden), dim=-1))
    if all_logits:
        return torch.cat(outs)
    return model.logits(hidden[-1:])[0]
