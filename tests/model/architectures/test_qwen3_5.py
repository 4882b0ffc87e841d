"""Qwen3.5-MoE against transformers 5.25's `Qwen3_5MoeForCausalLM` on tiny random checkpoints (fp32, CPU).

Both expert layouts of the text model, and the releases' multimodal layout: `Engine.score` equals transformers'
log-softmax within 1e-4 and 32 greedy tokens are transformers' (decoded through its cache, i.e. its recurrent step,
or checked by teacher forcing: one reference forward over prompt + generated tokens, whose argmax at every generated
position must be the next generated token). Then 2,100 tokens prefilled in 512-token chunks, prompts chunked at
sizes that split the scan's 64-token chunks, several sequences of different lengths sharing steps, a cancelled
sequence's slot reused (cancelled mid-generation, and mid-prompt beside a decoding sequence), and the routed experts
through the tiers against memory.
"""

from __future__ import annotations

import pytest
import torch
from qwen3_5_models import build_q35_reference, build_q35_release
from safetensors.torch import save_file

from reference_models import VOCAB, reference_greedy
from strata import Engine
from strata.runtime.generation.requests import GenRequest
from strata.runtime.generation.sampler import SamplingParams

ATOL = 1e-4


def memory_engine(directory, max_context: int, **runtime) -> Engine:
    cfg = {"runtime": {"max_context": max_context, "dtype": "float32", "experts": "memory", **runtime}}
    return Engine.from_pretrained(directory, config=cfg, device="cpu")


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_scores(engine: Engine, model, prompt: list[int], chunk: int | None = None) -> None:
    """strata's log-probabilities of `prompt` against transformers' forward over it whole, or (`chunk`) through its
    cache in passes of `chunk` tokens, as strata runs them (token-by-token passes round differently from a whole
    one: on these models transformers' own differ from its whole forward by ~1e-4)."""
    with torch.no_grad():
        if chunk is None:
            logits = model(input_ids=torch.tensor([prompt])).logits[0]
        else:
            rows, cache = [], None
            for i in range(0, len(prompt), chunk):
                out = model(input_ids=torch.tensor([prompt[i : i + chunk]]), cache=cache, use_cache=True)
                rows.append(out.logits[0])
                cache = out.cache
            logits = torch.cat(rows)
        ref = torch.log_softmax(logits.float(), dim=-1)
    ours = engine.score(prompt)
    assert ours.shape == (len(prompt), VOCAB)
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax after the prompt and each of `tokens` but the last, in one forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_matches_transformers(fused, tmp_path):
    model, directory = build_q35_reference(tmp_path / "q35", fused=fused)
    engine = memory_engine(directory, 512)
    prompt = prompt_of(48, 1)
    check_scores(engine, model, prompt)
    tokens = engine.generate(prompt, max_tokens=32, temperature=0.0).token_ids
    assert tokens == reference_greedy(model, prompt, 32, cached=True)  # transformers' recurrent decode step
    # the prefix cache is off for this model: the same prompt again runs whole and gives the same tokens
    assert engine.generate(prompt, max_tokens=32, temperature=0.0).token_ids == tokens
    prefix = engine.scheduler().prefix.stats()
    assert not prefix["enabled"] and prefix["cached_tokens"] == 0


def test_release_layout_matches_transformers(tmp_path):
    """config.json `qwen3_5_moe` with the language model under text_config, tensors under model.language_model.
    (fused experts) beside the vision tower, and a multi-token-prediction module (`mtp.*`), which is read past."""
    model, directory = build_q35_release(tmp_path / "release", seed=2)
    save_file({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)},
              str(directory / "mtp.safetensors"))
    engine = memory_engine(directory, 256)
    assert engine.checkpoint.config.model_type == "qwen3_5_moe" and engine.checkpoint.expert_layout == "fused"
    prompt = prompt_of(40, 3)
    check_scores(engine, model, prompt)
    tokens = engine.generate(prompt, max_tokens=32, temperature=0.0).token_ids
    assert teacher_forced(model, prompt, tokens) == tokens


def test_long_context_matches_transformers(tmp_path):
    """2,100 tokens prefilled in 512-token chunks (the recurrent state and the convolution carried from chunk to
    chunk, 33 scan chunks each), then 32 decode steps."""
    model, directory = build_q35_reference(tmp_path / "q35long", long=True, seed=3)
    engine = memory_engine(directory, 2200)
    assert engine.prefill_chunk == 512 and engine.score_chunk == 512
    prompt = prompt_of(2100, 2)
    check_scores(engine, model, prompt)
    tokens = engine.generate(prompt, max_tokens=32, temperature=0.0).token_ids
    assert len(tokens) == 32 and teacher_forced(model, prompt, tokens) == tokens


