"""DeepSeek-V4 against transformers 5.25's `DeepseekV4ForCausalLM` on tiny random checkpoints (fp32, CPU).

Both on-disk layouts (the original release's names with per-expert tensors, transformers' fused ones): `Engine.score`
equals transformers' log-softmax within 1e-4 and 32 greedy tokens (8 after 16 prompt tokens under Triton's
interpreter) are transformers' greedy tokens; then the same at 2,100 tokens, where the prompt is prefilled in
512-token chunks through the sliding window, hundreds of compressed entries and the indexer's top-k. Greedy tokens are
checked by teacher forcing: one reference forward over prompt + generated tokens, whose argmax at every generated
position must be the next generated token (greedy decoding's definition, without 32 reference forwards).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from deepseek_v4_models import build_v4_reference
from safetensors.torch import save_file

from reference_models import VOCAB
from strata import Engine
from strata.errors import CheckpointError, UnsupportedError
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.config import ModelConfig

ATOL = 1e-4
# the short check's prompt and greedy tokens: fewer under Triton's interpreter (tests/kernels/test_kernels_interpreted.py
# runs the fused-layout check there, where every pass's kernels run ~1,000x slower and these already cover them)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PROMPT, GREEDY = (16, 8) if INTERPRETED else (48, 32)


def memory_engine(directory, max_context: int) -> Engine:
    cfg = {"runtime": {"max_context": max_context, "dtype": "float32", "experts": "memory"}}
    return Engine.from_pretrained(directory, config=cfg, device="cpu")


def check_scores(engine: Engine, model, prompt: list[int]) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours = engine.score(prompt)
    assert ours.shape == (len(prompt), VOCAB)
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"


def check_greedy(engine: Engine, model, prompt: list[int], n: int = GREEDY) -> list[int]:
    out = engine.generate(prompt, max_tokens=n, temperature=0.0)
    assert out.finish_reason == "length" and len(out.token_ids) == n
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    assert logits.argmax(-1).tolist() == out.token_ids
    return out.token_ids


@pytest.mark.parametrize("fused", [False, True], ids=["original-names", "fused"])
def test_matches_transformers(fused, tmp_path):
    model, directory = build_v4_reference(tmp_path / "v4", fused=fused)
    engine = memory_engine(directory, 512)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    check_scores(engine, model, prompt)
    tokens = check_greedy(engine, model, prompt)
    # the prefix cache reuses the first request's state (rings snapshotted at the end of its prompt pass)
    assert engine.generate(prompt, max_tokens=len(tokens), temperature=0.0).token_ids == tokens


def test_long_context_matches_transformers(tmp_path):
    """2,100 tokens: YaRN on the compressed branches, a 64-token window, 525 CSA and 131 HCA entries, top-8 picks."""
    model, directory = build_v4_reference(tmp_path / "v4long", long=True, seed=3)
    engine = memory_engine(directory, 2200)
    assert engine.prefill_chunk == 512  # the prompt crosses chunk boundaries mid-window
    prompt = torch.randint(0, VOCAB, (2100,), generator=torch.Generator().manual_seed(2)).tolist()
    check_scores(engine, model, prompt)
    check_greedy(engine, model, prompt)


def test_mtp_layers_are_skipped(tmp_path):
    """A release's multi-token-prediction tensors (`mtp.*`) are read past: the model loads and scores the same."""
    model, directory = build_v4_reference(tmp_path / "v4", layers=2)
    save_file({"mtp.0.attn.wq_a.weight": torch.zeros(24, 64), "mtp.0.hc_head_fn": torch.zeros(3, 192)},
              str(directory / "mtp.safetensors"))
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    check_scores(memory_engine(directory, 64), model, prompt)


def test_config_spellings():
    """Legacy keys fold in as transformers' DeepseekV4Config does; bad schedules are one-line errors."""
    base = {"model_type": "deepseek_v4", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "head_dim": 16, "q_lora_rank": 8, "moe_intermediate_size": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "o_groups": 2, "index_head_dim": 16}
    legacy = ModelConfig.from_hf({**base, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1,
                                  "compress_rate_hca": 64, "qk_rope_head_dim": 4,
                                  "rope_scaling": {"type": "yarn", "factor": 16,
                                                   "original_max_position_embeddings": 65536},
                                  "compress_rope_theta": 160000.0})
    s = legacy.deepseek_v4
    assert s.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                             "compressed_sparse_attention"]
    assert [s.rate(i) for i in range(4)] == [0, 4, 64, 4]
    assert s.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"] and s.hash_layers == [0]
    assert legacy.qk_rope_head_dim == 4 and legacy.rope.rope_type == "default" and legacy.rope.theta == 10000.0
    assert s.compress_rope["rope_type"] == "yarn" and s.compress_rope["attention_factor"] == 1.0
    assert s.compress_rope["theta"] == 160000.0 and s.compress_rope["factor"] == 16
    default = ModelConfig.from_hf(base).deepseek_v4  # V4-Pro's schedule: 2 HCA, then CSA / HCA alternating
    assert default.layer_types == ["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention"]
    assert default.mlp_layer_types == ["hash_moe"] * 3 + ["moe"]
    with pytest.raises(CheckpointError, match="layer_types"):
        ModelConfig.from_hf({**base, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    with pytest.raises(UnsupportedError, match="scoring_func"):
        ModelConfig.from_hf({**base, "scoring_func": "softmax"})
    json.dumps(s.compress_rope)  # plain data: the planner and CLI print configs


def test_tiered_experts_equal_memory(tmp_path):
    """Through the tiers (a store; 5 experts' room in pinned RAM, the rest read from disk at each use) the routed
    experts, clipped as in memory, and the hash layer's table (a store table object) give the memory path's scores
    and greedy tokens."""
    model, directory = build_v4_reference(tmp_path / "v4", seed=5)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    memory = memory_engine(directory, 256)
    expected = memory.score(prompt)
    tokens = check_greedy(memory, model, prompt, 16)
    cfg = {"runtime": {"max_context": 256, "dtype": "float32"},
           "tiers": {"pinned": {"budget": "120KiB"}, "disk": {"scrub": False}}}
    with Engine.from_pretrained(directory, device="cpu", config=cfg) as tiered:
        assert tiered.executor is not None and tiered.executor.form.limit == 0.3
        store = tiered.tiers.store  # the hash layer's tid2eid: a store table, checked and held in RAM
        assert "tid2eid.0" in store.index.tables and "model.layers.0.mlp.gate.tid2eid" not in Checkpoint.open(
            store.directory).index
        assert torch.equal(tiered.model.layers[0].mlp.gate.tid2eid, memory.model.layers[0].mlp.gate.tid2eid)
        assert (tiered.score(prompt) - expected).abs().max().item() < 1e-5
        assert tiered.generate(prompt, max_tokens=16, temperature=0.0).token_ids == tokens
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk
        assert tiered.scheduler().cache.nbytes == tiered.plan.kv_bytes  # the planner counted what was allocated


def test_batched_sequences_decode_as_alone(tmp_path):
    """Three sequences of different lengths share every step (prompt chunks and decode rows in one batch, each with
    its own window, entries and picks): each gets transformers' greedy tokens."""
    model, directory = build_v4_reference(tmp_path / "v4", seed=7)
    cfg = {"runtime": {"max_context": 256, "dtype": "float32", "experts": "memory"}, "planner": {"max_batch": 3}}
    engine = Engine.from_pretrained(directory, config=cfg, device="cpu")
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
