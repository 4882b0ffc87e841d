"""GGUF blocks dequantized with torch on the tensor's own device: a GPU slot's blocks stay on the GPU.

Each function takes blocks [n, block_bytes] uint8 (one row a block) and returns float32 [n, block_values], bit for bit
what llama.cpp's numpy implementation (`gguf.quants.dequantize`) returns: the same products in the same order, each
rounded to float32 once (torch runs every elementwise op as its own kernel, so nothing is fused into an FMA).
Layouts as ggml-common.h defines them (QK_K = 256 values a superblock):

    Q8_0    d f16, 32 int8                                  w = q * d
    Q2_K    16 scale bytes (lo: scale, hi: min), 64 qs (2 bits), d f16, dmin f16
                                                            w = (d * sc) * q - (dmin * m), 16 values a scale
    Q3_K    32 hmask, 64 qs (2 bits), 12 bytes of 6-bit scales, d f16
                                                            w = (d * (sc - 32)) * (q - 4 * !hbit)
    Q4_K    d f16, dmin f16, 12 bytes of 6-bit scales and mins, 128 qs (4 bits)
                                                            w = (d * sc) * q - (dmin * m), 32 values a scale
    Q5_K    as Q4_K, with 32 qh bytes (the fifth bit) before the 128 qs
    Q6_K    128 ql (4 bits), 64 qh (2 bits), 16 int8 scales, d f16
                                                            w = (d * sc) * (q - 32), 16 values a scale
    IQ4_XS  d f16, 2 bytes of high scale bits, 4 bytes of low scale bits, 128 qs (4-bit indices into IQ4_NL's grid)
                                                            w = (d * (sc - 32)) * grid[q], 32 values a scale
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256
IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes a row [n, 2] -> their little-endian float16 as float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _shifts(*values: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n, dev = blocks.shape[0], blocks.device
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=dev).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, QK_K)


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n, dev = blocks.shape[0], blocks.device
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    # 16 6-bit scales: low 4 bits in bytes 0-7 (both nibbles), high 2 bits in bytes 8-11 (four pairs a byte)
    low = (scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4, device=dev).reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, device=dev).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=dev).reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(*range(8), device=dev).reshape(1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)  # the offset 4 applies where the mask bit is 0
    return (dl * q.float()).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [n, 12] -> (8 scales, 8 mins) [n, 8] as float32 (6 bits each)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n, dev = blocks.shape[0], blocks.device
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl, ml = (d * sc).reshape(n, 8, 1), (dmin * mn).reshape(n, 8, 1)
    q = (blocks[:, 16:].reshape(n, 4, 1, 32) >> _shifts(0, 4, device=dev).reshape(1, 1, 2, 1)) & 0x0F
    return (dl * q.reshape(n, 8, 32).float() - ml).reshape(n, QK_K)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n, dev = blocks.shape[0], blocks.device
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl, ml = (d * sc).reshape(n, 8, 1), (dmin * mn).reshape(n, 8, 1)
    ql = (blocks[:, 48:].reshape(n, 4, 1, 32) >> _shifts(0, 4, device=dev).reshape(1, 1, 2, 1)) & 0x0F
    qh = (blocks[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(*range(8), device=dev).reshape(1, 1, 8, 1)) & 1
    ql, qh = ql.reshape(n, 8, 32), qh.reshape(n, 8, 32)
    return (dl * (ql | (qh << 4)).float() - ml).reshape(n, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n, dev = blocks.shape[0], blocks.device
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = _f16(blocks[:, 208:210])
    dl = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = (ql.reshape(n, 2, 1, 64) >> _shifts(0, 4, device=dev).reshape(1, 1, 2, 1)).reshape(n, 8, 32) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=dev).reshape(1, 1, 4, 1)).reshape(n, 8, 32) & 0x03
    q = (low | (high << 4)).to(torch.int8) - 32
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n, dev = blocks.shape[0], blocks.device
    d = _f16(blocks[:, :2])
    high = blocks[:, 2].int() | (blocks[:, 3].int() << 8)  # 8 pairs of high scale bits, little-endian
    high = ((high[:, None] >> (2 * torch.arange(8, device=dev, dtype=torch.int32))) & 3).to(torch.uint8)
    low = (blocks[:, 4:8].reshape(n, 4, 1) >> _shifts(0, 4, device=dev).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    sc = (low | (high << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 8, 1)
    q = (blocks[:, 8:].reshape(n, 8, 1, 16) >> _shifts(0, 4, device=dev).reshape(1, 1, 2, 1)) & 0x0F
    grid = torch.tensor(IQ4_GRID, dtype=torch.float32, device=dev)
    return (dl * grid[q.reshape(n, 8, 32).long()]).reshape(n, QK_K)


DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": q8_0, "Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "IQ4_XS": iq4_xs,
}


def dequantize_blocks(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """blocks [n, block_bytes] uint8 of block type `name` (any device) -> float32 [n, block_values] there."""
    return DEQUANTIZERS[name](blocks)
