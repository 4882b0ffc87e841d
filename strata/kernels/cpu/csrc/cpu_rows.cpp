// strata CPU decode rows: the small ops between a decode step's matrix products, fused, on bf16 activations.
//
// A CPU decode layer streams ~100 MB of weights through the caches (its projections and experts); between those
// products it runs RMSNorms, the rotary, and attention of one query per sequence. As torch ops these are ~40
// launches a layer, each a few microseconds of dispatch that the streamed weights have evicted from the caches
// (a 2,048-value RMSNorm took ~60 us on average inside a decode step, ~15 us warm). Here each is one call:
//   strata_cpu_rms_norm   y = w * rmsnorm(x [+ delta]) over rows of d values (the residual sum written too)
//   strata_cpu_norm_rope  per-head RMSNorm (optional) then the rotate-half rotary, on [N, heads, d]
//   strata_cpu_attend     each sequence's query heads over its cached keys and values (grouped-query), fp32, on the
//                         calling thread
//   strata_cpu_decode_attention  a decode step's whole attention between its two projections: the two above, with
//                         the new keys and values written to the cache
//
// Numerics follow the torch chains they replace (strata.runtime.model): every elementwise result rounded to bf16
// where torch rounds it (nearest even), norms and attention summed in fp32; only summation order differs.
//
// A translation unit of its own (the Python side is strata/kernels/cpu/rows.py): adding these functions to
// cpu_experts.cpp's unit moved its dense kernel's code and cost the LM head ~8% of its read rate on an AMX Xeon.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define ON_X86 1
#include <immintrin.h>
#else
#define ON_X86 0
#endif

#define C_EXPORTED extern "C" __attribute__((visibility("default")))

C_EXPORTED int strata_cpu_isa_mask();  // cpu_experts.cpp
enum { ROWS_ISA_AVX512 = 2 };  // cpu_experts.cpp's ISA_AVX512

#include "cpu_bf16.h"

namespace {

// sum of squares of n fp32 values in 16 lanes (vectorized without reassociation), then the lanes in order
inline float sum_squares(const float* v, int64_t n) {
    float lane[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) lane[l] += v[i + l] * v[i + l];
    for (; i < n; ++i) lane[i & 15] += v[i] * v[i];
    float s = 0.f;
    for (int l = 0; l < 16; ++l) s += lane[l];
    return s;
}

// y = bf16(w * bf16(t * rsqrt(mean(t^2) + eps))) over one row of d values t (fp32 already), `w` bf16 or null (1)
inline void rms_norm_row(const float* t, const uint16_t* w, float eps, int64_t d, uint16_t* y) {
    const float r = 1.0f / std::sqrt(sum_squares(t, d) / float(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
        const float n = bf16_to_f32(f32_to_bf16(t[i] * r));
        y[i] = w ? f32_to_bf16(bf16_to_f32(w[i]) * n) : f32_to_bf16(n);
    }
}

constexpr int64_t kRowsMaxD = 1 << 14;  // the longest row these ops take (a hidden size, a head)

}  // namespace

// rows x [rows, d] bf16 (+ delta [rows, d] bf16, rounded to bf16 and written to sum, when delta is given) -> y [rows,
// d] bf16 = w * rmsnorm: transformers' RMSNorm on bf16 activations (`w * rms_norm(x.float()).to(bf16)`). Returns 0,
// or -1 for bad sizes.
C_EXPORTED int strata_cpu_rms_norm(const uint16_t* x, const uint16_t* delta, uint16_t* sum, const uint16_t* w,
                                   uint16_t* y, int64_t rows, int64_t d, float eps) {
    if (rows < 0 || d < 1 || d > kRowsMaxD || (delta && !sum)) return -1;
    float t[kRowsMaxD];
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * d;
        if (delta) {
            const uint16_t* dr = delta + r * d;
            uint16_t* sr = sum + r * d;
            for (int64_t i = 0; i < d; ++i) {
                sr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
                t[i] = bf16_to_f32(sr[i]);
            }
        } else {
            for (int64_t i = 0; i < d; ++i) t[i] = bf16_to_f32(xr[i]);
        }
        rms_norm_row(t, w, eps, d, y + r * d);
    }
    return 0;
}

