"""GGUF blocks dequantized by torch on the tensor's device (strata.kernels.gguf_dequant) against llama.cpp's numpy
implementation (`gguf.quants.dequantize`): bit for bit, on valid blocks and on random bytes (every bit pattern of the
f16 scales: NaN and infinity included), and through `dequantize_rows` / `ExpertLayout.dequantize`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks_random import random_blocks

from strata.kernels.gguf_blocks import BLOCK_TYPES, dequantize_rows, dequantize_rows_gguf
from strata.kernels.gguf_dequant import dequantize_blocks
from strata.kernels.quant import ExpertFormat, ExpertLayout

gguf = pytest.importorskip("gguf")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_torch_dequantizes_every_block_type_bit_for_bit_as_gguf(name):
    t = BLOCK_TYPES[name]
    rng = np.random.default_rng(list(BLOCK_TYPES).index(name))
    valid = random_blocks(name, 6, 4 * t.block_values, rng)
    noise = rng.integers(0, 256, size=valid.shape, dtype=np.uint8)  # any bytes: f16 NaN / inf scales too
    for raw in (valid, noise):
        with np.errstate(invalid="ignore", over="ignore"):
            want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(-1)
        got = dequantize_blocks(torch.from_numpy(raw).reshape(-1, t.block_bytes), name)
        assert got.dtype == torch.float32 and got.shape == (6 * 4, t.block_values)
        np.testing.assert_array_equal(_bits(got.reshape(-1).numpy()), _bits(want))
        assert raw is noise or 0.01 < float(np.abs(want).max()) < 1.0  # valid blocks: weights of a sane size


def test_dequantize_rows_reads_only_its_rows_and_matches_the_oracle():
    """rows * row_bytes of a longer section (a gguf half sized for a wider type): the rest is not read."""
    rng = np.random.default_rng(7)
    raw = torch.from_numpy(random_blocks("Q4_K", 4, 512, rng).reshape(-1))
    longer = torch.cat([raw, torch.full((300,), 0xFF, dtype=torch.uint8)])
    got = dequantize_rows(longer, BLOCK_TYPES["Q4_K"].ggml_id, 4, 512)
    want = dequantize_rows_gguf(longer, BLOCK_TYPES["Q4_K"].ggml_id, 4, 512)
    assert got.shape == (4, 512) and torch.equal(got, want) and got.abs().max() > 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_a_gpu_blob_dequantizes_on_the_gpu_as_gguf_does(name):
    """A blob in GPU memory (a GPU slot) dequantizes there, without the host's numpy: the same bits."""
    rng = np.random.default_rng(3)
    h, i = 512, 256
    layout = ExpertLayout.build(ExpertFormat("gguf", ggml=((name,), (name,), (name,))), h, i)
    blocks = [random_blocks(name, r, k, rng) for r, k in ((i, h), (i, h), (h, i))]
    blob = layout.pack_gguf(*((name, torch.from_numpy(b)) for b in blocks))
    gu, dn = layout.dequantize(blob.cuda(), torch.float32)
    assert gu.is_cuda and dn.is_cuda
    want = [gguf.quants.dequantize(b, gguf.GGMLQuantizationType[name]) for b in blocks]
    np.testing.assert_array_equal(gu.cpu().numpy(), np.concatenate(want[:2]))
    np.testing.assert_array_equal(dn.cpu().numpy(), want[2])
    gb, db = layout.dequantize(blob.cuda(), torch.bfloat16)
    assert torch.equal(gb.cpu(), torch.from_numpy(np.concatenate(want[:2])).bfloat16())
    assert torch.equal(db.cpu(), torch.from_numpy(want[2]).bfloat16())
