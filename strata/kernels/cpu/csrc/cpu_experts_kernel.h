// The CPU expert kernel body, written once and compiled once per instruction set (and, inside, per weight format).
//
// cpu_experts.cpp includes this file several times, each time inside its own namespace, under a
// `#pragma GCC target(...)` region, after defining a traits struct `K` in that namespace:
//
//   K::W            elements of a weight row consumed per vector step
//   K::Acc          fp32 accumulator vector;  K::zero(), K::add(a, b), K::hsum(a) -> float
//   K::load_w(p)    W bf16 weights at p -> whatever K::dot takes
//   K::load_fp8(c, p)   W float8_e4m3 bytes at p -> the same, the values times K::kFp8Unit's inverse (exactly);
//                   K::Fp8Ctx c: what the conversion keeps in registers (its tables)
//   K::load_mx(p, s)    W e2m1 codes at p (two a byte) of a group with e8m0 scale s -> the same, scaled;
//                   K::mx_scalar(code, s) one such value, as the vector path gives it
//   K::fma(a, s, b) b + a * s (s a float, broadcast; fused)
//   K::X            activation element type (float, or uint16_t = bf16);  K::load_x(p), K::x2f(v)
//   K::dot(a, x, w) a + x * w over the W elements (fp32 FMA, or vdpbf16ps pairs)
//   K::Hd, K::h_from_f(float)   storage type of the intermediate silu(gate) * up activations
//   K::NTMAX        tokens per register tile;  K::unroll(nt) vector steps per loop iteration
//   K::NT4          tokens per tile of the four-row tile (cpu_experts_tile4.h; 0: none)
//
// Numerics are fixed by the code, not by the thread that runs it: every dot product is summed in one
// order (U interleaved accumulators, combined in order, then a fixed horizontal sum, then the scalar
// tail; an FP8 row block by block, see dot2_tile), and every output element is written by exactly one thread (see cpu_experts.cpp), so the
// results are bit-identical for any thread count and any scheduling.

// How the kernel reads a row of each weight format (cpu_experts_formats.h): `load` gives the W elements from i
// (i a multiple of W) as the K::dot operand (`load2`: two steps at once, which FP8 on avx512_bf16 converts together),
// `scalar` one element for the tail, `x_position` where an element's activation is stored (MXFP4 on avx512_bf16:
// permuted within each group as its lanes hold the weights). bf16 and MXFP4 rows are summed as one span (an MXFP4
// group's scale is in the lookup table its codes go through, exactly: `K::load_mx`); FP8 rows are `blocked`: each
// block of bk columns is summed on its own and added times its scale_inv (vector part: times `vec_scale`, which
// also undoes a load's fixed power-of-two factor, K::kFp8Unit).
struct ReadBf16 {
    using Row = RowBf16;
    static constexpr bool kBlocked = false;
    static constexpr int kBits = 16;
    struct Ctx {};
    static inline auto load(const Ctx&, const Row& r, int64_t i) { return K::load_w(r.v + i); }
    template <class V>
    static inline void load2(const Ctx& c, const Row& r, int64_t i, V& w0, V& w1) {
        w0 = load(c, r, i), w1 = load(c, r, i + K::W);
    }
    static inline int64_t x_position(int64_t e, int64_t) { return e; }
    static inline float scalar(const Row& r, int64_t i) { return bf16_to_f32(r.v[i]); }
    static inline const uint8_t* bytes(const Row& r) { return reinterpret_cast<const uint8_t*>(r.v); }
    static inline int64_t span(const Row&, int64_t len) { return len; }
};
struct ReadFp8 {
    using Row = RowFp8;
    static constexpr bool kBlocked = true;
    static constexpr int kBits = 8;
    using Ctx = typename K::Fp8Ctx;
    static inline auto load(const Ctx& c, const Row& r, int64_t i) { return K::load_fp8(c, r.v + i); }
    template <class V>
    static inline void load2(const Ctx& c, const Row& r, int64_t i, V& w0, V& w1) {
        K::load_fp8x2(c, r.v + i, w0, w1);
    }
    static inline int64_t x_position(int64_t e, int64_t) { return e; }
    static inline float scalar(const Row& r, int64_t i) { return g_fmt.fp8_f32[r.v[i]]; }
    static inline float tail_scale(const Row& r, int64_t block) { return r.s[block]; }
    static inline float vec_scale(const Row& r, int64_t block) { return r.s[block] * K::kFp8Unit; }
    static inline const uint8_t* bytes(const Row& r) { return r.v; }
    static inline int64_t span(const Row& r, int64_t) { return r.bk; }
};
struct ReadMx {
    using Row = RowMx;
    static constexpr bool kBlocked = false;
    static constexpr int kBits = 4;
    struct Ctx {};
    static inline auto load(const Ctx&, const Row& r, int64_t i) { return K::load_mx(r.v + (i >> 1), r.s[i >> 5]); }
    template <class V>
    static inline void load2(const Ctx& c, const Row& r, int64_t i, V& w0, V& w1) {
        w0 = load(c, r, i), w1 = load(c, r, i + K::W);
    }
    // where element e of a row of len elements has its activation (avx512_bf16: cpu_experts_formats.h's order)
    static inline int64_t x_position(int64_t e, int64_t len) { return K::mx_x_position(e, len); }
    static inline float scalar(const Row& r, int64_t i) { return K::mx_scalar(r.code(i), r.s[i >> 5]); }
    static inline const uint8_t* bytes(const Row& r) { return r.v; }
    static inline int64_t span(const Row&, int64_t len) { return len; }
};