// x [N, heads, d] bf16 (rows of stride ldx between tokens, heads contiguous) -> y [N, heads, d] bf16: each head
// RMSNormed by w [d] (null: no norm), then rotated by cos/sin [N, rot] bf16 on its first rot values (rotate-half:
// bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as transformers' apply_rotary_pos_emb on bf16 tensors), the rest
// passed through. Returns 0, or -1 for bad sizes.
C_EXPORTED int strata_cpu_norm_rope(const uint16_t* x, int64_t ldx, const uint16_t* w, float eps, const uint16_t* cos,
                                    const uint16_t* sin, int64_t rot, int64_t N, int64_t heads, int64_t d,
                                    uint16_t* y) {
    if (N < 0 || heads < 1 || d < 1 || d > kRowsMaxD || rot < 0 || rot > d || rot % 2 || ldx < heads * d) return -1;
    float t[kRowsMaxD];
    uint16_t normed[kRowsMaxD];
    const int64_t half = rot / 2;
    for (int64_t n = 0; n < N; ++n) {
        const uint16_t* c = cos + n * rot;
        const uint16_t* s = sin + n * rot;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t* xh = x + n * ldx + h * d;
            uint16_t* yh = y + (n * heads + h) * d;
            const uint16_t* v = xh;
            if (w) {
                for (int64_t i = 0; i < d; ++i) t[i] = bf16_to_f32(xh[i]);
                rms_norm_row(t, w, eps, d, normed);
                v = normed;
            }
            for (int64_t i = 0; i < rot; ++i) {
                const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(v[i]) * bf16_to_f32(c[i])));
                const float other = i < half ? -bf16_to_f32(v[i + half]) : bf16_to_f32(v[i - half]);
                const float b = bf16_to_f32(f32_to_bf16(other * bf16_to_f32(s[i])));
                yh[i] = f32_to_bf16(a + b);
            }
            for (int64_t i = rot; i < d; ++i) yh[i] = v[i];
        }
    }
    return 0;
}

namespace {

struct AttendJob {
    const uint16_t* q = nullptr;  // [B, heads, d]
    const uint16_t* k = nullptr;  // element (b, s, h, i) at k + kb[b] + s * ks + h * kh + i
    const uint16_t* v = nullptr;  // element (b, s, h, i) at v + vb[b] + s * vs + h * vh + i
    const int64_t *kb = nullptr, *vb = nullptr, *len = nullptr;  // [B] each sequence's offsets and key count
    int64_t ks = 0, kh = 0, vs = 0, vh = 0;
    int64_t B = 0, heads = 0, kv_heads = 0, d = 0, dv = 0;
    float scale = 1.f;
    uint16_t* out = nullptr;  // [B, heads, dv]
};

}  // namespace

#if ON_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace k_rows_512 {

inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32 (exact)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// e^x of 16 fp32 values, to ~2 ulp (Cephes' expf polynomial after the reduction x = n ln 2 + r, |r| <= ln 2 / 2);
// underflows to 0 below about -87, as expf
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

// softmax of row [S] in place, 16 at a time (a masked tail)
inline void softmax_row(float* row, int64_t S) {
    __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s += 16) {
        const __mmask16 m = S - s >= 16 ? __mmask16(0xffff) : __mmask16((1u << (S - s)) - 1);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, row + s));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t s = 0; s < S; s += 16) {
        const __mmask16 m = S - s >= 16 ? __mmask16(0xffff) : __mmask16((1u << (S - s)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + s), mx));
        _mm512_mask_storeu_ps(row + s, m, e);
        total = _mm512_mask_add_ps(total, m, total, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int64_t s = 0; s < S; s += 16) {
        const __mmask16 m = S - s >= 16 ? __mmask16(0xffff) : __mmask16((1u << (S - s)) - 1);
        _mm512_mask_storeu_ps(row + s, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + s), inv));
    }
}

