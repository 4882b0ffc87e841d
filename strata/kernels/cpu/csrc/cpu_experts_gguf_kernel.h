// GGUF experts in the kernel body: cpu_experts_kernel.h includes this inside each instruction set's namespace, after
// its K and the other formats' row loops. K::Gguf decodes a step (cpu_experts_gguf.h); an instruction set whose K has
// none reads no GGUF experts (strata_cpu_experts_fmt refuses them), and these compile to nothing for it.
//
// Each matrix is read in its own type (the blob's header: gate, up, down), two rows a pass (gate and up of one type,
// two down rows) against a tile of up to kGgufTile tokens; the activations come permuted for the type's layout with
// their sub-block sums (g_gguf, cpu_experts_gguf_layout.h: x once a call, an expert's intermediate once its last
// gate/up rows are done).

struct ReadGguf {};  // run_job_fmt's tag for GGUF experts

// Tokens a row is read for at once (more: the row again, from the caches). A step's codes and scales are decoded once
// for the tile, which is most of a K-quant step's work at one token (cpu_experts_gguf.h), so a prompt's experts of 3
// or 4 tokens take one pass instead of two; at 4 a pass holds 8 accumulators, two rows' scales and codes (~26 zmm).
constexpr int kGgufTile = 4;

// out_r[t] = <row r, x_t> over the first len values of R (1 or 2) rows of type T, t < NT: one pass for both rows, each
// chain's activations loaded once for them. Every step, per row and token: each chain's products summed (its vectors in
// order) and added times its lanes' scales into accumulator c % U (U = 2 at one token: independent FMA chains), the
// step's -c times its sums into accumulator 0; then the accumulators in order, the fixed horizontal sum, and the values
// past the last whole step one by one (a split expert's down rows). A row's sums do not depend on the other row.
template <class KK, class T, int NT, int R, class XT>
__attribute__((always_inline)) static inline void gguf_dot(const uint8_t* const* rows, int64_t len, const XT* const* xs, const float* const* sums,
                            float* const* out, int64_t pf) {
    using Acc = typename KK::Acc;
    using G = typename KK::Gguf;
    constexpr int U = NT == 1 ? 2 : 1;
    Acc tot[R][NT][U];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) tot[r][t][u] = KK::zero();
    typename G::Scales sc[R];
    const int64_t steps = len / T::kStep;
    for (int64_t st = 0; st < steps; ++st) {
        const uint8_t* blk[R];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
            blk[r] = rows[r] + st * T::kBytes;
            if (pf) {
#pragma GCC unroll 4
                for (int o = 0; o < T::kBytes; o += 64) __builtin_prefetch(blk[r] + pf + o, 0, 3);
            }
            G::scales(T{}, blk[r], sc[r]);
        }
#pragma GCC unroll 4
        for (int c = 0; c < T::kChains; ++c) {
            decltype(KK::load_x(xs[0])) w[R][T::kVpc];
#pragma GCC unroll 2
            for (int r = 0; r < R; ++r) G::codes(T{}, blk[r], c, w[r]);
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) {
                const XT* x = xs[t] + st * T::kStep + 32 * c * T::kVpc;
                Acc a[R];
                const auto x0 = KK::load_x(x);
#pragma GCC unroll 2
                for (int r = 0; r < R; ++r) a[r] = KK::dot(KK::zero(), x0, w[r][0]);
#pragma GCC unroll 4
                for (int v = 1; v < T::kVpc; ++v) {
                    const auto xv = KK::load_x(x + 32 * v);
#pragma GCC unroll 2
                    for (int r = 0; r < R; ++r) a[r] = KK::dot(a[r], xv, w[r][v]);
                }
#pragma GCC unroll 2
                for (int r = 0; r < R; ++r) tot[r][t][c % U] = KK::fmav(a[r], sc[r].s[c], tot[r][t][c % U]);
            }
        }
        if constexpr (T::kMin) {
#pragma GCC unroll 4
            for (int t = 0; t < NT; ++t) {
                const auto xsum = G::load_sums(sums[t] + 16 * st);
#pragma GCC unroll 2
                for (int r = 0; r < R; ++r) tot[r][t][0] = KK::fmav(sc[r].c, xsum, tot[r][t][0]);
            }
        }
    }
    const GgufBlock bt = gguf_block(T::kId);
    float w[256];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
            Acc a = tot[r][t][0];
