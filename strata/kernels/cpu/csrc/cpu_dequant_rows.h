// Row decoders of cpu_dequant.cpp: one matrix row of a quantized format -> its weights in bf16, each value
// bf16(fl(fl(d * sc) * q) - fl(dmin * m)) (or the format's own product), the oracle's fp32 operations in its order
// (gguf's numpy, strata.kernels.quant's torch), rounded to nearest even.
//
// Written as plain loops over a sub-block's 16 or 32 values and included twice by cpu_dequant.cpp: once under an
// AVX-512 target pragma (GCC vectorizes the loops, 16 lanes: the same operations on each element, so the same bits)
// and once for plain x86-64. No FMA contraction (the library is built with -ffp-contract=off), so d * q - m rounds
// twice as numpy's does. The f16 scales are widened exactly (`f16_to_f32`), a block's sub-block scales computed once
// per block in scalar code.

// bf16 bits of v, rounded to nearest even: torch's `.to(torch.bfloat16)` of an fp32 value, every NaN 0xffff as its
// vectorized conversion writes it (an FP8 NaN code, an MXFP4 zero times scale 255's inf)
inline uint16_t to_bf16(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0xffffu : rounded);
}

// out[l] = bf16(s * q(l) - m) for l < n: the K-quants' inner product with their sub-block's scale and min (m = 0 for
// the types without mins: x - 0 is x, -0 included)
template <class Code>
inline void emit(uint16_t* out, int n, float s, float m, Code q) {
    for (int l = 0; l < n; ++l) out[l] = to_bf16(s * float(q(l)) - m);
}

// Q8_0: 34 bytes [d f16, 32 int8]; w = d * q
inline void row_q8_0(const uint8_t* p, int64_t k, uint16_t* out) {
    for (int64_t b = 0; b < k / 32; ++b, p += 34, out += 32) {
        const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
        emit(out, 32, f16_to_f32(p), 0.f, [q](int l) { return q[l]; });
    }
}

// Q2_K: 84 bytes [scales 16, qs 64, d, dmin]; value h*128 + s*32 + l = (qs[h*32 + l] >> 2s) & 3, sub-block j of 16
// values: w = (d * (sc[j] & 15)) * q - dmin * (sc[j] >> 4)
inline void row_q2_k(const uint8_t* p, int64_t k, uint16_t* out) {
    for (int64_t b = 0; b < k / 256; ++b, p += 84, out += 256) {
        const float d = f16_to_f32(p + 80), dmin = f16_to_f32(p + 82);
        for (int h = 0; h < 2; ++h)
            for (int s = 0; s < 4; ++s)
                for (int half = 0; half < 2; ++half) {
                    const int j = h * 8 + s * 2 + half;
                    const uint8_t* qs = p + 16 + h * 32 + half * 16;
                    emit(out + 16 * j, 16, d * float(p[j] & 15), dmin * float(p[j] >> 4),
                         [qs, s](int l) { return (qs[l] >> (2 * s)) & 3; });
                }
    }
}

// Q3_K: 110 bytes [hmask 32, qs 64, scales 12, d]; value h*128 + s*32 + l = ((qs[h*32 + l] >> 2s) & 3) - 4 unless bit
// (h*4 + s) of hmask[l] is set; sub-block j of 16 values: 6-bit signed scales packed as gguf's Q3_K unpacks them
inline void row_q3_k(const uint8_t* p, int64_t k, uint16_t* out) {
    for (int64_t b = 0; b < k / 256; ++b, p += 110, out += 256) {
        const uint8_t *hm = p, *sc = p + 96;
        const float d = f16_to_f32(p + 108);
        for (int h = 0; h < 2; ++h)
            for (int s = 0; s < 4; ++s)
                for (int half = 0; half < 2; ++half) {
                    const int j = h * 8 + s * 2 + half, bit = h * 4 + s;
                    const int lo = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4, hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
                    const int scale = int(int8_t(lo | (hi << 4))) - 32;
                    const uint8_t *qs = p + 32 + h * 32 + half * 16, *hb = hm + half * 16;
                    emit(out + 16 * j, 16, d * float(scale), 0.f, [qs, hb, s, bit](int l) {
                        return ((qs[l] >> (2 * s)) & 3) - (((hb[l] >> bit) & 1) ^ 1) * 4;
                    });
                }
    }
}

// Q4_K / Q5_K sub-block j's 6-bit scale and min (gguf's Q4_K.get_scale_min)
inline void scale_min_k4(const uint8_t* q, int j, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63, m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 15) | ((q[j - 4] >> 2) & 0x30), m = (q[j + 4] >> 4) | ((q[j] >> 2) & 0x30);
    }
}

// Q4_K: 144 bytes [d, dmin, scales 12, qs 128]; sub-block 2i the low nibbles of qs[32i..32i+32], 2i+1 the high ones;
// Q5_K: 176 bytes [d, dmin, scales 12, qh 32, qs 128], bit j of qh[l] the fifth bit of sub-block j's value l
template <bool Q5>
inline void row_q45_k(const uint8_t* p, int64_t k, uint16_t* out) {
    constexpr int kBytes = Q5 ? 176 : 144;
    for (int64_t b = 0; b < k / 256; ++b, p += kBytes, out += 256) {
        const float d = f16_to_f32(p), dmin = f16_to_f32(p + 2);
        const uint8_t *qh = p + 16, *qs = p + (Q5 ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            scale_min_k4(p + 4, j, sc, m);
            const uint8_t* q = qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            emit(out + 32 * j, 32, d * float(sc), dmin * float(m), [q, qh, shift, j](int l) {
                return ((q[l] >> shift) & 15) | (Q5 ? ((qh[l] >> j) & 1) << 4 : 0);
            });
        }
    }
}

