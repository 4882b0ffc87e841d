"""Checkpoints shipped in block-scaled FP8 and MXFP4 against transformers running their dequantized weights (fp32,
CPU): log-probabilities within 1e-4 and identical greedy tokens, with every expert in memory and through the tiers
(a store keeping the experts quantized, computed from pinned RAM and disk by the dequantizing fallback)."""

from __future__ import annotations

import pytest
import torch
from quantized_models import build_wide, dequantized_checkpoint, oracle, quantize_checkpoint

from reference_models import VOCAB, build_reference
from strata import Engine
from strata.kernels.quant import ExpertFormat

ATOL = 1e-4
FP32 = {"dtype": "float32", "cpu_numerics": "gpu", "max_context": 256}

# (architecture, fused layout, format); FP8 on every architecture and layout, MXFP4 where the expert width is a
# multiple of 32 (DeepSeek's tiny reference has 24). FP8 blocks are 16 x 16 (8 x 16 where the width is 24).
CASES = [("qwen3_moe", False, "fp8"), ("qwen2_moe", True, "fp8"), ("mixtral", False, "fp8"),
         ("deepseek_v3", False, "fp8"), ("deepseek_v3", True, "fp8"), ("glm4_moe", True, "fp8"),
         ("qwen3_moe", True, "mxfp4"), ("qwen2_moe", True, "mxfp4"), ("mixtral", True, "mxfp4")]


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by the definition: the full forward over the whole sequence at every step."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def check(quantized, reference, want_format: ExpertFormat, pinned_budget: str) -> None:
    """`quantized` (a checkpoint dir) in memory and through the tiers against transformers' model `reference`."""
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = greedy(reference, prompt, 8)
    memory = Engine.from_pretrained(quantized, device="cpu", config={"runtime": {**FP32, "experts": "memory"}})
    ours = memory.score(prompt)
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"
    assert memory.generate(prompt, max_tokens=8, temperature=0.0).token_ids == expected
    cfg = {"runtime": FP32, "store": {"mode": "packed"},  # (in place: tests/store/test_in_place.py)
           "tiers": {"pinned": {"budget": pinned_budget}, "disk": {"scrub": False}}}
    with Engine.from_pretrained(quantized, device="cpu", config=cfg) as tiered:
        store = tiered.tiers.store
        assert store.expert_format == want_format and store.index.version == 2
        tiered_scores = tiered.score(prompt)
        assert (tiered_scores - ours).abs().max().item() < 1e-5  # same dequantized weights, one expert at a time
        assert tiered.generate(prompt, max_tokens=8, temperature=0.0).token_ids == expected
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk


@pytest.mark.parametrize("arch, fused, fmt", CASES, ids=[f"{a}-{'fused' if f else 'per-expert'}-{q}" for a, f, q in CASES])
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(arch, fused, fmt, tmp_path):
    _, plain = build_reference(arch, tmp_path / "ref", fused=fused)
    block = (16, 16) if arch != "deepseek_v3" else (8, 16)  # rows must divide the expert width (24) to stack
    quantized = quantize_checkpoint(plain, tmp_path / fmt, fmt, block)
    want = ExpertFormat("fp8", block=block) if fmt == "fp8" else ExpertFormat("mxfp4")
    check(quantized, oracle(dequantized_checkpoint(quantized, tmp_path / "dequantized")), want, "24KiB")


def test_real_128x128_fp8_blocks(tmp_path):
    """DeepSeek-V3's block size on a shape that holds whole blocks (hidden and expert width 128)."""
    quantized = quantize_checkpoint(build_wide(tmp_path / "ref"), tmp_path / "fp8", "fp8", (128, 128))
    check(quantized, oracle(dequantized_checkpoint(quantized, tmp_path / "dequantized")),
          ExpertFormat("fp8", block=(128, 128)), "200KiB")


@pytest.mark.parametrize("experts", ["fp8", "mxfp4"])
def test_demo_models_written_as_quantized_releases(tmp_path, experts):
    """`strata demo-model --experts`: the bf16 demo model's weights rounded to the format (each expert exactly what
    packing the bf16 one gives), which strata runs, in memory and tiered, as its fp32 path runs the dequantized ones."""
    from strata.kernels.quant import ExpertLayout
    from strata.runtime.demo.model import write_demo_model
    from strata.runtime.model.checkpoint import Checkpoint

    plain = write_demo_model(tmp_path / "bf16", "tiny", layers=2, engram=False, progress=False)
    quantized = write_demo_model(tmp_path / experts, "tiny", layers=2, engram=False, progress=False, experts=experts)
    q, p = Checkpoint.open(quantized), Checkpoint.open(plain)
    fmt = q.expert_format
    assert fmt == (ExpertFormat("fp8", block=(32, 32)) if experts == "fp8" else ExpertFormat("mxfp4"))
    assert q.expert_layout == ("per-expert" if experts == "fp8" else "fused")
    layout = ExpertLayout.build(fmt, q.config.hidden_size, q.config.moe_intermediate_size)
    gu_p, dn_p = p.load_experts(1, torch.float32, "cpu")
    gu_q, dn_q = q.load_experts(1, torch.float32, "cpu")
    for e in (0, 9):
        want = layout.dequantize(layout.pack(gu_p[e], dn_p[e]), torch.float32)
        assert torch.equal(gu_q[e], want[0]) and torch.equal(dn_q[e], want[1])
    reference = Engine.from_pretrained(dequantized_checkpoint(quantized, tmp_path / "dequantized"), device="cpu",
                                       config={"runtime": {**FP32, "experts": "memory"}})
    prompt = list(range(5, 100, 7))
    want = reference.score(prompt)
    with Engine.from_pretrained(quantized, device="cpu", config={"runtime": FP32}) as tiered:
        assert (tiered.score(prompt) - want).abs().max().item() < ATOL
        assert tiered.generate(prompt, max_tokens=6).token_ids == reference.generate(prompt, max_tokens=6).token_ids