// One KV head's group of G query heads (d = dv = 16 * D16) over its S keys and values, in blocks of keys that stay
// in L1 while every query head of the group reads them (the cache is read once, not G times): a query's dot
// products with a block's keys (its vector in registers, two accumulator chains), then each query's softmax over
// all its scores, then each query's output (in registers over a block) plus a block's values times probabilities.
template <int D16>
void attend_group(const AttendJob& j, const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t G, int64_t S,
                  float* scores, float* acc, uint16_t* out) {
    constexpr int64_t kBlock = 64;
    for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
        const int64_t s1 = std::min(S, s0 + kBlock);
        for (int64_t g = 0; g < G; ++g) {
            __m512 qv[D16];
            for (int i = 0; i < D16; ++i) qv[i] = load16(q + g * j.d + 16 * i);
            for (int64_t s = s0; s < s1; ++s) {
                const uint16_t* kr = k + s * j.ks;
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                for (int i = 0; i < D16; i += 2) {
                    a0 = _mm512_fmadd_ps(qv[i], load16(kr + 16 * i), a0);
                    if (i + 1 < D16) a1 = _mm512_fmadd_ps(qv[i + 1], load16(kr + 16 * i + 16), a1);
                }
                scores[g * S + s] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) * j.scale;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) softmax_row(scores + g * S, S);
    std::fill(acc, acc + G * 16 * D16, 0.f);
    for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
        const int64_t s1 = std::min(S, s0 + kBlock);
        for (int64_t g = 0; g < G; ++g) {
            __m512 o[D16];
            float* a = acc + g * 16 * D16;
            for (int i = 0; i < D16; ++i) o[i] = _mm512_loadu_ps(a + 16 * i);
            for (int64_t s = s0; s < s1; ++s) {
                const uint16_t* vr = v + s * j.vs;
                const __m512 p = _mm512_set1_ps(scores[g * S + s]);
                for (int i = 0; i < D16; ++i) o[i] = _mm512_fmadd_ps(p, load16(vr + 16 * i), o[i]);
            }
            for (int i = 0; i < D16; ++i) _mm512_storeu_ps(a + 16 * i, o[i]);
        }
    }
    for (int64_t i = 0; i < G * 16 * D16; ++i) out[i] = f32_to_bf16(acc[i]);
}

// One (sequence, KV head): the query heads of its group over the sequence's keys (consecutive heads: q and out rows
// of the group are contiguous).
void attend_item(const AttendJob& j, int64_t item, std::vector<float>& buf) {
    const int64_t b = item / j.kv_heads, h = item % j.kv_heads, G = j.heads / j.kv_heads, S = j.len[b];
    buf.resize(size_t(G * (S + j.dv)));
    const uint16_t* k = j.k + j.kb[b] + h * j.kh;
    const uint16_t* v = j.v + j.vb[b] + h * j.vh;
    const int64_t head = b * j.heads + h * G;
    const uint16_t* q = j.q + head * j.d;
    uint16_t* out = j.out + head * j.dv;
    float* scores = buf.data();
    float* acc = scores + G * S;
    switch (j.d) {
        case 64: attend_group<4>(j, q, k, v, G, S, scores, acc, out); break;
        case 128: attend_group<8>(j, q, k, v, G, S, scores, acc, out); break;
        case 256: attend_group<16>(j, q, k, v, G, S, scores, acc, out); break;
    }
}

}  // namespace k_rows_512
#pragma GCC pop_options
#endif  // ON_X86

