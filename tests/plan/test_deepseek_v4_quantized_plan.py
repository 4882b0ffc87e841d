"""`strata inspect` and the planner on DeepSeek-V4 as its releases ship it, at DeepSeek-V4-Flash's shapes (hidden 4096,
experts 2048 wide, 128 x 128 FP8 blocks): FP4 experts (V4-Flash) counted as MXFP4 blobs, FP8 ones (V4-Flash-Base)
as fp8 128x128 blobs, the dense FP8 linears named with their block. Two of its 43 layers, written as headers over
sparse files (the planner reads headers only)."""

from __future__ import annotations

import pytest
from demo_checkpoints import header_only_checkpoint
from test_planner import GiB, host

from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.runtime.demo.deepseek_v4 import v4_config, v4_tensors
from strata.runtime.demo.deepseek_v4_quant import v4_quantization, v4_quantized_tensors
from strata.runtime.plan.checkpoints.inspect import format_summary, formats_line, summarize_checkpoint
from strata.runtime.plan.planner import plan

H, I = 4096, 2048  # noqa: E741 - DeepSeek-V4-Flash's hidden and expert widths
FORMATS = {"mxfp4": ExpertFormat("mxfp4"), "fp8": ExpertFormat("fp8", block=(128, 128))}
# one expert as the release stores it: gate, up and down with their scales
EXPERT_BYTES = {"mxfp4": 3 * (I * H // 2 + I * H // 32), "fp8": 3 * (I * H + (I // 128) * (H // 128) * 4)}


@pytest.fixture(scope="module", params=["mxfp4", "fp8"])
def flash(request, tmp_path_factory):
    experts = request.param
    cfg = v4_config("bench", layers=2)
    cfg.update(v4_quantization(experts, cfg))
    tensors = v4_quantized_tensors(v4_tensors(cfg), experts, cfg)
    d = header_only_checkpoint(tmp_path_factory.mktemp(f"v4-flash-{experts}") / "m", cfg, tensors)
    return experts, d


def test_inspect_names_the_release_formats_and_bytes(flash):
    experts, d = flash
    s = summarize_checkpoint(d)
    fmt = FORMATS[experts]
    assert s.expert_format == fmt and s.expert_layout == "per-expert" and s.experts_per_layer == 256
    assert s.expert_bytes == EXPERT_BYTES[experts]
    assert s.roles_format(("experts",)) == (fmt.name, 2 * 256 * EXPERT_BYTES[experts])
    assert s.roles_format(("shared_experts",))[0] == "fp8 128x128"
    assert s.roles_format(("attention",))[0].startswith("fp8 128x128 + bf16")  # the compressors' projections: bf16
    assert formats_line(s).startswith(f"experts {fmt.name}: ")
    assert "other" not in s.bytes_by_role or s.bytes_by_role["other"] == 0  # every scale placed with its weight
    assert f"experts {fmt.name}" in format_summary(s)


def test_the_plan_counts_the_experts_as_stored(flash):
    experts, d = flash
    p = plan(d, host(gpu=None, ram=512 * GiB), {"runtime": {"max_context": 4096}})
    layout = ExpertLayout.build(FORMATS[experts], H, I)
    assert p.expert_format == FORMATS[experts].name and p.expert_bytes == layout.payload_bytes
    assert layout.payload_bytes < EXPERT_BYTES[experts] + 4 * 256  # the release's bytes, sections 256-aligned
    assert any("dense FP8 weights" in note for note in p.notes)