// Q6_K: 210 bytes [ql 128, qh 64, scales 16 int8, d]; value h*128 + s*32 + l (s < 4) = (ql nibble | 2 bits of qh) - 32
// (ql[h*64 + (s & 1)*32 + l] >> 4(s >> 1), qh[h*32 + l] >> 2s), sub-block j of 16 values scaled by d * scales[j]
inline void row_q6_k(const uint8_t* p, int64_t k, uint16_t* out) {
    for (int64_t b = 0; b < k / 256; ++b, p += 210, out += 256) {
        const float d = f16_to_f32(p + 208);
        const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
        for (int h = 0; h < 2; ++h)
            for (int s = 0; s < 4; ++s)
                for (int half = 0; half < 2; ++half) {
                    const int j = h * 8 + s * 2 + half;
                    const uint8_t *ql = p + h * 64 + (s & 1) * 32 + half * 16, *qh = p + 128 + h * 32 + half * 16;
                    const int lo_shift = 4 * (s >> 1), hi_shift = 2 * s;
                    emit(out + 16 * j, 16, d * float(scales[j]), 0.f, [ql, qh, lo_shift, hi_shift](int l) {
                        return (((ql[l] >> lo_shift) & 15) | (((qh[l] >> hi_shift) & 3) << 4)) - 32;
                    });
                }
    }
}

// IQ4_XS: 136 bytes [d, scales_h u16, scales_l 4, qs 128]; sub-block j of 32: kvalues of the low nibbles of
// qs[16j..16j+16], then of the high ones, scaled by d * (6-bit signed scale): `iq4_xs_scale`
inline float iq4_xs_scale(const uint8_t* p, float d, int j) {
    const int scales_h = p[2] | (p[3] << 8);
    const int lo = (p[4 + j / 2] >> (4 * (j % 2))) & 15, hi = (scales_h >> (2 * j)) & 3;
    return d * float(int(int8_t(lo | (hi << 4))) - 32);
}
inline void row_iq4_xs(const uint8_t* p, int64_t k, uint16_t* out) {
    static const int8_t kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    for (int64_t b = 0; b < k / 256; ++b, p += 136, out += 256) {
        const float d = f16_to_f32(p);
        for (int j = 0; j < 8; ++j) {
            const float dl = iq4_xs_scale(p, d, j);
            const uint8_t* q = p + 8 + 16 * j;
            emit(out + 32 * j, 16, dl, 0.f, [q](int l) { return kv[q[l] & 15]; });
            emit(out + 32 * j + 16, 16, dl, 0.f, [q](int l) { return kv[q[l] >> 4]; });
        }
    }
}

// FP8 e4m3 row of k values, the scale of column c scales[c / bk]: w = e4m3 * scale (0x7f / 0xff: NaN, as torch's)
inline void row_fp8(const uint8_t* p, const float* scales, int64_t k, int64_t bk, uint16_t* out) {
    for (int64_t c0 = 0; c0 < k; c0 += bk) {
        const float s = scales[c0 / bk];
        const int64_t n = std::min(bk, k - c0);
        for (int64_t l = 0; l < n; ++l) {
            const uint32_t b = p[c0 + l], e = (b >> 3) & 15, m = b & 7;
            const float normal = float_of(((e + 120) << 23) | (m << 20)), sub = float(m) * 0x1p-9f;
            const float mag = (b & 0x7f) == 0x7f ? std::numeric_limits<float>::quiet_NaN() : e ? normal : sub;
            out[c0 + l] = to_bf16(float_of(bits_of(mag) | ((b & 0x80) << 24)) * s);
        }
    }
}

// MXFP4 row of k values (k / 2 bytes, value 2i the low nibble of byte i), one e8m0 scale a group of 32:
// w = E2M1[code] * 2^(scale - 127), built from its bits (2^-127 is subnormal; 255 gives inf, as torch's exp2)
inline void row_mxfp4(const uint8_t* p, const uint8_t* scales, int64_t k, uint16_t* out) {
    for (int64_t g = 0; g < k / 32; ++g, p += 16, out += 32) {
        const uint32_t e8 = scales[g];
        const float s = float_of(e8 == 0 ? 0x00400000u : e8 == 255 ? 0x7f800000u : e8 << 23);
        for (int l = 0; l < 32; ++l) {
            const uint32_t c = (p[l / 2] >> (4 * (l % 2))) & 15, e = (c >> 1) & 3, m = c & 1;
            const uint32_t mag = e ? ((e + 126) << 23) | (m << 22) : (m ? 0x3f000000u : 0u);
            out[l] = to_bf16(float_of(mag | ((c & 8) << 28)) * s);
        }
    }
}

// One segment's rows [r0, r1) (cpu_dequant.cpp's Segment), each to its row of out
inline void segment_rows(const Segment& g, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        uint16_t* out = g.out + r * g.k;
        if (g.fmt == kFp8) {
            row_fp8(g.values + r * g.k, g.fp8_scales + (r / g.bn) * ((g.k + g.bk - 1) / g.bk), g.k, g.bk, out);
            continue;
        }
        if (g.fmt == kMxfp4) {
            row_mxfp4(g.values + r * (g.k / 2), g.mx_scales + r * (g.k / 32), g.k, out);
            continue;
        }
        const uint8_t* p = g.values + r * g.row_bytes;
        switch (g.type) {
            case 8: row_q8_0(p, g.k, out); break;
            case 10: row_q2_k(p, g.k, out); break;
            case 11: row_q3_k(p, g.k, out); break;
            case 12: row_q45_k<false>(p, g.k, out); break;
            case 13: row_q45_k<true>(p, g.k, out); break;
            case 14: row_q6_k(p, g.k, out); break;
            case 23: row_iq4_xs(p, g.k, out); break;
        }
    }
}