#pragma GCC unroll 4
            for (int u = 1; u < U; ++u) a = KK::add(a, tot[r][t][u]);
            out[r][t] = KK::hsum(a);
        }
        for (int64_t e0 = steps * T::kStep; e0 < len; e0 += bt.values) {  // in order, in fp32, after the vector sum
            gguf_block_values(T::kId, rows[r] + e0 / bt.values * bt.bytes, w);
            const int64_t n = std::min<int64_t>(bt.values, len - e0);
            for (int t = 0; t < NT; ++t) {
                float s = 0.0f;
                for (int64_t i = 0; i < n; ++i) s += w[i] * KK::x2f(xs[t][e0 + i]);
                out[r][t] += s;
            }
        }
    }
}

template <class KK, class T, int R, class XT>
__attribute__((always_inline)) static inline void gguf_dot_n(int nt, const uint8_t* const* rows, int64_t len, const XT* const* xs,
                              const float* const* sums, float* const* out, int64_t pf) {
    static_assert(kGgufTile == 4, "a case per tile width");
    switch (nt) {
        case 1: gguf_dot<KK, T, 1, R>(rows, len, xs, sums, out, pf); break;
        case 2: gguf_dot<KK, T, 2, R>(rows, len, xs, sums, out, pf); break;
        case 3: gguf_dot<KK, T, 3, R>(rows, len, xs, sums, out, pf); break;
        default: gguf_dot<KK, T, 4, R>(rows, len, xs, sums, out, pf); break;
    }
}

// R rows of GGUF type `type` (one gguf_readable accepted), against the same activations.
template <class KK, int R, class XT>
static void gguf_dot_any(int type, int nt, const uint8_t* const* rows, int64_t len, const XT* const* xs,
                         const float* const* sums, float* const* out, int64_t pf) {
    switch (type) {
        case GG_Q4_K: gguf_dot_n<KK, TQ4K, R>(nt, rows, len, xs, sums, out, pf); break;
        case GG_Q2_K: gguf_dot_n<KK, TQ2K, R>(nt, rows, len, xs, sums, out, pf); break;
        case GG_Q6_K: gguf_dot_n<KK, TQ6K, R>(nt, rows, len, xs, sums, out, pf); break;
        case GG_Q8_0: gguf_dot_n<KK, TQ80, R>(nt, rows, len, xs, sums, out, pf); break;
        case GG_Q5_K: gguf_dot_n<KK, TQ5K, R>(nt, rows, len, xs, sums, out, pf); break;
        case GG_IQ4_XS: gguf_dot_n<KK, TIQ4, R>(nt, rows, len, xs, sums, out, pf); break;
        case GG_Q3_K: gguf_dot_n<KK, TQ3K, R>(nt, rows, len, xs, sums, out, pf); break;
        default: break;
    }
}

// Where row r of expert ex's gate_up [2 ld, H] starts: gate's section holds rows [0, ld) of rbg bytes, up's (Job::bn
// bytes in) rows [ld, 2 ld) of rbu bytes. (An interleaved form's gate row 2j may lie in up's section, and so be in up's
// type.)
static inline const uint8_t* gguf_gate_up_row(const Job& job, const ExpertArg& ex, int64_t r, int64_t rbg,
                                              int64_t rbu) {
    return r < ex.ld ? ex.gate_up + r * rbg : ex.gate_up + job.bn + (r - ex.ld) * rbu;
}

