"""llama.cpp's reference quantizers for ggml block types: float rows -> GGUF blocks.

    blocks = quantize_rows(w, "Q4_K")    # float32 [..., K] -> uint8 [..., K / 256 * 144]
    gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)   # ~ w

The `gguf` package quantizes only Q8_0 (used here as it is); the K-quants follow ggml-quants.c's
`quantize_row_q{2,4,5,6}_K_ref`, what `llama-quantize` runs when it has no importance matrix:

- Q4_K / Q5_K: 256-value superblocks of 8 sub-blocks of 32, each fitted as scale * q - min (q in 0..15 / 0..31)
  by `make_qkx2_quants`' search (least-squares fits over a sweep of trial scales, weights |x| + rms(x)); the 8 scales
  and 8 mins are then quantized to 6 bits against two f16 superblock scales and every value requantized against the
  rounded ones.
- Q6_K: 16 sub-blocks of 16, each a symmetric fit of q in -32..31 by `make_qx_quants` (19 trial scales, weights x^2),
  the 16 scales in int8 against one f16 superblock scale.
- Q2_K: 16 sub-blocks of 16, scale * q - min with q in 0..3 (`make_qkx2_quants`, absolute error, weights |x|), the
  scales and mins in 4 bits each.

`quantize_rows` runs the K-quants compiled (strata.kernels.cpu.quantize: the same C functions, each search over 8 or 16
sub-blocks in the lanes of a vector) where the CPU library loads; `quantize_rows_reference` is their numpy port and
the tests' oracle for the compiled code. Every numpy function is vectorized over blocks (one numpy operation handles
all of a matrix's sub-blocks at once: values along axis 0, sub-blocks along axis 1) and computes in float32 with the C code's operations in its order: products
associated as written, sums taken one term after another (numpy reduces an outer axis row by row), rounding with
`np.rint` as `nearest_int` does (to nearest, ties to even). The blocks are then llama.cpp's byte for byte
(tests/store/test_gguf_quantize.py holds both to ggml's own quantize_row_*_ref where llama-cpp-python is present;
a ggml built to fuse multiply-adds could tip a near-tie of a search, changing a block but not its error).
"""

from __future__ import annotations

import numpy as np

from strata.errors import UnsupportedError

QK_K = 256  # values in a K-quant superblock
QUANTIZED_TYPES = ("Q8_0", "Q2_K", "Q4_K", "Q5_K", "Q6_K")  # the types `quantize_rows` writes
_BLOCK = {"Q8_0": (32, 34), "Q2_K": (QK_K, 84), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}
_F32 = np.float32


def block_shape(type_name: str) -> tuple[int, int]:
    """(values, bytes) of one block of `type_name`."""
    if type_name not in _BLOCK:
        raise UnsupportedError(f"GGML type {type_name} is not one strata quantizes to; use one of "
                               f"{', '.join(QUANTIZED_TYPES)}")
    return _BLOCK[type_name]


def can_quantize(type_name: str, k: int) -> bool:
    """Whether rows of `k` values split into whole blocks of `type_name`."""
    return k % block_shape(type_name)[0] == 0


def quantize_rows(x: np.ndarray, type_name: str) -> np.ndarray:
    """float [..., K] -> uint8 [..., K / block_values * block_bytes]: each row as ggml blocks of `type_name`. The
    K-quants run compiled (strata.kernels.cpu.quantize, the same bytes some 10x faster a thread) where the CPU
    library loads, else `quantize_rows_reference`."""
    values, nbytes = _checked(x, type_name)
    if type_name != "Q8_0":
        from strata.kernels.cpu.quantize import quantize_rows as compiled

        out = compiled(x, type_name)
        if out is not None:
            return out
    return quantize_rows_reference(x, type_name)


