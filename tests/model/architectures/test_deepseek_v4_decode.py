"""DeepSeek-V4 decode steps as `DecodeBatch` steps (fixed shapes over a `kv_len` bucket: what CUDA graphs capture)
against its `StepBatch` path, on tiny random checkpoints built with transformers (tests/support/deepseek_v4_models.py).

On the CPU in fp32: DecodeBatch decode (source rings written and the current entry pooled every step, kept only where
its window completes; window keys gathered from the ring by position; HCA entries over the bucket's span, CSA's
top-k over it with the incomplete picks at -1) gives the StepBatch path's logits within 1e-4 and the same greedy
tokens, for sequences of different lengths in slots out of order, across HCA and CSA window completions, the sliding
window, the indexer's top-k filling up, a `kv_len` bucket, and a context shorter than the window; and a step runs no
op whose result the host reads (what a CUDA graph cannot capture). On CUDA (marked gpu): the engine's eager
DecodeBatch steps follow the StepBatch path, and decode steps captured in CUDA graphs, in memory and tiered, give the
eager engine's greedy tokens.
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
from deepseek_v4_models import build_v4_reference
from torch.utils._python_dispatch import TorchDispatchMode

from reference_models import VOCAB
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.graphs import DecodeGraphs
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.loader import load_model

MAX_LEN = 700


def caches(model, max_len: int = MAX_LEN, device: str = "cpu"):
    """The model's own cache (windows, source rings, entries), `num_slots` sequences of `max_len` in fp32."""
    return lambda num_slots: model.new_cache(num_slots, max_len, torch.float32, device)


def test_decode_batch_equals_step_batch(tmp_path):
    """A 12-token window, CSA entries every 4 tokens with top-3 picks, HCA every 8: sequences of 3, 40 and 1 tokens
    in slots 3, 0 and 2 of a 4-slot cache (slot 1 unused), 32 steps: the short ones cross the window and the top-k's
    filling up (fewer complete entries than picks, then more), all of them several HCA and CSA completions."""
    _, directory = build_v4_reference(tmp_path / "v4", seed=11)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    s = model.cfg.deepseek_v4
    assert model.decode_graphs
    assert (s.sliding_window, s.rate(1), s.rate(2), s.index_topk) == (12, 4, 8, 3)
    greedy_both_ways(model, caches(model), [3, 40, 1], 32, seed=12, slots=[3, 0, 2])


def test_long_decode_batch_equals_step_batch_across_buckets(tmp_path):
    """A 64-token window, HCA every 16, top-8 picks: 250, 70 and 5 tokens; the longest crosses from the 256-position
    bucket into the 512 one (the entries read per sequence grow with it), the shortest crosses the window."""
    _, directory = build_v4_reference(tmp_path / "v4", long=True, seed=13)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    assert model.cfg.deepseek_v4.sliding_window == 64
    assert greedy_both_ways(model, caches(model), [250, 70, 5], 24, seed=14, slots=[1, 2, 0]) == {256, 512}


def test_decode_batch_with_a_context_shorter_than_the_window(tmp_path):
    """A 10-position cache: the window ring (10 rows) is shorter than the 12-token window, the bucket is the whole
    context, one HCA entry is read of the two the cache holds."""
    _, directory = build_v4_reference(tmp_path / "v4", seed=17, layers=3)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    assert greedy_both_ways(model, caches(model, max_len=10), [2, 5, 1], 4, seed=18, slots=[1, 0, 2]) == {10}


class HostReads(TorchDispatchMode):
    """Records the ops whose result the host reads (a sync on CUDA, or a shape from data) while `active`."""

    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.repeat_interleave.Tensor",
             "aten.bincount", "aten.unique", "aten._unique", "aten.item")

    def __init__(self):
        super().__init__()
        self.active, self.reads, self.ops = True, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            self.ops += 1
            name = str(func)
            masks = name.startswith(("aten.index.", "aten.index_put")) and any(  # boolean-mask indexing
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
            if name.startswith(self.READS) or masks:
                self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_decode_batch_step_reads_nothing_back(tmp_path):
    """A DecodeBatch step, but for the routed experts' CPU math (which groups tokens on the host; on CUDA they take
    the pair kernels), runs no op whose result the host reads: nothing syncs, no shape comes from data."""
    _, directory = build_v4_reference(tmp_path / "v4", seed=19)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    cache = model.new_cache(3, 300, torch.float32, "cpu")
    reads = HostReads()
    for layer in model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda *_: setattr(reads, "active", False))
        layer.mlp.experts.register_forward_hook(lambda *_: setattr(reads, "active", True))
    with torch.no_grad():
        for slot, n in ((0, 30), (2, 7)):
            model.run_layers(torch.randint(0, VOCAB, (n,)), StepBatch([slot], [0], [n]), cache)
        with reads:
            model.run_layers(torch.tensor([5, 9]), DecodeBatch(torch.tensor([2, 0]), torch.tensor([7, 30]), 256),
                             cache)
    assert reads.ops > 500 and reads.reads == []


