"""gpt-oss against transformers 5.25's `GptOssForCausalLM` on tiny random checkpoints (fp32, CPU).

`Engine.score` equals transformers' log-softmax within 1e-4 and 32 greedy tokens are transformers' greedy tokens, for
the bf16-style checkpoint transformers saves (experts transposed) and for the release's MXFP4 experts (against
transformers on the dequantized weights); then at 2,100 tokens, where sliding-window layers slide 30-odd windows while
the prompt is prefilled in 512-token chunks. Greedy tokens are checked by teacher forcing: one reference forward over
prompt + generated tokens, whose argmax at every generated position must be the next generated token.
"""

from __future__ import annotations

import pytest
import torch
from gpt_oss_models import build_gpt_oss, mxfp4_variant, oracle

from reference_models import VOCAB
from strata import Engine
from strata.errors import CheckpointError
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.config import ModelConfig

ATOL = 1e-4


def memory_engine(directory, max_context: int, **planner) -> Engine:
    cfg = {"runtime": {"max_context": max_context, "dtype": "float32", "experts": "memory"}, "planner": planner}
    return Engine.from_pretrained(directory, config=cfg, device="cpu")


def check_scores(engine: Engine, model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours = engine.score(prompt)
    assert ours.shape == (len(prompt), VOCAB)
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"
    return ours


def check_greedy(engine: Engine, model, prompt: list[int], n: int = 32) -> list[int]:
    out = engine.generate(prompt, max_tokens=n, temperature=0.0)
    assert out.finish_reason == "length" and len(out.token_ids) == n
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    assert logits.argmax(-1).tolist() == out.token_ids
    return out.token_ids


def test_matches_transformers(tmp_path):
    model, directory = build_gpt_oss(tmp_path / "oss")
    ckpt = Checkpoint.open(directory)
    assert ckpt.expert_layout == "fused" and ckpt.experts_transposed
    cfg = ckpt.config
    assert cfg.sliding_windows == [12, None, 12, None] and cfg.qkv_bias and cfg.o_bias
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate and cfg.gpt_oss.swiglu_limit == 1.5
    engine = memory_engine(directory, 512)
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    check_scores(engine, model, prompt)
    tokens = check_greedy(engine, model, prompt)
    assert engine.generate(prompt, max_tokens=32, temperature=0.0).token_ids == tokens  # through the prefix cache


def test_mxfp4_experts_match_transformers_on_the_dequantized_weights(tmp_path):
    _, directory = build_gpt_oss(tmp_path / "oss", seed=2)
    released = mxfp4_variant(directory, tmp_path / "oss-mxfp4")
    model = oracle(released)  # transformers reads the release's names and dequantizes the blocks itself
    ckpt = Checkpoint.open(released)
    assert ckpt.expert_format.kind == "mxfp4" and not ckpt.experts_transposed
    engine = memory_engine(released, 512)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    check_scores(engine, model, prompt)
    check_greedy(engine, model, prompt)


def test_long_context_matches_transformers(tmp_path):
    """2,100 tokens: a 64-token window on layers 0 and 2 (YaRN over 256 original positions), chunks of 512."""
    model, directory = build_gpt_oss(tmp_path / "osslong", long=True, seed=3)
    engine = memory_engine(directory, 2200)
    assert engine.prefill_chunk == 512  # the prompt crosses chunk boundaries mid-window
    prompt = torch.randint(0, VOCAB, (2100,), generator=torch.Generator().manual_seed(2)).tolist()
    check_scores(engine, model, prompt)
    check_greedy(engine, model, prompt)


def test_batched_sequences_decode_as_alone(tmp_path):
    """Three sequences of different lengths, two past the window, share every step: each gets transformers' greedy
    tokens."""
    model, directory = build_gpt_oss(tmp_path / "oss", seed=7)
    engine = memory_engine(directory, 256, max_batch=3)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 30, 57)]
    streams = [engine.stream(p, max_tokens=12, temperature=0.0) for p in prompts]
    for prompt, stream in zip(prompts, streams, strict=True):
        for _ in stream:
            pass
        tokens = stream.output.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        assert len(tokens) == 12 and logits.argmax(-1).tolist() == tokens


