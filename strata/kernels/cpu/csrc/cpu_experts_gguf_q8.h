// GGUF K-quant experts against int8 activations (the avx512_int8 backend: llama.cpp's numerics). Q4_K, Q5_K, Q6_K and
// Q2_K rows are read as unsigned byte codes and multiplied with activations quantized to int8 (Q8_K: one fp32 scale a
// 256-value step, codes in [-127, 127]), 64 products an instruction pair where the bf16 path takes 32 a vdpbf16ps:
//
//   vpmaddubsw  u8 code x s8 activation, adjacent pairs summed -> s16 (at most 2 * 63 * 127: no saturation)
//   vpdpwssd    s16 pair sums x the sub-block scale (one s16 word each) -> s32 lanes, accumulated over the step
//
// A step's s32 lanes, converted once, are multiplied by d * dx (the block's and the activations' scales); its mins
// (Q4_K, Q5_K, Q2_K) and Q6_K's offset of 32 come off through the step's sub-block sums of the int8 codes (Q8_K's
// bsums, 16 values each): dmin * dx * sum_s m_s X_s. Every integer sum is exact; the roundings are the activations'
// two (x, and each expert's silu(gate) * up, to int8) and the fp32 products and sums after the step.
//
// The activations of a step are stored permuted so each 64-byte vector lines up with one load of codes (layouts
// GL_*8, built in cpu_experts_gguf_layout.h):
//   Q4_K, Q5_K  vector v: the low (v even) or high nibbles of 64 bytes of qs: sub-blocks 4(v>>1) + (v&1) and + 2
//   Q6_K        vector 2h + nib: elements 128h + 64nib + 0..63 in order (ql's nibble nib, qh's two bits by half)
//   Q2_K        vector j: 2-bit field j of the 64 bytes of qs: elements 32j + 0..31, then 128 + 32j + 0..31
//
// Included by cpu_experts_gguf.h on x86 only; gguf_dot calls q8_dot for the GgufQ8T types.
#pragma once

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")
namespace gguf_q8 {

// A row's step as the dot product takes it: each vector's scale words, the words that multiply the step's 16
// sub-block sums, and the two multipliers of the block (d: the codes' sums, dm: the sums' product, subtracted).
struct Scales {
    __m512i w[4];
    __m256i mw;
    float d, dm;
};

inline __m512i word_index(int a, int b) {  // words 0-15 take scale word a, words 16-31 scale word b
    return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(short(a)), _mm512_set1_epi16(short(b)));
}
// Scale-word indices, per vector: Q6_K's word k of vector v is sub-block 4v + k / 8; Q2_K's word k of vector j is
// sub-block 8 (k >> 4) + 2j + (k >> 3 & 1).
struct Index {
    alignas(64) int16_t q6[4][32];
    alignas(64) int16_t q2[4][32];
    Index() {
        for (int v = 0; v < 4; ++v)
            for (int k = 0; k < 32; ++k)
                q6[v][k] = int16_t(4 * v + k / 8), q2[v][k] = int16_t(8 * (k >> 4) + 2 * v + ((k >> 3) & 1));
    }
};
const Index g_index;
inline __m512i index(const int16_t* p) { return _mm512_load_si512(p); }

// A row's sum: its lanes less its mins' lanes, then a fixed shuffle tree (short rows pay its latency once a row)
inline float lanes_sum(__m512 a, __m256 m) {
    __m512 s = _mm512_sub_ps(a, _mm512_zextps256_ps512(m));
    s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
    __m128 q = _mm512_castps512_ps128(s);
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
inline __m512i nibble(__m512i v, bool high) {
    return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0f));
}

struct Q4K {
    static constexpr int kBytes = 144;
    static inline void scales(const uint8_t* b, Scales& s) {
        uint64_t lo, hi;
        gguf_q4k_scales64(b + 4, lo, hi);
        // words 0-7: sc_0..7, 8-15: m_0..7
        const __m512i w = _mm512_castsi256_si512(
            _mm256_cvtepu8_epi16(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo))));
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
            const int a = 4 * (v >> 1) + (v & 1);
            s.w[v] = _mm512_permutexvar_epi16(word_index(a, a + 2), w);
        }
        // the sums are of 16 values: sub-block s's min against sums 2s and 2s + 1
        const __m256i pair = _mm256_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
        s.mw = _mm256_permutexvar_epi16(pair, _mm512_castsi512_si256(w));
        s.d = *gg_f16_ref(b), s.dm = *gg_f16_ref(b + 2);
    }
    static inline __m512i codes(const uint8_t* b, int v) {
        return nibble(_mm512_loadu_si512(b + 16 + 64 * (v >> 1)), v & 1);
    }
};

struct Q5K : Q4K {
    static constexpr int kBytes = 176;
    // Q4_K's nibbles (qs at 48) with each code's 5th bit, bit s of qh[l] for sub-block s (qh's 32 bytes in both halves)
    static inline __m512i codes(const uint8_t* b, int v) {
        const __m512i q = nibble(_mm512_loadu_si512(b + 48 + 64 * (v >> 1)), v & 1);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
        const int s = 4 * (v >> 1) + (v & 1);
        const __m512i bit = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_set1_epi8(char(1 << s)),
                                                   _mm512_set1_epi8(char(1 << (s + 2))));
        return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, bit), q, _mm512_set1_epi8(16));
    }
};