@pytest.mark.parametrize("chunk", [1, 37, 100])
def test_chunked_prefill_matches_transformers(chunk, tmp_path):
    """Prompt passes of 1, 37 and 100 tokens (against transformers' cache fed the same passes): chunk boundaries
    inside the scan's 64-token chunks and the convolution's window; a 1-token pass continuing a state runs the
    decode step."""
    model, directory = build_q35_reference(tmp_path / "q35", seed=4)
    engine = memory_engine(directory, 512, prefill_chunk=chunk)
    assert engine.score_chunk == chunk
    prompt = prompt_of(150, 5)
    check_scores(engine, model, prompt, chunk)
    tokens = engine.generate(prompt, max_tokens=8, temperature=0.0).token_ids
    assert teacher_forced(model, prompt, tokens) == tokens


def test_batched_sequences_and_reused_slots(tmp_path):
    """Three sequences of different lengths share every step (prompt chunks and decode rows in one batch, each
    with its own state): each gets transformers' greedy tokens. Then a sequence cancelled mid-generation leaves its
    state in its slot, and the next one there starts from zeros."""
    model, directory = build_q35_reference(tmp_path / "q35", seed=7)
    cfg = {"runtime": {"max_context": 256, "dtype": "float32", "experts": "memory", "prefill_chunk": 16},
           "planner": {"max_batch": 3}}
    engine = Engine.from_pretrained(directory, config=cfg, device="cpu")
    prompts = [prompt_of(n, 8 + n) for n in (9, 30, 57)]
    streams = [engine.stream(p, max_tokens=12, temperature=0.0) for p in prompts]
    for prompt, stream in zip(prompts, streams, strict=True):
        for _ in stream:
            pass
        tokens = stream.output.token_ids
        assert len(tokens) == 12 and teacher_forced(model, prompt, tokens) == tokens
    engine.scheduler().configure(max_batch=1)  # one slot: every request below runs in it
    cancelled = engine.stream(prompt_of(70, 9), max_tokens=50, temperature=0.0)
    for i, _ in enumerate(cancelled):
        if i == 3:
            cancelled.close()
            break
    prompt = prompt_of(21, 10)
    tokens = engine.generate(prompt, max_tokens=16, temperature=0.0).token_ids
    assert teacher_forced(model, prompt, tokens) == tokens


def test_a_sequence_cancelled_mid_prompt_beside_a_decoding_one(tmp_path):
    """A long prompt cancelled while its chunks still run beside a decoding sequence: the decoding one keeps
    transformers' greedy tokens, and the next sequence in the cancelled one's slot starts from zero states (its
    tokens transformers' too), though that slot's linear-attention and convolution states held part of a prompt."""
    model, directory = build_q35_reference(tmp_path / "q35", seed=9)
    cfg = {"runtime": {"max_context": 256, "dtype": "float32", "experts": "memory", "prefill_chunk": 4},
           "planner": {"max_batch": 2}}
    engine = Engine.from_pretrained(directory, config=cfg, device="cpu")
    sched = engine.scheduler()
    sched.start()
    long_prompt, short_prompt = prompt_of(200, 11), prompt_of(13, 12)
    # the short one first: its prompt takes the steps' 4-token budget, then the long one's chunks share them
    short_run, long_run = sched.submit_together([
        GenRequest(short_prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        GenRequest(long_prompt, SamplingParams(max_tokens=4, temperature=0.0))], asynchronous=False)
    short_events = short_run.iter_events(timeout=120)
    first = next(short_events)  # the short prompt is done; the long one has ~190 of its 200 tokens to go
    sched.cancel(long_run)
    cut = list(long_run.iter_events(timeout=120))
    assert [e.token_id for e in cut if e.token_id is not None] == [] and cut[-1].finish_reason == "abort"
    after = engine.generate(prompt_of(21, 13), max_tokens=10, temperature=0.0).token_ids  # the freed slot
    short_tokens = [first.token_id] + [e.token_id for e in short_events if e.token_id is not None]
    assert len(short_tokens) == 12 and teacher_forced(model, short_prompt, short_tokens) == short_tokens
    assert teacher_forced(model, prompt_of(21, 13), after) == after


def test_tiered_experts_equal_memory(tmp_path):
    """Routed experts through the tiers (a store; a few experts' room in pinned RAM, the rest read from disk at each
    use) give the memory path's scores and greedy tokens; the cache is what the planner counted."""
    model, directory = build_q35_reference(tmp_path / "q35", fused=True, seed=5)
    prompt = prompt_of(40, 6)
    memory = memory_engine(directory, 256)
    expected = memory.score(prompt)
    tokens = memory.generate(prompt, max_tokens=16, temperature=0.0).token_ids
    assert teacher_forced(model, prompt, tokens) == tokens
    cfg = {"runtime": {"max_context": 256, "dtype": "float32"},
           "tiers": {"pinned": {"budget": "40KiB"}, "disk": {"scrub": False}}}
    with Engine.from_pretrained(directory, device="cpu", config=cfg) as tiered:
        assert tiered.executor is not None
        assert (tiered.score(prompt) - expected).abs().max().item() < 1e-5
        assert tiered.generate(prompt, max_tokens=16, temperature=0.0).token_ids == tokens
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk
        assert tiered.scheduler().cache.nbytes == tiered.plan.kv_bytes  # the planner counted what was allocated
