"""Expert formats: quantizers round to the nearest grid point, dequantizers invert them, blobs lay out as documented."""

import pytest
import torch

from strata.kernels.quant import (
    E2M1,
    SECTION_ALIGN,
    ExpertFormat,
    ExpertLayout,
    dequantize_fp8,
    dequantize_mxfp4,
    quantize_fp8,
    quantize_mxfp4,
)

FP8_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FP8_GRID = FP8_GRID[torch.isfinite(FP8_GRID)]


def test_fp8_blocks_round_to_nearest_and_scale_per_block():
    torch.manual_seed(0)
    w = torch.randn(40, 70) * torch.logspace(-3, 2, 40)[:, None]  # rows of very different magnitudes
    q, s = quantize_fp8(w, (16, 32))
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (3, 3)
    # each block's largest magnitude maps to 448 exactly
    amax = torch.zeros(3, 3)
    for bi in range(3):
        for bj in range(3):
            amax[bi, bj] = w[bi * 16:(bi + 1) * 16, bj * 32:(bj + 1) * 32].abs().max()
    torch.testing.assert_close(s, amax / 448.0)
    back = dequantize_fp8(q, s, (16, 32))
    scale_full = s.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :70]
    x = w / scale_full
    nearest = FP8_GRID[(x.reshape(-1, 1) - FP8_GRID).abs().argmin(dim=1)].reshape(x.shape)
    assert bool(((q.float() - x).abs() <= (nearest - x).abs()).all())  # no grid point is nearer than the code
    assert torch.equal(back, q.float() * scale_full)
    assert torch.equal(dequantize_fp8(q.view(torch.uint8), s, (16, 32)), back)


def test_fp8_all_zero_block_has_unit_scale():
    q, s = quantize_fp8(torch.zeros(16, 16), (16, 16))
    assert s.item() == 1.0 and q.float().abs().sum() == 0


def test_mxfp4_codes_scales_and_ties():
    # one group: amax 6 -> exponent 0; values on and between grid points
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.3, -2.9, 0.0, 1.0] + [0.0] * 20)
    q, s = quantize_mxfp4(row[None])
    assert s.tolist() == [[127]]
    back = dequantize_mxfp4(q, s)[0]
    # ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0
    assert back[:12].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -3.0, 0.0, 1.0]
    # packing: element 0 in the low nibble of byte 0, element 1 in the high nibble
    codes = [E2M1.index(v) for v in (0.0, 1.0)]
    assert q[0, 0].item() == codes[0] | codes[1] << 4


def test_mxfp4_codes_match_a_sorted_search_of_the_midpoints():
    """Each code is the count of e2m1 midpoints at or below the scaled magnitude (ties then moved to the even code),
    negatives that round to zero stored as +0, NaN past every midpoint: a search over the sorted midpoints, written
    independently here, on random values, exact midpoints of both signs and special values."""
    torch.manual_seed(2)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    on_grid = torch.cat([mids, mids / 2, torch.tensor([0.0, 0.5, 1.0, 4.0, 6.0, 0.1, 5.5])])
    w = on_grid[torch.randint(0, len(on_grid), (16, 256))] * torch.where(torch.rand(16, 256) < 0.5, -1.0, 1.0)
    w[:, ::32] = 6.0  # amax 6: every group's scale 2^0, so the values above are the scaled ones
    w[0, 1:3], w[1, 3], w[2, 4] = torch.tensor([float("nan"), -0.0]), -0.2, float("nan")
    q, s = quantize_mxfp4(w)
    has_nan = w.reshape(16, 8, 32).isnan().any(-1)
    assert bool((s[~has_nan] == 127).all()) and bool((s[has_nan] == 0).all())  # (NaN's amax: the smallest scale)
    scaled = w / torch.exp2(s.float() - 127).repeat_interleave(32, 1)
    mag = scaled.abs()
    code = torch.searchsorted(mids, mag.reshape(-1), right=True).reshape(mag.shape)
    code[mag.isnan()] = 7
    tie = (code > 0) & (mag == mids[(code - 1).clamp(min=0)]) & (code % 2 == 1)
    code = torch.where(tie, code - 1, code)
    code = code | ((scaled < 0) & (code > 0)).long() << 3
    assert torch.equal(q, (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8))


