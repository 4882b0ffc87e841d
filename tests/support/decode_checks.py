"""Decode equality checks shared by the tests of several packages (DecodeBatch steps, CUDA graphs, one-graph split
decode)."""

from __future__ import annotations

import torch

from reference_models import VOCAB
from strata import Engine
from strata.runtime.model.kv_cache import DecodeBatch, KVCache, StepBatch, kv_bucket


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


def greedy_both_ways(model, new_cache, lengths: list[int], steps: int, seed: int, device: str = "cpu",
                     atol: float = 1e-4, decode=None, slots: list[int] | None = None) -> set[int]:
    """Prefill `lengths` random prompts into two caches (`new_cache(num_slots)`), then `steps` greedy steps of all of
    them together: StepBatch steps on one cache (`run_layers`), DecodeBatch steps on the other, logits within `atol`
    and the same greedy tokens (the StepBatch path's fed to both; on CUDA compared where the top two are more than
    2 atol apart). `slots`: each sequence's cache slot (default 0, 1, ...; the caches hold max(slots) + 1).
    `decode(ids, slots, lengths, cache)`: the DecodeBatch step (default: a DecodeBatch over `kv_bucket`). Returns the
    buckets."""
    slots = list(range(len(lengths))) if slots is None else slots
    a, b = new_cache(max(slots) + 1), new_cache(max(slots) + 1)
    buckets = set()

    def as_decode_batch(ids, slots, lengths, cache):
        kv_len = kv_bucket(max(lengths), cache.max_len)
        buckets.add(kv_len)
        batch = DecodeBatch(torch.tensor(slots, device=device), torch.tensor(lengths, device=device), kv_len)
        return model.run_layers(ids, batch, cache)

    decode = decode or as_decode_batch
    g = torch.Generator().manual_seed(seed)
    last = []
    with torch.inference_mode():
        for slot, n in zip(slots, lengths, strict=True):
            prompt = torch.randint(0, VOCAB, (n,), generator=g).to(device)
            for cache in (a, b):
                hidden = model.run_layers(prompt, StepBatch([slot], [0], [n]), cache)
            last.append(int(model.logits(hidden[-1:]).argmax(-1)))
        ids = torch.tensor(last, device=device)
        for _ in range(steps):
            want = model.logits(model.run_layers(ids, StepBatch(slots, lengths, [1] * len(slots)), a))
            got = model.logits(decode(ids, slots, lengths, b))
            err = (got - want).abs().max().item()
            assert err < atol, f"max |logit - StepBatch's| = {err:.2e} at lengths {lengths}"
            top = want.topk(2, -1).values
            clear = (top[:, 0] - top[:, 1] > 2 * atol) if device != "cpu" else torch.ones_like(top[:, 0], dtype=bool)
            assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
            ids = want.argmax(-1)
            lengths = [n + 1 for n in lengths]
    return buckets


def engine_path(model):
    """A `greedy_both_ways` decode step as the generation loop hands it to the model: a StepBatch of one token a
    sequence, which a CUDA model runs through its DecodeGraphs."""
    def decode(ids, slots, lengths, cache):
        return model(ids, StepBatch(slots, lengths, [1] * len(slots)), cache)

    return decode


def assert_graphs_equal_eager(directory, prompts: list[list[int]], max_tokens: int, experts: str,
                              tiered_budget: int | str | None = None) -> None:
    """Greedy decode of `prompts` together on CUDA in fp32 (experts "memory" or "tiered" with `tiered_budget` bytes of
    GPU slots), decode steps captured in CUDA graphs against the same engine's steps run eagerly: no capture failed,
    graphs were captured, and every stream's tokens are equal."""
    def run(graphs: bool):
        cfg = {"runtime": {"max_context": 256, "dtype": "float32", "warmup": False, "experts": experts},
               "planner": {"max_batch": len(prompts)}, "debug": {"cuda_graphs": graphs}}
        if experts == "tiered":
            cfg["tiers"] = {"gpu": {"budget": str(tiered_budget)}}
        with Engine.from_pretrained(directory, config=cfg, device="cuda") as engine:
            streams = [engine.stream(p, max_tokens=max_tokens, temperature=0.0) for p in prompts]
            for stream in streams:
                for _ in stream:
                    pass
            graphs = engine.model.graphs
            return [s.output.token_ids for s in streams], graphs.captures, dict(graphs.failed)

    eager, none, _ = run(False)
    captured, captures, failed = run(True)
    assert none == 0 and captures > 0 and not failed, failed
    assert captured == eager


def eager_cuda_engine(directory, max_len: int) -> Engine:
    """A CUDA engine in fp32, every expert in memory, CUDA graphs off: its decode steps run through its DecodeGraphs
    as eager DecodeBatch steps (nothing captured)."""
    from strata.runtime.model.graphs import DecodeGraphs

    cfg = {"runtime": {"max_context": max_len, "dtype": "float32", "experts": "memory", "warmup": False},
           "debug": {"cuda_graphs": False}}
    engine = Engine.from_pretrained(directory, config=cfg, device="cuda")
    assert isinstance(engine.model.graphs, DecodeGraphs) and engine.model.graphs.mode() is None
    return engine


def assert_engine_decode_follows_step_batches(engine: Engine, new_cache, slots: list[int] | None = None) -> None:
    """`greedy_both_ways` on CUDA for prompts of 250, 70 and 5 tokens (across the 256 -> 512 bucket), 32 steps: the
    engine path's eager DecodeBatch steps follow the StepBatch steps' logits up to tf32 products (atol 2e-2) with
    nothing captured; then one generation through the engine."""
    model = engine.model
    greedy_both_ways(model, new_cache, [250, 70, 5], 32, seed=16, device="cuda", atol=2e-2, decode=engine_path(model),
                     slots=slots)
    assert model.graphs.captures == 0 and model.graphs.replays == 0
    assert engine.generate([1, 2, 3], max_tokens=8, temperature=0.0).finish_reason == "length"
