"""A decode MoE layer's last launch and the next block's first, as one: the experts' combine, the residual add and
the next RMSNorm, optionally after waiting for the CPU worker's partial sum in page-locked host memory.

A decode layer ends with the weighted sum of its experts' rows plus the residual (`fused.combine`), and the next
layer (or the model's final norm) starts with an RMSNorm of that sum (`fused.rms_norm`); in a split decode step
the combine is also preceded by the kernel that waits for the worker's answer and copies it to the device
(`host_signal.wait_and_fetch`). Each is a launch of a few rows, bound by its launch and ramp-up (~2-4 us on the
H200), not by its bytes. Here one program a token does all of it:

    x_out  = round(sum_j w[n, j] * y[n * k + j] + extra[n]) + residual[n]      (fused.combine's rounding)
    normed = weight * round(x_out * rsqrt(mean(x_out^2) + eps))              (fused.rms_norm's rounding)

with `extra` read from the host once `done` (a page-locked int64) equals the step's generation, as
`wait_and_fetch` reads it. The sum of squares reduces over the same block and warps as `fused.rms_norm`.

Kernels that wait on host memory launch without programmatic dependent launch (`strata.kernels.pdl`), as
`host_signal`'s do; the others keep its contract (the norm's weight is read before the wait).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from strata.kernels import fused, pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

# $STRATA_FUSED_NORM_AHEAD=0 (bench/hotpath.py's `+nonorm`): the combine and the next RMSNorm in their own launches
NORM_AHEAD = os.environ.get("STRATA_FUSED_NORM_AHEAD", "1") != "0"
# $STRATA_FUSED_WAIT_COMBINE=0 (`+nowait`): a split layer's wait for the worker in its own kernel (wait_and_fetch)
WAIT_COMBINE = os.environ.get("STRATA_FUSED_WAIT_COMBINE", "1") != "0"
MAX_HIDDEN = 16384  # one program holds a row: fused.rms_norm's limit


@dataclass
class NormAhead:
    """The next block's RMSNorm (its weight [H] and eps), handed to a decode layer whose last launch (the MoE
    combine) may apply it to the residual stream it produces: `out` holds the normed rows [N, H] once a combine
    did, else stays None and the next block runs its norm itself."""

    weight: torch.Tensor
    eps: float
    out: torch.Tensor | None = None


@dataclass
class HostAnswer:
    """The CPU worker's partial sum of one layer, not yet fetched: `done` = header[1] (int64 [8], page-locked)
    reaches `gen` [1] int64 (device) once `src` (fp32 [N * H], page-locked) holds it. header[3] gets the
    generation given up on after `max_spins` reads, header[4] the reads it took (as `wait_and_fetch` writes
    them)."""

    header: torch.Tensor
    gen: torch.Tensor
    src: torch.Tensor
    max_spins: int


def available(y: torch.Tensor, hidden: int) -> bool:
    """Whether `combine_norm` can run on y's device for rows of `hidden` (fused kernels on, decode-sized)."""
    return fused.fold_ok(y) and hidden <= MAX_HIDDEN


