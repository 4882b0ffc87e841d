"""MiniMax-M2 on CUDA in bf16 (run on the GPU machine; skipped without CUDA): against transformers as the bf16
checks of tests/engine/test_gpu.py hold the other architectures (strata's error against the fp32 reference within
twice transformers' own bf16 error, greedy tokens equal up to the reference's first near-tie), at 64 and 2,100
tokens; and decode graphs of the tiny `--arch minimax_m2` demo model equal eager decode, with every expert in memory
and in one-graph decode with two GPU slots a layer."""

from __future__ import annotations

import pytest
import torch
from decode_checks import assert_batched_decode_identical
from minimax_m2_models import build_minimax_m2_reference
from test_gpu import PREFIX, assert_same_greedy_prefix, greedy_full_forward

from reference_models import VOCAB
from strata import Engine
from strata.runtime.plan.footprint import read_footprint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("length, long", [(64, False), (2100, True)], ids=["short", "long"])
def test_bf16_cuda_matches_transformers(length, long, tmp_path):
    from transformers import AutoModelForCausalLM

    ref32, directory = build_minimax_m2_reference(tmp_path / "m2", long=long, seed=5)
    prompt = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        exact = torch.log_softmax(ref32(torch.tensor([prompt])).logits[0].float(), -1)
    ref16 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        hf16 = torch.log_softmax(ref16(torch.tensor([prompt], device="cuda")).logits[0].float(), -1).cpu()
    engine = Engine.from_pretrained(directory, config={"runtime": {"max_context": 4096}}, device="cuda")
    assert engine.dtype == torch.bfloat16 and engine.device.type == "cuda"
    ours = engine.score(prompt)
    hf_err, our_err = (hf16 - exact).abs().mean().item(), (ours - exact).abs().mean().item()
    assert our_err <= 2 * hf_err + 0.01, f"strata bf16 mean error {our_err:.4f} vs transformers bf16 {hf_err:.4f}"
    hf_max, our_max = (hf16 - exact).abs().max().item(), (ours - exact).abs().max().item()
    assert our_max <= max(2 * hf_max, 0.1), f"strata bf16 max error {our_max:.3f} vs transformers bf16 {hf_max:.3f}"
    expected, gaps = greedy_full_forward(ref16, prompt, PREFIX)
    assert_same_greedy_prefix(engine.generate(prompt, max_tokens=PREFIX).token_ids, expected, gaps)


def test_decode_graphs_equal_eager_decode(tmp_path):
    """The whole-projection q/k norms run before the fused rotary kernels (which then norm nothing), the partially
    rotary heads (half of each) rotate in torch, the sigmoid router runs in the model's dtype: graphs give eager
    decode's tokens."""
    from strata.runtime.demo.model import write_demo_model

    d = write_demo_model(tmp_path / "m2", size="tiny", engram=False, arch="minimax_m2", progress=False)
    eager = Engine.from_pretrained(d, device="cuda", config={"runtime": {"experts": "memory"},
                                                             "debug": {"cuda_graphs": False}})
    graphs = Engine.from_pretrained(d, device="cuda", config={"runtime": {"experts": "memory"}})
    ids = eager.tokenizer.encode("The river runs through the valley and the town")
    want = eager.generate(ids, max_tokens=24)
    assert graphs.generate(ids, max_tokens=24).token_ids == want.token_ids
    assert graphs.model.graphs.replays > 0 and not graphs.model.graphs.failed
    assert_batched_decode_identical(eager, graphs, steps=12)
    slot = 3 * 64 * 32 * 2  # one bf16 expert of the tiny size
    layers = read_footprint(d).moe_layers  # the budget is the whole GPU tier's: two slots for each MoE layer
    cfg = {"tiers": {"gpu": {"budget": str(2 * layers * slot)}, "pinned": {"budget": str(48 * slot)}},
           "runtime": {"cpu_numerics": "gpu"}}
    with Engine.from_pretrained(d, device="cuda", config=cfg) as tiered:
        assert tiered.generate(ids, max_tokens=24).token_ids == want.token_ids
        assert tiered.model.graphs.replays > 0 and not tiered.model.graphs.failed
        assert tiered.stats()["tiers"]["tiers"]["gpu"]["evictions"] > 0
