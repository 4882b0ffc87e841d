// The scale searches of llama.cpp's K-quant quantizers (ggml-quants.c's make_qx_quants and make_qkx2_quants), each
// run over 8 or 16 sub-blocks at once. Included by cpu_quantize.cpp inside its anonymous namespace, after its scalar
// helpers (nearest_int's constant, clamp, GROUP_MAX_EPS).
#pragma once

// The searches below run S sub-blocks at once, one in each lane of a GCC vector (x [n][S]: value i of sub-block s at
// x[i * S + s]). Each lane's arithmetic is the C function's, in its order (IEEE float per lane, no contraction), with
// its branches as lane selects, so each lane's sums stay sequential and its bytes those of the scalar code;
// target_clones picks AVX-512, AVX2 or SSE2 code for the machine at load.
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

template <int S>
struct Lanes;
template <>
struct Lanes<8> {
    typedef float F __attribute__((vector_size(32)));
    typedef int32_t I __attribute__((vector_size(32)));
};
template <>
struct Lanes<16> {
    typedef float F __attribute__((vector_size(64)));
    typedef int32_t I __attribute__((vector_size(64)));
};

template <class F>
__attribute__((always_inline)) inline F load_lanes(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof(F));
    return v;
}
template <class F, class I>
__attribute__((always_inline)) inline I nearest_lanes(const F& f) {  // nearest_int in every lane
    const F val = f + 12582912.f;
    I i;
    std::memcpy(&i, &val, sizeof(I));
    return (i & 0x007fffff) - 0x00400000;
}
template <class F, class I>
__attribute__((always_inline)) inline F abs_lanes(const F& x) {
    F v;
    I i;
    std::memcpy(&i, &x, sizeof(I));
    i &= 0x7fffffff;
    std::memcpy(&v, &i, sizeof(F));
    return v;
}
template <class I>
__attribute__((always_inline)) inline I clamp_lanes(const I& x, int lo, int hi) {
    const I v = x < lo ? I{} + lo : x;
    return v > hi ? I{} + hi : v;
}