// Two weight rows (ra, rb) of length len against nt <= K::NTMAX activation rows xs[t]:
// oa[t] = <ra, xs[t]>, ob[t] = <rb, xs[t]>. Each weight vector is loaded (and converted) once for all tokens.
// Order: per span (the whole row, or an FP8 block), U interleaved accumulators combined in order; a span's
// vectors then go through the fixed horizontal sum (one span) or are added times the block's scale into a
// vector total summed at the end (blocks); scalar tails (len or a block not a multiple of W) last, in order.
template <class F, int NT, int U>
static inline void dot2_tile(const typename F::Row& ra, const typename F::Row& rb, int64_t len,
                             const typename K::X* const* xs, float* oa, float* ob, int64_t pf) {
    constexpr int W = K::W;
    constexpr int64_t step_bytes = int64_t(W) * U * F::kBits / 8;
    const typename F::Ctx ctx{};
    const uint8_t* pa = F::bytes(ra) + pf;
    const uint8_t* pb = F::bytes(rb) + pf;
    typename K::Acc aa[U][NT], ab[U][NT], fa[NT], fb[NT];
    float sa[NT], sb[NT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
        fa[t] = fb[t] = K::zero();
        sa[t] = sb[t] = 0.0f;
    }
    const int64_t span = F::span(ra, len);
    for (int64_t c0 = 0, block = 0; c0 < len; c0 += span, ++block) {
        const int64_t c1 = std::min(len, c0 + span);
#pragma GCC unroll 16
        for (int u = 0; u < U; ++u) {
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                aa[u][t] = K::zero();
                ab[u][t] = K::zero();
            }
        }
        int64_t i = c0;
        for (; i + int64_t(W) * U <= c1; i += int64_t(W) * U) {
            if (pf) {  // software prefetch `pf` bytes ahead, one prefetch per 64-byte line and row
                const int64_t at = i * F::kBits / 8;
                if constexpr (step_bytes >= 64) {
#pragma GCC unroll 8
                    for (int l = 0; l < step_bytes / 64; ++l) {
                        __builtin_prefetch(pa + at + 64 * l, 0, 3);
                        __builtin_prefetch(pb + at + 64 * l, 0, 3);
                    }
                } else if ((at & 63) == 0) {
                    __builtin_prefetch(pa + at, 0, 3);
                    __builtin_prefetch(pb + at, 0, 3);
                }
            }
            if constexpr (U % 2 == 0) {  // two steps a load (FP8 on avx512_bf16 converts 64 bytes at once)
#pragma GCC unroll 16
                for (int u = 0; u < U; u += 2) {
                    decltype(F::load(ctx, ra, i)) wa0, wa1, wb0, wb1;
                    F::load2(ctx, ra, i + u * W, wa0, wa1);
                    F::load2(ctx, rb, i + u * W, wb0, wb1);
#pragma GCC unroll 16
                    for (int t = 0; t < NT; ++t) {
                        const auto x0 = K::load_x(xs[t] + i + u * W), x1 = K::load_x(xs[t] + i + (u + 1) * W);
                        aa[u][t] = K::dot(aa[u][t], x0, wa0);
                        ab[u][t] = K::dot(ab[u][t], x0, wb0);
                        aa[u + 1][t] = K::dot(aa[u + 1][t], x1, wa1);
                        ab[u + 1][t] = K::dot(ab[u + 1][t], x1, wb1);
                    }
                }
            } else {
#pragma GCC unroll 16
                for (int u = 0; u < U; ++u) {
                    const auto wa = F::load(ctx, ra, i + u * W);
                    const auto wb = F::load(ctx, rb, i + u * W);
#pragma GCC unroll 16
                    for (int t = 0; t < NT; ++t) {
                        const auto xv = K::load_x(xs[t] + i + u * W);
                        aa[u][t] = K::dot(aa[u][t], xv, wa);
                        ab[u][t] = K::dot(ab[u][t], xv, wb);
                    }
                }
            }
        }
        for (; i + W <= c1; i += W) {
            const auto wa = F::load(ctx, ra, i);
            const auto wb = F::load(ctx, rb, i);
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                const auto xv = K::load_x(xs[t] + i);
                aa[0][t] = K::dot(aa[0][t], xv, wa);
                ab[0][t] = K::dot(ab[0][t], xv, wb);
            }
        }
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) {
            typename K::Acc a = aa[0][t], b = ab[0][t];
#pragma GCC unroll 16
            for (int u = 1; u < U; ++u) {
                a = K::add(a, aa[u][t]);
                b = K::add(b, ab[u][t]);
            }
            if constexpr (F::kBlocked) {
                fa[t] = K::fma(a, F::vec_scale(ra, block), fa[t]);
                fb[t] = K::fma(b, F::vec_scale(rb, block), fb[t]);
            } else {
                sa[t] = K::hsum(a);
                sb[t] = K::hsum(b);
            }
        }
        if constexpr (F::kBlocked) {
            if (i < c1) {  // the block's tail: summed alone, then times its scale
                float qa[NT], qb[NT];
                for (int t = 0; t < NT; ++t) qa[t] = qb[t] = 0.0f;
                for (; i < c1; ++i) {
                    const float wa = F::scalar(ra, i), wb = F::scalar(rb, i);
                    for (int t = 0; t < NT; ++t) {
                        const float xv = K::x2f(xs[t][i]);
                        qa[t] += wa * xv;
                        qb[t] += wb * xv;
                    }
                }
                const float s_a = F::tail_scale(ra, block), s_b = F::tail_scale(rb, block);
                for (int t = 0; t < NT; ++t) {
                    sa[t] += qa[t] * s_a;
                    sb[t] += qb[t] * s_b;
                }
            }
        } else {
            for (; i < c1; ++i) {  // tail: len not a multiple of W
                const float wa = F::scalar(ra, i), wb = F::scalar(rb, i);
                for (int t = 0; t < NT; ++t) {
                    const float xv = K::x2f(xs[t][i]);
                    sa[t] += wa * xv;
                    sb[t] += wb * xv;
                }
            }
        }
    }
    for (int t = 0; t < NT; ++t) {
        if constexpr (F::kBlocked) {
            oa[t] = K::hsum(fa[t]) + sa[t];
            ob[t] = K::hsum(fb[t]) + sb[t];
        } else {
            oa[t] = sa[t];
            ob[t] = sb[t];
        }
    }
}