// gate_up_rows' work on expert e's rows [j0, j1) when gate and up have one type T: both rows in one pass, the type
// dispatched once a chunk.
template <class KK, class T>
static void gguf_gate_up_pass(const Job& job, int64_t e, int64_t j0, int64_t j1) {
    using X = typename KK::X;
    const ExpertArg& ex = job.experts[e];
    const int64_t H = job.H, I = ex.I, ns = gguf_sums_len(H), rb = gguf_row_bytes(T::kId, H);
    const X* x = reinterpret_cast<const X*>(g_gguf.x[T::kLayout].data());
    const float* sums = g_gguf.xs[T::kLayout].data();
    typename KK::Hd* hb = static_cast<typename KK::Hd*>(job.hbuf) + job.hoff[e];
    const X* xs[kGgufTile];
    const float* ss[kGgufTile];
    float g[2][kGgufTile], u[2][kGgufTile];
    float* outs[2][2] = {{g[0], u[0]}, {g[1], u[1]}};
    // a tile's silu after the next tile's dot products are issued (gate_up_rows says why)
    int cur = 0, pend_nt = 0;
    int64_t pend_s = 0, pend_j = 0;
    const auto write = [&](int b) {
        activate(job, ex, pend_j, pend_nt, g[b], u[b], [&](int t, auto h) { hb[(pend_s + t) * I + pend_j] = h; });
    };
    for (int64_t j = j0; j < j1; ++j) {
        const uint8_t* rows[2] = {gguf_gate_up_row(job, ex, job.act.gate_row(j), rb, rb),
                                  gguf_gate_up_row(job, ex, job.act.up_row(j, ex.ld), rb, rb)};
        for (int64_t s = 0; s < ex.T; s += kGgufTile) {
            const int nt = static_cast<int>(std::min<int64_t>(kGgufTile, ex.T - s));
            for (int t = 0; t < nt; ++t) xs[t] = x + ex.idx[s + t] * H, ss[t] = sums + ex.idx[s + t] * ns;
            gguf_dot_n<KK, T, 2>(nt, rows, H, xs, ss, outs[cur], job.pf);
            write(cur ^ 1);
            pend_nt = nt, pend_s = s, pend_j = j;
            cur ^= 1;
        }
    }
    write(cur ^ 1);
}

// down_rows' work and pairing on output rows [h0, h1) of expert e, its down matrix of type T.
template <class KK, class T>
static void gguf_down_pass(const Job& job, int64_t e, int64_t h0, int64_t h1) {
    using X = typename KK::Hd;
    const ExpertArg& ex = job.experts[e];
    const int64_t H = job.H, I = ex.I, n = h1 - h0, half = (n + 1) / 2, ns = gguf_sums_len(I);
    const int64_t rb = gguf_row_bytes(T::kId, ex.ld);
    const X* hp = reinterpret_cast<const X*>(g_gguf.h.data()) + job.hoff[e];
    const float* hs = g_gguf.hs.data() + g_gguf.hs_off[e];
    const X* xs[kGgufTile];
    const float* ss[kGgufTile];
    float ya[2][kGgufTile], yb[2][kGgufTile];
    float* outs[2][2] = {{ya[0], yb[0]}, {ya[1], yb[1]}};
    // a tile's results added after the next tile's dot products are issued (down_rows says why)
    int cur = 0, pend_nt = 0;
    int64_t pend_s = 0, pend_a = 0, pend_b = -1;  // pend_b < 0: no second row
    const auto add = [&](int b) {
        for (int t = 0; t < pend_nt; ++t) {
            float* o = job.out + ex.idx[pend_s + t] * H;
            const float w = ex.w[pend_s + t];
            o[pend_a] += w * ya[b][t];
            if (pend_b >= 0) o[pend_b] += w * yb[b][t];
        }
    };
    for (int64_t i = 0; i < half; ++i) {
        const int64_t ha = job.down_split ? h0 + i : h0 + 2 * i;
        const int64_t hb_row = job.down_split ? ha + half : ha + 1;
        const bool pair = hb_row < h1;
        const uint8_t* rows[2] = {ex.down + ha * rb, ex.down + (pair ? hb_row : ha) * rb};
        for (int64_t s = 0; s < ex.T; s += kGgufTile) {
            const int nt = static_cast<int>(std::min<int64_t>(kGgufTile, ex.T - s));
            for (int t = 0; t < nt; ++t) xs[t] = hp + (s + t) * I, ss[t] = hs + (s + t) * ns;
            gguf_dot_n<KK, T, 2>(nt, rows, I, xs, ss, outs[cur], job.pf);
            add(cur ^ 1);
            pend_nt = nt, pend_s = s, pend_a = ha, pend_b = pair ? hb_row : -1;
            cur ^= 1;
        }
    }
    add(cur ^ 1);
}

