// The CPU expert kernel body, written once and compiled once per instruction set.
//
// cpu_experts.cpp includes this file several times, each time inside its own namespace, under a
// `#pragma GCC target(...)` region, after defining a traits struct `K` in that namespace:
//
//   K::W            elements of a weight row consumed per vector step
//   K::Acc          fp32 accumulator vector;  K::zero(), K::add(a, b), K::hsum(a) -> float
//   K::load_w(p)    W bf16 weights at p -> whatever K::dot takes
//   K::X            activation element type (float, or uint16_t = bf16);  K::load_x(p), K::x2f(v)
//   K::dot(a, x, w) a + x * w over the W elements (fp32 FMA, or vdpbf16ps pairs)
//   K::Hd, K::h_from_f(float)   storage type of the intermediate silu(gate) * up activations
//   K::NTMAX        tokens per register tile;  K::unroll(nt) vector steps per loop iteration
//
// Numerics are fixed by the code, not by the thread that runs it: every dot product is summed in one
// order (U interleaved accumulators, combined in order, then a fixed horizontal sum, then the scalar
// tail), and every output element is written by exactly one thread (see cpu_experts.cpp), so the
// results are bit-identical for any thread count and any scheduling.

// Two weight rows (ra, rb) of length len against nt <= K::NTMAX activation rows xs[t]:
// oa[t] = <ra, xs[t]>, ob[t] = <rb, xs[t]>. Each weight vector is loaded once for all tokens.
template <int NT, int U>
static inline void dot2_tile(const uint16_t* __restrict ra, const uint16_t* __restrict rb, int64_t len,
                             const typename K::X* const* xs, float* oa, float* ob, int64_t pf) {
    constexpr int W = K::W;
    typename K::Acc aa[U][NT], ab[U][NT];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) {
            aa[u][t] = K::zero();
            ab[u][t] = K::zero();
        }
    }
    int64_t i = 0;
    for (; i + int64_t(W) * U <= len; i += int64_t(W) * U) {
        if (pf) {  // software prefetch `pf` elements ahead, one prefetch per 64-byte line and row
            constexpr int step_bytes = W * U * 2;
            if constexpr (step_bytes >= 64) {
#pragma GCC unroll 8
                for (int l = 0; l < step_bytes / 64; ++l) {
                    __builtin_prefetch(ra + i + pf + 32 * l, 0, 3);
                    __builtin_prefetch(rb + i + pf + 32 * l, 0, 3);
                }
            } else if (((i * 2) & 63) == 0) {
                __builtin_prefetch(ra + i + pf, 0, 3);
                __builtin_prefetch(rb + i + pf, 0, 3);
            }
        }
#pragma GCC unroll 16
        for (int u = 0; u < U; ++u) {
            const auto wa = K::load_w(ra + i + u * W);
            const auto wb = K::load_w(rb + i + u * W);
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                const auto xv = K::load_x(xs[t] + i + u * W);
                aa[u][t] = K::dot(aa[u][t], xv, wa);
                ab[u][t] = K::dot(ab[u][t], xv, wb);
            }
        }
    }
    for (; i + W <= len; i += W) {
        const auto wa = K::load_w(ra + i);
        const auto wb = K::load_w(rb + i);
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) {
            const auto xv = K::load_x(xs[t] + i);
            aa[0][t] = K::dot(aa[0][t], xv, wa);
            ab[0][t] = K::dot(ab[0][t], xv, wb);
        }
    }
    float sa[NT], sb[NT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
        typename K::Acc a = aa[0][t], b = ab[0][t];
#pragma GCC unroll 16
        for (int u = 1; u < U; ++u) {
            a = K::add(a, aa[u][t]);
            b = K::add(b, ab[u][t]);
        }
        sa[t] = K::hsum(a);
        sb[t] = K::hsum(b);
    }
    for (; i < len; ++i) {  // tail: len not a multiple of W
        const float wa = bf16_to_f32(ra[i]), wb = bf16_to_f32(rb[i]);
        for (int t = 0; t < NT; ++t) {
            const float xv = K::x2f(xs[t][i]);
            sa[t] += wa * xv;
            sb[t] += wb * xv;
        }
    }
    for (int t = 0; t < NT; ++t) {
        oa[t] = sa[t];
        ob[t] = sb[t];
    }
}

template <int NT>
static inline void dot2_nt(const uint16_t* ra, const uint16_t* rb, int64_t len, const typename K::X* const* xs,
                           float* oa, float* ob, int64_t pf) {
    dot2_tile<NT, K::unroll(NT)>(ra, rb, len, xs, oa, ob, pf);
}