def quantize_rows_reference(x: np.ndarray, type_name: str) -> np.ndarray:
    """`quantize_rows` in numpy: the port of ggml-quants.c this module describes (Q8_0: `gguf`'s own)."""
    values, nbytes = _checked(x, type_name)
    k = x.shape[-1]
    blocks = np.ascontiguousarray(x, dtype=_F32).reshape(-1, values)
    if type_name == "Q8_0":
        import gguf

        out = gguf.quants.quantize(blocks, gguf.GGMLQuantizationType.Q8_0)  # llama.cpp's own, bit-exact
    else:
        out = {"Q2_K": _q2_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[type_name](blocks)
    return out.reshape(*x.shape[:-1], k // values * nbytes)


def _checked(x: np.ndarray, type_name: str) -> tuple[int, int]:
    """(values, bytes) of a `type_name` block, after checking that x's rows split into whole blocks."""
    values, nbytes = block_shape(type_name)
    k = x.shape[-1]
    if k % values:
        raise UnsupportedError(f"rows of {k} values do not split into {type_name} blocks of {values}; "
                               f"use a type with {values}-value blocks only for rows a multiple of {values}")
    return values, nbytes


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float [n] -> uint8 [n, 2]: f16 little-endian (GGML_FP32_TO_FP16 rounds to nearest even, as numpy does)."""
    return v.astype(np.float16).astype("<f2").view(np.uint8).reshape(-1, 2)


def _f16_round(v: np.ndarray) -> np.ndarray:
    """The float32 value an f16 field holds (GGML_FP16_TO_FP32 of GGML_FP32_TO_FP16)."""
    return v.astype(np.float16).astype(_F32)


def _seq_sum(v: np.ndarray) -> np.ndarray:
    """Sum over axis 0 of [n, S], one term after another as the C loops add them (numpy reduces an outer axis by
    adding rows in order; along the inner axis it sums pairwise, which would tip near-ties of the searches)."""
    return v.sum(axis=0)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
               use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants over sub-blocks x [n, S] (values along axis 0) with weights w [n, S]: (scale [S],
    -min [S], q [n, S]) for x ~ scale * q - (-min), q in 0..nmax, min <= 0: a least-squares fit over nstep + 1 trial
    scales (nmax + rmin + i rdelta) / (max - min), kept where it lowers the weighted squared (or absolute, `use_mad`)
    error. As in C, a kept fit's min is the origin of the trials after it."""
    low = np.minimum(x.min(axis=0), _F32(0))
    mx = x.max(axis=0)
    flat = mx == low
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)

    def error(scale, offset, q):
        diff = scale * q + offset - x
        return _seq_sum(w * (np.abs(diff) if use_mad else diff * diff))

    def levels(top):  # q for trial numerator `top` from the current origin `low`
        iscale = top / np.where(flat, _F32(1), mx - low)
        return iscale, np.clip(np.rint(iscale * (x - low)), 0, nmax).astype(_F32)

    iscale, q = levels(_F32(nmax))
    scale = _F32(1) / iscale
    best = error(scale, low, q)
    for step in range(nstep + 1):
        _, trial = levels(_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax))
        wl = w * trial
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * trial), _seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det = np.where(ok, det, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0  # the fit's offset must stay a subtraction: refit the scale through zero
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, _F32(1)), this_scale)
        this_min = np.where(positive, _F32(0), this_min)
        cur = error(this_scale, this_min, trial)
        take = ok & ~flat & (cur < best)
        q = np.where(take, trial, q)
        best = np.where(take, cur, best)
        scale = np.where(take, this_scale, scale)
        low = np.where(take, this_min, low)
    scale = np.where(flat, _F32(0), scale)
    q = np.where(flat, _F32(0), q)
    return scale.astype(_F32), (-low).astype(_F32), q


def _make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants with rmse_type 1 over sub-blocks x [n, S] (values along axis 0): (scale [S], q [n, S]
    in -nmax..nmax-1 stored + nmax) for x ~ scale * q: 19 trial scales -(nmax + 0.1 i) / max (max the value of
    largest magnitude), each refitted by weighted least squares (weights x^2), the one of largest
    sum(w x q)^2 / sum(w q^2) kept."""
    at = np.abs(x).argmax(axis=0)
    big = np.take_along_axis(x, at[None, :], axis=0)[0]
    zero = np.abs(big) < _F32(1e-15)
    big = np.where(zero, _F32(1), big)
    w = x * x
    wx = w * x

    def fit(iscale):
        lv = np.clip(np.rint(iscale * x), -nmax, nmax - 1).astype(_F32)
        return lv, _seq_sum(wx * lv), _seq_sum(w * lv * lv)

    lv, sumlx, suml2 = fit(_F32(-nmax) / big)
    q = lv
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0))
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        lv, sumlx, suml2 = fit(-(_F32(nmax) + _F32(0.1) * _F32(i)) / big)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        safe = np.where(suml2 > 0, suml2, _F32(1))
        q = np.where(take, lv, q)
        scale = np.where(take, sumlx / safe, scale)
        best = np.where(take, scale * sumlx, best)
    scale = np.where(zero, _F32(0), scale)
    stored = np.where(zero, _F32(0), q + nmax)  # an all-zero sub-block stores 0s, as C leaves it
    return scale.astype(_F32), stored.astype(np.uint8)


def _requantize(x: np.ndarray, step: np.ndarray, low: np.ndarray, q: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Each sub-block's values against its rounded step and offset, x ~ step * q - low (sub-blocks whose step is 0
    keep the search's q, as the C code skips them): x [B, S, n], step and low [B, S], q [B, S, n]."""
    live = step != 0
    safe = np.where(live, step, _F32(1))
    again = np.clip(np.rint((x + low[..., None]) / safe[..., None]), qmin, qmax)
    return np.where(live[..., None], again, q).astype(np.int16)


