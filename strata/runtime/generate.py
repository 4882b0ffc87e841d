"""The generation loop as free functions: chunked prefill, decode steps, scoring.

All of them drive one sequence in one KV-cache slot; the server's scheduler batches several
sequences through the same `MoETransformer.forward` with a multi-sequence `StepBatch`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from strata.runtime.kv_cache import KVCache, StepBatch
from strata.runtime.model import MoETransformer
from strata.runtime.overlap import TokenReadback, queue_decode
from strata.runtime.sampler import SamplingParams, sample


@torch.inference_mode()
def prefill(model: MoETransformer, cache: KVCache, slot: int, ids: torch.Tensor, chunk: int, all_logits: bool = False) -> torch.Tensor:
    """Run prompt `ids` [T] into cache `slot` in chunks of `chunk` tokens.

    Returns the next-token logits of the last position [V] fp32, or of every position [T, V] when
    `all_logits` (used by `score`).
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


def generate_tokens(
    model: MoETransformer,
    cache: KVCache,
    prompt: list[int],
    params: SamplingParams,
    eos_ids: set[int],
    chunk: int,
    device: torch.device,
    generator: torch.Generator,
    overlap: bool = False,
) -> Iterator[int]:
    """Yield sampled token ids until EOS, `max_tokens`, or the cache is full (the caller stops on stop strings).

    An EOS token ends the loop without being yielded. `overlap` (strata.runtime.overlap): each decode step is
    queued before the host reads the token it is fed, so the host's work overlaps the GPU's; same tokens.
    """
    slot = 0
    logits = prefill(model, cache, slot, torch.tensor(prompt, dtype=torch.long, device=device), chunk)
    tokens = sample(logits[None], params, generator)  # [1] on the device
    read = TokenReadback(tokens)
    position = len(prompt)

    def step(ids: torch.Tensor, at: int):  # the decode step fed ids [1] at position `at`, and its sampling
        return queue_decode(model, cache, [slot], [at], ids, [(params, generator)])

    for i in range(params.max_tokens):
        last = position >= cache.max_len or i == params.max_tokens - 1  # no step whose logits nobody samples
        # overlapped, the next step (and its sampling) goes first and this token is read while it runs
        nxt = step(tokens, position) if overlap and not last else None
        token = read.tolist()[0]
        if token in eos_ids and not params.ignore_eos:
            return
        yield token
        if last:
            return
        nxt = nxt or step(tokens, position)
        tokens, read = nxt.tokens, nxt.read
        position += 1
