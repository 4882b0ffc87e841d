"""Qwen3.5-MoE's decode-step chains in a few Triton launches, where torch needs about seventy a layer.

A Gated DeltaNet layer's decode step in torch (strata.runtime.model.qwen3_5.delta_rule) is ~60 launches of a few
microseconds each (gathers, the convolution's taps, l2 norms, the decay, the delta rule's outer products, the gated
norm), and every layer's zero-centred norms are ~7 more each; at one token a step those launches, not the weights'
bytes, set the layer's time. Here:

    conv_step(qkv [B, C], conv [slots, C, K-1], weight [C, 1, K], slots [B], fresh [B] | None) -> [B, C]
        the short causal convolution and its silu, each sequence's window gathered by slot and moved on in place
    delta_step(qkv [B, C], a, b [B, Hv], A_log, dt_bias [Hv], recurrent [slots, Hv, dk, dv], slots, fresh, ...)
        -> [B, Hv, dv]: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), q and k l2-normalised, then the
        gated delta rule on each sequence's state (fp32, updated in place)
    gated_rms_norm(x [N, D], gate [N, D], weight [D], eps) -> [N, D]: weight * rms_norm(x) * silu(gate)
    zero_centered_rms_norm(x [N, D], weight [D], eps, delta=None) -> [N, D] (or (x + delta, norm) with delta)

Each reproduces the torch chain's rounding steps (a value rounded to the model dtype where torch rounds it); only
sums (the convolution's taps, the norms, k^T S and q^T S) add in another order. Callers check `fused_ok` and keep
the torch chain off CUDA, which stays the reference.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import fused, pdl
from strata.kernels.gpu.fused import triton

if triton is not None:
    import triton.language as tl

__all__ = ["conv_step", "delta_step", "gated_rms_norm", "zero_centered_rms_norm", "decode_ok", "fused_ok"]


def fused_ok(x: torch.Tensor) -> bool:
    """Whether these kernels run on `x`: `fused.fused_ok` (CUDA or Triton's interpreter, `[debug] fused_kernels` on)."""
    return fused.fused_ok(x)


def decode_ok(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, recurrent: torch.Tensor, dk: int,
              dv: int) -> bool:
    """Whether a decode step's convolution and delta rule run as the fused kernels: fused kernels on, one dtype
    for the inputs, the convolution's window and weight, an fp32 state, heads of at most 256."""
    return (fused_ok(qkv) and qkv.dtype == conv.dtype == weight.dtype and recurrent.dtype == torch.float32
            and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32) and dk <= 256 and dv <= 256
            and conv.stride(-1) == 1
            and recurrent[0].is_contiguous() and weight.is_contiguous())


def conv_step(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
              fresh: torch.Tensor | None) -> torch.Tensor:
    """`delta_rule.conv_step` on the windows of `slots`: silu(conv) [B, C] in qkv's dtype; each window moved on by
    one in place (zeros first where `fresh`)."""
    b, c = qkv.shape
    rows = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    out = torch.empty_like(rows)
    block = 256
    _conv_step_kernel[(b, triton.cdiv(c, block))](
        rows, conv, weight, slots, fresh if fresh is not None else slots, out, c, rows.stride(0), conv.stride(0),
        conv.stride(1), K=weight.shape[-1], BLOCK=block, FRESH=fresh is not None, BF16=qkv.dtype == torch.bfloat16,
        num_warps=4, **pdl.launch(qkv))
    return out


