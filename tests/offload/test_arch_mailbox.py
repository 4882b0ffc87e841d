"""One-graph split decode (the mailbox worker computing the cold experts inside the step's CUDA graph) for the
architectures whose experts or layers are not Qwen3-MoE's: gpt-oss (MXFP4 experts with gate_up and down biases,
the clamped SwiGLU on interleaved rows), Qwen3.5-MoE (Gated DeltaNet states stepped inside the graph) and
DeepSeek-V4 (its compressed caches and clipped SwiGLU). GPU tests: each tiny demo model with two experts a layer in
VRAM and the rest cold in pinned RAM decodes the same tokens in one-graph steps as in host steps that also send
every cold expert to the CPU kernel."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_5_moe", "deepseek_v4"])
def test_one_graph_split_decode_equals_host_steps(arch, tmp_path):
    from mailbox_engines import host_and_graph_engines

    from strata.config import StrataConfig
    from strata.runtime.demo.model import write_demo_model
    from strata.runtime.plan.planner import plan_for

    model = write_demo_model(tmp_path / arch, size="tiny", arch=arch, progress=False)
    planned = plan_for(model, StrataConfig())
    layers = planned.moe_layers  # the GPU budget is the whole tier's: two slots for each MoE layer
    base = {"tiers": {"gpu": {"budget": str(2 * layers * planned.slot_bytes)},
                      "pinned": {"budget": str(4 * layers * planned.experts_per_layer * planned.slot_bytes)}},
            "policy": {"promote": False}}
    engines = host_and_graph_engines(model, base)
    try:
        ids = engines["host"].tokenizer.encode("The river runs through the valley and the town")
        got = {mode: e.generate(ids, max_tokens=24, temperature=0.0).token_ids for mode, e in engines.items()}
        graph = engines["graph"]
        assert graph.model.graphs.mode() == "mailbox" and not graph.model.graphs.failed
        assert any(key[3] == "mailbox" for key in graph.model.graphs.graphs)
        assert got["graph"] == got["host"]
        assert graph.executor.mailbox.experts_computed > 0
    finally:
        for e in engines.values():
            e.close()
