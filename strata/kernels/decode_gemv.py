"""A decode step's dense projections as a Triton GEMV: y = x @ W.T (+ b) for a few rows of x.

At decode a layer's attention projections see one row a sequence, so they are matrix-vector products bound by
reading W from HBM. cuBLAS picks GEMM tiles for them that leave bandwidth unused on the H200 (RESULTS.md,
nineteenth session: the bench model's stacked q/k/v, 5120 x 2048 bf16, at 2.7 TB/s in 7.7 us; its o
projection, 2048 x 4096, split over K in two launches, 7.0 + 1.7 us), and each launch of a CUDA graph waits
on the one before it. Here each program reads BLOCK_M full rows of W once, streaming K in BLOCK_K tiles, and
keeps one fp32 sum a row and x row; one launch, no split-K reduce.

Results add each row's products in another order than cuBLAS, so they may differ from `F.linear` by one
bf16 rounding step in a few elements (tests bound it); the all-in-memory and tiered engines take the same
path, so tiering does not change them. `STRATA_DECODE_GEMV=0` keeps cuBLAS (the A/B switch, bench/hotpath.py's
`+nogemv`). Off CUDA (and without Triton) `linear` is `F.linear`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from strata.kernels import fused

triton, tl = fused.triton, (fused.tl if fused.triton is not None else None)

ENABLED = os.environ.get("STRATA_DECODE_GEMV", "1") != "0"
MAX_ROWS = 8  # rows of x the per-row sums take; more rows re-read W less often through cuBLAS's tiles


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs the GEMV for x [N, K] and weight [M, K]: on, decode-sized, matching dtypes."""
    return (ENABLED and fused.fold_ok(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.stride(1) == 1 and weight.device == x.device
            and x.dtype in (torch.bfloat16, torch.float16))


def config(m: int, k: int, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages) for W [m, k] and `rows` rows of x: enough programs to keep
    every SM reading (an H200 has 132) with a few KB of each row's tile in flight a warp."""
    block_m = 4 if m <= 4096 else 8
    # the [rows, BLOCK_M, BLOCK_K] products live in registers: at most 8K fp32 a program (64 a thread of 4 warps)
    block_k = min(1024, triton.next_power_of_2(k), max(64, 8192 // (triton.next_power_of_2(rows) * block_m)))
    return block_m, block_k, 4, 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           cfg: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [N, K], weight [M, K], bias [M] -> [N, M] in x's dtype; the GEMV where
    `available` says so. `cfg` overrides `config` (the probe's sweep)."""
    if not available(x, weight) or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())):
        return F.linear(x, weight, bias)
    n, k = x.shape
    m = weight.shape[0]
    out = torch.empty((n, m), dtype=x.dtype, device=x.device)
    block_m, block_k, warps, stages = cfg or config(m, k, n)
    _gemv_kernel[(triton.cdiv(m, block_m),)](
        x, weight, bias if bias is not None else weight, out, n, m, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(n), BLOCK_M=block_m, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages)
    return out


def project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a projection: a plain `nn.Linear` goes through `linear` (the GEMV at decode sizes); any
    other module (a quantized or wrapped one) runs as itself."""
    if type(module) is torch.nn.Linear:
        return linear(x, module.weight, module.bias)
    return module(x)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, m, k, stride_x, stride_w, stride_out,
                     HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr):
        # program p: output columns [p * BLOCK_M, +BLOCK_M) of every row of x; acc [ROWS, BLOCK_M] fp32
        cols = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = cols < m
        rows = tl.arange(0, ROWS)
        row_ok = rows < n
        offs = tl.arange(0, BLOCK_K)
        acc = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + offs
            if EVEN_K:
                w = tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=col_ok[:, None], other=0.0,
                            eviction_policy="evict_first")  # [BLOCK_M, BLOCK_K]: read once, keep L2 for x
                xs = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=row_ok[:, None], other=0.0)
            else:
                k_ok = kk < k
                w = tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                            other=0.0, eviction_policy="evict_first")
                xs = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                             other=0.0)
            # [ROWS, 1, BLOCK_K] * [1, BLOCK_M, BLOCK_K] summed over K: each product exact in fp32
            acc += tl.sum(xs.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