def test_config_defaults_and_errors():
    """transformers' GptOssConfig defaults (gpt-oss-120b's shape; alternating layers; YaRN x32, theta 150,000) and the
    release's spelling (rope_scaling, experts_per_token); a bad schedule is a one-line error."""
    released = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32, "experts_per_token": 4,
                "rope_theta": 150000, "sliding_window": 128, "eos_token_id": 200002,
                "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                                 "original_max_position_embeddings": 4096, "truncate": False}}
    cfg = ModelConfig.from_hf(released)
    assert (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size) == (24, 32, 4, 2880)
    assert cfg.sliding_windows[:3] == [128, None, 128] and cfg.head_dim == 64 and cfg.num_kv_heads == 8
    assert cfg.moe_intermediate_size == 2880 and cfg.eos_token_ids == [200002] and cfg.qkv_bias and cfg.o_bias
    assert cfg.rope.theta == 150000 and cfg.rope.factor == 32 and not cfg.rope.truncate and cfg.rope.dim == 64
    assert ModelConfig.from_hf({"model_type": "gpt_oss"}).rope == cfg.rope  # the defaults are the release's
    assert cfg.gpt_oss.swiglu_alpha == 1.702 and cfg.gpt_oss.swiglu_limit == 7.0
    with pytest.raises(CheckpointError, match="layer_types"):
        ModelConfig.from_hf({**released, "layer_types": ["sliding_attention"] * 23})
    with pytest.raises(CheckpointError, match="sliding_window"):
        ModelConfig.from_hf({**released, "sliding_window": 0})


@pytest.mark.parametrize("experts, budget", [("bf16", "400KiB"), ("mxfp4", "64KiB")])
def test_tiered_experts_equal_memory(experts, budget, tmp_path):
    """Through the tiers, with room for 5 experts in pinned RAM and the rest read back from disk at each use:
    transformers' transposed tensors packed into a store in strata's orientation, or the release's MXFP4 served in
    place and kept MXFP4 in every tier, the biases dense with the layers; the memory path's scores and greedy tokens."""
    _, directory = build_gpt_oss(tmp_path / "oss", seed=5)
    if experts == "mxfp4":
        directory = mxfp4_variant(directory, tmp_path / "oss-mxfp4")
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    memory = memory_engine(directory, 256)
    expected = memory.score(prompt)
    tokens = memory.generate(prompt, max_tokens=16, temperature=0.0).token_ids
    # the reference math on the CPU (MXFP4 dequantized to fp32), not the compiled kernel's bf16 products
    cfg = {"runtime": {"max_context": 256, "dtype": "float32", "cpu_numerics": "gpu"},
           "tiers": {"pinned": {"budget": budget}, "disk": {"scrub": False}}}
    with Engine.from_pretrained(directory, device="cpu", config=cfg) as tiered:
        plan = tiered.plan
        assert plan.store_mode == ("in_place" if experts == "mxfp4" else "packed")
        assert "reference math" in plan.decode
        store = tiered.tiers.store
        assert store.expert_format.kind == ("mxfp4" if experts == "mxfp4" else "plain")
        ex = tiered.executor  # the clamped form and each layer's biases, and the sums kept in fp32 for the down biases
        assert sorted(ex.expert_biases) == [0, 1, 2, 3] and ex.form.interleaved and not ex.plain_math
        assert (tiered.score(prompt) - expected).abs().max().item() < 1e-5
        assert tiered.generate(prompt, max_tokens=16, temperature=0.0).token_ids == tokens
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk
    cfg["runtime"]["cpu_numerics"] = "fork"  # the compiled kernel: the clamped form and gate_up biases in it
    with Engine.from_pretrained(directory, device="cpu", config=cfg) as forked:
        assert forked.plan.decode.startswith("experts on CPU threads from RAM, the compiled kernel")
        assert (forked.score(prompt) - expected).abs().max().item() < 3e-2  # its bf16 products (fp32 for fp32 experts)
        assert forked.executor.cpu_experts > 0 and forked.executor.use_fast_cpu
        assert tiered.scheduler().cache.nbytes == plan.kv_bytes  # the planner counted what was allocated