// make_qx_quants with rmse_type 1 and no importance weights, over S sub-blocks of n <= 32 values: scale[s],
// L[i * S + s] (an all-zero sub-block: scale 0 and 0s, as C leaves it)
template <int S>
VECTOR_CLONES void make_qx_quants(int n, int nmax, const float* x, int8_t* L, float* scale_out) {
    using F = typename Lanes<S>::F;
    using I = typename Lanes<S>::I;
    F max = F{}, amax = F{};
    for (int i = 0; i < n; ++i) {
        const F v = load_lanes<F>(x + i * S), ax = abs_lanes<F, I>(v);
        const I more = ax > amax;
        amax = more ? ax : amax;
        max = more ? v : max;
    }
    const I zero = amax < GROUP_MAX_EPS;
    const F denom = zero ? F{} + 1.0f : max;
    F iscale = float(-nmax) / denom, sumlx = F{}, suml2 = F{};
    I Lv[32];
    for (int i = 0; i < n; ++i) {
        const F v = load_lanes<F>(x + i * S);
        const I l = clamp_lanes(nearest_lanes<F, I>(iscale * v), -nmax, nmax - 1);
        Lv[i] = l + nmax;
        const F w = v * v, lf = __builtin_convertvector(l, F);
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    F scale = suml2 != 0 ? sumlx / suml2 : F{}, best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / denom;
        sumlx = suml2 = F{};
        for (int i = 0; i < n; ++i) {
            const F v = load_lanes<F>(x + i * S);
            const F lf = __builtin_convertvector(clamp_lanes(nearest_lanes<F, I>(iscale * v), -nmax, nmax - 1), F);
            const F w = v * v;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        const I take = (suml2 > 0) & (sumlx * sumlx > best * suml2);
        const F sc = sumlx / (suml2 > 0 ? suml2 : F{} + 1.0f);
        scale = take ? sc : scale;
        best = take ? sc * sumlx : best;
        for (int i = 0; i < n; ++i) {
            const I l = nmax + clamp_lanes(nearest_lanes<F, I>(iscale * load_lanes<F>(x + i * S)), -nmax, nmax - 1);
            Lv[i] = take ? l : Lv[i];
        }
    }
    scale = zero ? F{} : scale;
    std::memcpy(scale_out, &scale, sizeof(F));
    for (int i = 0; i < n; ++i) {
        const I l = zero ? I{} : Lv[i];
        for (int s = 0; s < S; ++s) L[i * S + s] = static_cast<int8_t>(l[s]);
    }
}

// make_qkx2_quants' codes Lt [QK_K / S][S] (lane s: sub-block s) back in element order L, and the sub-blocks' largest
// scale and min
template <int S>
inline void untile_codes(const uint8_t* Lt, const float* scales, const float* mins, uint8_t* L, float& max_scale,
                         float& max_min) {
    constexpr int n = QK_K / S;
    for (int j = 0; j < S; ++j) {
        for (int l = 0; l < n; ++l) L[n * j + l] = Lt[l * S + j];
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
}

// make_qkx2_quants over S sub-blocks of n <= 32 values with weights w [n][S]: scale[s], the_min[s], L[i * S + s]
template <int S>
VECTOR_CLONES void make_qkx2_quants(int n, int nmax, const float* x, const float* w, uint8_t* L, float* scale_out,
                                    float* the_min, float rmin, float rdelta, int nstep, bool use_mad) {
    using F = typename Lanes<S>::F;
    using I = typename Lanes<S>::I;
    F min = load_lanes<F>(x), max = min, sum_w = load_lanes<F>(w), sum_x = sum_w * min;
    for (int i = 1; i < n; ++i) {
        const F v = load_lanes<F>(x + i * S), wi = load_lanes<F>(w + i * S);
        min = v < min ? v : min;
        max = v > max ? v : max;
        sum_w += wi;
        sum_x += wi * v;
    }
    min = min > 0 ? F{} : min;
    const I flat = max == min;
    F iscale = float(nmax) / (flat ? F{} + 1.0f : max - min), scale = 1 / iscale, best = F{};
    I Lv[32], Laux[32];
    for (int i = 0; i < n; ++i) {
        const F v = load_lanes<F>(x + i * S);
        Lv[i] = clamp_lanes(nearest_lanes<F, I>(iscale * (v - min)), 0, nmax);
        F diff = scale * __builtin_convertvector(Lv[i], F) + min - v;
        diff = use_mad ? abs_lanes<F, I>(diff) : diff * diff;
        best += load_lanes<F>(w + i * S) * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (flat ? F{} + 1.0f : max - min);
        F sum_l = F{}, sum_l2 = F{}, sum_xl = F{};
        for (int i = 0; i < n; ++i) {
            const F v = load_lanes<F>(x + i * S), wi = load_lanes<F>(w + i * S);
            Laux[i] = clamp_lanes(nearest_lanes<F, I>(iscale * (v - min)), 0, nmax);
            const F l = __builtin_convertvector(Laux[i], F);
            sum_l += wi * l;
            sum_l2 += wi * l * l;
            sum_xl += wi * l * v;
        }
        const F D = sum_w * sum_l2 - sum_l * sum_l;
        I take = (D > 0) & ~flat;
        const F d = take ? D : F{} + 1.0f;
        F this_scale = (sum_w * sum_xl - sum_x * sum_l) / d, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
        const I positive = this_min > 0;
        this_scale = positive ? sum_xl / (sum_l2 > 0 ? sum_l2 : F{} + 1.0f) : this_scale;
        this_min = positive ? F{} : this_min;
        F cur = F{};
        for (int i = 0; i < n; ++i) {
            F diff = this_scale * __builtin_convertvector(Laux[i], F) + this_min - load_lanes<F>(x + i * S);
            diff = use_mad ? abs_lanes<F, I>(diff) : diff * diff;
            cur += load_lanes<F>(w + i * S) * diff;
        }
        take &= cur < best;
        best = take ? cur : best;
        scale = take ? this_scale : scale;
        min = take ? this_min : min;
        for (int i = 0; i < n; ++i) Lv[i] = take ? Laux[i] : Lv[i];
    }
    scale = flat ? F{} : scale;
    const F neg_min = -min;
    std::memcpy(scale_out, &scale, sizeof(F));
    std::memcpy(the_min, &neg_min, sizeof(F));
    for (int i = 0; i < n; ++i) {
        const I l = flat ? I{} : Lv[i];
        for (int s = 0; s < S; ++s) L[i * S + s] = static_cast<uint8_t>(l[s]);
    }
}
