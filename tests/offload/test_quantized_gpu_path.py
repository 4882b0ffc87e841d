"""A tiered layer on FP8 / MXFP4 stores through the GPU fast path (strata.kernels.gpu.experts.quant_pairs, quant_slots):
the GPU tier's slots handed to the pair kernels as `QuantSlotWeights`, decode through the pair path, prefill through the
grouped GEMMs on a dequantized scratch and through the per-expert loop, each against every expert in memory, dequantized
(fp32). On the CPU the GPU tier is simulated in RAM and the pair path is its torch fallback; on CUDA (marked gpu) the
same layer runs the Triton kernels.

The fast path is turned on here for the formats the GPU kernels read (strata.kernels.quant.FAST_PATHS' GPU
entries), whatever the runtime's registry says."""

from __future__ import annotations

import pytest
import torch

from reference_models import build_reference
from strata.errors import StrataError
from strata.kernels import quant
from strata.kernels.experts import moe_forward
from strata.kernels.gpu.experts.grouped import formats_supported
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.store import ExpertStore

quantized_models = pytest.importorskip("quantized_models",
                                       reason="tests/support/quantized_models.py (quantized checkpoints)")


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, ExpertStore]:
    from strata.runtime.plan.checkpoints.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("quantized-gpu-path")
    _, per_expert = build_reference("qwen3_moe", root / "per-expert")
    _, fused = build_reference("qwen3_moe", root / "fused", fused=True)
    ckpts = {"fp8": quantized_models.quantize_checkpoint(per_expert, root / "fp8", "fp8"),
             "mxfp4": quantized_models.quantize_checkpoint(fused, root / "mxfp4", "mxfp4")}
    try:
        opened = {name: ExpertStore.open(convert_checkpoint(path, root / f"{name}-store", progress=False))
                  for name, path in ckpts.items()}
    except StrataError as e:  # a strata whose convert does not read quantized checkpoints yet
        pytest.skip(f"no quantized store here: {e}")
    if not all(s.expert_format.quantized for s in opened.values()):
        pytest.skip("convert dequantizes these checkpoints' experts: no quantized store to serve")
    yield opened
    for s in opened.values():
        s.close()


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU entries of FAST_PATHS with every format the GPU kernels read."""
    kinds = frozenset(formats_supported())
    for path in ("gpu_pairs", "gpu_in_place", "gpu_grouped"):
        monkeypatch.setitem(quant.FAST_PATHS, path, quant.FAST_PATHS[path] | kinds)


DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.mark.parametrize("path", ["decode", "grouped", "loop"])
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_a_tiered_layer_on_quantized_slots_equals_the_dequantized_experts(stores, gpu_path, name, path):
    """3 GPU slots for 16 experts: each step stages cold experts into slots (evicting), the pairs read the quantized
    slots (decode), or prefill's grouped GEMMs / per-expert loop dequantize them; all equal the fp32 reference."""
    store = stores[name]
    layer = store.index.moe_layers[0]
    gu, dn = store.load_layer_experts(layer, torch.float32, "cpu")
    e, h = gu.shape[0], gu.shape[2]
    m = TierManager(store, TierBudgets(gpu_slots=3, pinned_slots=16), gpu_device=DEVICE, io_threads=2)
    try:
        compute = ExpertCompute(m, "gpu", "gpu")  # cold experts copied into GPU slots (no CPU share)
        assert compute.pairs_read_format and isinstance(compute.slots, QuantSlotWeights)
        assert compute.slots.layout == store.layout
        compute.pair_path = path == "decode"
        compute.grouped_prefill = path == "grouped"
        experts = TieredExperts(layer, e, compute)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            n = 3 if path == "decode" else 7
            ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(n)])
            w, x = torch.rand(n, 2, generator=g), torch.randn(n, h, generator=g)
            want = moe_forward(x, gu, dn, ids, w)
            got = experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)).cpu()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert m.stats()["tiers"]["gpu"]["evictions"] > 0  # 3 slots cannot hold the steps' experts
    finally:
        m.close()
