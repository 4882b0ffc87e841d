"""Decode equality checks shared by the GPU tests of several packages (CUDA graphs, one-graph split decode)."""

from __future__ import annotations

import torch

from strata import Engine
from strata.runtime.model.kv_cache import KVCache, StepBatch


def assert_batched_decode_identical(eager: Engine, graphs: Engine, steps: int) -> None:
    """Batched decode of 3 sequences at different lengths, straight through both models: equal hidden states."""
    caches = [KVCache(m.model.cfg, 3, 1024, m.dtype, "cuda") for m in (eager, graphs)]
    g = torch.Generator().manual_seed(0)
    lengths = [3, 200, 40]
    with torch.inference_mode():
        for slot, n in enumerate(lengths):
            prompt = torch.randint(0, 100, (n,), generator=g).cuda()
            for m, c in zip((eager, graphs), caches, strict=True):
                m.model(prompt, StepBatch([slot], [0], [n]), c)
        for _ in range(steps):
            tok = torch.randint(0, 100, (3,), generator=g).cuda()
            outs = [m.model(tok, StepBatch([0, 1, 2], lengths, [1, 1, 1]), c) for m, c in zip((eager, graphs), caches, strict=True)]
            assert torch.equal(outs[0], outs[1])
            lengths = [n + 1 for n in lengths]