def test_the_switch_gives_decode_graphs(tmp_path):
    """`enable_decode_graphs` sets up DecodeGraphs over the model's layers, captured as the build's mode says (with
    `decode_graphs` off: told no mode, every step eager)."""
    _, directory = build_v4_reference(tmp_path / "v4", seed=1, layers=2)
    model = load_model(Checkpoint.open(directory), torch.float32, "cpu")
    model.enable_decode_graphs(lambda: "segmented")
    assert isinstance(model.graphs, DecodeGraphs) and model.graphs.mode() == "segmented"
    assert model.graphs.forward == model.run_layers
    model.decode_graphs = False
    model.enable_decode_graphs(lambda: "full")
    assert isinstance(model.graphs, DecodeGraphs) and model.graphs.mode() is None


@pytest.mark.gpu
def test_cuda_decode_steps_run_as_decode_batches(tmp_path):
    """On CUDA (fp32) a decode step handed over as a StepBatch runs through DecodeGraphs as an eager DecodeBatch step
    (nothing captured), its in-memory experts through the pair kernels; its logits follow the StepBatch path's (up to
    tf32 products) across the 256 -> 512 bucket, past the 64-token window."""
    _, directory = build_v4_reference(tmp_path / "v4", long=True, seed=15)
    engine = eager_cuda_engine(directory, MAX_LEN)
    assert_engine_decode_follows_step_batches(engine, caches(engine.model, device="cuda"), slots=[2, 0, 1])
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["memory", "tiered"])
def test_cuda_graph_decode_equals_eager(experts, tmp_path):
    """Decode steps captured in CUDA graphs (memory: one graph a step, the experts through the pair kernels in the
    clipped form; tiered: 3 of the 8 experts of each layer in GPU slots, the rest copied in at host steps between
    graph segments) give the eager engine's greedy tokens, fp32, three sequences batched, 40 steps: past the 12-token
    window, across HCA and CSA completions."""
    _, directory = build_v4_reference(tmp_path / "v4", seed=21)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40, 3)]
    assert_graphs_equal_eager(directory, prompts, 40, experts, 4 * 3 * 3 * 64 * 32 * 4)  # 3 fp32 experts a layer


def test_a_pass_computes_each_positions_tables_once(tmp_path):
    """Within one pass over the layers the rotary tables of a positions tensor are computed once (what every layer's
    attention, compressor and indexer ask for); their values are those computed alone, window starts included; a
    new pass computes them again."""
    from strata.runtime.model.config import RopeConfig
    from strata.runtime.model.deepseek_v4.rope import InterleavedRope

    rope = InterleavedRope(RopeConfig(theta=10000.0, dim=16))
    pos = torch.tensor([0, 5, 17, 130])
    alone = rope(pos, torch.float32)
    starts = rope(pos // 8 * 8, torch.float32)
    rope.begin_pass()
    first = rope(pos, torch.float32)
    assert rope(pos, torch.float32)[0] is first[0]  # shared, not recomputed
    assert rope(pos.clone(), torch.float32)[0] is not first[0]  # another tensor: its own tables
    assert torch.equal(first[0], alone[0]) and torch.equal(first[1], alone[1])
    windows = rope.window_starts(pos, 8, torch.float32)
    assert torch.equal(windows[0], starts[0]) and torch.equal(windows[1], starts[1])
    assert rope.window_starts(pos, 8, torch.float32)[0] is windows[0]
    rope.end_pass()
    assert rope(pos, torch.float32)[0] is not first[0]