struct Q6K {
    static constexpr int kBytes = 210;
    static inline void scales(const uint8_t* b, Scales& s) {
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
        const __m512i w = _mm512_castsi256_si512(sc);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) s.w[v] = _mm512_permutexvar_epi16(index(g_index.q6[v]), w);
        s.mw = _mm256_slli_epi16(sc, 5);  // codes are q + 32: 32 sc_s X_s comes off
        s.d = s.dm = *gg_f16_ref(b + 208);
    }
    // vector 2h + nib: ql's nibble nib of bytes 64h.., qh's bits 2(2 nib) (lower half) and 2(2 nib + 1) (upper half) of
    // bytes 128 + 32h.. moved to bits 4-5
    static inline __m512i codes(const uint8_t* b, int v) {
        const int h = v >> 1, nib = v & 1;
        const __m512i lo = nibble(_mm512_loadu_si512(b + 64 * h), nib);
        const __m512i qh =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
        const __m512i up = nib ? _mm512_srlv_epi16(qh, word_index(0, 2)) : _mm512_sllv_epi16(qh, word_index(4, 2));
        return _mm512_or_si512(lo, _mm512_and_si512(up, _mm512_set1_epi8(0x30)));
    }
};

struct Q2K {
    static constexpr int kBytes = 84;
    static inline void scales(const uint8_t* b, Scales& s) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
        const __m512i w = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f))));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) s.w[j] = _mm512_permutexvar_epi16(index(g_index.q2[j]), w);
        s.mw = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f)));
        s.d = *gg_f16_ref(b + 80), s.dm = *gg_f16_ref(b + 82);
    }
    static inline __m512i codes(const uint8_t* b, int j) {
        const __m512i q = _mm512_loadu_si512(b + 16);
        return _mm512_and_si512(j ? _mm512_srli_epi16(q, 2 * j) : q, _mm512_set1_epi8(0x03));
    }
};

// out_r[t] = <row r, x_t> over the first len values of R rows of type D, t < NT: a 256-value step at a time, its
// integer sums exact; then the values past the last whole step one by one (a split expert's down rows: their own
// scale, at step `steps` of the metadata).
template <class D, int Id, int NT, int R>
__attribute__((noinline)) void dot(const uint8_t* const* rows, int64_t len, const int8_t* const* xs,
                                   const Q8Step* const* meta, float* const* out, int64_t pf) {
    __m512 acc[R][NT];
    __m256 accm[R][NT];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps(), accm[r][t] = _mm256_setzero_ps();
    const int64_t steps = len / 256;
    for (int64_t st = 0; st < steps; ++st) {
        const uint8_t* blk[R];
        Scales sc[R];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
            blk[r] = rows[r] + st * D::kBytes;
            if (pf) {
#pragma GCC unroll 4
                for (int o = 0; o < D::kBytes; o += 64) __builtin_prefetch(blk[r] + pf + o, 0, 3);
            }
            D::scales(blk[r], sc[r]);
        }
        __m512i s[R][NT];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) s[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
            __m512i w[R];
#pragma GCC unroll 2
            for (int r = 0; r < R; ++r) w[r] = D::codes(blk[r], v);
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) {
                const __m512i x = _mm512_loadu_si512(xs[t] + 256 * st + 64 * v);
#pragma GCC unroll 2
                for (int r = 0; r < R; ++r)
                    s[r][t] = _mm512_dpwssd_epi32(s[r][t], _mm512_maddubs_epi16(w[r], x), sc[r].w[v]);
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
            const Q8Step& m = meta[t][st];
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.bsum));
#pragma GCC unroll 2
            for (int r = 0; r < R; ++r) {
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][t]), _mm512_set1_ps(sc[r].d * m.d), acc[r][t]);
                accm[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc[r].mw, bs)),
                                             _mm256_set1_ps(sc[r].dm * m.d), accm[r][t]);
            }
        }
    }
    const GgufBlock bt = gguf_block(Id);
    float w[256];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
            out[r][t] = lanes_sum(acc[r][t], accm[r][t]);
        }
        for (int64_t e0 = steps * 256; e0 < len; e0 += bt.values) {  // in order, in fp32, after the vector sum
            gguf_block_values(Id, rows[r] + e0 / bt.values * bt.bytes, w);
            const int64_t n = std::min<int64_t>(bt.values, len - e0);
            for (int t = 0; t < NT; ++t) {
                float sum = 0.0f;
                for (int64_t i = 0; i < n; ++i) sum += w[i] * float(xs[t][e0 + i]);
                out[r][t] += sum * meta[t][steps].d;
            }
        }
    }
}

}  // namespace gguf_q8
#pragma GCC pop_options

namespace {
// A type read against int8 activations, as the kernel body dispatches it (GgufT's kId, kLayout, kBytes, kStep)
template <int Id, int Layout, class Dc>
struct GgufQ8T {
    static constexpr int kId = Id, kLayout = Layout, kBytes = Dc::kBytes, kStep = 256;
    static constexpr bool kQ8 = true;
    using D = Dc;
};
using TQ4K8 = GgufQ8T<GG_Q4_K, GL_Q4K8, gguf_q8::Q4K>;
using TQ5K8 = GgufQ8T<GG_Q5_K, GL_Q4K8, gguf_q8::Q5K>;
using TQ6K8 = GgufQ8T<GG_Q6_K, GL_Q6K8, gguf_q8::Q6K>;
using TQ2K8 = GgufQ8T<GG_Q2_K, GL_Q2K8, gguf_q8::Q2K>;
}  // namespace