// MXFP4 rows where K reads 128 values a step (K::kMxSteps, avx512_bf16): four vectors a row and step, one group in
// each 128-bit lane, through the unscaled E2M1 table (K::load_mx4); a lane's products are summed (two chains of two
// dot steps, then added) and added times its group's 2^(scale - 127) into the row's total (K::mx4_scales, one
// FMA). Whole groups past the last step take K::load_mx (the group's scaled table) into a second total, the partial
// last group the scalar tail; the row's sum is hsum(steps' total) + hsum(groups' total) + tail, in that order (the
// groups' term only where the row has such groups: most rows are whole steps, and two horizontal sums of zeros a
// row pair are a few percent of a short row's time).
template <class KK, int NT>
static inline void dot2_mx_steps(const RowMx& ra, const RowMx& rb, int64_t len, const typename KK::X* const* xs,
                                 float* oa, float* ob, int64_t pf) {
    using Acc = typename KK::Acc;
    const auto table = KK::mx4_table();
    Acc fa[NT], fb[NT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) fa[t] = fb[t] = KK::zero();
    const auto step = [&](int64_t i, const Acc& sa, const Acc& sb) __attribute__((always_inline)) {
        if (pf) {  // 64 bytes a row and step: one line each
            __builtin_prefetch(ra.v + (i >> 1) + pf, 0, 3);
            __builtin_prefetch(rb.v + (i >> 1) + pf, 0, 3);
        }
        typename KK::Mx4 wa, wb;
        KK::load_mx4(table, ra.v + (i >> 1), wa);
        KK::load_mx4(table, rb.v + (i >> 1), wb);
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) {
            const typename KK::X* x = xs[t] + i;
            const auto x0 = KK::load_x(x), x1 = KK::load_x(x + 32), x2 = KK::load_x(x + 64), x3 = KK::load_x(x + 96);
            const Acc pa = KK::add(KK::dot(KK::dot(KK::zero(), x0, wa[0]), x2, wa[2]),
                                   KK::dot(KK::dot(KK::zero(), x1, wa[1]), x3, wa[3]));
            const Acc pb = KK::add(KK::dot(KK::dot(KK::zero(), x0, wb[0]), x2, wb[2]),
                                   KK::dot(KK::dot(KK::zero(), x1, wb[1]), x3, wb[3]));
            fa[t] = KK::fmav(pa, sa, fa[t]);
            fb[t] = KK::fmav(pb, sb, fb[t]);
        }
    };
    int64_t i = 0;
    // four steps share one 16-byte load of their 16 groups' scales, each step's four picked out by one permute
    for (; i + 4 * kMxStep <= len; i += 4 * kMxStep) {
        const Acc qa = KK::mx16_scales(ra.s + (i >> 5)), qb = KK::mx16_scales(rb.s + (i >> 5));
        step(i, KK::template mx4_pick<0>(qa), KK::template mx4_pick<0>(qb));
        step(i + kMxStep, KK::template mx4_pick<1>(qa), KK::template mx4_pick<1>(qb));
        step(i + 2 * kMxStep, KK::template mx4_pick<2>(qa), KK::template mx4_pick<2>(qb));
        step(i + 3 * kMxStep, KK::template mx4_pick<3>(qa), KK::template mx4_pick<3>(qb));
    }
    for (; i + kMxStep <= len; i += kMxStep) step(i, KK::mx4_scales(ra.s + (i >> 5)), KK::mx4_scales(rb.s + (i >> 5)));
    float sa[NT], sb[NT];
    for (int t = 0; t < NT; ++t) {
        sa[t] = KK::hsum(fa[t]);
        sb[t] = KK::hsum(fb[t]);
    }
    if (i + kMxGroup <= len) {
        Acc ga[NT], gb[NT];
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) ga[t] = gb[t] = KK::zero();
        for (; i + kMxGroup <= len; i += kMxGroup) {
            const auto wa = KK::load_mx(ra.v + (i >> 1), ra.s[i >> 5]), wb = KK::load_mx(rb.v + (i >> 1), rb.s[i >> 5]);
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                const auto xv = KK::load_x(xs[t] + i);
                ga[t] = KK::dot(ga[t], xv, wa);
                gb[t] = KK::dot(gb[t], xv, wb);
            }
        }
        for (int t = 0; t < NT; ++t) {
            sa[t] += KK::hsum(ga[t]);
            sb[t] += KK::hsum(gb[t]);
        }
    }
    for (; i < len; ++i) {  // the partial last group (a split expert's rows), in order
        const float wa = KK::mx_scalar(ra.code(i), ra.s[i >> 5]), wb = KK::mx_scalar(rb.code(i), rb.s[i >> 5]);
        for (int t = 0; t < NT; ++t) {
            const float xv = KK::x2f(xs[t][i]);
            sa[t] += wa * xv;
            sb[t] += wb * xv;
        }
    }
    for (int t = 0; t < NT; ++t) {
        oa[t] = sa[t];
        ob[t] = sb[t];
    }
}

