// AVX-512 row decoders of cpu_dequant.cpp for the types a prompt's experts mostly come in (Q4_K, Q5_K, Q6_K, Q8_0,
// IQ4_XS, FP8, MXFP4): the same fp32 operations per weight as cpu_dequant_rows.h's loops (so the same bits, checked by
// tests/kernels/cpu/test_cpu_dequant.py), 32 weights a step, 3-10x the rate GCC's vectorization of those loops reaches.
// Included by cpu_dequant.cpp inside namespace dq_avx512, under its AVX-512 target pragma (after cpu_dequant_rows.h,
// whose scalar helpers and other types' loops it uses).

// 16 fp32 -> their bf16 bits in the high halves of 32-bit lanes (round to nearest even; NaN: 0xffff, as to_bf16)
inline __m512i round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(-1));
}

// out[0..32) = bf16 of a (values 0..15) and b (16..31)
inline void store32(uint16_t* out, __m512 a, __m512 b) {
    static const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                                27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    _mm512_storeu_si512(out, _mm512_permutex2var_epi16(round_bf16(a), odd, round_bf16(b)));
}

// 32 int8 codes q -> bf16(s * q - m) (values 0..15 with s0, m0, 16..31 with s1, m1)
inline void emit32(uint16_t* out, __m256i q, __m512 s0, __m512 m0, __m512 s1, __m512 m1) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    store32(out, _mm512_sub_ps(_mm512_mul_ps(a, s0), m0), _mm512_sub_ps(_mm512_mul_ps(b, s1), m1));
}
inline void emit32(uint16_t* out, __m256i q, float s, float m) {
    emit32(out, q, _mm512_set1_ps(s), _mm512_set1_ps(m), _mm512_set1_ps(s), _mm512_set1_ps(m));
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline void v_row_q8_0(const uint8_t* p, int64_t k, uint16_t* out) {
    for (int64_t b = 0; b < k / 32; ++b, p += 34, out += 32) emit32(out, load32(p + 2), f16_to_f32(p), 0.f);
}

// Q4_K / Q5_K (cpu_dequant_rows.h's row_q45_k): sub-blocks 2i and 2i+1 from the same 32 bytes of qs
template <bool Q5>
inline void v_row_q45_k(const uint8_t* p, int64_t k, uint16_t* out) {
    constexpr int kBytes = Q5 ? 176 : 144;
    const __m256i nib = _mm256_set1_epi8(15), five = _mm256_set1_epi8(16);
    for (int64_t b = 0; b < k / 256; ++b, p += kBytes, out += 256) {
        const float d = f16_to_f32(p), dmin = f16_to_f32(p + 2);
        const __m256i qh = Q5 ? load32(p + 16) : _mm256_setzero_si256();
        const uint8_t* qs = p + (Q5 ? 48 : 16);
        for (int i = 0; i < 4; ++i) {
            const __m256i q = load32(qs + 32 * i);
            __m256i lo = _mm256_and_si256(q, nib), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
            if (Q5) {
                const __m256i b0 = _mm256_set1_epi8(char(1 << (2 * i))), b1 = _mm256_set1_epi8(char(2 << (2 * i)));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), five));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), five));
            }
            int sc, m;
            scale_min_k4(p + 4, 2 * i, sc, m);
            emit32(out + 64 * i, lo, d * float(sc), dmin * float(m));
            scale_min_k4(p + 4, 2 * i + 1, sc, m);
            emit32(out + 64 * i + 32, hi, d * float(sc), dmin * float(m));
        }
    }
}

// Q6_K (row_q6_k): 32 values h*128 + s*32 .. +32 a step, their two sub-blocks' scales in the two halves
inline void v_row_q6_k(const uint8_t* p, int64_t k, uint16_t* out) {
    const __m256i nib = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 256; ++b, p += 210, out += 256) {
        const float d = f16_to_f32(p + 208);
        const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
        for (int h = 0; h < 2; ++h) {
            const __m256i qh = load32(p + 128 + h * 32);
            for (int s = 0; s < 4; ++s) {
                const __m256i ql = load32(p + h * 64 + (s & 1) * 32);
                const __m256i lo = _mm256_and_si256(s >> 1 ? _mm256_srli_epi16(ql, 4) : ql, nib);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), two);
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), off);
                const int j = h * 8 + s * 2;
                emit32(out + 16 * j, q, _mm512_set1_ps(d * float(scales[j])), zero,
                       _mm512_set1_ps(d * float(scales[j + 1])), zero);
            }
        }
    }
}