static void dot2(int nt, const uint16_t* ra, const uint16_t* rb, int64_t len, const typename K::X* const* xs,
                 float* oa, float* ob, int64_t pf) {
    static_assert(K::NTMAX >= 1 && K::NTMAX <= 8, "tile of 1..8 tokens");
    switch (nt) {
        case 1: dot2_nt<1>(ra, rb, len, xs, oa, ob, pf); break;
        case 2: if constexpr (K::NTMAX >= 2) dot2_nt<2>(ra, rb, len, xs, oa, ob, pf); break;
        case 3: if constexpr (K::NTMAX >= 3) dot2_nt<3>(ra, rb, len, xs, oa, ob, pf); break;
        case 4: if constexpr (K::NTMAX >= 4) dot2_nt<4>(ra, rb, len, xs, oa, ob, pf); break;
        case 5: if constexpr (K::NTMAX >= 5) dot2_nt<5>(ra, rb, len, xs, oa, ob, pf); break;
        case 6: if constexpr (K::NTMAX >= 6) dot2_nt<6>(ra, rb, len, xs, oa, ob, pf); break;
        case 7: if constexpr (K::NTMAX >= 7) dot2_nt<7>(ra, rb, len, xs, oa, ob, pf); break;
        case 8: if constexpr (K::NTMAX >= 8) dot2_nt<8>(ra, rb, len, xs, oa, ob, pf); break;
        default: break;
    }
}

static inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

// Phase 1 on expert e, intermediate rows [j0, j1): h[t, j] = silu(<gate_j, x_t>) * <up_j, x_t>.
static void gate_up_rows(const Job& job, int64_t e, int64_t j0, int64_t j1) {
    const ExpertArg& ex = job.experts[e];
    const int64_t H = job.H, I = ex.I, T = ex.T;
    const typename K::X* xbase = static_cast<const typename K::X*>(job.xact);
    typename K::Hd* hb = static_cast<typename K::Hd*>(job.hbuf) + job.hoff[e];
    const typename K::X* xs[K::NTMAX];
    float g[K::NTMAX], u[K::NTMAX];
    for (int64_t j = j0; j < j1; ++j) {
        const uint16_t* ra = ex.gate_up + j * H;
        const uint16_t* rb = ex.gate_up + (ex.ld + j) * H;  // up rows start at ld (I < ld: a split expert)
        for (int64_t s = 0; s < T; s += K::NTMAX) {
            const int nt = static_cast<int>(std::min<int64_t>(K::NTMAX, T - s));
            for (int t = 0; t < nt; ++t) xs[t] = xbase + ex.idx[s + t] * H;
            dot2(nt, ra, rb, H, xs, g, u, job.pf);
            for (int t = 0; t < nt; ++t) hb[(s + t) * I + j] = K::h_from_f(silu_mul(g[t], u[t]));
        }
    }
}

// Phase 2, output rows [h0, h1) of every expert in ascending order: out[tok, h] += w * <down_h, h_tok>.
// Two rows at a time: adjacent ones, or with `down_split` one from each half of the range (two streams a
// thread, in different pages). Either way each row's dot product is summed alone, in the same order.
static void down_rows(const Job& job, int64_t h0, int64_t h1) {
    const int64_t H = job.H, n = h1 - h0, half = (n + 1) / 2;
    const typename K::Hd* xs[K::NTMAX];
    float ya[K::NTMAX], yb[K::NTMAX];
    for (int64_t e = 0; e < job.E; ++e) {
        const ExpertArg& ex = job.experts[e];
        const int64_t I = ex.I, T = ex.T;
        const typename K::Hd* hb = static_cast<const typename K::Hd*>(job.hbuf) + job.hoff[e];
        for (int64_t i = 0; i < half; ++i) {
            const int64_t ha = job.down_split ? h0 + i : h0 + 2 * i;
            const int64_t hb_row = job.down_split ? ha + half : ha + 1;
            const bool pair = hb_row < h1;
            const uint16_t* ra = ex.down + ha * ex.ld;  // the first I of the row's ld columns
            const uint16_t* rb = pair ? ex.down + hb_row * ex.ld : ra;
            for (int64_t s = 0; s < T; s += K::NTMAX) {
                const int nt = static_cast<int>(std::min<int64_t>(K::NTMAX, T - s));
                for (int t = 0; t < nt; ++t) xs[t] = hb + (s + t) * I;
                dot2(nt, ra, rb, I, xs, ya, yb, job.pf);
                for (int t = 0; t < nt; ++t) {
                    float* o = job.out + ex.idx[s + t] * H;
                    const float w = ex.w[s + t];
                    o[ha] += w * ya[t];
                    if (pair) o[hb_row] += w * yb[t];
                }
            }
        }
    }
}

