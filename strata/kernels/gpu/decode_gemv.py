"""A decode step's dense projections as a Triton GEMV: y = x @ W.T (+ b) for one row of x.

At decode a single sequence's attention projections are matrix-vector products bound by reading W from HBM.
cuBLAS picks GEMM tiles for them that leave bandwidth unused on the H200 (`bench/probes/gemv_probe.py --sweep`, code
8d4c1d0: the bench model's o projection, 2048 x 4096 bf16, 9.3 us in cuBLAS against 6.2 us here; its stacked
q/k/v, 5120 x 2048, 7.6 against 6.8 us). Each program reads BLOCK_M full rows of W once,
streaming K in BLOCK_K tiles, with one fp32 sum a row; one launch, no split-K reduce. For more rows than one
(batched decode) cuBLAS's tiles re-read W less often than per-row sums can, so `linear` hands them to it.

Results add each row's products in another order than cuBLAS and round once (a bias is added in fp32), so they
may differ from `F.linear` by one bf16 rounding step in a few elements (tests bound it against a float64
reference); the all-in-memory and tiered engines take the same path, so tiering does not change them.
Off CUDA (and without Triton, or with the module flag `ENABLED` off, as tests do) `linear` is `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.gpu import fused, pdl

triton, tl = fused.triton, (fused.tl if fused.triton is not None else None)

ENABLED = True  # a module flag, not a setting: tests turn it off to compare with cuBLAS
MAX_ROWS = 1  # rows of x the GEMV takes; at 4 and 8 rows the probe had per-row sums 2-10x slower than cuBLAS


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs the GEMV for x [N, K] and weight [M, K]: on, decode-sized, matching dtypes."""
    return (ENABLED and fused.fold_ok(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.stride(1) == 1 and weight.device == x.device
            and x.dtype in (torch.bfloat16, torch.float16))


def config(m: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages) for W [m, k]: 2 warps streaming 1024-wide K tiles of one row of
    W a program, two for a tall W (many programs already keep the H200's 132 SMs reading). These are the probe's
    sweep winners for this kernel on the H200 (`bench/probes/gemv_probe.py --sweep`, code 8d4c1d0)."""
    return 2 if m >= 4096 else 1, min(1024, triton.next_power_of_2(k)), 2, 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           cfg: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [N, K], weight [M, K], bias [M] -> [N, M] in x's dtype; the GEMV where
    `available` says so (N == 1). `cfg` overrides `config` (the probe's sweep)."""
    if not available(x, weight) or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())):
        return F.linear(x, weight, bias)
    k = x.shape[1]
    m = weight.shape[0]
    out = torch.empty((1, m), dtype=x.dtype, device=x.device)
    block_m, block_k, warps, stages = cfg or config(m, k)
    _gemv_kernel[(triton.cdiv(m, block_m),)](
        x, weight, bias if bias is not None else weight, out, m, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=warps, num_stages=stages, **pdl.launch(x))
    return out


def project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a projection: a plain `nn.Linear` goes through `linear` (the GEMV at decode sizes); any
    other module (a quantized or wrapped one) runs as itself."""
    if type(module) is torch.nn.Linear:
        return linear(x, module.weight, module.bias)
    return module(x)


if triton is not None:

    @triton.jit
    def _w_tile(w_ptr, cols, col_ok, kk, k, stride_w, EVEN_K: tl.constexpr):
        """W's [BLOCK_M, BLOCK_K] tile at columns kk: read once, evict-first (L2 stays for x)."""
        if EVEN_K:
            mask = col_ok[:, None]
        else:
            mask = col_ok[:, None] & (kk < k)[None, :]
        return tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=mask, other=0.0,
                       eviction_policy="evict_first")

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, m, k, stride_w, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
        # program p: output columns [p * BLOCK_M, +BLOCK_M); acc [BLOCK_M] fp32
        cols = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = cols < m
        offs = tl.arange(0, BLOCK_K)
        # W's first K tile: no kernel writes W, so with PDL it streams in while the kernel before this one (the
        # norm that produces x) finishes
        w = _w_tile(w_ptr, cols, col_ok, offs, k, stride_w, EVEN_K)
        pdl.enter(PDL)
        xs = tl.load(x_ptr + offs, mask=offs < k, other=0.0)
        # [BLOCK_M, BLOCK_K] * [1, BLOCK_K] summed over K: each product exact in fp32
        acc = tl.sum(w.to(tl.float32) * xs.to(tl.float32)[None, :], axis=1)
        for k0 in range(BLOCK_K, k, BLOCK_K):
            kk = k0 + offs
            w = _w_tile(w_ptr, cols, col_ok, kk, k, stride_w, EVEN_K)
            xs = tl.load(x_ptr + kk, mask=kk < k, other=0.0)
            acc += tl.sum(w.to(tl.float32) * xs.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
