// llama.cpp's reference K-quant quantizers (ggml-quants.c: quantize_row_q{2,4,5,6}_K_ref and the searches they call,
// make_qkx2_quants and make_qx_quants), for strata.tiers.store.gguf_quantize: float rows -> GGUF blocks, byte for
// byte what `llama-quantize` writes without an importance matrix and what that module's numpy port computes.
//
// The C code's float operations in its order (built with -ffp-contract=off: no fused multiply-adds; sums one term
// after another), nearest_int's magic-number rounding (to nearest, ties to even), and its f16 conversions (round to
// nearest even). The scale searches, which take nearly all of the time, run 8 or 16 sub-blocks at once in vector lanes
// (cpu_quantize_search.h). One call quantizes `rows` rows of `k` values (k a multiple of 256), each row into its
// blocks; the Python side splits a matrix over threads (ctypes releases the GIL for the call).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_bits.h"

#define C_EXPORTED extern "C" __attribute__((visibility("default")))

#pragma GCC diagnostic ignored "-Wpsabi"  // the lane helpers are inlined into each clone: no vector crosses a call

namespace {

constexpr int QK_K = 256;
constexpr float GROUP_MAX_EPS = 1e-15f;


// ggml's GGML_FP32_TO_FP16 without F16C (ggml_compute_fp32_to_fp16): round to nearest even, as F16C does
inline uint16_t f32_to_f16(float f) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = bits_of(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits_of(base);
    const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
// GGML_FP16_TO_FP32 (ggml_compute_fp16_to_fp32): exact
inline float f16_to_f32(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result = sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized));
    return float_of(result);
}
inline float f16_round(float f) { return f16_to_f32(f32_to_f16(f)); }
inline void put_f16(uint8_t* p, float f) {
    const uint16_t h = f32_to_f16(f);
    std::memcpy(p, &h, 2);
}

inline int nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int i;
    std::memcpy(&i, &val, 4);
    return (i & 0x007fffff) - 0x00400000;
}
template <class T>
inline T clamp(T v, T lo, T hi) { return v < lo ? lo : (v > hi ? hi : v); }

#include "cpu_quantize_search.h"

void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) {
        *d = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

// Q4_K (nmax 15: 144 bytes d, dmin, scales[12], qs[128]) and Q5_K (nmax 31: 176 bytes d, dmin, scales[12], qh[32],
// qs[128]): 8 sub-blocks of 32 fitted as scale * q - min, the scales and mins in 6 bits against two f16 scales
void quantize_k4_k5(const float* x, uint8_t* y, int nmax) {
    const bool q5 = nmax == 31;
    uint8_t L[QK_K], Lt[QK_K], sc12[12] = {0};
    float xt[QK_K], wt[QK_K], mins[QK_K / 32], scales[QK_K / 32];
    for (int j = 0; j < QK_K / 32; ++j) {  // sub-block j in lane j
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = std::sqrt(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) xt[l * 8 + j] = x[32 * j + l], wt[l * 8 + j] = av_x + std::fabs(x[32 * j + l]);
    }
    if (q5)
        make_qkx2_quants<8>(32, 31, xt, wt, Lt, scales, mins, -0.5f, 0.1f, 15, false);
    else
        make_qkx2_quants<8>(32, 15, xt, wt, Lt, scales, mins, -1.f, 0.1f, 20, false);
    float max_scale = 0, max_min = 0;
    untile_codes<8>(Lt, scales, mins, L, max_scale, max_min);
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t ls = static_cast<uint8_t>(nearest_int(inv_scale * scales[j]));
        uint8_t lm = static_cast<uint8_t>(nearest_int(inv_min * mins[j]));
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            sc12[j] = ls, sc12[j + 4] = lm;
        } else {
            sc12[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc12[j - 4] |= ((ls >> 4) << 6);
            sc12[j - 0] |= ((lm >> 4) << 6);
        }
    }
    put_f16(y, max_scale / 63.f);
    put_f16(y + 2, max_min / 63.f);
    std::memcpy(y + 4, sc12, 12);
    const float d_all = f16_round(max_scale / 63.f), dmin_all = f16_round(max_min / 63.f);
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t sc, m;
        get_scale_min_k4(j, sc12, &sc, &m);
        const float d = d_all * sc;
        if (!d) continue;
        const float dm = dmin_all * m;
        for (int ii = 0; ii < 32; ++ii) L[32 * j + ii] = static_cast<uint8_t>(clamp(nearest_int((x[32 * j + ii] + dm) / d), 0, nmax));
    }
    if (!q5) {
        uint8_t* q = y + 16;
        for (int j = 0; j < QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
        return;
    }
    uint8_t* qh = y + 16;
    uint8_t* ql = y + 48;
    std::memset(qh, 0, QK_K / 8);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK_K; n += 64) {
        for (int j = 0; j < 32; ++j) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) l1 -= 16, qh[j] |= m1;
            if (l2 > 15) l2 -= 16, qh[j] |= m2;
            ql[j] = static_cast<uint8_t>(l1 | (l2 << 4));
        }
        m1 <<= 2, m2 <<= 2, ql += 32;
    }
}

