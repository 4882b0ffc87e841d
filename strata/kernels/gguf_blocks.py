"""GGUF (llama.cpp) block types that routed experts are stored in, as the file ships them.

A GGUF matrix [N, K] of a block type is N rows of K / block_values blocks, each `block_bytes` bytes (K-quants: 256-value
superblocks with 6- or 4-bit sub-block scales and f16 super-scales; Q8_0: 32 int8 values and one f16 scale; IQ4_XS: 256
values on a non-linear 4-bit grid). strata keeps those bytes as they are in every tier; `dequantize_rows` dequantizes
them with torch on their own device (strata.kernels.gguf_dequant), bit for bit as llama.cpp's own numpy implementation
in the `gguf` package does (`dequantize_rows_gguf`, the oracle every kernel is tested against).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.errors import UnsupportedError


@dataclass(frozen=True)
class BlockType:
    """One ggml block type: its id in GGUF files, values per block and bytes per block."""

    name: str
    ggml_id: int
    block_values: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` values (`k` a multiple of `block_values`)."""
        return k // self.block_values * self.block_bytes


# the expert block types strata reads (ids and sizes as ggml.h / gguf.GGML_QUANT_SIZES define them)
BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q8_0", 8, 32, 34),
    BlockType("Q2_K", 10, 256, 84),
    BlockType("Q3_K", 11, 256, 110),
    BlockType("Q4_K", 12, 256, 144),
    BlockType("Q5_K", 13, 256, 176),
    BlockType("Q6_K", 14, 256, 210),
    BlockType("IQ4_XS", 23, 256, 136),
)}
BY_ID: dict[int, BlockType] = {t.ggml_id: t for t in BLOCK_TYPES.values()}


def block_type(name: str, tensor: str = "") -> BlockType:
    """The `BlockType` called `name`; a one-line `UnsupportedError` naming the type and `tensor` otherwise."""
    if name not in BLOCK_TYPES:
        where = f"tensor {tensor!r} is " if tensor else ""
        raise UnsupportedError(f"{where}GGML type {name}, which strata does not keep experts in; requantize the file's "
                               f"experts to one of {', '.join(BLOCK_TYPES)}")
    return BLOCK_TYPES[name]


def dequantize_rows(raw: torch.Tensor, type_id: int, rows: int, k: int) -> torch.Tensor:
    """raw: at least rows * row_bytes uint8 (any device) of block type `type_id` -> float32 [rows, k] on raw's device,
    dequantized there by torch (strata.kernels.gguf_dequant: bit for bit `gguf`'s numpy, and faster on the CPU too)."""
    from strata.kernels.gguf_dequant import dequantize_blocks

    t = BY_ID[type_id]
    blocks = raw.reshape(-1)[: rows * t.row_bytes(k)].view(-1, t.block_bytes)
    return dequantize_blocks(blocks, t.name).reshape(rows, k)


def dequantize_rows_gguf(raw: torch.Tensor, type_id: int, rows: int, k: int) -> torch.Tensor:
    """`dequantize_rows` by llama.cpp's own numpy implementation (`gguf.quants.dequantize`): the tests' oracle."""
    import gguf

    t = BY_ID[type_id]
    nbytes = rows * t.row_bytes(k)
    blocks = raw.reshape(-1)[:nbytes].cpu().numpy().reshape(rows, t.row_bytes(k))
    w = gguf.quants.dequantize(np.ascontiguousarray(blocks), gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(rows, k).to(raw.device)
