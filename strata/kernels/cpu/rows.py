"""A CPU decode step's small ops between its matrix products, one compiled call each, on bf16 activations.

    y = rms_norm(x, weight, eps)                      # transformers' RMSNorm
    total, y = add_rms_norm(x, delta, weight, eps)    # the residual add, then the norm
    y = norm_rope(x, cos, sin, weight, eps)           # per-head RMSNorm (optional), then the rotate-half rotary
    out = attend(q, keys, values, scale)              # one query per sequence over its cached keys
    out = decode_attention(qkv, ..., k_cache, v_cache, slots, positions, scale)  # all of it, the cache written

A CPU decode layer streams its weights (~100 MB on Qwen3-30B-A3B's shapes) through the caches; what runs between
those products, as torch ops, is ~40 dispatches a layer that each find their data evicted (csrc/cpu_rows.cpp). Each
function here returns None where it does not apply (the caller runs the torch chain): not bf16, not on the CPU,
more than `MAX_ROWS` rows (prefill), no compiled kernel, or the forward pass's fused kernels off (`[debug]
fused_kernels = false`: torch's op chains, the reference, on the CPU as on CUDA). Results are the torch chains' up to
fp32 summation order.
"""

from __future__ import annotations

import ctypes

import torch

from strata.kernels import options
from strata.kernels.cpu import library as kernel_lib

MAX_ROWS = 16
"""Tokens a call takes: a decode step's rows (a prompt's run through torch's vectorized ops)."""
MAX_D = 1 << 14
"""The longest row (hidden size, head) the compiled ops take (csrc/cpu_rows.cpp's kRowsMaxD)."""

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_declared: set[int] = set()


def _lib() -> ctypes.CDLL | None:
    """The kernel library with these entry points declared; None where it does not load (no compiler, not x86) or
    the running forward pass has its fused kernels off (`strata.kernels.options`)."""
    if not options.current().fused:
        return None
    lib = kernel_lib.library() if kernel_lib.backend(None) in ("avx512_bf16", "avx512", "avx2") else None
    if lib is None:
        return None
    if id(lib) not in _declared:
        lib.strata_cpu_rms_norm.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _F]
        lib.strata_cpu_norm_rope.argtypes = [_P, _I64, _P, _F, _P, _P, _I64, _I64, _I64, _I64, _P]
        lib.strata_cpu_attend.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _I64,
                                          _P, _F, _P]
        lib.strata_cpu_decode_attention.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _F, _P, _F, _P, _P, _I64,
                                                    _P, _P, _I64, _I64, _P, _P, _F, _P]
        for fn in (lib.strata_cpu_rms_norm, lib.strata_cpu_norm_rope, lib.strata_cpu_attend,
                   lib.strata_cpu_decode_attention):
            fn.restype = ctypes.c_int
        _declared.add(id(lib))
    return lib


