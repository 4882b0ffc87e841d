"""A tiered layer on a GGUF store through the GPU fast path (strata.kernels.gpu.experts.gguf_pairs, gguf_tiles): the GPU
tier's slots handed to the pair kernels as `QuantSlotWeights` of the store's gguf layout, decode through the pair path,
prefill through the grouped GEMMs on a dequantized scratch and through the per-expert loop, each against every expert in
memory, dequantized (fp32). The store mixes block types per tensor and per layer, so each matrix's kernels pick an
expert's type by its blob's header. On the CPU the GPU tier is simulated in RAM and the paths are their torch fallbacks;
on CUDA the same layer runs the Triton kernels.

The fast path is turned on here for gguf (strata.kernels.quant.FAST_PATHS' GPU entries), whatever the runtime's
registry says."""

from __future__ import annotations

import pytest
import torch

from strata.kernels import quant
from strata.kernels.experts import moe_forward
from strata.kernels.gpu.experts.gguf_tiles import KERNEL_TYPES
from strata.kernels.gpu.experts.grouped import formats_supported
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_models import build_qwen3_gguf  # noqa: E402

TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q3_K", "IQ4_XS")]  # layer 0 as Q4_K_M keeps it; layer 1 the others
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from strata.runtime.plan.checkpoints.gguf_convert import convert_gguf

    root = tmp_path_factory.mktemp("gguf-gpu-path")
    _, path = build_qwen3_gguf(root, TYPES, seed=3)
    opened = ExpertStore.open(convert_gguf(path, root / "store"))
    yield opened
    opened.close()


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU entries of FAST_PATHS with every format the GPU kernels read (and, where the registry lists GGUF block
    types per path, every type they read)."""
    kinds = frozenset(formats_supported())
    for path in ("gpu_pairs", "gpu_in_place", "gpu_grouped"):
        monkeypatch.setitem(quant.FAST_PATHS, path, quant.FAST_PATHS[path] | kinds)
        if hasattr(quant, "GGUF_FAST_TYPES"):
            monkeypatch.setitem(quant.GGUF_FAST_TYPES, path, KERNEL_TYPES)


@pytest.mark.parametrize("path", ["decode", "grouped", "loop"])
def test_a_tiered_layer_on_gguf_slots_equals_the_dequantized_experts(store, gpu_path, path):
    """3 GPU slots for 4 experts a layer, both layers through one slot pool: each step stages cold experts into slots
    (evicting), the pairs read the gguf slots (decode), or prefill's grouped GEMMs / per-expert loop dequantize them;
    all equal the fp32 reference."""
    assert store.expert_format.kind == "gguf" and store.expert_format.ggml == (("Q4_K", "Q2_K"), ("Q4_K", "Q3_K"),
                                                                              ("Q6_K", "IQ4_XS"))
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=8), gpu_device=DEVICE, io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "gpu")  # cold experts copied into GPU slots (no CPU share)
        assert compute.pairs_read_format and isinstance(compute.slots, QuantSlotWeights)
        compute.pair_path = path == "decode"
        compute.grouped_prefill = path == "grouped"
        for layer in store.index.moe_layers:
            gu, dn = store.load_layer_experts(layer, torch.float32, "cpu")
            e, h = gu.shape[0], gu.shape[2]
            experts = TieredExperts(layer, e, compute)
            for step in range(3):
                g = torch.Generator().manual_seed(10 * layer + step)
                n = 3 if path == "decode" else 7
                ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(n)])
                w, x = torch.rand(n, 2, generator=g), torch.randn(n, h, generator=g)
                want = moe_forward(x, gu, dn, ids, w)
                got = experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)).cpu()
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                assert want.abs().max() > 0.01
        assert m.stats()["tiers"]["gpu"]["evictions"] > 0  # 3 slots cannot hold the steps' experts
    finally:
        m.close()