// A pass (gguf_gate_up_pass or gguf_down_pass) of the type `type` names.
template <class KK, bool GateUp>
static void gguf_pass(int type, const Job& job, int64_t e, int64_t r0, int64_t r1) {
#define GGUF_PASS_OF_TYPE(T) return GateUp ? gguf_gate_up_pass<KK, T>(job, e, r0, r1) : gguf_down_pass<KK, T>(job, e, r0, r1)
    switch (type) {
        case GG_Q4_K: GGUF_PASS_OF_TYPE(TQ4K);
        case GG_Q2_K: GGUF_PASS_OF_TYPE(TQ2K);
        case GG_Q6_K: GGUF_PASS_OF_TYPE(TQ6K);
        case GG_Q8_0: GGUF_PASS_OF_TYPE(TQ80);
        case GG_Q5_K: GGUF_PASS_OF_TYPE(TQ5K);
        case GG_IQ4_XS: GGUF_PASS_OF_TYPE(TIQ4);
        case GG_Q3_K: GGUF_PASS_OF_TYPE(TQ3K);
        default: return;
    }
#undef GGUF_PASS_OF_TYPE
}

// Phase 1 on expert e, intermediate rows [j0, j1) (gate_up_rows' work): gate row j in its type, up row j (at the
// section's middle, Job::bn bytes in) in its own (an interleaved form: gate_up rows 2j and 2j + 1, each in the type of
// the section it lies in). The thread finishing the expert's last rows prepares its intermediate for the down rows.
template <class KK>
static void gguf_gate_up_rows(const Job& job, int64_t e, int64_t j0, int64_t j1) {
    if constexpr (has_gguf<KK>::value) {
        using X = typename KK::X;
        const ExpertArg& ex = job.experts[e];
        const int tg = gguf_type(ex.gate_up_scales, 0), tu = gguf_type(ex.gate_up_scales, 1);
        if (tg == tu) {
            gguf_pass<KK, true>(tg, job, e, j0, j1);
        } else {  // a row of each type at a time, each dispatched on its own: the type of the section it lies in
            const int64_t H = job.H, I = ex.I, T = ex.T, ns = gguf_sums_len(H);
            const int64_t rbg = gguf_row_bytes(tg, H), rbu = gguf_row_bytes(tu, H);
            typename KK::Hd* hb = static_cast<typename KK::Hd*>(job.hbuf) + job.hoff[e];
            const X *pg[kGgufTile], *pu[kGgufTile];
            const float *sg[kGgufTile], *su[kGgufTile];
            float g[kGgufTile], u[kGgufTile];
            float* og[1] = {g};
            float* ou[1] = {u};
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t rg = job.act.gate_row(j), ru = job.act.up_row(j, ex.ld);
                const int ty_g = rg < ex.ld ? tg : tu, ty_u = ru < ex.ld ? tg : tu;
                const int lg = gguf_layout_of(ty_g), lu = gguf_layout_of(ty_u);
                const X* xg = reinterpret_cast<const X*>(g_gguf.x[lg].data());
                const X* xu = reinterpret_cast<const X*>(g_gguf.x[lu].data());
                const uint8_t* rows[2] = {gguf_gate_up_row(job, ex, rg, rbg, rbu),
                                          gguf_gate_up_row(job, ex, ru, rbg, rbu)};
                for (int64_t s = 0; s < T; s += kGgufTile) {
                    const int nt = static_cast<int>(std::min<int64_t>(kGgufTile, T - s));
                    for (int t = 0; t < nt; ++t) {
                        const int64_t n = ex.idx[s + t];
                        pg[t] = xg + n * H, pu[t] = xu + n * H;
                        sg[t] = g_gguf.xs[lg].data() + n * ns, su[t] = g_gguf.xs[lu].data() + n * ns;
                    }
                    gguf_dot_any<KK, 1>(ty_g, nt, rows, H, pg, sg, og, job.pf);
                    gguf_dot_any<KK, 1>(ty_u, nt, rows + 1, H, pu, su, ou, job.pf);
                    activate(job, ex, j, nt, g, u, [&](int t, auto h) { hb[(s + t) * I + j] = h; });
                }
            }
        }
        if (g_gguf.rows_left[e].fetch_sub(j1 - j0, std::memory_order_acq_rel) == j1 - j0)
            gguf_prepare_down<typename KK::Hd>(job, e);
    }
}

// Phase 2, output rows [h0, h1) of every expert (down_rows' work), each down matrix in its type.
template <class KK>
static void gguf_down_rows(const Job& job, int64_t h0, int64_t h1) {
    if constexpr (has_gguf<KK>::value) {
        for (int64_t e = 0; e < job.E; ++e) gguf_pass<KK, false>(gguf_down_type(job.experts[e]), job, e, h0, h1);
    }
}
