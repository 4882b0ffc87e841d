"""Qwen3.5-MoE decode steps as `DecodeBatch` steps (fixed shapes over a `kv_len` bucket: what CUDA graphs capture)
against its `StepBatch` path, on tiny random checkpoints built with transformers (tests/support/qwen3_5_models.py).

On the CPU in fp32: DecodeBatch decode (each Gated DeltaNet layer's states gathered by slot, stepped and written back;
each full-attention layer's keys written at each position and attended over the bucket) gives the StepBatch path's
logits within 1e-4 and the same 32 greedy tokens (8 under Triton's interpreter), for sequences of different lengths in slots out of order, across a
`kv_len` bucket. On CUDA (marked gpu): the engine's decode steps through the split-KV kernel over the head-major
cache's transposed view, and decode steps captured in CUDA graphs, in memory and tiered, equal to eager decode.
"""

from __future__ import annotations

import os

import pytest
import torch
from decode_checks import (
    assert_engine_decode_follows_step_batches,
    assert_graphs_equal_eager,
    eager_cuda_engine,
    greedy_both_ways,
)
from qwen3_5_models import build_q35_reference

from reference_models import VOCAB
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.graphs import DecodeGraphs
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch, kv_bucket
from strata.runtime.model.loader import load_model

MAX_LEN = 700
# greedy steps a short check takes: fewer under Triton's interpreter (tests/kernels/test_kernels_interpreted.py runs
# this module's short checks there, where a step's kernels run ~1,000x slower and 8 steps already cover them)
STEPS = 8 if os.environ.get("TRITON_INTERPRET") == "1" else 32


def caches(model, device: str = "cpu"):
    """The model's own cache (linear states and full-attention slabs), `num_slots` sequences of MAX_LEN in fp32."""
    return lambda num_slots: model.new_cache(num_slots, MAX_LEN, torch.float32, device)


def test_decode_batch_equals_step_batch(tmp_path):
    """Sequences of 3, 40 and 1 tokens in slots 3, 0 and 2 of a 4-slot cache (slot 1 unused)."""
    _, directory = build_q35_reference(tmp_path / "q35", seed=11)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    assert model.decode_graphs
    greedy_both_ways(model, caches(model), [3, 40, 1], STEPS, seed=12, slots=[3, 0, 2])


def test_long_decode_batch_equals_step_batch_across_buckets(tmp_path):
    """250, 70 and 5 tokens: the longest crosses from the 256-position bucket into the 512 one."""
    _, directory = build_q35_reference(tmp_path / "q35", long=True, seed=13)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    assert greedy_both_ways(model, caches(model), [250, 70, 5], 32, seed=14, slots=[1, 2, 0]) == {256, 512}


def test_a_one_token_prompt_in_a_reused_slot_starts_from_zeros(tmp_path):
    """A DecodeBatch row at position 0 (a one-token prompt: the engine's decode path takes every step whose sequences
    feed one token each) in a slot a 9-token sequence held before, beside a row continuing at position 5: its linear
    layers start from zeros, as the StepBatch path's first pass does, and the next step continues both alike."""
    _, directory = build_q35_reference(tmp_path / "q35", seed=3)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    a, b = caches(model)(2), caches(model)(2)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for slot, n in ((1, 9), (0, 5)):  # slot 1's earlier occupant, slot 0's prompt
            prompt = torch.randint(0, VOCAB, (n,), generator=g)
            for cache in (a, b):
                model.run_layers(prompt, StepBatch([slot], [0], [n]), cache)
        for pos in ([5, 0], [6, 1]):
            ids = torch.randint(0, VOCAB, (2,), generator=g)
            want = model.logits(model.run_layers(ids, StepBatch([0, 1], pos, [1, 1]), a))
            batch = DecodeBatch(torch.tensor([0, 1]), torch.tensor(pos), kv_bucket(max(pos), MAX_LEN))
            got = model.logits(model.run_layers(ids, batch, b))
            assert (got - want).abs().max().item() < 1e-4, pos


def test_the_switch_gives_decode_graphs(tmp_path):
    """`enable_decode_graphs` sets up DecodeGraphs over the model's layers, captured as the build's mode says."""
    _, directory = build_q35_reference(tmp_path / "q35", seed=1, layers=2)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    model.enable_decode_graphs(lambda: "segmented")
    assert isinstance(model.graphs, DecodeGraphs) and model.graphs.mode() == "segmented"
    assert model.graphs.forward == model.run_layers


@pytest.mark.gpu
def test_cuda_decode_steps_run_through_the_kernel(tmp_path, monkeypatch):
    """On CUDA (fp32) a decode step handed over as a StepBatch runs through DecodeGraphs as an eager DecodeBatch step,
    its full-attention layers through the split-KV kernel over the slabs' transposed view; its logits follow the
    StepBatch path's (up to the kernel's tf32 dot products) across the 256 -> 512 bucket."""
    import strata.runtime.model.qwen3_5.attention as q35_attention

    _, directory = build_q35_reference(tmp_path / "q35", long=True, seed=15)
    engine = eager_cuda_engine(directory, MAX_LEN)
    kernel_calls = []
    real = q35_attention.decode_attention
    monkeypatch.setattr(q35_attention, "decode_attention", lambda *a, **k: kernel_calls.append(1) or real(*a, **k))

    assert_engine_decode_follows_step_batches(engine, caches(engine.model, "cuda"), slots=[2, 0, 1])
    assert kernel_calls
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["memory", "tiered"])
def test_cuda_graph_decode_equals_eager(experts, tmp_path):
    """Decode steps captured in CUDA graphs (tiered: 3 of the 8 experts of each layer in GPU slots, the rest copied in
    at host steps between graph segments, or read by the CPU worker) give the eager engine's greedy tokens, fp32,
    three sequences batched."""
    _, directory = build_q35_reference(tmp_path / "q35", seed=21)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40, 3)]
    assert_graphs_equal_eager(directory, prompts, 24, experts, 4 * 3 * 3 * 64 * 32 * 4)  # 3 fp32 experts a layer