def combine_norm(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor | None,
                 eps: float, extra: torch.Tensor | HostAnswer | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(x_out, normed): `fused.combine(y, weights, residual.dtype, extra, residual)` and, given `norm_weight`, the
    RMSNorm of x_out with it (`fused.rms_norm(x_out, norm_weight, eps)`), in one launch. y [N*k, H] fp32,
    weights [N, k], residual [N, H], extra [N, H] fp32 on the device or a `HostAnswer` (waited for in the same
    kernel) -> [N, H] twice in residual's dtype (normed None without a weight). None when it cannot run here
    (the caller runs the unfused ops; a `HostAnswer` then needs `wait_and_fetch` first)."""
    n, k = weights.shape
    hidden = y.shape[1]
    dtype = residual.dtype
    if (not available(y, hidden) or y.dtype != torch.float32 or y.stride(-1) != 1 or y.shape[0] != n * k
            or residual.shape != (n, hidden) or not residual.is_contiguous()
            or (norm_weight is not None and norm_weight.dtype != dtype)):
        return None
    wait = extra if isinstance(extra, HostAnswer) else None
    if wait is not None and (wait.src.dtype != torch.float32 or wait.src.numel() != n * hidden):
        return None
    if isinstance(extra, torch.Tensor) and (extra.dtype != torch.float32 or not extra.is_contiguous()):
        return None
    w = weights.float().contiguous()
    out = torch.empty((n, hidden), dtype=dtype, device=y.device)
    normed = torch.empty_like(out) if norm_weight is not None else None
    if n:
        block = triton.next_power_of_2(hidden)
        src = wait.src if wait is not None else extra if extra is not None else y
        header = wait.header if wait is not None else w  # unread pointers without a wait
        gen = wait.gen if wait is not None else w
        launch = {"PDL": False} if wait is not None else pdl.launch(y)
        _combine_norm_kernel[(n,)](
            y, w, src, residual, norm_weight if norm_weight is not None else residual, out,
            normed if normed is not None else out, header, gen, hidden, y.stride(0), eps,
            wait.max_spins if wait is not None else 0, K=k, BLOCK=block, EXTRA=extra is not None,
            WAIT=wait is not None, NORM=norm_weight is not None, FENCE=y.is_cuda, BF16=dtype == torch.bfloat16,
            num_warps=8 if block >= 4096 else 4, **launch)
    return out, normed


if triton is not None:
    from strata.kernels.fused import _round
    from strata.kernels.host_signal import load_acquire

    @triton.jit
    def _combine_norm_kernel(y_ptr, w_ptr, extra_ptr, res_ptr, nw_ptr, out_ptr, normed_ptr, hdr_ptr, gen_ptr, H,
                             stride_y, eps, max_spins, K: tl.constexpr, BLOCK: tl.constexpr, EXTRA: tl.constexpr,
                             WAIT: tl.constexpr, NORM: tl.constexpr, FENCE: tl.constexpr, BF16: tl.constexpr,
                             PDL: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        dt = out_ptr.dtype.element_ty
        if NORM:  # a weight: read before the wait
            nw = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        pdl.enter(PDL)
        res = tl.load(res_ptr + n * H + offs, mask=mask, other=0.0).to(tl.float32)  # its latency under the rows'
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):  # experts in routing order, whatever tier computed each row
            wj = tl.load(w_ptr + n * K + j)
            acc += tl.load(y_ptr + (n * K + j) * stride_y + offs, mask=mask, other=0.0) * wj
        if WAIT:  # the worker's answer: every program waits for `done` itself (hdr [8] int64, host)
            want = tl.load(gen_ptr)
            seen = load_acquire(hdr_ptr + 1, FENCE)
            spins = 0
            while (seen != want) & (spins < max_spins):
                seen = load_acquire(hdr_ptr + 1, FENCE)
                spins += 1
            if n == 0:
                if seen != want:
                    tl.store(hdr_ptr + 3, want)
                tl.store(hdr_ptr + 4, spins.to(tl.int64))
            acc += tl.load(extra_ptr + n * H + offs, mask=mask, other=0.0, volatile=True)
        elif EXTRA:  # the CPU's weighted partial sum of the cold pairs, already on the device
            acc += tl.load(extra_ptr + n * H + offs, mask=mask, other=0.0)
        # x + mlp(h): the MoE output rounded to the model dtype first, then the add, rounded again
        x = _round(_round(acc, dt, BF16) + res, dt, BF16)
        tl.store(out_ptr + n * H + offs, x.to(dt), mask=mask)
        if NORM:  # the next block's RMSNorm of x_out, as fused.rms_norm computes it
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
            tl.store(normed_ptr + n * H + offs, (nw * _round(x * r, dt, BF16)).to(dt), mask=mask)