// Decode attention of B sequences, one query each: q [B, heads, d] bf16; sequence b's key s of KV head h at
// k + kb[b] + s * ks + h * kh (d values), its value at v + vb[b] + s * vs + h * vh (dv values); len[b] keys (all of
// them attended: the caller passes each sequence's cached prefix, the new key included). Query head i reads KV head
// i / (heads / kv_heads). out [B, heads, dv] bf16 = softmax(q k^T * scale) v, in fp32, on the calling thread.
// AVX-512 only, d = dv in {64, 128, 256}. Returns 0, or -1 for other sizes or no AVX-512.
C_EXPORTED int strata_cpu_attend(const uint16_t* q, int64_t B, int64_t heads, int64_t kv_heads, int64_t d, int64_t dv,
                                 const uint16_t* k, const int64_t* kb, int64_t ks, int64_t kh, const uint16_t* v,
                                 const int64_t* vb, int64_t vs, int64_t vh, const int64_t* len, float scale,
                                 uint16_t* out) {
    if (B < 0 || kv_heads < 1 || heads % kv_heads || d != dv || (d != 64 && d != 128 && d != 256)) return -1;
    if (!(strata_cpu_isa_mask() & (1 << ROWS_ISA_AVX512))) return -1;
    for (int64_t b = 0; b < B; ++b)
        if (len[b] < 1) return -1;
    AttendJob j;
    j.q = q, j.k = k, j.v = v, j.kb = kb, j.vb = vb, j.len = len;
    j.ks = ks, j.kh = kh, j.vs = vs, j.vh = vh;
    j.B = B, j.heads = heads, j.kv_heads = kv_heads, j.d = d, j.dv = dv, j.scale = scale, j.out = out;
#if ON_X86
    std::vector<float> buf;
    for (int64_t item = 0; item < B * kv_heads; ++item) k_rows_512::attend_item(j, item, buf);
    return 0;
#else
    return -1;
#endif
}

// One CPU decode step's attention from its q/k/v projection: qkv [N, (heads + 2 kv_heads) d] bf16 (token rows of
// stride ldx: q's heads, then k's, then v's), one token per sequence. Each token's query and key heads are RMSNormed
// by wq / wk [d] (null: not normed) and rotated by cos/sin [N, rot] (strata_cpu_norm_rope); its key and value rows
// [kv_heads, d] are written to the caches at (slot[n], pos[n]), element (s, p, h, i) at cache + s * ss + p * ps +
// h * d + i; then its query attends over the slot's keys 0..pos[n] (strata_cpu_attend) -> out [N, heads, d] bf16.
// One call where the Python side took ~10 ops and two calls a layer. Returns 0, or -1 for sizes the two don't take.
C_EXPORTED int strata_cpu_decode_attention(const uint16_t* qkv, int64_t ldx, int64_t N, int64_t heads,
                                           int64_t kv_heads, int64_t d, const uint16_t* wq, float eps_q,
                                           const uint16_t* wk, float eps_k, const uint16_t* cos, const uint16_t* sin,
                                           int64_t rot, uint16_t* k_cache, uint16_t* v_cache, int64_t ss, int64_t ps,
                                           const int64_t* slot, const int64_t* pos, float scale, uint16_t* out) {
    if (N < 0 || kv_heads < 1 || heads % kv_heads || ldx < (heads + 2 * kv_heads) * d || ps < kv_heads * d) return -1;
    if (!(strata_cpu_isa_mask() & (1 << ROWS_ISA_AVX512)) || (d != 64 && d != 128 && d != 256)) return -1;
    for (int64_t n = 0; n < N; ++n)
        if (slot[n] < 0 || pos[n] < 0) return -1;
    std::vector<uint16_t> q(size_t(N * heads * d));
    if (strata_cpu_norm_rope(qkv, ldx, wq, eps_q, cos, sin, rot, N, heads, d, q.data())) return -1;
    std::vector<int64_t> at(static_cast<size_t>(N)), len(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) {
        at[n] = slot[n] * ss, len[n] = pos[n] + 1;
        const uint16_t* row = qkv + n * ldx + heads * d;  // this token's key heads, then its value heads
        const int64_t to = at[n] + pos[n] * ps;
        if (strata_cpu_norm_rope(row, ldx, wk, eps_k, cos + n * rot, sin + n * rot, rot, 1, kv_heads, d, k_cache + to))
            return -1;
        std::memcpy(v_cache + to, row + kv_heads * d, size_t(kv_heads * d) * sizeof(uint16_t));
    }
    return strata_cpu_attend(q.data(), N, heads, kv_heads, d, d, k_cache, at.data(), ps, d, v_cache, at.data(), ps, d,
                             len.data(), scale, out);
}
