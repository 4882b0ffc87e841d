// The avx512_bf16 kernel's GGUF decoders (cpu_experts_gguf.h says what a step is): a step's scales into its chains'
// lane scale vectors and the mins' lanes (`scales`), a chain's codes into bf16 words in registers (`codes`).
//
//   Q4_K   a 64-byte load a half superblock: a word's nibble k (shift 4k) ORed into 0x4300 is 128 + q; the chains
//          (nibbles 0 and 2: lanes 0-7 sub-block 2j, 8-15 sub-block 2j + 2; nibbles 1 and 3: their odd neighbours)
//          take d sc_s, the mins' lanes -(dmin m_s + 128 d sc_s)
//   Q2_K   the 64 bytes of codes in one load: fields 0-2 of a word's low byte masked in place, 128 + (q << 2j), their
//          activations stored times 4^-j (exact); field 3 and the high byte's after one shift
//   Q6_K   ql's nibble and qh's 2 bits merged by one vpternlogd into a 6-bit index, looked up as bf16(q - 32) (exact)
//          by vpermt2w from a 64-entry table; qh's 32 bytes broadcast to both halves, the upper half 2 bits down
//   Q8_0   two blocks a step: int8 -> fp32 -> bf16 (exact), block 0's values in lanes 0-7, block 1's in 8-15
//   Q5_K   Q4_K's with each code's 5th bit merged from qh (one variable shift to bit 4 of the word, one vpternlogd)
//   IQ4_XS a nibble's grid value by vpermw from a 32-word table; every lane one 32-value block, 4 vectors a chain
//
// Included by cpu_experts_gguf.h's includer after it, ON_X86 only.
#pragma once

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")
namespace gguf_avx512 {

struct Tables {
    alignas(64) uint16_t q6[64];   // bf16(c - 32)
    alignas(64) uint16_t iq4[32];  // bf16 of IQ4_XS's grid value c & 15
    Tables() {
        for (int c = 0; c < 64; ++c) q6[c] = f32_to_bf16(float(c - 32));
        for (int c = 0; c < 32; ++c) iq4[c] = f32_to_bf16(float(kGgufIq4nl[c & 15]));
    }
};
const Tables g_tables;

struct Decode {
    struct Scales {  // GgufScales' fields (a template argument would drop the vector types' attributes)
        __m512 s[4];
        __m512 c;
    };
    static inline __m512 load_sums(const float* p) { return _mm512_loadu_ps(p); }
    static inline __m512i code(__m512i v, int16_t mask) {  // (v & mask) | 0x4300 in every word
        return _mm512_ternarylogic_epi32(v, _mm512_set1_epi16(mask), _mm512_set1_epi16(0x4300), 0xEA);
    }
    static inline __m512i or43(__m512i v) { return _mm512_or_si512(v, _mm512_set1_epi16(0x4300)); }
    // A broadcast from memory is a load alone: a register broadcast, vpermps or vcvtph2ps of a zmm takes pipes the
    // FMAs need (the asm keeps the compiler from broadcasting a register it still holds the value in).
    static inline __m512 bcast(const float* p) {
        __m512 r;
        __asm__("vbroadcastss %1, %0" : "=v"(r) : "m"(*p));
        return r;
    }
    static inline __m512 halves(const float* lo, const float* hi) {  // *lo in lanes 0-7, *hi in 8-15 (one blend)
        return _mm512_mask_blend_ps(0xFF00, bcast(lo), bcast(hi));
    }
    template <int N>
    static inline void chains(const GgufLayout& L, __m512 a, Scales& d) {
#pragma GCC unroll 4
        for (int c = 0; c < N; ++c) d.s[c] = _mm512_permutexvar_ps(_mm512_load_si512(L.chain_sb[c]), a);
    }

    static inline void scales(TQ4K, const uint8_t* b, Scales& d) {
        uint64_t lo, hi;
        gguf_q4k_scales64(b + 4, lo, hi);
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), halves(gg_f16_ref(b), gg_f16_ref(b + 2)));
        chains<4>(g_gguf_layouts.l[GL_Q4K], a, d);  // [d sc_s | dmin m_s]
        d.c = a;  // the sums carry -128 (lanes 0-7) and -1 (8-15)
    }
    static inline __m512i counts(int lower, int upper) {  // per word: the lower 16 words' value, the upper 16 words'
        return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(short(lower)), _mm512_set1_epi16(short(upper)));
    }
    static inline void scales(TQ5K, const uint8_t* b, Scales& d) { scales(TQ4K{}, b, d); }  // Q4_K's scales and mins
    // chain c: half h = c >> 1, nibble c & 1 of the even and odd bytes, and its 5th bit, bit 4h + 2 (b >= 32) + nib of
    // qh (broadcast to both halves) shifted to bit 4 of each word; 128 + q as Q4_K's
    static inline void codes(TQ5K, const uint8_t* b, int c, __m512i* w) {
        const int h = c >> 1, nib = c & 1;
        const __m512i q = _mm512_loadu_si512(b + 48 + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
        const __m512i lo = nib ? _mm512_srli_epi16(q, 4) : q, hi = _mm512_srli_epi16(q, 8 + 4 * nib);
        // the bit sits at bit p0 = 4h + nib of a word's low byte (p0 + 2 in the upper half), 8 more in its high byte
        const int p0 = 4 * h + nib;
        const __m512i b0 = h == 0 ? _mm512_sllv_epi16(qh, counts(4 - p0, 2 - p0))
                                  : _mm512_srlv_epi16(qh, counts(p0 - 4, p0 - 2));
        const __m512i b1 = _mm512_srlv_epi16(qh, counts(p0 + 4, p0 + 6));
        const __m512i nib4 = _mm512_set1_epi16(0x000F);
        w[0] = code(_mm512_ternarylogic_epi32(lo, b0, nib4, 0xE4), 0x001F);
        w[1] = code(_mm512_ternarylogic_epi32(hi, b1, nib4, 0xE4), 0x001F);
    }

    static inline void codes(TQ4K, const uint8_t* b, int c, __m512i* w) {  // chain c: half c >> 1, nibbles c & 1 (+2)
        const __m512i q = _mm512_loadu_si512(b + 16 + 64 * (c >> 1));
        if (c & 1)
            w[0] = code(_mm512_srli_epi16(q, 4), 0x000F), w[1] = or43(_mm512_srli_epi16(q, 12));
        else
            w[0] = code(q, 0x000F), w[1] = code(_mm512_srli_epi16(q, 8), 0x000F);
    }

    static inline void scales(TQ2K, const uint8_t* b, Scales& d) {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15))),
                                       bcast(gg_f16_ref(b + 80)));
        const __m512 mins = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)), bcast(gg_f16_ref(b + 82)));
        d.c = _mm512_fnmsub_ps(a, _mm512_loadu_ps(kGgufQ2Offset), mins);
        chains<4>(g_gguf_layouts.l[GL_Q2K], a, d);
    }
    static inline void codes(TQ2K, const uint8_t* b, int j, __m512i* w) {  // field j of the even, then odd bytes
        const __m512i q = _mm512_loadu_si512(b + 16), q8 = _mm512_srli_epi16(q, 8);
        if (j == 3)
            w[0] = code(_mm512_srli_epi16(q, 6), 0x0003), w[1] = or43(_mm512_srli_epi16(q, 14));
        else
            w[0] = code(q, int16_t(3 << (2 * j))), w[1] = code(q8, int16_t(3 << (2 * j)));
    }

    static inline void scales(TQ3K, const uint8_t* b, Scales& d) {
        uint64_t lo, hi;
        gguf_q3k_scales64(b + 96, lo, hi);
        const __m512i sc = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<long long>(hi),
                                                                                static_cast<long long>(lo))),
                                            _mm512_set1_epi32(32));
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), bcast(gg_f16_ref(b + 108)));
        chains<4>(g_gguf_layouts.l[GL_Q3K], a, d);
        d.c = a;  // the sums carry -(128 4^-j + 4)
    }
    // chain j: Q2_K's fields in place, each code's high bit (hmask bit 4 hf + j of byte l, bytes broadcast to both
    // halves, the upper one 4 bits down) shifted just above it: 128 + (ql + 4 h) << 2j, the sums taking the rest
    static inline void codes(TQ3K, const uint8_t* b, int j, __m512i* w) {
        const __m512i q = _mm512_loadu_si512(b + 32);
        __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
        h = _mm512_mask_srli_epi16(h, 0xFFFF0000u, h, 4);
        const __m512i h8 = _mm512_srli_epi16(h, 8);
        __m512i a0, a1, h0, h1;
        int16_t field, keep;
        if (j == 3) {
            a0 = _mm512_srli_epi16(q, 6), a1 = _mm512_srli_epi16(q, 14), field = 3, keep = 7;
            h0 = _mm512_srli_epi16(h, 1), h1 = _mm512_srli_epi16(h8, 1);
        } else {
            a0 = q, a1 = _mm512_srli_epi16(q, 8), field = int16_t(3 << (2 * j)), keep = int16_t(7 << (2 * j));
            h0 = _mm512_slli_epi16(h, j + 2), h1 = _mm512_slli_epi16(h8, j + 2);
        }
        const __m512i f = _mm512_set1_epi16(field);
        w[0] = code(_mm512_ternarylogic_epi32(a0, h0, f, 0xE4), keep);
        w[1] = code(_mm512_ternarylogic_epi32(a1, h1, f, 0xE4), keep);
    }

    static inline void scales(TQ6K, const uint8_t* b, Scales& d) {
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                           reinterpret_cast<const __m128i*>(b + 192)))), bcast(gg_f16_ref(b + 208)));
        chains<4>(g_gguf_layouts.l[GL_Q6K], a, d);
    }
    static inline void codes(TQ6K, const uint8_t* b, int c, __m512i* w) {  // chain c: half c >> 1, nibble c & 1
        const int h = c >> 1;
        const __m512i t0 = _mm512_load_si512(g_tables.q6), t1 = _mm512_load_si512(g_tables.q6 + 32);
        const __m512i nib = _mm512_set1_epi16(0x000F);
        const __m512i l = _mm512_loadu_si512(b + 64 * h);
        __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
        q = _mm512_mask_srli_epi16(q, 0xFFFF0000u, q, 2);  // ql bytes 32..63 take the next 2 bits of qh
        // an index of 6 bits: the nibble, then the 2 high bits (vpermt2w reads no more)
        __m512i i0, i1;
        if (c & 1) {
            i0 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), q, nib, 0xE4);
            i1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 12), _mm512_srli_epi16(q, 8), nib, 0xE4);
        } else {
            i0 = _mm512_ternarylogic_epi32(l, _mm512_slli_epi16(q, 4), nib, 0xE4);
            i1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 8), _mm512_srli_epi16(q, 4), nib, 0xE4);
        }
        w[0] = _mm512_permutex2var_epi16(t0, i0, t1), w[1] = _mm512_permutex2var_epi16(t0, i1, t1);
    }

    static inline void scales(TIQ4, const uint8_t* b, Scales& d) {
        int8_t ls[8];
        gguf_iq4xs_scales(b, ls);
        uint64_t packed;
        std::memcpy(&packed, ls, 8);
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_cvtsi64_si128(static_cast<long long>(packed)));
        chains<2>(g_gguf_layouts.l[GL_IQ4], _mm512_mul_ps(_mm512_cvtepi32_ps(sc), bcast(gg_f16_ref(b))), d);
    }
    // chain c: half c's 64 bytes, nibble k of every word through the grid's table (vpermw reads 5 index bits: the
    // table repeats); every lane one 32-value block
    static inline void codes(TIQ4, const uint8_t* b, int c, __m512i* w) {
        const __m512i t = _mm512_load_si512(g_tables.iq4);
        const __m512i q = _mm512_loadu_si512(b + 8 + 64 * c);
        w[0] = _mm512_permutexvar_epi16(q, t);
        w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), t);
        w[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 8), t);
        w[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 12), t);
    }

    static inline __m512 q8_values(const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static inline void scales(TQ80, const uint8_t* b, Scales& d) {
        d.s[0] = halves(gg_f16_ref(b), gg_f16_ref(b + 34));
    }
    static inline void codes(TQ80, const uint8_t* b, int, __m512i* w) {
        w[0] = (__m512i)_mm512_cvtne2ps_pbh(q8_values(b + 36), q8_values(b + 2));
        w[1] = (__m512i)_mm512_cvtne2ps_pbh(q8_values(b + 52), q8_values(b + 18));
    }
};

}  // namespace gguf_avx512
#pragma GCC pop_options
