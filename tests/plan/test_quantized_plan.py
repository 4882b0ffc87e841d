"""The planner and `strata inspect` on quantized experts: bytes counted as stored (a GiB holds ~2x the FP8 experts and
~3.8x the MXFP4 ones of bf16), each role's format shown, dense FP8 weights counted dequantized, and the decode path
named with its fallbacks, following which kernels read the format (strata.kernels.quant.FAST_PATHS)."""

from __future__ import annotations

import pytest
from test_inspect import qwen3_moe, write_sparse_checkpoint

from strata.kernels import quant
from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.runtime.demo.model import demo_config, write_demo_model
from strata.runtime.plan.checkpoints.convert import convert_checkpoint
from strata.runtime.plan.checkpoints.inspect import format_summary, formats_line, summarize_checkpoint
from strata.runtime.plan.host import GpuInfo, HostInfo
from strata.runtime.plan.planner import plan

GiB, TiB = 1 << 30, 1 << 40
FP8_128 = ExpertFormat("fp8", block=(128, 128))


def host(gpu: int | None = 24 * GiB) -> HostInfo:
    gpus = [GpuInfo(0, "sim", gpu, gpu)] if gpu else []
    return HostInfo(gpus=gpus, ram_total=256 * GiB, ram_available=256 * GiB, tmpfs_path="/dev/shm/strata",
                    tmpfs_free=64 * GiB, disk_path="/data/strata", disk_free=4 * TiB, cpu_count=16)


