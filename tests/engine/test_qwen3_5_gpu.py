"""Qwen3.5-MoE on CUDA in bf16 (run on the GPU machine; skipped without CUDA): against transformers as the bf16
checks of tests/engine/test_gpu.py hold the other architectures (strata's error against the fp32 reference within
twice transformers' own bf16 error, greedy tokens equal up to the reference's first near-tie), at 64 and 2,100
tokens, decode steps captured in CUDA graphs; in memory and with two GPU slots a layer through the tiers; several
sequences batched decode as they do alone."""

from __future__ import annotations

import pytest
import torch
from qwen3_5_models import build_q35_reference
from test_gpu import PREFIX, assert_same_greedy_prefix, greedy_full_forward

from reference_models import VOCAB
from strata import Engine
from strata.runtime.plan.footprint import read_footprint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("length, long", [(64, False), (2100, True)], ids=["short", "long"])
def test_bf16_cuda_matches_transformers(length, long, tmp_path):
    from transformers import AutoModelForCausalLM

    ref32, directory = build_q35_reference(tmp_path / "q35", fused=True, long=long, seed=5)
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
    assert engine.model.graphs.captures > 0  # the decode steps above ran as CUDA graphs


def test_tiered_decode_equals_memory(tmp_path):
    """Two GPU slots a layer (cold experts copied in, or computed with the GPU's numerics) give the in-memory model's
    tokens."""
    from strata.runtime.demo.model import write_demo_model

    d = write_demo_model(tmp_path / "q35", size="tiny", arch="qwen3_5_moe", progress=False)
    memory = Engine.from_pretrained(d, device="cuda", config={"runtime": {"experts": "memory"}})
    ids = memory.tokenizer.encode("The river runs through the valley and the town")
    want = memory.generate(ids, max_tokens=24).token_ids
    slot = 3 * 64 * 32 * 2  # one bf16 expert of the tiny size
    layers = read_footprint(d).moe_layers  # the budget is the whole GPU tier's: two slots for each MoE layer
    cfg = {"tiers": {"gpu": {"budget": str(2 * layers * slot)}, "pinned": {"budget": str(64 * slot)}},
           "runtime": {"cpu_numerics": "gpu"}}
    with Engine.from_pretrained(d, device="cuda", config=cfg) as tiered:
        assert tiered.generate(ids, max_tokens=24).token_ids == want
        assert tiered.model.graphs.captures > 0
        assert tiered.stats()["tiers"]["tiers"]["gpu"]["evictions"] > 0


def test_batched_sequences_decode_as_alone(tmp_path):
    """Three sequences of different lengths sharing every step on the GPU (fp32, so that another batch shape's
    rounding cannot flip a near tie) each get the tokens they get alone."""
    model, directory = build_q35_reference(tmp_path / "q35", seed=7)
    cfg = {"runtime": {"experts": "memory", "dtype": "float32", "max_context": 256}, "planner": {"max_batch": 3}}
    engine = Engine.from_pretrained(directory, device="cuda", config=cfg)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 30, 57)]
    alone = [engine.generate(p, max_tokens=12, temperature=0.0).token_ids for p in prompts]
    streams = [engine.stream(p, max_tokens=12, temperature=0.0) for p in prompts]
    for stream, want in zip(streams, alone, strict=True):
        for _ in stream:
            pass
        assert stream.output.token_ids == want
