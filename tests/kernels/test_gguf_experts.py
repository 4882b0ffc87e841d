"""GGUF experts in strata's blobs (kind "gguf"): each block type's bytes kept as the file ships them, a mix of types
per tensor, and dequantized exactly as llama.cpp's `gguf` package dequantizes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks_random import random_blocks

from strata.errors import UnsupportedError
from strata.kernels.gguf_blocks import BLOCK_TYPES, block_type
from strata.kernels.quant import ExpertFormat, ExpertLayout

gguf = pytest.importorskip("gguf")


def _oracle(blocks: np.ndarray, name: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name])


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_each_block_type_dequantizes_as_gguf_does(name):
    rng = np.random.default_rng(0)
    h, i = 512, 256
    fmt = ExpertFormat("gguf", ggml=((name,), (name,), (name,)))
    layout = ExpertLayout.build(fmt, h, i)
    gate, up, down = random_blocks(name, i, h, rng), random_blocks(name, i, h, rng), random_blocks(name, h, i, rng)
    blob = layout.pack_gguf(*((name, torch.from_numpy(b)) for b in (gate, up, down)))
    gu, dn = layout.dequantize(blob, torch.float32)
    assert gu.shape == (2 * i, h) and dn.shape == (h, i)
    np.testing.assert_array_equal(gu.numpy(), np.concatenate([_oracle(gate, name), _oracle(up, name)]))
    np.testing.assert_array_equal(dn.numpy(), _oracle(down, name))
    assert 0.01 < float(gu.abs().max()) < 1.0  # the random blocks are weights of a sane size


def test_a_store_mixes_types_per_tensor_and_per_expert():
    rng = np.random.default_rng(1)
    h, i = 256, 256
    fmt = ExpertFormat("gguf", ggml=(("Q4_K", "Q2_K"), ("Q4_K",), ("Q6_K", "Q4_K")))
    assert fmt.name == "gguf Q4_K/Q2_K/Q6_K" and ExpertFormat.from_dict(fmt.to_dict()) == fmt
    layout = ExpertLayout.build(fmt, h, i)
    for g, d in (("Q4_K", "Q6_K"), ("Q2_K", "Q4_K")):  # two experts in one layout, of different types
        gate, up, down = random_blocks(g, i, h, rng), random_blocks("Q4_K", i, h, rng), random_blocks(d, h, i, rng)
        blob = layout.pack_gguf((g, torch.from_numpy(gate)), ("Q4_K", torch.from_numpy(up)), (d, torch.from_numpy(down)))
        gu, dn = layout.dequantize(blob, torch.float32)
        np.testing.assert_array_equal(gu[:i].numpy(), _oracle(gate, g))
        np.testing.assert_array_equal(gu[i:].numpy(), _oracle(up, "Q4_K"))
        np.testing.assert_array_equal(dn.numpy(), _oracle(down, d))


def test_up_of_a_wider_type_than_gate_keeps_its_rows_and_leaves_down_alone():
    rng = np.random.default_rng(2)
    h, i = 256, 512
    layout = ExpertLayout.build(ExpertFormat("gguf", ggml=(("Q2_K",), ("Q8_0",), ("Q3_K",))), h, i)
    gate, up, down = random_blocks("Q2_K", i, h, rng), random_blocks("Q8_0", i, h, rng), random_blocks("Q3_K", h, i, rng)
    blob = layout.pack_gguf(("Q2_K", torch.from_numpy(gate)), ("Q8_0", torch.from_numpy(up)),
                            ("Q3_K", torch.from_numpy(down)))
    gu, dn = layout.dequantize(blob, torch.float32)
    np.testing.assert_array_equal(gu[:i].numpy(), _oracle(gate, "Q2_K"))
    np.testing.assert_array_equal(gu[i:].numpy(), _oracle(up, "Q8_0"))  # Q8_0 rows: 272 bytes, Q2_K's 84
    np.testing.assert_array_equal(dn.numpy(), _oracle(down, "Q3_K"))


def test_shapes_and_types_a_gguf_format_cannot_take():
    with pytest.raises(ValueError, match="multiple of 256"):
        ExpertLayout.build(ExpertFormat("gguf", ggml=(("Q4_K",), ("Q4_K",), ("Q4_K",))), 256, 96)
    with pytest.raises(ValueError, match="gguf expert types"):
        ExpertFormat("gguf", ggml=(("Q4_0",), ("Q4_K",), ("Q4_K",)))
    with pytest.raises(UnsupportedError, match="'blk.3.ffn_down_exps.weight' is GGML type Q4_0"):
        block_type("Q4_0", "blk.3.ffn_down_exps.weight")
    layout = ExpertLayout.build(ExpertFormat("gguf", ggml=(("Q8_0",), ("Q8_0",), ("Q8_0",))), 64, 32)
    with pytest.raises(ValueError, match="does not quantize experts to GGUF"):
        layout.pack(torch.zeros(64, 64), torch.zeros(64, 32))
