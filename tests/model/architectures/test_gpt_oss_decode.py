"""gpt-oss decode steps as `DecodeBatch` steps (fixed shapes over a `kv_len` bucket: what CUDA graphs capture) against
its `StepBatch` path, on tiny random checkpoints (tests/support/gpt_oss_models.py).

On the CPU in fp32: the torch decode attention with sinks (`attend_decode_sinks`) equals the per-sequence one
(`attend_with_sinks`), and a model's DecodeBatch decode gives the StepBatch path's logits within 1e-4 and the same 32
greedy tokens, for several sequences of different lengths in one batch, past the sliding window and across a
`kv_len` bucket. The switch (`decode_graphs`) and, on CUDA (marked gpu), the engine's decode steps
running as eager DecodeBatch steps through the Triton kernel's sinks build.
"""

from __future__ import annotations

import pytest
import torch
from decode_checks import (
    assert_engine_decode_follows_step_batches,
    assert_graphs_equal_eager,
    eager_cuda_engine,
    greedy_both_ways,
)
from gpt_oss_models import build_gpt_oss

from reference_models import VOCAB
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.gpt_oss.attention import attend_decode_sinks, attend_with_sinks
from strata.runtime.model.graphs import DecodeGraphs
from strata.runtime.model.kv_cache import KVCache
from strata.runtime.model.loader import load_model

MAX_LEN = 700


def kv_caches(model, device: str = "cpu"):
    """The shared KVCache gpt-oss runs with, `num_slots` sequences of MAX_LEN positions in fp32."""
    return lambda num_slots: KVCache(model.cfg, num_slots, MAX_LEN, torch.float32, device)


@pytest.mark.parametrize("window", [None, 5, 12, 400])
def test_decode_attention_with_sinks_equals_the_per_sequence_one(window):
    """Three sequences at positions 0, 3 and 250 in one step (before, inside and past the window; a window of 400
    wider than the 256-position bucket) == each alone over its prefix."""
    g = torch.Generator().manual_seed(0 if window is None else window)
    heads, kv_heads, d, length = 8, 2, 16, 256
    kc, vc = torch.randn(4, MAX_LEN, kv_heads, d, generator=g), torch.randn(4, MAX_LEN, kv_heads, d, generator=g)
    q, sinks = torch.randn(3, heads, d, generator=g), torch.randn(heads, generator=g) * 2
    slots, pos = torch.tensor([2, 0, 3]), torch.tensor([0, 3, 250])
    out = attend_decode_sinks(q, kc, vc, slots, pos, length, window, d ** -0.5, sinks)
    assert out.shape == (3, heads, d)
    for i in range(3):
        p = int(pos[i])
        want = attend_with_sinks(q[i : i + 1], kc[slots[i], : p + 1], vc[slots[i], : p + 1], p, window, d ** -0.5,
                                 sinks)
        torch.testing.assert_close(out[i], want[0], rtol=1e-5, atol=1e-6)


def test_decode_batch_equals_step_batch(tmp_path):
    """A 12-token window: sequences of 3, 40 and 1 tokens (one far past the window, one reaching it mid-decode)."""
    _, directory = build_gpt_oss(tmp_path / "oss", seed=11)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    assert model.cfg.sliding_windows == [12, None, 12, None]
    greedy_both_ways(model, kv_caches(model), [3, 40, 1], 32, seed=12)


def test_long_decode_batch_equals_step_batch_across_buckets(tmp_path):
    """A 64-token window (YaRN over 256 positions): 250, 70 and 5 tokens; the longest crosses from the 256-position
    bucket into the 512 one."""
    _, directory = build_gpt_oss(tmp_path / "oss", long=True, seed=13)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    assert model.cfg.sliding_windows[0] == 64
    assert greedy_both_ways(model, kv_caches(model), [250, 70, 5], 32, seed=14) == {256, 512}


def test_the_switch_gives_decode_graphs(tmp_path):
    """`enable_decode_graphs` sets up DecodeGraphs over gpt-oss's layers, captured as the build's mode says
    (`decode_graphs`), never with the switch off."""
    _, directory = build_gpt_oss(tmp_path / "oss", seed=1, layers=2)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    assert model.decode_graphs
    model.enable_decode_graphs(lambda: "segmented")
    assert isinstance(model.graphs, DecodeGraphs) and model.graphs.mode() == "segmented"
    assert model.graphs.forward == model.run_layers
    model.decode_graphs = False
    model.enable_decode_graphs(lambda: "full")
    assert model.graphs.mode() is None


@pytest.mark.gpu
def test_cuda_decode_steps_run_as_decode_batches(tmp_path, monkeypatch):
    """On CUDA (fp32) the engine's model runs a decode step given as a StepBatch through DecodeGraphs, as an eager
    DecodeBatch step (nothing captured) attending with the kernel's sinks build; its logits follow the StepBatch
    path's (up to the kernel's tf32 dot products) across the 256 -> 512 bucket, past the 64-token window."""
    import strata.runtime.model.gpt_oss.attention as oss_attention

    _, directory = build_gpt_oss(tmp_path / "oss", long=True, seed=15)
    engine = eager_cuda_engine(directory, MAX_LEN)  # (captured steps: the test below)
    sinks_builds = []
    real = oss_attention.decode_attention
    monkeypatch.setattr(oss_attention, "decode_attention",
                        lambda *a, **k: sinks_builds.append(k["sinks"] is not None) or real(*a, **k))

    assert_engine_decode_follows_step_batches(engine, kv_caches(engine.model, "cuda"))
    assert sinks_builds and all(sinks_builds)
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["memory", "tiered"])
def test_cuda_graph_decode_equals_eager(experts, tmp_path):
    """Decode steps captured in CUDA graphs (the pair kernels in the clamped form, gate_up biases in the kernels,
    down biases in the combine; tiered: 4 of the 32 experts (72 KiB each in fp32) in GPU slots, the rest copied
    in at host steps between graph segments) give the eager engine's greedy tokens, fp32, two sequences batched."""
    _, directory = build_gpt_oss(tmp_path / "oss", seed=21)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40)]
    assert_graphs_equal_eager(directory, prompts, 24, experts, "300KiB")
