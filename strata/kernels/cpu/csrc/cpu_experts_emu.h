// strata CPU expert kernel: portable emulations of its AVX-512 variants, for tests on any machine.
//
// Included once, by cpu_experts.cpp (after bf16_to_f32 / f32_to_bf16, the format tables, the kernel's structs and
// the AVX-512 variants), and compiled without optimisation: test-only code.
#pragma once

// Portable scalar emulations of the two AVX-512 kernels, for tests on machines without AVX-512: the
// same template, the same lane layout, the same summation order (vector FMA = fmaf per lane, the
// horizontal sum of hsum512, vdpbf16ps = per lane acc += odd product, then += even product, with
// denormals flushed as the instruction does; FP8 and MXFP4 weights converted to the same values in the same
// lanes), so they match the real kernels bit for bit by construction. Slow; never chosen automatically.
#pragma GCC push_options
#pragma GCC optimize("O0")  // test-only code: keep the build fast (O1 would double it)
namespace emu {
struct F16 {
    float v[16];
};
inline F16 zero16() {
    F16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = 0.0f;
    return r;
}
inline F16 add16(F16 a, const F16& b) {
    for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] + b.v[i];
    return a;
}
inline float hsum16(const F16& a) {  // the order of hsum512
    float s[16], t[4];
    for (int j = 0; j < 16; ++j) s[j] = a.v[j] + a.v[j ^ 8];
    for (int j = 0; j < 4; ++j) t[j] = s[j] + s[j ^ 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}
inline float flush(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
}  // namespace emu

namespace k_emu512 {
struct K {
    static constexpr int W = 16;
    static constexpr int NTMAX = 8;
    static constexpr int unroll(int nt) { return nt <= 2 ? 4 : nt <= 4 ? 2 : 1; }
    static constexpr int NT4 = 6;  // as the AVX-512 sets
    using Acc = emu::F16;
    using X = float;
    using Hd = float;
    static inline Acc zero() { return emu::zero16(); }
    static inline emu::F16 load_w(const uint16_t* p) {
        emu::F16 r;
        for (int i = 0; i < 16; ++i) r.v[i] = bf16_to_f32(p[i]);
        return r;
    }
    static inline emu::F16 load_x(const float* p) {
        emu::F16 r;
        std::memcpy(r.v, p, sizeof(r.v));
        return r;
    }
    struct Fp8Ctx {};
    static constexpr float kFp8Unit = kFp8F16Unit;
    static inline emu::F16 load_fp8(const Fp8Ctx&, const uint8_t* p) {  // vpmovsxbw, shift, mask, vcvtph2ps
        emu::F16 r;
        for (int i = 0; i < 16; ++i) r.v[i] = f16_to_f32(fp8_as_f16_over_256(p[i]));
        return r;
    }
    static inline emu::F16 load_mx(const uint8_t* p, uint8_t s) {  // lane i: element i's code through the table
        emu::F16 r;
        for (int i = 0; i < 16; ++i) r.v[i] = g_fmt.mx_f32[s][(p[i >> 1] >> ((i & 1) * 4)) & 15];
        return r;
    }
    static inline void load_fp8x2(const Fp8Ctx& c, const uint8_t* p, emu::F16& w0, emu::F16& w1) {
        w0 = load_fp8(c, p), w1 = load_fp8(c, p + W);
    }
    static constexpr bool kMxSteps = false;
    static inline int64_t mx_x_position(int64_t e, int64_t) { return e; }
    static inline float mx_scalar(uint8_t code, uint8_t s) { return g_fmt.mx_f32[s][code]; }
    static inline Acc dot(Acc a, const emu::F16& x, const emu::F16& w) {
        for (int i = 0; i < 16; ++i) a.v[i] = std::fma(x.v[i], w.v[i], a.v[i]);
        return a;
    }
    static inline Acc fma(const Acc& a, float s, Acc b) {
        for (int i = 0; i < 16; ++i) b.v[i] = std::fma(a.v[i], s, b.v[i]);
        return b;
    }
    static inline Acc add(Acc a, const Acc& b) { return emu::add16(a, b); }
    static inline float hsum(const Acc& a) { return emu::hsum16(a); }
    static inline float x2f(float v) { return v; }
    static inline float h_from_f(float v) { return v; }
};
#include "cpu_experts_kernel.h"
}  // namespace k_emu512

namespace k_emu512bf16 {
struct B32 {
    uint16_t v[32];
};
struct K {
    static constexpr int W = 32;
    static constexpr int NTMAX = 8;
    static constexpr int unroll(int nt) { return nt <= 2 ? 4 : nt <= 4 ? 2 : 1; }
    static constexpr int NT4 = 6;  // as the AVX-512 sets
    using Acc = emu::F16;
    using X = uint16_t;
    using Hd = uint16_t;
    static inline Acc zero() { return emu::zero16(); }
    static inline B32 load_w(const uint16_t* p) {
        B32 r;
        std::memcpy(r.v, p, sizeof(r.v));
        return r;
    }
    static inline B32 load_x(const uint16_t* p) { return load_w(p); }
    struct Fp8Ctx {};
    static constexpr float kFp8Unit = 1.0f;
    static inline B32 load_fp8(const Fp8Ctx&, const uint8_t* p) {  // the lookups' result: the exact bf16
        B32 r;
        for (int i = 0; i < 32; ++i) r.v[i] = g_fmt.fp8_bf16[p[i]];
        return r;
    }
    static inline void load_fp8x2(const Fp8Ctx& c, const uint8_t* p, B32& w0, B32& w1) {
        w0 = load_fp8(c, p), w1 = load_fp8(c, p + W);
    }
    static constexpr bool kMxSteps = true;
    static inline int64_t mx_x_position(int64_t e, int64_t len) { return mx_step_x_position(e, len); }
    using Mx4 = B32[4];
    static inline int mx4_table() { return 0; }
    static inline void load_mx4(int, const uint8_t* p, Mx4& w) {  // vector k, lane L, word 4h + r: 32L + 16h + 4r + k
        for (int k = 0; k < 4; ++k)
            for (int L = 0; L < 4; ++L)
                for (int q = 0; q < 8; ++q) {
                    const int64_t e = 32 * L + 16 * (q >> 2) + 4 * (q & 3) + k;
                    w[k].v[8 * L + q] = g_fmt.mx_bf16[127][(p[e >> 1] >> ((e & 1) * 4)) & 15];
                }
    }
    static inline Acc mx4_scales(const uint8_t* s) {  // lanes 4L..4L+3: e8m0_value(s[L]) (vpmaxud's 2^-127 for 0)
        Acc r;
        for (int i = 0; i < 16; ++i) r.v[i] = e8m0_value(s[i >> 2]);
        return r;
    }
    static inline Acc mx16_scales(const uint8_t* s) {  // lane g: e8m0_value(s[g]), 16 groups
        Acc r;
        for (int i = 0; i < 16; ++i) r.v[i] = e8m0_value(s[i]);
        return r;
    }
    template <int J>
    static inline Acc mx4_pick(const Acc& all) {  // lanes 4L..4L+3: all[4J + L]
        Acc r;
        for (int i = 0; i < 16; ++i) r.v[i] = all.v[4 * J + (i >> 2)];
        return r;
    }
    static inline Acc fmav(const Acc& a, const Acc& s, Acc b) {
        for (int i = 0; i < 16; ++i) b.v[i] = std::fma(a.v[i], s.v[i], b.v[i]);
        return b;
    }
    static inline B32 load_mx(const uint8_t* p, uint8_t s) {  // word w: element mx_lane_element(w), as load_mx's
        B32 r;
        for (int w = 0; w < 32; ++w) {
            const int64_t e = mx_lane_element(w);
            r.v[w] = g_fmt.mx_bf16[s][(p[e >> 1] >> ((e & 1) * 4)) & 15];
        }
        return r;
    }
    static inline float mx_scalar(uint8_t code, uint8_t s) { return bf16_to_f32(g_fmt.mx_bf16[s][code]); }
    static inline Acc fma(const Acc& a, float s, Acc b) {
        for (int i = 0; i < 16; ++i) b.v[i] = std::fma(a.v[i], s, b.v[i]);
        return b;
    }
    static inline Acc dot(Acc a, const B32& x, const B32& w) {
        for (int i = 0; i < 16; ++i) {  // bf16 x bf16 products are exact in fp32
            float acc = emu::flush(a.v[i]);
            acc = emu::flush(acc + emu::flush(bf16_to_f32(x.v[2 * i + 1])) * emu::flush(bf16_to_f32(w.v[2 * i + 1])));
            acc = emu::flush(acc + emu::flush(bf16_to_f32(x.v[2 * i])) * emu::flush(bf16_to_f32(w.v[2 * i])));
            a.v[i] = acc;
        }
        return a;
    }
    static inline Acc add(Acc a, const Acc& b) { return emu::add16(a, b); }
    static inline float hsum(const Acc& a) { return emu::hsum16(a); }
    static inline float x2f(uint16_t v) { return bf16_to_f32(v); }
    static inline uint16_t h_from_f(float v) { return f32_to_bf16(v); }
    using Gguf = GgufEmuDecode<B32, emu::F16>;  // GGUF steps (cpu_experts_gguf.h)
};
#include "cpu_experts_kernel.h"
}  // namespace k_emu512bf16
#pragma GCC pop_options

