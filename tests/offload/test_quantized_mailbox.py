"""One-graph split decode on quantized experts: the native CPU worker computing a step's cold FP8 / MXFP4 / GGUF experts
from their blobs in pinned RAM inside the step's one graph (GPU tests; `FAST_PATHS["cpu_mailbox"]` given the format,
which it holds by default), against the host-step path on the same store."""

from __future__ import annotations

import pytest

from strata.kernels import quant

pytestmark = pytest.mark.gpu


def _graph_decode_equals_host_steps(model, base: dict, kind: str) -> tuple[list[int], dict]:
    """`model` tiered as `base` says, decoded in host steps and in one graph a step: the graph engine's experts are
    `kind`, it decodes in mailbox steps with the worker computing cold experts, and its tokens and batched decode
    equal the host-step engine's. Returns (the prompt's ids, each engine's generation)."""
    from decode_checks import assert_batched_decode_identical
    from mailbox_engines import host_and_graph_engines

    engines = host_and_graph_engines(model, base)
    try:
        ids = engines["host"].tokenizer.encode("The river runs through the valley and the town")
        got = {mode: e.generate(ids, max_tokens=24) for mode, e in engines.items()}
        graph = engines["graph"]
        assert graph.tiers.store.expert_format.kind == kind
        assert graph.model.graphs.mode() == "mailbox" and not graph.model.graphs.failed
        assert got["graph"].token_ids == got["host"].token_ids
        assert graph.executor.mailbox.experts_computed > 0
        assert_batched_decode_identical(engines["host"], graph, steps=12)
    finally:
        for e in engines.values():
            e.close()
    return ids, got


@pytest.mark.parametrize("experts", ["fp8", "mxfp4"])
def test_one_graph_split_decode_on_quantized_experts_equals_host_steps(tmp_path, monkeypatch, experts):
    """The store's experts in `experts`, two GPU slots' bytes, promotions off and every cold expert sent to the CPU
    (no GPU share): the one-graph engine's tokens and batched decode equal the host-step engine's, its worker
    computed cold experts, and with a 0.6 GPU share (rows split, the GPU reading the rest of each blob in place)
    the first tokens still agree."""
    from mailbox_engines import SLOT

    from strata import Engine
    from strata.runtime.demo.model import write_demo_model

    monkeypatch.setitem(quant.FAST_PATHS, "cpu_mailbox", quant.FAST_PATHS["cpu_mailbox"] | {experts})
    model = write_demo_model(tmp_path / "tiny", size="tiny", engram=False)
    base = {"tiers": {"gpu": {"budget": str(2 * SLOT)}, "pinned": {"budget": str(64 * SLOT)}},
            "policy": {"promote": False}, "store": {"experts": experts}}
    ids, got = _graph_decode_equals_host_steps(model, base, experts)
    with Engine.from_pretrained(model, device="cuda", config={**base, "debug": {"gpu_share": 0.6}}) as shared:
        assert shared.wait_settled(60)
        shared.generate(ids, max_tokens=2)  # the mailbox opens once placement is done
        assert shared.generate(ids, max_tokens=24).token_ids[:4] == got["host"].token_ids[:4]
        assert shared.model.graphs.mode() == "mailbox" and shared.executor.gpu_share is not None


def test_one_graph_split_decode_on_gguf_experts_equals_host_steps(tmp_path):
    """A GGUF file whose layers mix K-quant types as Q4_K_M does (its experts kept in their blocks), one GPU slot of
    four experts a layer: the one-graph engine decodes in mailbox steps, its worker reading the cold blobs past their
    header, with the host-step engine's tokens and batched decode."""
    pytest.importorskip("gguf")
    from gguf_models import build_qwen3_gguf

    from strata.kernels.quant import ExpertFormat, ExpertLayout

    types = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K")]
    _, path = build_qwen3_gguf(tmp_path, types, seed=3)
    payload = ExpertLayout.build(ExpertFormat("gguf", ggml=(("Q4_K",), ("Q4_K",), ("Q4_K", "Q6_K"))), 256,
                                 256).payload_bytes
    slot = -(-payload // 4096) * 4096  # a slot holds the largest expert, 4 KiB aligned
    base = {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(64 * slot)}},  # 2 MoE layers
            "policy": {"promote": False}}
    _graph_decode_equals_host_steps(path, base, "gguf")