def _scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 scale bytes from 8 six-bit scales and 8 six-bit mins per block (uint8 [B, 8] each)."""
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _k_scale_min(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Shared by Q4_K and Q5_K: (d, dmin, 12 scale bytes, q [B, 8, 32]) of blocks [B, 256]."""
    nb = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(nb * 8, 32).T)  # [32, sub-blocks]
    av_x = np.sqrt(_seq_sum(x * x) / _F32(32))
    scales, mins, q = _make_qkx2(x, av_x + np.abs(x), nmax, rmin, 0.1, nstep, False)
    scales, mins, q = scales.reshape(nb, 8), mins.reshape(nb, 8), q.T
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    inv_scale = np.where(max_scale > 0, _F32(63) / np.where(max_scale > 0, max_scale, _F32(1)), _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / np.where(max_min > 0, max_min, _F32(1)), _F32(0))
    # nearest_int into a uint8, then at most 63 (a negative int wraps to a large byte, so ends at 63 too)
    ls = np.minimum(np.rint(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    d, dmin = max_scale / _F32(63), max_min / _F32(63)
    step = _f16_round(d)[:, None] * ls.astype(_F32)
    low = _f16_round(dmin)[:, None] * lm.astype(_F32)
    q = _requantize(blocks.reshape(nb, 8, 32), step, low, q.reshape(nb, 8, 32), 0, nmax)
    return d, dmin, _scales_k4(ls, lm), q.astype(np.uint8)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: [B, 256] float32 -> [B, 144] (d, dmin, scales[12], qs[128])."""
    d, dmin, sc, q = _k_scale_min(blocks, 15, -1.0, 20)
    nb = blocks.shape[0]
    q = q.reshape(nb, 4, 2, 32)  # 4 groups of 64 values: the low nibbles hold the first 32, the high the next
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), sc, qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: [B, 256] -> [B, 176] (d, dmin, scales[12], qh[32], qs[128])."""
    d, dmin, sc, q = _k_scale_min(blocks, 31, -0.5, 15)
    nb = blocks.shape[0]
    q = q.reshape(nb, 4, 2, 32)
    low = q & 0xF
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    high = (q >> 4).astype(np.uint8)  # bit 2g of qh[j] is value 64g + j's fifth bit, bit 2g+1 value 64g + 32 + j's
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None, None] + np.arange(2, dtype=np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce((high << shifts).reshape(nb, 8, 32), axis=1).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), sc, qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: [B, 256] -> [B, 210] (ql[128], qh[64], scales[16] int8, d)."""
    nb = blocks.shape[0]
    scales, q = _make_qx(np.ascontiguousarray(blocks.reshape(nb * 16, 16).T), 32)
    scales, q = scales.reshape(nb, 16), q.T.reshape(nb, 16, 16)
    at = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, at[:, None], axis=1)[:, 0]
    empty = np.abs(max_scale) < _F32(1e-15)  # the whole block is zero: all-zero bytes
    iscale = np.where(empty, _F32(0), _F32(-128) / np.where(empty, _F32(1), max_scale))
    d = np.where(empty, _F32(0), _F32(1) / np.where(empty, _F32(1), iscale))
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)
    step = _f16_round(d)[:, None] * sc.astype(_F32)
    signed = q.astype(np.int16) - 32
    q = (_requantize(blocks.reshape(nb, 16, 16), step, np.zeros_like(step), signed, -32, 31) + 32).astype(np.uint8)
    q = q.reshape(nb, 2, 4, 32)  # per half of 128 values: 4 quarters of 32
    ql = np.concatenate([q[:, :, 0] & 0xF | ((q[:, :, 2] & 0xF) << 4),
                         q[:, :, 1] & 0xF | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql, qh.reshape(nb, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    out[empty] = 0
    return out


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref: [B, 256] -> [B, 84] (scales[16]: scale | min << 4, qs[64], d, dmin)."""
    nb = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(nb * 16, 16).T)  # [16, sub-blocks]
    scales, mins, q = _make_qkx2(x, np.abs(x), 3, -0.5, 0.1, 15, True)
    scales, mins, q = scales.reshape(nb, 16), mins.reshape(nb, 16), q.T
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    some, some_min = max_scale > 0, max_min > 0
    # nearest_int stored in a uint8, the min's nibble OR'd above it (a negative scale wraps, as in C)
    ls = np.where(some[:, None], np.rint((_F32(15) / np.where(some, max_scale, _F32(1)))[:, None] * scales), 0)
    lm = np.where(some_min[:, None], np.rint((_F32(15) / np.where(some_min, max_min, _F32(1)))[:, None] * mins), 0)
    sc = ((ls.astype(np.int64) & 0xFF) | ((lm.astype(np.int64) << 4) & 0xFF)).astype(np.uint8)
    d = np.where(some, max_scale / _F32(15), _F32(0))
    dmin = np.where(some_min, max_min / _F32(15), _F32(0))
    step = _f16_round(d)[:, None] * (sc & 0xF).astype(_F32)
    low = _f16_round(dmin)[:, None] * (sc >> 4).astype(_F32)
    q = _requantize(blocks.reshape(nb, 16, 16), step, low, q.reshape(nb, 16, 16), 0, 3).astype(np.uint8)
    q = q.reshape(nb, 2, 4, 32)  # per half of 128 values: byte l holds values l, l + 32, l + 64, l + 96
    qs = (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([sc, qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)