// IQ4_XS (row_iq4_xs): the non-linear grid looked up with a byte shuffle
inline void v_row_iq4_xs(const uint8_t* p, int64_t k, uint16_t* out) {
    const __m128i kv = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const __m128i nib = _mm_set1_epi8(15);
    for (int64_t b = 0; b < k / 256; ++b, p += 136, out += 256) {
        const float d = f16_to_f32(p);
        for (int j = 0; j < 8; ++j) {
            const float dl = iq4_xs_scale(p, d, j);
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 + 16 * j));
            const __m128i a = _mm_shuffle_epi8(kv, _mm_and_si128(q, nib));
            const __m128i c = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(q, 4), nib));
            emit32(out + 32 * j, _mm256_set_m128i(c, a), dl, 0.f);
        }
    }
}

// FP8 (row_fp8), bk a multiple of 16: e4m3 as the f16 bits of value / 256 (exact, subnormals too), widened, times 256,
// the NaN codes made NaN, times the block's scale
inline void v_row_fp8(const uint8_t* p, const float* scales, int64_t k, int64_t bk, uint16_t* out) {
    const __m512i low7 = _mm512_set1_epi32(0x7f), nan_code = low7;
    const __m512 k256 = _mm512_set1_ps(256.f), nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
    for (int64_t c0 = 0; c0 < k; c0 += bk) {
        const __m512 s = _mm512_set1_ps(scales[c0 / bk]);
        __m512 v[2];
        for (int64_t l = 0; l < bk; l += 16) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c0 + l)));
            const __m512i mag = _mm512_and_si512(b, low7);
            const __m512i h = _mm512_or_si512(_mm512_slli_epi32(mag, 7),
                                              _mm512_slli_epi32(_mm512_andnot_si512(low7, b), 8));
            __m512 w = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), k256);
            w = _mm512_mask_mov_ps(w, _mm512_cmpeq_epi32_mask(mag, nan_code), nan);
            // (NaN's sign: to_bf16 writes every NaN as 0xffff)
            v[(l / 16) & 1] = _mm512_mul_ps(w, s);
            if ((l / 16) & 1) store32(out + c0 + l - 16, v[0], v[1]);
        }
    }
}

// MXFP4 (row_mxfp4): E2M1 codes looked up in a 16-float table, times the group's power of two
inline void v_row_mxfp4(const uint8_t* p, const uint8_t* scales, int64_t k, uint16_t* out) {
    const __m512 e2m1 = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f,
                                       -4.f, -6.f);
    const __m128i nib = _mm_set1_epi8(15);
    for (int64_t g = 0; g < k / 32; ++g, p += 16, out += 32) {
        const uint32_t e8 = scales[g];
        const __m512 s = _mm512_set1_ps(float_of(e8 == 0 ? 0x00400000u : e8 == 255 ? 0x7f800000u : e8 << 23));
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
        const __m512 a = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), e2m1);
        const __m512 c = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), e2m1);
        store32(out, _mm512_mul_ps(a, s), _mm512_mul_ps(c, s));
    }
}

// cpu_dequant_rows.h's segment_rows with these decoders where they apply
inline void v_segment_rows(const Segment& g, int64_t r0, int64_t r1) {
    const bool fp8_vec = g.fmt == kFp8 && g.bk % 32 == 0 && g.k % g.bk == 0;
    if ((g.fmt == kGguf && (g.type == 10 || g.type == 11)) || (g.fmt == kFp8 && !fp8_vec)) {
        segment_rows(g, r0, r1);
        return;
    }
    for (int64_t r = r0; r < r1; ++r) {
        uint16_t* out = g.out + r * g.k;
        if (g.fmt == kFp8) {
            v_row_fp8(g.values + r * g.k, g.fp8_scales + (r / g.bn) * (g.k / g.bk), g.k, g.bk, out);
        } else if (g.fmt == kMxfp4) {
            v_row_mxfp4(g.values + r * (g.k / 2), g.mx_scales + r * (g.k / 32), g.k, out);
        } else {
            const uint8_t* p = g.values + r * g.row_bytes;
            switch (g.type) {
                case 8: v_row_q8_0(p, g.k, out); break;
                case 12: v_row_q45_k<false>(p, g.k, out); break;
                case 13: v_row_q45_k<true>(p, g.k, out); break;
                case 14: v_row_q6_k(p, g.k, out); break;
                case 23: v_row_iq4_xs(p, g.k, out); break;
            }
        }
    }
}