template <class F, int NT>
static inline void dot2_nt(const typename F::Row& ra, const typename F::Row& rb, int64_t len,
                           const typename K::X* const* xs, float* oa, float* ob, int64_t pf) {
    if constexpr (std::is_same_v<F, ReadMx> && K::kMxSteps)
        dot2_mx_steps<K, NT>(ra, rb, len, xs, oa, ob, pf);
    else
        dot2_tile<F, NT, K::unroll(NT)>(ra, rb, len, xs, oa, ob, pf);
}

template <class F>
static void dot2(int nt, const typename F::Row& ra, const typename F::Row& rb, int64_t len,
                 const typename K::X* const* xs, float* oa, float* ob, int64_t pf) {
    static_assert(K::NTMAX >= 1 && K::NTMAX <= 8, "tile of 1..8 tokens");
    switch (nt) {
        case 1: dot2_nt<F, 1>(ra, rb, len, xs, oa, ob, pf); break;
        case 2: if constexpr (K::NTMAX >= 2) dot2_nt<F, 2>(ra, rb, len, xs, oa, ob, pf); break;
        case 3: if constexpr (K::NTMAX >= 3) dot2_nt<F, 3>(ra, rb, len, xs, oa, ob, pf); break;
        case 4: if constexpr (K::NTMAX >= 4) dot2_nt<F, 4>(ra, rb, len, xs, oa, ob, pf); break;
        case 5: if constexpr (K::NTMAX >= 5) dot2_nt<F, 5>(ra, rb, len, xs, oa, ob, pf); break;
        case 6: if constexpr (K::NTMAX >= 6) dot2_nt<F, 6>(ra, rb, len, xs, oa, ob, pf); break;
        case 7: if constexpr (K::NTMAX >= 7) dot2_nt<F, 7>(ra, rb, len, xs, oa, ob, pf); break;
        case 8: if constexpr (K::NTMAX >= 8) dot2_nt<F, 8>(ra, rb, len, xs, oa, ob, pf); break;
        default: break;
    }
}

static inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

// Intermediate row j of expert ex for nt tokens, its gate g[t] and up u[t] summed: put(t, h) stores each h (K::Hd).
// The job's form and the expert's bias are chosen here, once a row and tile (cpu_experts_act.h).
template <class Put>
static inline void activate(const Job& job, const ExpertArg& ex, int64_t j, int nt, const float* g, const float* u,
                            Put put) {
    if (job.act.plain && !ex.bias) {
        for (int t = 0; t < nt; ++t) put(t, K::h_from_f(silu_mul(g[t], u[t])));
        return;
    }
    const float bg = ex.bias ? ex.bias[job.act.gate_row(j)] : 0.0f;
    const float bu = ex.bias ? ex.bias[job.act.up_row(j, ex.ld)] : 0.0f;
    for (int t = 0; t < nt; ++t) put(t, K::h_from_f(swiglu_form(job.act, g[t] + bg, u[t] + bu)));
}
#include "cpu_experts_tile4.h"  // four rows a tile for experts with many tokens: gate_up_rows4, down_expert_rows4

// Phase 1 on expert e, intermediate rows [j0, j1): h[t, j] = act(<gate_j, x_t>, <up_j, x_t>) (the job's SwiGLU form).
template <class F>
static void gate_up_rows(const Job& job, int64_t e, int64_t j0, int64_t j1) {
    const ExpertArg& ex = job.experts[e];
    if (tile4_for<F>(ex.T)) return gate_up_rows4<F>(job, e, j0, j1);
    const int64_t H = job.H, I = ex.I, T = ex.T;
    const typename K::X* xbase = static_cast<const typename K::X*>(job.xact);
    typename K::Hd* hb = static_cast<typename K::Hd*>(job.hbuf) + job.hoff[e];
    const typename K::X* xs[K::NTMAX];
    float g[2][K::NTMAX], u[2][K::NTMAX];
    const Mat m{ex.gate_up, ex.gate_up_scales, H, job.bn, job.bk};
    // a tile's silu is computed after the next tile's dot products are issued: exp and the divide wait on the end of
    // the tile's sums, and placed there they overlap the next tile's loads and products instead of stalling between
    // tiles (~7% of one core's time on MXFP4 experts; the values written are the same)
    int cur = 0, pend_nt = 0;
    int64_t pend_s = 0, pend_at = 0, pend_j = 0;
    const auto write = [&](int b) {
        activate(job, ex, pend_j, pend_nt, g[b], u[b], [&](int t, auto h) { hb[(pend_s + t) * I + pend_at] = h; });
    };
    for (int64_t j = j0; j < j1; ++j) {
        const auto ra = F::Row::of(m, job.act.gate_row(j));
        const auto rb = F::Row::of(m, job.act.up_row(j, ex.ld));  // gate rows first: up's from ld (I < ld: split)
        for (int64_t s = 0; s < T; s += K::NTMAX) {
            const int nt = static_cast<int>(std::min<int64_t>(K::NTMAX, T - s));
            for (int t = 0; t < nt; ++t) xs[t] = xbase + ex.idx[s + t] * H;
            dot2<F>(nt, ra, rb, H, xs, g[cur], u[cur], job.pf);
            write(cur ^ 1);
            pend_nt = nt, pend_s = s, pend_j = j, pend_at = F::x_position(j, I);  // down reads h[t] as it reads x
            cur ^= 1;
        }
    }
    write(cur ^ 1);
}

