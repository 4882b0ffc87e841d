"""The model's collaborators (strata.runtime.model.hooks), the capture state (strata.runtime.model.capture) and the
tiered executor as the engine shows it (`Engine.executor`). CPU: no graphs; what a capture defers is replayed by hand.
"""

from __future__ import annotations

import threading

import pytest
import torch

from strata import Engine
from strata.runtime.model.capture import SegmentRecorder, capturing, current_capture_mode, current_recorder
from strata.runtime.model.kv_cache import KVCache, StepBatch
from strata.runtime.offload.executor import ExpertExecutor
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore


class Seen:
    """A `LayerObserver` that keeps what it was told."""

    def __init__(self):
        self.calls: list[tuple[int, torch.Tensor]] = []

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        self.calls.append((layer, hidden.clone()))


def test_the_layer_observer_is_told_each_layers_output(tiny_model_dir):
    """After every decoder layer, in order, with that layer's output [N, H]: the last one, normed, is the pass's
    result. None stops it."""
    engine = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"experts": "memory"}})
    model, seen = engine.model, Seen()
    assert model.layer_observer is None  # every expert in memory: no prefetcher observes the layers
    model.observe_layers(seen)
    cache = KVCache(model.cfg, 1, 64, engine.dtype, "cpu")
    with torch.inference_mode():
        out = model(torch.arange(3, 9), StepBatch([0], [0], [6]), cache)
        assert [layer for layer, _ in seen.calls] == list(range(model.cfg.num_layers))
        assert all(h.shape == (6, model.cfg.hidden_size) for _, h in seen.calls)
        assert torch.equal(model.norm(seen.calls[-1][1]), out)
        model.observe_layers(None)
        model(torch.tensor([9]), StepBatch([0], [6], [1]), cache)
    assert len(seen.calls) == model.cfg.num_layers
    engine.close()


def test_the_capture_state_is_the_threads_own_and_restored_after():
    """`capturing` sets this thread's mode (and recorder); another thread sees none; leaving the block, even by an
    exception, restores what was there before."""
    rec = SegmentRecorder(pool=None)
    assert current_capture_mode() is None and current_recorder() is None
    with capturing("segmented"):  # the eager warm-up of a capture: a mode, no recorder yet
        assert current_capture_mode() == "segmented" and current_recorder() is None
        with capturing("segmented", rec):
            assert current_recorder() is rec
            other: list = []
            t = threading.Thread(target=lambda: other.append((current_capture_mode(), current_recorder())))
            t.start()
            t.join()
            assert other == [(None, None)]
        assert current_capture_mode() == "segmented" and current_recorder() is None
        with pytest.raises(RuntimeError), capturing("mailbox"):
            raise RuntimeError("a capture that failed")
        assert current_capture_mode() == "segmented"
    assert current_capture_mode() is None and current_recorder() is None


@pytest.fixture(scope="module")
def store(tiny_model_dir, tmp_path_factory):
    s = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("store") / "tiny", progress=False))
    yield s
    s.close()


def test_the_executor_predicts_after_a_layer_and_a_capture_defers_the_fetch_to_each_replay(store):
    """`ExpertCompute.after_layer` runs its prefetcher: eagerly it predicts and fetches now; inside a segmented
    capture it hands the fetch to the capture (`defer`), which issues it at every replay."""
    predicted = []
    predictors = {layer: (lambda h, layer=layer: predicted.append(layer) or torch.tensor([[1, 2]]))
                  for layer in store.index.moe_layers}
    first, second = store.index.moe_layers[:2]
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=len(store.keys())), gpu_device=torch.device("cpu"),
                    io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "gpu")  # copies only: the prefetcher fetches into GPU slots
        compute.start_prefetching(predictors, lookahead=1)
        issued = lambda: m.stats_.prefetch_issued  # noqa: E731
        rec = SegmentRecorder(pool=None)
        with capturing("segmented", rec):
            compute.after_layer(first, torch.zeros(1, 8))
        assert predicted == [second] and len(rec.deferred) == 1 and issued() == 0  # predicted in the graph only
        rec.deferred[0]()  # a replay: the captured prediction's experts are fetched
        assert issued() == 2 and m.wait_settled(30)
        assert all("gpu" in m.residency((second, e)) for e in (1, 2))
        compute.after_layer(second - 1, torch.zeros(1, 8))  # eager: predicted now, nothing deferred
        assert predicted == [second, second] and len(rec.deferred) == 1
    finally:
        m.close()


def test_the_engine_shows_its_executor(tiny_engine, tiny_model_dir):
    """`Engine.executor`: a tiered engine's `ExpertCompute` (the model's layer observer, with its prefetcher),
    with every field `ExpertExecutor` documents; None when every expert is in memory."""
    ex = tiny_engine.executor
    assert isinstance(ex, ExpertCompute) and tiny_engine.model.layer_observer is ex and ex.prefetcher is not None
    fields = [n for n in vars(ExpertExecutor) if not n.startswith("_")] + list(ExpertExecutor.__annotations__)
    assert {"rates", "mailbox", "close_mailbox", "reproducible"} <= set(fields)
    assert all(hasattr(ex, n) for n in fields)
    assert tiny_engine.stats()["cpu_bytes_per_s"] == ex.rates.cpu_bytes_per_s
    memory = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"experts": "memory"}})
    assert memory.executor is None and memory.stats()["one_graph_decode"] is None
    memory.close()