def test_mxfp4_scale_is_the_smallest_power_of_two_that_fits():
    torch.manual_seed(1)
    w = torch.randn(8, 64) * 10
    q, s = quantize_mxfp4(w)
    amax = w.reshape(8, 2, 32).abs().amax(-1)
    e = s.float() - 127
    assert bool((amax / torch.exp2(e) <= 6).all()) and bool((amax / torch.exp2(e - 1) > 6).all())
    back = dequantize_mxfp4(q, s)
    grid = torch.tensor(sorted(set(abs(v) for v in E2M1)))
    step = torch.exp2(e).repeat_interleave(32, 1)
    # every dequantized value is a grid point times the group's scale, and the nearest one to the input
    rel = (w / step).abs()
    nearest = grid[(rel.reshape(-1, 1) - grid).abs().argmin(1)].reshape(rel.shape)
    assert torch.equal(back.abs() / step, nearest)


@pytest.mark.parametrize("fmt", [ExpertFormat("plain", "BF16"), ExpertFormat("fp8", block=(16, 16)),
                                 ExpertFormat("fp8", block=(128, 128)), ExpertFormat("mxfp4")])
def test_layout_round_trip(fmt):
    torch.manual_seed(2)
    h, i = 128, 64 if fmt.block != (128, 128) else 128
    layout = ExpertLayout.build(fmt, h, i)
    gate_up, down = torch.randn(2 * i, h), torch.randn(h, i)
    blob = layout.pack(gate_up, down)
    assert blob.numel() == layout.payload_bytes
    for sec in (layout.gate_up, layout.gate_up_scales, layout.down, layout.down_scales):
        if sec is not None and fmt.quantized:
            assert sec.offset % SECTION_ALIGN == 0
    gu, dn = layout.dequantize(blob, torch.float32)
    if fmt.kind == "plain":
        torch.testing.assert_close(gu, gate_up.bfloat16().float())
        torch.testing.assert_close(dn, down.bfloat16().float())
        assert layout.payload_bytes == 3 * h * i * 2
    else:
        q = (lambda w: dequantize_fp8(*quantize_fp8(w, fmt.block), fmt.block)) if fmt.kind == "fp8" else \
            (lambda w: dequantize_mxfp4(*quantize_mxfp4(w)))
        assert torch.equal(gu, q(gate_up)) and torch.equal(dn, q(down))
        ratio = 3 * h * i * 2 / layout.payload_bytes
        assert ratio > (1.9 if fmt.kind == "fp8" else 3.5)


def test_pack_quantized_takes_checkpoint_tensors():
    fmt = ExpertFormat("mxfp4")
    layout = ExpertLayout.build(fmt, 64, 32)
    torch.manual_seed(3)
    gate_up, down = torch.randn(64, 64), torch.randn(64, 32)
    (gq, gs), (dq, ds) = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    blob = layout.pack_quantized((gq.reshape(64, 2, 16), gs), (dq, ds))  # gpt-oss's [N, K/32, 16] blocks
    assert torch.equal(blob, layout.pack(gate_up, down))


def test_bad_shapes_name_the_fix():
    with pytest.raises(ValueError, match="multiple of the block"):
        ExpertLayout.build(ExpertFormat("fp8", block=(128, 128)), 256, 96)
    with pytest.raises(ValueError, match="multiples of 32"):
        ExpertLayout.build(ExpertFormat("mxfp4"), 48, 64)
    with pytest.raises(ValueError, match="not one of"):
        ExpertFormat("int4")
    layout = ExpertLayout.build(ExpertFormat("fp8", block=(16, 16)), 32, 16)
    with pytest.raises(ValueError, match="is not the expert's"):
        layout.pack(torch.zeros(16, 32), torch.zeros(32, 16))


def test_format_dict_round_trip():
    for fmt in (ExpertFormat("plain", "F16"), ExpertFormat("fp8", block=(64, 32)), ExpertFormat("mxfp4")):
        assert ExpertFormat.from_dict(fmt.to_dict()) == fmt
    assert ExpertFormat("fp8").name == "fp8 128x128"
