// The kernel body's two-row tile: two weight rows of one format against up to K::NTMAX tokens' activations (dot2),
// the dot products of the row loops (gate/up: a gate row and an up row; down: two output rows) and of the four-row
// tile's partial last tile (cpu_experts_tile4.h). Their summation order is the kernel's numerics (cpu_experts_kernel.h
// says what it guarantees): dot2_tile for every format, dot2_mx_steps for MXFP4 rows where K reads 128 values a step.
//
// Part of the kernel body: included by cpu_experts_kernel.h inside each instruction set's namespace, after K's readers
// of each format (ReadBf16, ReadFp8, ReadMx), before activate and the row loops.

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