// Phase 2, output rows [h0, h1) of every expert in ascending order: out[tok, h] += w * <down_h, h_tok>.
// Two rows at a time: adjacent ones, or with `down_split` one from each half of the range (two streams a
// thread, in different pages). Either way each row's dot product is summed alone, in the same order.
template <class F>
static void down_rows(const Job& job, int64_t h0, int64_t h1) {
    const int64_t H = job.H, n = h1 - h0, half = (n + 1) / 2;
    const typename K::Hd* xs[K::NTMAX];
    float ya[2][K::NTMAX], yb[2][K::NTMAX];
    // a tile's results are added into out after the next tile's dot products are issued (as gate_up_rows' silu; each
    // element still gets its experts' terms in ascending order)
    struct Pending {
        int nt;
        int64_t s, row_a, row_b;  // row_b < 0: no second row
    } pend{0, 0, 0, -1};
    int cur = 0;
    const auto add = [&](const ExpertArg& ex, int b) {
        for (int t = 0; t < pend.nt; ++t) {
            float* o = job.out + ex.idx[pend.s + t] * H;
            const float w = ex.w[pend.s + t];
            o[pend.row_a] += w * ya[b][t];
            if (pend.row_b >= 0) o[pend.row_b] += w * yb[b][t];
        }
    };
    for (int64_t e = 0; e < job.E; ++e) {
        const ExpertArg& ex = job.experts[e];
        if (tile4_for<F>(ex.T)) { down_expert_rows4<F>(job, e, h0, h1); continue; }  // (pend: added, nt 0)
        const int64_t I = ex.I, T = ex.T;
        const typename K::Hd* hb = static_cast<const typename K::Hd*>(job.hbuf) + job.hoff[e];
        const Mat m{ex.down, ex.down_scales, ex.ld, job.bn, job.bk};  // rows of ld columns, the first I computed
        for (int64_t i = 0; i < half; ++i) {
            const int64_t ha = job.down_split ? h0 + i : h0 + 2 * i;
            const int64_t hb_row = job.down_split ? ha + half : ha + 1;
            const bool pair = hb_row < h1;
            const auto ra = F::Row::of(m, ha);
            const auto rb = pair ? F::Row::of(m, hb_row) : ra;
            for (int64_t s = 0; s < T; s += K::NTMAX) {
                const int nt = static_cast<int>(std::min<int64_t>(K::NTMAX, T - s));
                for (int t = 0; t < nt; ++t) xs[t] = hb + (s + t) * I;
                dot2<F>(nt, ra, rb, I, xs, ya[cur], yb[cur], job.pf);
                add(ex, cur ^ 1);
                pend = {nt, s, ha, pair ? hb_row : -1};
                cur ^= 1;
            }
        }
        add(ex, cur ^ 1);
        pend.nt = 0;
    }
}

#include "cpu_experts_gguf_kernel.h"  // ReadGguf: GGUF experts, each matrix in its own block type

#include "cpu_experts_job.h"  // a thread's share of a layer's job: the two phases, chunk by chunk