def delta_step(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               recurrent: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None, key_heads: int, dk: int,
               dv: int) -> torch.Tensor:
    """One token of each of B sequences: the convolved qkv [B, 2 Hk dk + Hv dv], the raw gate inputs a, b [B, Hv]
    (in_proj_a's and in_proj_b's outputs) -> outputs [B, Hv, dv] in qkv's dtype; the states of `slots` in
    `recurrent` [slots, Hv, dk, dv] stepped in place (from zeros where `fresh`)."""
    rows, hv = qkv.shape[0], recurrent.shape[1]
    if not (a.stride(-1) == 1 and b.stride(-1) == 1 and a.stride(0) == b.stride(0)):
        a, b = a.contiguous(), b.contiguous()
    out = torch.empty(rows, hv, dv, dtype=qkv.dtype, device=qkv.device)
    bv = min(triton.next_power_of_2(dv), 32)  # a program's columns of the state: [dk, bv] fp32 in registers
    _delta_step_kernel[(rows, hv, triton.cdiv(dv, bv))](
        qkv, a, b, a_log, dt_bias, recurrent, slots, fresh if fresh is not None else slots, out, qkv.stride(0),
        a.stride(0), recurrent.stride(0), key_heads * dk, dk**0.5, REP=hv // key_heads, DK=dk, DV=dv,
        DKB=triton.next_power_of_2(dk), BV=bv,
        FRESH=fresh is not None, BF16=qkv.dtype == torch.bfloat16, num_warps=4, **pdl.launch(qkv))
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`(weight * rms_norm(x.float()).to(dtype)) * silu(gate.float())` in x's dtype over the last dim, one launch;
    None where the fused kernel does not apply (the caller runs the torch chain)."""
    d = x.shape[-1]
    if not fused_ok(x) or weight.dtype != x.dtype or gate.dtype != x.dtype or d > 8192:
        return None
    rows, gates = x.reshape(-1, d).contiguous(), gate.reshape(-1, d).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _gated_norm_kernel[(rows.shape[0],)](rows, gates, weight, out, d, eps, BLOCK=triton.next_power_of_2(d),
                                             BF16=x.dtype == torch.bfloat16, num_warps=4, **pdl.launch(x))
    return out.view(x.shape)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """`(rms_norm(x.float()) * (1 + weight.float())).to(dtype)` over the last dim, one launch; with `delta`, the
    residual add first: (x + delta, its norm). None where the fused kernel does not apply."""
    d = x.shape[-1]
    if not fused_ok(x) or d > 16384 or (delta is not None and delta.dtype != x.dtype):
        return None
    rows = x.reshape(-1, d).contiguous()
    deltas = delta.reshape(-1, d).contiguous() if delta is not None else rows
    total = torch.empty_like(rows) if delta is not None else rows
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _zc_norm_kernel[(rows.shape[0],)](rows, deltas, weight, total, out, d, eps, BLOCK=block, ADD=delta is not None,
                                          BF16=x.dtype == torch.bfloat16, num_warps=8 if block >= 4096 else 4,
                                          **pdl.launch(x))
    if delta is not None:
        return total.view(x.shape), out.view(x.shape)
    return out.view(x.shape)


if triton is not None:

    @triton.jit
    def _conv_step_kernel(x_ptr, conv_ptr, w_ptr, slots_ptr, fresh_ptr, out_ptr, C, stride_x, stride_slot,
                          stride_chan, K: tl.constexpr, BLOCK: tl.constexpr, FRESH: tl.constexpr, BF16: tl.constexpr,
                          PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < C
        dt = out_ptr.dtype.element_ty
        pdl.enter(PDL)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        window = conv_ptr + slot * stride_slot + offs * stride_chan
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K - 1):  # the window's inputs, oldest first; each moves down one place
            p = tl.load(window + j, mask=mask, other=0.0).to(tl.float32)
            if FRESH:  # a sequence at position 0: zeros, not what its slot held
                p = tl.where(tl.load(fresh_ptr + row) != 0, 0.0, p)
            acc += p * tl.load(w_ptr + offs * K + j, mask=mask, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(window + (j - 1), p.to(dt), mask=mask)
        acc += x * tl.load(w_ptr + offs * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
        if K > 1:
            tl.store(window + (K - 2), x.to(dt), mask=mask)
        y = fused.round_to(acc, dt, BF16)  # the convolution's output, rounded to the weight's dtype
        tl.store(out_ptr + row * stride_x + offs, (y / (1.0 + tl.exp(-y))).to(dt), mask=mask)  # silu

    @triton.jit
    def _delta_step_kernel(qkv_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, rec_ptr, slots_ptr, fresh_ptr, out_ptr,
                           stride_qkv, stride_ab, stride_slot, KEY_DIM, scale, REP: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, DKB: tl.constexpr, BV: tl.constexpr, FRESH: tl.constexpr,
                           BF16: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cols = tl.program_id(2) * BV + tl.arange(0, BV)
        dks = tl.arange(0, DKB)  # DK padded to a power of two (masked)
        kmask, vmask = dks < DK, cols < DV
        dt = out_ptr.dtype.element_ty
        hv = tl.num_programs(1)
        pdl.enter(PDL)
        a_log = tl.load(alog_ptr + head).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + head).to(tl.float32)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        base = qkv_ptr + row * stride_qkv
        kh = head // REP  # the key head serving this value head
        q = tl.load(base + kh * DK + dks, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(base + KEY_DIM + kh * DK + dks, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(base + 2 * KEY_DIM + head * DV + cols, mask=vmask, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) / scale  # l2norm, then q / dk ** 0.5
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        braw = tl.load(b_ptr + row * stride_ab + head).to(tl.float32)
        beta = fused.round_to(1.0 / (1.0 + tl.exp(-braw)), dt, BF16)  # sigmoid in the model dtype, as torch's
        x = tl.load(a_ptr + row * stride_ab + head).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
        g = -tl.exp(a_log) * softplus
        state = rec_ptr + slot * stride_slot + head * (DK * DV) + dks[:, None] * DV + cols[None, :]
        smask = kmask[:, None] & vmask[None, :]
        s = tl.load(state, mask=smask, other=0.0)  # [DKB, BV] fp32
        if FRESH:
            s = tl.where(tl.load(fresh_ptr + row) != 0, 0.0, s)
        s = s * tl.exp(g)  # forget
        delta = (v - tl.sum(k[:, None] * s, axis=0)) * beta  # the part of v the state does not predict
        s = s + k[:, None] * delta[None, :]
        tl.store(state, s, mask=smask)
        o = tl.sum(q[:, None] * s, axis=0)
        tl.store(out_ptr + (row * hv + head) * DV + cols, o.to(dt), mask=vmask)

    @triton.jit
    def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr, BF16: tl.constexpr,
                           PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        dt = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        pdl.enter(PDL)
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        h = fused.round_to(w * fused.round_to(x * r, dt, BF16), dt, BF16)  # weight * norm(x).to(dtype), rounded
        z = tl.load(z_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * D + offs, (h * (z / (1.0 + tl.exp(-z)))).to(dt), mask=mask)

    @triton.jit
    def _zc_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, D, eps, BLOCK: tl.constexpr, ADD: tl.constexpr,
                        BF16: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        dt = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        pdl.enter(PDL)
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # the residual add, rounded as torch's
            x = fused.round_to(x + tl.load(d_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32), dt, BF16)
            tl.store(sum_ptr + row * D + offs, x.to(dt), mask=mask)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(out_ptr + row * D + offs, (x * r * (1.0 + w)).to(dt), mask=mask)