def _fp8(spec):
    """Every projection weight (experts, attention) as DeepSeek-V3 ships it: F8_E4M3 + 128x128 F32 scale_inv."""
    out = []
    for role, name, dtype, shape in spec:
        if name.endswith("proj.weight") and len(shape) == 2:
            blocks = (-(-shape[0] // 128), -(-shape[1] // 128))
            out += [(role, name, "F8_E4M3", shape), (role, name + "_scale_inv", "F32", blocks)]
        else:
            out.append((role, name, dtype, shape))
    return out


@pytest.fixture(scope="module")
def q30b(tmp_path_factory) -> dict:
    """Qwen3-30B-A3B's shapes (4 of its 48 layers, experts one tensor per projection) as sparse files: bf16, and FP8
    as its FP8 release ships it."""
    spec, _ = qwen3_moe(4, 2048, 32, 768, 128)
    root = tmp_path_factory.mktemp("q30b-fp8")
    config = demo_config("bench", layers=4, engram=False)
    write_sparse_checkpoint(root / "bf16", spec, config, shards=1)
    fp8 = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    write_sparse_checkpoint(root / "fp8", _fp8(spec), fp8, shards=2)
    return {"bf16": root / "bf16", "fp8": root / "fp8"}


def test_inspect_shows_each_roles_format_and_bytes(q30b):
    s = summarize_checkpoint(q30b["fp8"])
    assert s.expert_format == FP8_128
    assert s.expert_bytes == 3 * 768 * 2048 + 4 * (12 * 16 + 16 * 6)  # values and the blocks' float scales
    assert s.roles_format(("experts",)) == ("fp8 128x128", s.bytes_by_role["experts"])
    assert s.roles_format(("attention",))[0] == "fp8 128x128 + bf16"  # q/k norms stay bf16
    line = formats_line(s)
    assert line.startswith("experts fp8 128x128: ") and ", dense bf16 + fp8 128x128: " in line
    text = format_summary(s)
    assert "formats        experts fp8 128x128" in text and "fp8 128x128" in text.split("bytes by role")[1]
    assert summarize_checkpoint(q30b["bf16"]).expert_format == ExpertFormat("plain", "BF16")


def test_the_plan_counts_fp8_experts_as_stored(q30b):
    """The same GPU budget holds twice the experts; dense FP8 weights cost what their bf16 originals do once loaded."""
    cfg = {"tiers": {"gpu": {"budget": "2GiB"}}}
    bf16, fp8 = plan(q30b["bf16"], host(), cfg), plan(q30b["fp8"], host(), cfg)
    layout = ExpertLayout.build(FP8_128, 2048, 768)
    assert fp8.expert_bytes == layout.payload_bytes and fp8.expert_format == "fp8 128x128"
    assert fp8.slot_bytes == -(-layout.payload_bytes // 4096) * 4096
    assert fp8.tier("gpu").slots == 2 * GiB // fp8.slot_bytes and 1.95 < fp8.tier("gpu").slots / bf16.tier("gpu").slots <= 2
    assert fp8.non_expert_bytes == bf16.non_expert_bytes  # dequantized to bf16, scales dropped
    assert fp8.store_bytes < 0.65 * bf16.store_bytes  # (the bf16 embeddings are a fifth of it)
    assert "dense FP8 weights" in " ".join(fp8.notes) and fp8.dense_format == "bf16 + fp8 128x128"
    text = fp8.format()
    assert "(fp8 128x128)" in text and "formats      experts fp8 128x128: " in text


def test_mxfp4_store_of_a_bf16_checkpoint(q30b):
    """`[store] experts = "mxfp4"`: the planner counts the store's MXFP4 blobs, ~3.8x the experts a GiB."""
    cfg = {"tiers": {"gpu": {"budget": "1GiB"}}}  # (under the 512 experts' 1.2 GiB in mxfp4)
    bf16 = plan(q30b["bf16"], host(), cfg)
    mx = plan(q30b["bf16"], host(), {**cfg, "store": {"experts": "mxfp4"}})
    assert mx.expert_bytes == ExpertLayout.build(ExpertFormat("mxfp4"), 2048, 768).payload_bytes
    assert mx.expert_format == "mxfp4" and 3.6 < mx.tier("gpu").slots / bf16.tier("gpu").slots < 3.9
    fp8 = plan(q30b["bf16"], host(), {**cfg, "store": {"experts": "fp8"}})
    assert fp8.expert_format == "fp8 128x128"  # 768 = 6 x 128: DeepSeek's block


def test_the_decode_path_follows_the_kernels_that_read_the_format(q30b, monkeypatch):
    # the GPU's pair, in-place and grouped kernels and the compiled CPU kernel read FP8 as stored: graphs, no fallback
    gpu = plan(q30b["fp8"], host())
    assert gpu.decode_graphs and "pair kernels" in gpu.decode and "do not read" not in " ".join(gpu.notes)
    # tiered: where one-graph decode's CPU worker does not read FP8, the cold experts run in host steps and the
    # plan says why; where it does, one CUDA graph a step
    monkeypatch.setitem(quant.FAST_PATHS, "cpu_mailbox", frozenset({"plain"}))
    split = plan(q30b["fp8"], host(), {"tiers": {"gpu": {"budget": "1GiB"}}})
    assert "host steps" in split.decode and "CPU worker does not read fp8 128x128" in " ".join(split.notes)
    monkeypatch.setitem(quant.FAST_PATHS, "cpu_mailbox", frozenset({"plain", "fp8"}))
    split = plan(q30b["fp8"], host(), {"tiers": {"gpu": {"budget": "1GiB"}}})
    assert "one CUDA graph a step" in split.decode and "does not read" not in " ".join(split.notes)
    cpu = plan(q30b["fp8"], host(gpu=None))
    assert cpu.decode == "experts on CPU threads from RAM, the compiled kernel"
    assert "does not read" not in " ".join(cpu.notes)
    # a format the GPU's pair kernels do not read is grouped by expert and dequantized, without graphs, and says so
    monkeypatch.setitem(quant.FAST_PATHS, "gpu_pairs", frozenset({"plain"}))
    monkeypatch.setitem(quant.FAST_PATHS, "gpu_grouped", frozenset({"plain"}))
    gpu = plan(q30b["fp8"], host())
    assert not gpu.decode_graphs and "grouped by expert" in gpu.decode
    notes = " ".join(gpu.notes)
    assert "decode pair kernels do not read fp8 128x128" in notes and "no CUDA graphs" in notes
    assert "grouped GEMMs do not read fp8 128x128" in notes
    assert "CPU kernel does not read" not in notes
    # one the compiled CPU kernel does not read falls back to the reference math, and says so
    monkeypatch.setitem(quant.FAST_PATHS, "cpu_kernel", frozenset({"plain"}))
    cpu = plan(q30b["fp8"], host(gpu=None))
    assert "dequantized one by one" in cpu.decode and "compiled CPU kernel does not read" in " ".join(cpu.notes)
    monkeypatch.undo()
    assert plan(q30b["bf16"], host()).decode_graphs


def test_a_quantized_store_is_planned_from_its_index(tmp_path):
    demo = write_demo_model(tmp_path / "demo", "tiny", layers=2, engram=False, progress=False)
    store = convert_checkpoint(demo, tmp_path / "store", progress=False, experts="fp8")
    from_ckpt = plan(demo, host(gpu=None), {"store": {"experts": "fp8"}})
    from_store = plan(store, host(gpu=None))
    assert from_store.source == "store" and from_store.expert_format == from_ckpt.expert_format == "fp8 32x32"
    assert from_store.expert_bytes == from_ckpt.expert_bytes and from_store.slot_bytes == from_ckpt.slot_bytes
    assert from_store.non_expert_bytes == from_ckpt.non_expert_bytes
