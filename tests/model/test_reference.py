"""strata against transformers' reference implementations on tiny random checkpoints (fp32, CPU).

For every architecture and both on-disk expert layouts: `Engine.score` equals transformers'
log-softmax within 1e-4 and 32 greedy tokens are identical; then the same at a context of more than
2,048 tokens with RoPE scaling, partial rotary or a sliding window active.
"""

from __future__ import annotations

import pytest
import torch

from reference_models import ARCHS, VOCAB, WINDOWED, build_reference, reference_greedy
from strata import Engine

ATOL = 1e-4


def check_against_reference(model, directory, prompt: list[int], n_greedy: int = 32, max_context: int = 4096,
                            cached: bool = False):
    engine = Engine.from_pretrained(directory, config={"runtime": {"max_context": max_context, "dtype": "float32"}},
                                    device="cpu")
    assert engine.dtype == torch.float32
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours = engine.score(prompt)
    assert ours.shape == (len(prompt), VOCAB) and ours.dtype == torch.float32
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"
    expected = reference_greedy(model, prompt, n_greedy, cached)
    out = engine.generate(prompt, max_tokens=n_greedy, temperature=0.0)
    assert out.token_ids == expected
    assert out.finish_reason == "length"


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch, fused, tmp_path):
    model, directory = build_reference(arch, tmp_path / arch, fused=fused)
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    check_against_reference(model, directory, prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_long_context_matches_transformers(arch, tmp_path):
    """> 2,048 tokens with YaRN (Qwen3, DeepSeek-V3, V2-Lite's form of DeepSeek-V2), linear RoPE + sliding window
    (Qwen2), a window (Mixtral) or half-rotary heads (GLM-4.5)."""
    model, directory = build_reference(arch, tmp_path / arch, long=True, seed=3)
    prompt = torch.randint(0, VOCAB, (2100,), generator=torch.Generator().manual_seed(2)).tolist()
    # the windowed models' oracle reruns the whole sequence a token (no cache to trust), so they decode 8 tokens
    # past a prompt that has already wrapped their window; the others decode 32
    windowed = arch in WINDOWED
    check_against_reference(model, directory, prompt, n_greedy=8 if windowed else 32, cached=not windowed)


@pytest.mark.parametrize("arch, fused", [("glm4_moe", False), ("deepseek_v2", True)])
def test_tiered_from_disk_matches_transformers(arch, fused, tmp_path):
    """Experts served by the tiers from a pinned budget of a few experts, the rest read back from disk."""
    model, directory = build_reference(arch, tmp_path / arch, fused=fused, seed=5)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    config = {"runtime": {"dtype": "float32", "max_context": 256},
              "tiers": {"pinned": {"budget": "64KiB"}, "disk": {"scrub": False}}}
    with Engine.from_pretrained(directory, config=config, device="cpu") as engine, torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert (engine.score(prompt) - ref).abs().max().item() < ATOL
        assert engine.generate(prompt, max_tokens=12, temperature=0.0).token_ids == reference_greedy(model, prompt, 12)
        assert engine.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk
