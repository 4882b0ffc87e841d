// The CPU expert kernel's instruction sets: one traits struct K each (cpu_experts_kernel.h lists what it provides),
// under its own `#pragma GCC target`, with the kernel body included after it.
//
// Weight loads per format (cpu_experts_formats.h):
//   bf16   avx2/avx512: widened to fp32 by shifts; avx512_bf16: as they are (vdpbf16ps pairs)
//   fp8    avx2/avx512: the byte as fp16 bits of value / 256 (two shifts and a mask), vcvtph2ps; blocks scaled by
//          scale_inv * 256 (exact: a power of two). avx512_bf16: two vpermi2b lookups give the bf16 value's high and
//          low bytes (exact), vpermt2b interleaves them (AVX512_VBMI)
//   mxfp4  fp32 paths: vpermps looks the codes up in the group's table (its e8m0 scale's 16 values, g_fmt.mx_f32),
//          the codes brought to their lanes in order by a broadcast and one variable shift (avx2 looks up the
//          magnitude, 8 entries, and sets the sign). avx512_bf16: 128 values a step, a group in each 128-bit lane,
//          through the unscaled E2M1 table held in a register, each lane's sum times its group's scale by one FMA
//          (load_mx4, mx4_scales); whole groups past the last step through the group's scaled table (load_mx)
//   fp8 on avx512_bf16 converts 64 bytes at a time where the loop is unrolled (load_fp8x2)
//
// Included once, by cpu_experts.cpp, after its Job, ReadJob and the format tables; ON_X86 only.
#pragma once

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace k_avx2 {
struct K {
    static constexpr int W = 8;
    static constexpr int NTMAX = 4;  // 2 x 4 accumulators + weights + activation fit the 16 ymm registers
    static constexpr int NT4 = 0;  // no four-row tile (cpu_experts_tile4.h): 16 registers
    static constexpr int unroll(int nt) { return nt == 1 ? 4 : nt == 2 ? 2 : 1; }
    using Acc = __m256;
    using X = float;
    using Hd = float;
    static inline __m256 zero() { return _mm256_setzero_ps(); }
    static inline __m256 load_w(const uint16_t* p) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    struct Fp8Ctx {};
    static constexpr float kFp8Unit = kFp8F16Unit;
    static inline __m256 load_fp8(const Fp8Ctx&, const uint8_t* p) {  // fp8_as_f16_over_256, 8 lanes
        const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(int16_t(0xBF80))));
    }
    static inline __m256 load_mx(const uint8_t* p, uint8_t s) {
        int32_t raw;
        std::memcpy(&raw, p, 4);
        // the 4 bytes in every lane, lane d shifted right by 4d: its low nibble is element d's code
        const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(raw), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        const __m256 mag = _mm256_permutevar8x32_ps(_mm256_load_ps(g_fmt.mx_f32[s]), idx);  // codes' low 3 bits
        const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(idx, 28), _mm256_set1_epi32(int32_t(0x80000000u)));
        return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));  // E2M1[c + 8] = -E2M1[c]
    }
    static inline void load_fp8x2(const Fp8Ctx& c, const uint8_t* p, __m256& w0, __m256& w1) {
        w0 = load_fp8(c, p), w1 = load_fp8(c, p + W);
    }
    static constexpr bool kMxSteps = false;  // MXFP4 a group a step, activations in order
    static inline int64_t mx_x_position(int64_t e, int64_t) { return e; }
    static inline float mx_scalar(uint8_t code, uint8_t s) { return g_fmt.mx_f32[s][code]; }
    static inline __m256 load_x(const float* p) { return _mm256_loadu_ps(p); }
    static inline __m256 dot(__m256 a, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, a); }
    static inline __m256 fma(__m256 a, float s, __m256 b) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), b); }
    static inline __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
    static inline float hsum(__m256 a) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static inline float x2f(float v) { return v; }
    static inline float h_from_f(float v) { return v; }
};
#include "cpu_experts_kernel.h"

// RAM read bandwidth probe: stream through buffers (chunks taken dynamically), xor-fold 32-byte loads.
static void read_job(void* ctx, int tid) {
    ReadJob& job = *static_cast<ReadJob*>(ctx);
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const int64_t n = static_cast<int64_t>(job.chunks.size());
    for (;;) {
        const int64_t c = job.next.fetch_add(1, std::memory_order_relaxed);
        if (c >= n) break;
        const char* p = job.chunks[c].first;
        const int64_t len = job.chunks[c].second & ~int64_t(127);
        for (int64_t i = 0; i < len; i += 128) {
            if (job.pf) __builtin_prefetch(p + i + job.pf, 0, 3), __builtin_prefetch(p + i + job.pf + 64, 0, 3);
            acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
            acc1 = _mm256_xor_si256(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
            acc2 = _mm256_xor_si256(acc2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
            acc3 = _mm256_xor_si256(acc3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
        }
        job.done.fetch_add(1, std::memory_order_acq_rel);
    }
    const __m256i a = _mm256_xor_si256(_mm256_xor_si256(acc0, acc1), _mm256_xor_si256(acc2, acc3));
    job.checksum.fetch_xor(static_cast<uint64_t>(_mm256_extract_epi64(a, 0) ^ _mm256_extract_epi64(a, 3)),
                           std::memory_order_relaxed);
    if (tid == 0) spin_until([&] { return job.done.load(std::memory_order_acquire) == n; });
}
}  // namespace k_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace {
inline float hsum512(__m512 a) {  // fixed order (no _mm512_reduce_add_ps: GCC 12 warns inside its header)
    __m512 s = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
    __m128 q = _mm512_castps512_ps128(s);
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
}  // namespace

namespace k_avx512 {
struct K {
    static constexpr int W = 16;
    static constexpr int NTMAX = 8;
    static constexpr int unroll(int nt) { return nt <= 2 ? 4 : nt <= 4 ? 2 : 1; }
    static constexpr int NT4 = 6;  // four-row tile: 4 x 6 accumulators + 4 weights + 1 activation of 32 registers
    using Acc = __m512;
    using X = float;
    using Hd = float;
    static inline __m512 zero() { return _mm512_setzero_ps(); }
    static inline __m512 load_w(const uint16_t* p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    struct Fp8Ctx {};
    static constexpr float kFp8Unit = kFp8F16Unit;
    static inline __m512 load_fp8(const Fp8Ctx&, const uint8_t* p) {  // fp8_as_f16_over_256, 16 lanes
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xBF80))));
    }
    static inline __m512 load_mx(const uint8_t* p, uint8_t s) {  // as k_avx2's, 16 lanes: vpermps reads 4 bits
        int64_t raw;
        std::memcpy(&raw, p, 8);
        // lanes 0-7 hold bytes 0-3, lanes 8-15 bytes 4-7; lane d shifted right by 4 (d mod 8): element d's code
        const __m512i d = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                   _mm512_set1_epi64(raw));
        const __m512i idx = _mm512_srlv_epi32(d, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20,
                                                                   24, 28));
        return _mm512_permutexvar_ps(idx, _mm512_load_ps(g_fmt.mx_f32[s]));
    }
    static inline void load_fp8x2(const Fp8Ctx& c, const uint8_t* p, __m512& w0, __m512& w1) {
        w0 = load_fp8(c, p), w1 = load_fp8(c, p + W);
    }
    static constexpr bool kMxSteps = false;  // MXFP4 a group a step, activations in order
    static inline int64_t mx_x_position(int64_t e, int64_t) { return e; }
    static inline float mx_scalar(uint8_t code, uint8_t s) { return g_fmt.mx_f32[s][code]; }
    static inline __m512 load_x(const float* p) { return _mm512_loadu_ps(p); }
    static inline __m512 dot(__m512 a, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, a); }
    static inline __m512 fma(__m512 a, float s, __m512 b) { return _mm512_fmadd_ps(a, _mm512_set1_ps(s), b); }
    static inline __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
    static inline float hsum(__m512 a) { return hsum512(a); }
    static inline float x2f(float v) { return v; }
    static inline float h_from_f(float v) { return v; }
};
#include "cpu_experts_kernel.h"
}  // namespace k_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")
namespace k_avx512bf16 {
struct K {
    static constexpr int W = 32;  // 32 bf16 = 16 pairs per vdpbf16ps
    static constexpr int NTMAX = 8;
    static constexpr int unroll(int nt) { return nt <= 2 ? 4 : nt <= 4 ? 2 : 1; }
    static constexpr int NT4 = 6;  // four-row tile: 4 x 6 accumulators + 4 weights + 1 activation of 32 registers
    using Acc = __m512;
    using X = uint16_t;
    using Hd = uint16_t;
    static inline __m512 zero() { return _mm512_setzero_ps(); }
    static inline __m512i load_w(const uint16_t* p) { return _mm512_loadu_si512(p); }
    struct Fp8Ctx {  // the magnitude's bf16 bytes (128 entries each: two registers) and the interleaves
        __m512i hi0, hi1, lo0, lo1, inter, inter_hi;
        Fp8Ctx()
            : hi0(_mm512_load_si512(g_fmt.fp8_hi)), hi1(_mm512_load_si512(g_fmt.fp8_hi + 64)),
              lo0(_mm512_load_si512(g_fmt.fp8_lo)), lo1(_mm512_load_si512(g_fmt.fp8_lo + 64)),
              inter(_mm512_load_si512(g_fmt.fp8_interleave)), inter_hi(_mm512_load_si512(g_fmt.fp8_interleave_hi)) {}
    };
    static constexpr float kFp8Unit = 1.0f;
    static inline __m512i load_fp8(const Fp8Ctx& c, const uint8_t* p) {  // needs AVX512_VBMI (ISA_VBMI)
        const __m512i v = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512i hi = _mm512_permutex2var_epi8(c.hi0, v, c.hi1);  // 7 index bits: the magnitude
        const __m512i lo = _mm512_permutex2var_epi8(c.lo0, v, c.lo1);
        const __m512i hs = _mm512_ternarylogic_epi32(hi, v, _mm512_set1_epi8(char(0x80)), 0xF8);  // hi | (v & 0x80)
        return _mm512_permutex2var_epi8(lo, c.inter, hs);
    }
    static inline void load_fp8x2(const Fp8Ctx& c, const uint8_t* p, __m512i& w0, __m512i& w1) {  // 64 at once
        const __m512i v = _mm512_loadu_si512(p);
        const __m512i hi = _mm512_permutex2var_epi8(c.hi0, v, c.hi1);
        const __m512i lo = _mm512_permutex2var_epi8(c.lo0, v, c.lo1);
        const __m512i hs = _mm512_ternarylogic_epi32(hi, v, _mm512_set1_epi8(char(0x80)), 0xF8);
        w0 = _mm512_permutex2var_epi8(lo, c.inter, hs);
        w1 = _mm512_permutex2var_epi8(lo, c.inter_hi, hs);
    }
    // MXFP4 128 values a step where a row has them (cpu_experts_dot2.h's dot2_mx_steps), else a group a step;
    // activations stored as mx_step_x_position orders them
    static constexpr bool kMxSteps = true;
    static inline int64_t mx_x_position(int64_t e, int64_t len) { return mx_step_x_position(e, len); }
    // A step's 64 bytes, one group in each 128-bit lane; qword h of lane L shifted right by 4k bits puts its nibble
    // 4r + k in word r's low bits: vector k, lane L, word 4h + r = element 32L + 16h + 4r + k, looked up in the
    // unscaled E2M1 table (bit 4 of the index, the next nibble's, meets the table's repeat). Seven vector
    // operations for 128 values; each lane's group scale is applied to its partial sums (mx4_scales).
    using Mx4 = __m512i[4];
    static inline __m512i mx4_table() { return _mm512_load_si512(g_fmt.mx_bf16[127]); }  // scale 2^0
    static inline void load_mx4(const __m512i& table, const uint8_t* p, Mx4& w) {
        const __m512i v = _mm512_loadu_si512(p);
        w[0] = _mm512_permutexvar_epi16(v, table);
        w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi64(v, 4), table);
        w[2] = _mm512_permutexvar_epi16(_mm512_srli_epi64(v, 8), table);
        w[3] = _mm512_permutexvar_epi16(_mm512_srli_epi64(v, 12), table);
    }
    // fp32 lanes 4L..4L+3: 2^(s[L] - 127) (2^-127 for 0: the larger of s << 23 and that subnormal's bits)
    static inline __m512 mx4_scales(const uint8_t* s) {
        int32_t raw;
        std::memcpy(&raw, s, 4);
        const __m128i each = _mm_shuffle_epi8(_mm_cvtsi32_si128(raw), _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2,
                                                                                    3, 3, 3, 3));
        const __m512i lane = _mm512_cvtepu8_epi32(each);  // dwords 4L..4L+3: s[L]
        return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_slli_epi32(lane, 23), _mm512_set1_epi32(0x400000)));
    }
    // lane g: 2^(s[g] - 127) for 16 groups (four steps), as mx4_scales; mx4_pick<J> puts step J's in its lanes
    static inline __m512 mx16_scales(const uint8_t* s) {
        const __m512i g = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
        return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_slli_epi32(g, 23), _mm512_set1_epi32(0x400000)));
    }
    template <int J>
    static inline __m512 mx4_pick(__m512 all) {  // lanes 4L..4L+3: all[4J + L]
        const __m512i idx = _mm512_set_epi32(4 * J + 3, 4 * J + 3, 4 * J + 3, 4 * J + 3, 4 * J + 2, 4 * J + 2,
                                             4 * J + 2, 4 * J + 2, 4 * J + 1, 4 * J + 1, 4 * J + 1, 4 * J + 1,
                                             4 * J, 4 * J, 4 * J, 4 * J);
        return _mm512_permutexvar_ps(idx, all);
    }
    static inline __m512 fmav(__m512 a, __m512 s, __m512 b) { return _mm512_fmadd_ps(a, s, b); }
    // A group's 16 bytes in every 128-bit lane; qword q of lane L (the group's qword q & 1) shifted right by 4L
    // bits puts nibble 4r + L of it in word r's low bits, so word w holds element mx_lane_element(w); vpermw reads
    // 5 index bits (bit 4, the next nibble's, meets the table's repeat). Three vector operations a group.
    static inline __m512i load_mx(const uint8_t* p, uint8_t s) {
        const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m512i idx = _mm512_srlv_epi64(v, _mm512_set_epi64(12, 12, 8, 8, 4, 4, 0, 0));
        return _mm512_permutexvar_epi16(idx, _mm512_load_si512(g_fmt.mx_bf16[s]));
    }
    static inline float mx_scalar(uint8_t code, uint8_t s) { return bf16_to_f32(g_fmt.mx_bf16[s][code]); }
    static inline __m512i load_x(const uint16_t* p) { return _mm512_loadu_si512(p); }
    static inline __m512 dot(__m512 a, __m512i x, __m512i w) {
        return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)w);
    }
    static inline __m512 fma(__m512 a, float s, __m512 b) { return _mm512_fmadd_ps(a, _mm512_set1_ps(s), b); }
    static inline __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
    static inline float hsum(__m512 a) { return hsum512(a); }
    static inline float x2f(uint16_t v) { return bf16_to_f32(v); }
    static inline uint16_t h_from_f(float v) { return f32_to_bf16(v); }
    using Gguf = gguf_avx512::Decode;  // GGUF steps (cpu_experts_gguf_avx512.h)
};
#include "cpu_experts_kernel.h"
}  // namespace k_avx512bf16
#pragma GCC pop_options