def _rows_ok(x: torch.Tensor, rows: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and 0 < rows <= MAX_ROWS
            and 0 < x.shape[-1] <= MAX_D and not (torch.is_grad_enabled() and x.requires_grad))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"CPU {what} kernel refused its arguments (code {rc})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`weight * rms_norm(x.float()).to(bf16)` over x [..., D] bf16 (weight [D] bf16) -> [..., D] bf16, or None."""
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    if not _rows_ok(x, rows) or weight.dtype != torch.bfloat16 or weight.shape != (d,) or (lib := _lib()) is None:
        return None
    xc, w = x.contiguous(), weight.contiguous()
    y = torch.empty_like(xc)
    _check(lib.strata_cpu_rms_norm(xc.data_ptr(), None, None, w.data_ptr(), y.data_ptr(), rows, d, eps), "RMSNorm")
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, rms_norm(x + delta)) for x, delta [..., D] bf16 (the sum rounded to bf16 first, as torch's
    add), or None."""
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    if (not _rows_ok(x, rows) or delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device
            or weight.dtype != torch.bfloat16 or weight.shape != (d,) or (lib := _lib()) is None):
        return None
    xc, dc, w = x.contiguous(), delta.contiguous(), weight.contiguous()
    total, y = torch.empty_like(xc), torch.empty_like(xc)
    _check(lib.strata_cpu_rms_norm(xc.data_ptr(), dc.data_ptr(), total.data_ptr(), w.data_ptr(), y.data_ptr(), rows,
                                   d, eps), "RMSNorm")
    return total, y


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None,
              eps: float) -> torch.Tensor | None:
    """x [N, heads, d] bf16, each head RMSNormed by weight [d] (None: not normed), then its first `rot` values rotated
    by cos/sin [N, rot] bf16 (rotate-half, `strata.runtime.model.rope.apply_rope`) -> [N, heads, d] bf16, or None."""
    if x.dim() != 3:
        return None
    n, heads, d = x.shape
    rot = cos.shape[-1]
    if (not _rows_ok(x, n) or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16 or cos.shape != (n, rot)
            or sin.shape != (n, rot) or rot > d or rot % 2 or x.stride(2) != 1 or x.stride(1) != d
            or weight is not None and (weight.dtype != torch.bfloat16 or weight.shape != (d,))
            or (lib := _lib()) is None):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    w = weight.contiguous() if weight is not None else None
    y = torch.empty((n, heads, d), dtype=x.dtype)
    _check(lib.strata_cpu_norm_rope(x.data_ptr(), x.stride(0), w.data_ptr() if w is not None else None, eps,
                                    cos.data_ptr(), sin.data_ptr(), rot, n, heads, d, y.data_ptr()), "rotary")
    return y


def attends(head_dim: int, value_dim: int) -> bool:
    """Whether `attend` computes heads of these sizes here: AVX-512 (and the compiled library), head sizes 64, 128 or
    256, values as wide as keys."""
    return (head_dim == value_dim and head_dim in (64, 128, 256)
            and kernel_lib.backend(None) in ("avx512_bf16", "avx512") and _lib() is not None)


def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor | None:
    """Decode attention, one query per sequence: q [B, heads, d] bf16; keys[b] [S_b, kv_heads, d] and values[b]
    [S_b, kv_heads, dv] bf16 (views of the cache: rows strided, each row's heads contiguous), every key attended ->
    [B, heads, dv] bf16, softmax(q k^T * scale) v in fp32 (query head i reads KV head i / (heads / kv_heads)), on the
    calling thread. None where this does not apply (also: no AVX-512, or a head size other than 64, 128 or 256, or
    dv != d)."""
    if q.dim() != 3 or len(keys) != q.shape[0] or len(values) != q.shape[0] or not keys:
        return None
    b, heads, d = q.shape
    k0, v0 = keys[0], values[0]
    if (not _rows_ok(q, b) or k0.dim() != 3 or v0.dim() != 3 or heads % k0.shape[1] or k0.shape[2] != d
            or v0.shape[1] != k0.shape[1] or k0.shape[1] == 0 or (lib := _lib()) is None):
        return None
    kv_heads, dv = k0.shape[1], v0.shape[2]
    if not attends(d, dv):
        return None
    for k, v in zip(keys, values, strict=True):  # one layout for every sequence: one stride set, a base each
        if (k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or k.device.type != "cpu" or v.device.type != "cpu"
                or k.shape[1:] != k0.shape[1:] or v.shape[1:] != v0.shape[1:] or k.shape[0] != v.shape[0]
                or k.shape[0] < 1 or k.stride() != k0.stride() or v.stride() != v0.stride() or k.stride(2) != 1
                or v.stride(2) != 1 or k.data_ptr() % 2 or v.data_ptr() % 2):
            return None
    qc = q.contiguous()
    kbase, vbase = k0.data_ptr(), v0.data_ptr()
    # each sequence's offsets from the first one's, in elements (the cache is one tensor, so they divide evenly)
    kb = (ctypes.c_int64 * b)(*[(k.data_ptr() - kbase) // 2 for k in keys])
    vb = (ctypes.c_int64 * b)(*[(v.data_ptr() - vbase) // 2 for v in values])
    lens = (ctypes.c_int64 * b)(*[k.shape[0] for k in keys])
    out = torch.empty((b, heads, dv), dtype=torch.bfloat16)
    _check(lib.strata_cpu_attend(qc.data_ptr(), b, heads, kv_heads, d, dv, kbase, kb, k0.stride(0),
                                 k0.stride(1), vbase, vb, v0.stride(0), v0.stride(1), lens,
                                 scale, out.data_ptr()), "attention")
    return out


def decode_attention(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     q_norm: tuple[torch.Tensor, float] | None, k_norm: tuple[torch.Tensor, float] | None,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int], positions: list[int],
                     scale: float) -> torch.Tensor | None:
    """A decode step's attention between its projections, one token per sequence: qkv [N, (heads + 2 kv_heads) d]
    bf16 (each row q's heads, k's, v's); q_norm / k_norm: (weight [d] bf16, eps) of the per-head RMSNorms (None:
    none); cos/sin [N, rot] bf16. Writes token n's rotated key and its value at caches [slots, max_len, kv_heads, d]
    [slots[n], positions[n]], then attends its rotated query over that slot's keys 0..positions[n] -> [N, heads, d]
    bf16: `norm_rope` twice, the cache writes and `attend` in one call, with their results. None (nothing written)
    where it does not apply: `attend`'s conditions, or caches not contiguous and alike."""
    n, width = qkv.shape if qkv.dim() == 2 else (0, 0)
    d = width // (heads + 2 * kv_heads) if width else 0
    rot = cos.shape[-1]
    if (not _rows_ok(qkv, n) or d * (heads + 2 * kv_heads) != width or qkv.stride(1) != 1 or heads % kv_heads
            or len(slots) != n or len(positions) != n or not attends(d, d) or rot > d or rot % 2
            or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16 or cos.shape != (n, rot)
            or sin.shape != (n, rot) or k_cache.dim() != 4 or k_cache.shape[2:] != (kv_heads, d)
            or v_cache.shape != k_cache.shape or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or k_cache.device.type != "cpu"
            or v_cache.device.type != "cpu"
            or any(not 0 <= p < k_cache.shape[1] for p in positions) or any(not 0 <= s < k_cache.shape[0] for s in slots)
            or any(w is not None and (w[0].dtype != torch.bfloat16 or w[0].shape != (d,)) for w in (q_norm, k_norm))
            or (lib := _lib()) is None):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    wq, eq = (q_norm[0].contiguous(), q_norm[1]) if q_norm is not None else (None, 0.0)
    wk, ek = (k_norm[0].contiguous(), k_norm[1]) if k_norm is not None else (None, 0.0)
    slot_arr, pos_arr = (ctypes.c_int64 * n)(*slots), (ctypes.c_int64 * n)(*positions)
    out = torch.empty((n, heads, d), dtype=torch.bfloat16)
    _check(lib.strata_cpu_decode_attention(
        qkv.data_ptr(), qkv.stride(0), n, heads, kv_heads, d, wq.data_ptr() if wq is not None else None, eq,
        wk.data_ptr() if wk is not None else None, ek, cos.data_ptr(), sin.data_ptr(), rot, k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), slot_arr, pos_arr, scale, out.data_ptr()),
        "attention")
    return out
