// strata CPU expert kernel: portable emulations of its AVX-512 variants, for tests on any machine.
//
// Included once, by cpu_experts.cpp (after bf16_to_f32 / f32_to_bf16, the kernel's structs and the
// AVX-512 variants), and compiled without optimisation: test-only code.
#pragma once

// Portable scalar emulations of the two AVX-512 kernels, for tests on machines without AVX-512: the
// same template, the same lane layout, the same summation order (vector FMA = fmaf per lane, the
// horizontal sum of hsum512, vdpbf16ps = per lane acc += odd product, then += even product, with
// denormals flushed as the instruction does), so they match the real kernels bit for bit by
// construction. Slow; never chosen automatically.
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
    static inline Acc dot(Acc a, const emu::F16& x, const emu::F16& w) {
        for (int i = 0; i < 16; ++i) a.v[i] = std::fma(x.v[i], w.v[i], a.v[i]);
        return a;
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
};
#include "cpu_experts_kernel.h"
}  // namespace k_emu512bf16
#pragma GCC pop_options