// Read phase-2 chunk c's down rows once (every expert's [h0, h1) x I), so that computing it later hits this
// core's L2: what a thread does with its wait for the last phase-1 chunks instead of spinning.
static void read_ahead_down(const Job& job, int64_t c) {
    const int64_t h0 = c * job.down_rows, h1 = std::min(job.H, h0 + job.down_rows);
    for (int64_t e = 0; e < job.E; ++e) {
        const ExpertArg& ex = job.experts[e];
        for (int64_t h = h0; h < h1; ++h) {
            const volatile uint8_t* row = reinterpret_cast<const volatile uint8_t*>(ex.down + h * ex.ld);
            for (int64_t b = 0; b < 2 * ex.I; b += 64) (void)row[b];  // one load a 64-byte line (volatile: kept)
        }
    }
}

static void down_chunk(Job& job, int64_t c) {
    const int64_t h0 = c * job.down_rows;
    down_rows(job, h0, std::min(job.H, h0 + job.down_rows));
    job.done2.fetch_add(1, std::memory_order_acq_rel);
}

// One thread's share of a layer: gate/up chunks; once every gate/up chunk is finished, down chunks.
// The warm rows' pieces go to the thread that read them ahead (strata_cpu_warm), the rest is taken
// dynamically; tid 0 (the caller) returns only when every down chunk is finished. A thread that finds no
// gate/up chunk left claims up to `claim_max` down chunks and reads their weights while the others finish
// phase 1, then computes them first: the same writer per element, so the same sums.
static void run_job(void* ctx, int tid) {
    Job& job = *static_cast<Job*>(ctx);
    int64_t* tr = job.trace ? job.trace + kTraceRow * tid : nullptr;
    if (tr) tr[0] = mono_ns();
    const int64_t n1 = static_cast<int64_t>(job.chunks1.size()), n2 = job.n_down_chunks, ns = job.n_static;
    auto piece = [&](int64_t k) {  // static piece k, if nobody has taken it yet
        if (job.taken[k].exchange(1, std::memory_order_acq_rel) != 0) return;
        const Chunk& ch = job.chunks1[k];
        if (ch.r0 < ch.r1) {  // empty: its owner's read reached none of it (the dynamic chunks hold its rows)
            gate_up_rows(job, ch.e, ch.r0, ch.r1);
            if (k % job.P != tid) job.stolen.fetch_add(1, std::memory_order_relaxed);
        }
        job.done1.fetch_add(1, std::memory_order_acq_rel);
    };
    if (ns) job.arrived[tid].store(1, std::memory_order_release);
    for (int64_t k = tid; k < ns; k += job.P) piece(k);  // this thread's warm rows first: they are in its caches
    if (tr) tr[5] = mono_ns();
    for (;;) {
        const int64_t c = ns + job.next1.fetch_add(1, std::memory_order_relaxed);
        if (c >= n1) break;
        const Chunk& ch = job.chunks1[c];
        gate_up_rows(job, ch.e, ch.r0, ch.r1);
        job.done1.fetch_add(1, std::memory_order_acq_rel);
    }
    // pieces of threads that have not come (yet); not an arrived thread's: read from another core's L2 they cost
    // twice what they cost from RAM (`bench/cpu_kernel_trace.py --warm`, code 4d973f8), and their owner is on its
    // way to them
    for (int64_t k = 0; k < ns; ++k)
        if (!job.arrived[k % job.P].load(std::memory_order_acquire)) piece(k);
    if (tr) tr[1] = mono_ns();
    int64_t claimed[kMaxClaim];
    int64_t nc = 0;
    while (nc < job.claim_max && job.done1.load(std::memory_order_acquire) != n1) {
        const int64_t c = job.next2.fetch_add(1, std::memory_order_relaxed);
        if (c >= n2) break;
        claimed[nc++] = c;
        read_ahead_down(job, c);
    }
    spin_until([&] { return job.done1.load(std::memory_order_acquire) == n1; });
    if (tr) tr[2] = mono_ns(), tr[4] = nc;
    for (int64_t i = 0; i < nc; ++i) down_chunk(job, claimed[i]);
    for (;;) {
        const int64_t c = job.next2.fetch_add(1, std::memory_order_relaxed);
        if (c >= n2) break;
        down_chunk(job, c);
    }
    if (tr) tr[3] = mono_ns();
    if (tid == 0) spin_until([&] { return job.done2.load(std::memory_order_acquire) == n2; });
}