// Q6_K: 210 bytes ql[128], qh[64], scales[16] int8, d; 16 sub-blocks of 16, symmetric fits of q in -32..31
void quantize_q6_k(const float* x, uint8_t* y) {
    int8_t L[QK_K], Lt[QK_K];
    float xt[QK_K], scales[QK_K / 16];
    for (int ib = 0; ib < QK_K / 16; ++ib)
        for (int l = 0; l < 16; ++l) xt[l * 16 + ib] = x[16 * ib + l];
    make_qx_quants<16>(16, 32, xt, Lt, scales);
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        for (int l = 0; l < 16; ++l) L[16 * ib + l] = Lt[l * 16 + ib];
        const float abs_scale = std::fabs(scales[ib]);
        if (abs_scale > max_abs_scale) max_abs_scale = abs_scale, max_scale = scales[ib];
    }
    if (max_abs_scale < GROUP_MAX_EPS) {
        std::memset(y, 0, 210);
        return;
    }
    const float iscale = -128.f / max_scale;
    put_f16(y + 208, 1 / iscale);
    int8_t* sc = reinterpret_cast<int8_t*>(y + 192);
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const int v = nearest_int(iscale * scales[ib]);
        sc[ib] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    const float d_all = f16_round(1 / iscale);
    for (int j = 0; j < QK_K / 16; ++j) {
        const float d = d_all * sc[j];
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii)
            L[16 * j + ii] = static_cast<int8_t>(clamp(nearest_int(x[16 * j + ii] / d), -32, 31) + 32);
    }
    uint8_t* ql = y;
    uint8_t* qh = y + 128;
    for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l + 0] & 0xF, q2 = L[j + l + 32] & 0xF, q3 = L[j + l + 64] & 0xF,
                          q4 = L[j + l + 96] & 0xF;
            ql[l + 0] = static_cast<uint8_t>(q1 | (q3 << 4));
            ql[l + 32] = static_cast<uint8_t>(q2 | (q4 << 4));
            qh[l] = static_cast<uint8_t>((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                                         ((L[j + l + 96] >> 4) << 6));
        }
    }
}

// Q2_K: 84 bytes scales[16] (scale | min << 4), qs[64], d, dmin; 16 sub-blocks of 16, q in 0..3
void quantize_q2_k(const float* x, uint8_t* y) {
    uint8_t L[QK_K], Lt[QK_K], sc[16];
    float xt[QK_K], wt[QK_K], mins[QK_K / 16], scales[QK_K / 16];
    const float q4scale = 15.f;
    for (int j = 0; j < QK_K / 16; ++j)
        for (int l = 0; l < 16; ++l) xt[l * 16 + j] = x[16 * j + l], wt[l * 16 + j] = std::fabs(x[16 * j + l]);
    make_qkx2_quants<16>(16, 3, xt, wt, Lt, scales, mins, -0.5f, 0.1f, 15, true);
    float max_scale = 0, max_min = 0;
    untile_codes<16>(Lt, scales, mins, L, max_scale, max_min);
    float d = 0, dmin = 0;
    if (max_scale > 0) {
        const float iscale = q4scale / max_scale;
        for (int j = 0; j < QK_K / 16; ++j) sc[j] = static_cast<uint8_t>(nearest_int(iscale * scales[j]));
        d = max_scale / q4scale;
    } else {
        for (int j = 0; j < QK_K / 16; ++j) sc[j] = 0;
    }
    if (max_min > 0) {
        const float iscale = q4scale / max_min;
        for (int j = 0; j < QK_K / 16; ++j) sc[j] |= static_cast<uint8_t>(nearest_int(iscale * mins[j]) << 4);
        dmin = max_min / q4scale;
    }
    std::memcpy(y, sc, 16);
    put_f16(y + 80, d);
    put_f16(y + 82, dmin);
    const float d_all = f16_round(d), dmin_all = f16_round(dmin);
    for (int j = 0; j < QK_K / 16; ++j) {
        const float dj = d_all * (sc[j] & 0xF);
        if (!dj) continue;
        const float dm = dmin_all * (sc[j] >> 4);
        for (int ii = 0; ii < 16; ++ii) L[16 * j + ii] = static_cast<uint8_t>(clamp(nearest_int((x[16 * j + ii] + dm) / dj), 0, 3));
    }
    uint8_t* qs = y + 16;
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

}  // namespace

// rows x k floats (k % 256 == 0) -> rows x (k / 256 * block bytes) GGUF blocks of ggml type `type` (Q2_K 10, Q4_K 12,
// Q5_K 13, Q6_K 14). Returns the bytes a row takes, or -1 for another type or a k that is not whole superblocks.
C_EXPORTED int64_t strata_gguf_quantize(int type, const float* x, int64_t rows, int64_t k, uint8_t* out) {
    int bytes = 0;
    switch (type) {
        case 10: bytes = 84; break;
        case 12: bytes = 144; break;
        case 13: bytes = 176; break;
        case 14: bytes = 210; break;
        default: return -1;
    }
    if (k <= 0 || k % QK_K) return -1;
    const int64_t blocks = rows * (k / QK_K);
    for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + b * QK_K;
        uint8_t* yb = out + b * bytes;
        switch (type) {
            case 10: quantize_q2_k(xb, yb); break;
            case 12: quantize_k4_k5(xb, yb, 15); break;
            case 13: quantize_k4_k5(xb, yb, 31); break;
            default: quantize_q6_k(xb, yb); break;
        }
    }
    return k / QK_K * bytes;
}
