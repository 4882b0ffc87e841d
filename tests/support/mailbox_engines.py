"""Shared set-up of the GPU tests of one-graph split decode (tests/offload/test_cpu_mailbox.py, tests/offload/test_warm_ahead.py):
the tiny demo model, a tiered config that leaves most experts cold, and a run checked against the in-memory
engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

SLOT = 12288  # bytes of one tiny expert


def tiny_split_setup(tmp_path) -> tuple:
    """(model dir, tiered config: 2 GPU slots and no promotions, prompt ids, the in-memory engine's 4 greedy tokens)."""
    from strata import Engine
    from strata.runtime.demo.model import write_demo_model

    model = write_demo_model(tmp_path / "tiny", size="tiny", engram=False)
    cfg = {"tiers": {"gpu": {"budget": str(2 * SLOT)}, "pinned": {"budget": str(64 * SLOT)}}, "policy": {"promote": False}}
    with Engine.from_pretrained(model, device="cuda", config={"runtime": {"experts": "memory"}}) as memory:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        want = memory.generate(ids, max_tokens=4).token_ids
    return model, cfg, ids, want


@contextmanager
def one_graph_decode(model, cfg, ids, want) -> Iterator[tuple]:
    """A tiered engine that decoded 16 tokens in one-graph (mailbox) steps, its first 4 the in-memory engine's
    `want`: yields (engine, bytes of experts its CPU worker read for those 16 tokens, expert groups it served)."""
    from strata import Engine

    with Engine.from_pretrained(model, device="cuda", config=cfg) as tiered:
        assert tiered.wait_settled(60)
        tiered.generate(ids, max_tokens=2)  # the mailbox opens once placement is done
        counters = tiered._compute.mailbox.counters  # [0]: expert groups served, [1]: their bytes read
        groups, before = int(counters[0]), int(counters[1])
        assert tiered.generate(ids, max_tokens=16).token_ids[:4] == want
        assert tiered.model.graphs.mode() == "mailbox" and not tiered.model.graphs.failed
        yield tiered, int(counters[1]) - before, int(counters[0]) - groups


def host_and_graph_engines(model, base: dict) -> dict:
    """{"host": engine, "graph": engine} on `model` (CUDA) with the tiered config `base`: split decode in host steps,
    and in one graph a step with the mailbox worker; no GPU share, both settled and sending every cold expert to the
    CPU (the host path's cost model told the CPU is infinitely fast), so both compute the same experts the same
    way. The caller closes them."""
    from strata import Engine

    engines = {mode: Engine.from_pretrained(model, device="cuda",
                                            config={**base, "debug": {"split_decode": mode, "gpu_share": 0}})
               for mode in ("host", "graph")}
    for e in engines.values():
        assert e.wait_settled(60)
        e.executor.rates.cpu_bytes_per_s = 1e15
        e.executor.rates.observe_cpu = lambda *a: None
    return engines
