// Four weight rows against a tile of K::NT4 tokens, for experts with many tokens (a prompt's layer call): 4 x NT4
// accumulators (24 zmm on the AVX-512 sets) take 4 weight and NT4 activation loads a vector step for 4 * NT4 dot
// steps, where the two-row tile (dot2) takes 2 + NTMAX for 2 * NTMAX. Part of the kernel body: included by
// cpu_experts_kernel.h inside each instruction set's namespace, after dot2 (cpu_experts_dot2.h) and activate.
//
// Numerics: an expert with at least NT4 tokens is tiled NT4 tokens at a time (its last tile the remainder) whether
// its rows go four or two at a time; dot4_tile sums a row exactly as dot2_tile<F, NT, 1> does, which is dot2's
// order for NT4 tokens, and the last partial tile goes through dot2 in both cases (fewer tokens: dot4_small). A
// row's sums depend on the expert's token count only, not on how a chunk's rows fall into groups of four (which
// depends on the thread count).
//
// Reads: a group's rows are used by every token tile of the expert; its first tile reads the next group's rows into
// L2 (one line a row a vector step, at the place it reads in its own rows), so the next group's first tile finds
// them there instead of waiting on RAM. This runs whatever the distance prefetch along a row (job.pf, the two-row
// tile's, 0 on AMD CPUs): a row is one 4 KiB page, where a hardware prefetcher stops, so a group's rows each begin
// with a RAM latency unless read ahead. At 32 tokens an expert this took ~13% off a layer call against prefetching
// along the rows; on a Zen 4 without the distance prefetch, 27-31% off at 4-8 tokens an expert.

// An expert's rows go through the four-row tile from 4 tokens (128 experts of the bench model's shape, two Zen 4
// cores: with 6 tokens each ~25% less time a layer call than the two-row tile; 4 and 5 are memory-bound, a few
// percent). Fewer tokens (decode's 1, a short prompt's 2 or 3): the two-row tile, as the formats without a four-row
// tile.
constexpr int64_t kTile4MinTokens = 4;
static_assert(K::NT4 == 0 || K::unroll(K::NT4) == 1, "dot2 sums NT4 tokens unrolled once, as dot4_tile does");
static_assert(K::NT4 == 0 || K::NT4 == 6, "dot4_small: experts of 4 or 5 tokens");

// Whether rows of format F have the four-row tile: sets with NT4 registers to spare, rows summed as one span
// (bf16; MXFP4 where it is read a group a step). FP8's blocks and avx512_bf16's 128-value MXFP4 steps keep dot2.
template <class F>
constexpr bool kHasTile4 = K::NT4 > 0 && !F::kBlocked && !(std::is_same_v<F, ReadMx> && K::kMxSteps);

template <class F>
static inline bool tile4_for(int64_t T) {
    if constexpr (kHasTile4<F>)
        return T >= kTile4MinTokens;
    else
        return false;
}

// o[k][t] = <r[k], xs[t]> for the four rows r[0..3] and NT tokens: one accumulator a row and token, whole W steps in
// order, the fixed horizontal sum, then the scalar tail in order (dot2_tile's order with U = 1).
template <class F, int NT>
static inline void dot4_tile(const typename F::Row* r, int64_t len, const typename K::X* const* xs,
                             float* const* o, const typename F::Row* ahead) {
    constexpr int W = K::W;
    constexpr int64_t step_bytes = int64_t(W) * F::kBits / 8;
    const typename F::Ctx ctx{};
    typename K::Acc acc[4][NT];
#pragma GCC unroll 16
    for (int k = 0; k < 4; ++k)
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) acc[k][t] = K::zero();
    int64_t i = 0;
    for (; i + W <= len; i += W) {
        if (ahead) {  // the next four rows into L2, a line of each as this tile passes the same place in its rows
            const int64_t at = i * F::kBits / 8;
            if (step_bytes >= 64 || (at & 63) == 0) {
#pragma GCC unroll 4
                for (int k = 0; k < 4; ++k)
#pragma GCC unroll 4
                    for (int64_t l = 0; l < std::max<int64_t>(1, step_bytes / 64); ++l)
                        __builtin_prefetch(F::bytes(ahead[k]) + at + 64 * l, 0, 2);
            }
        }
        decltype(F::load(ctx, r[0], i)) w[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) w[k] = F::load(ctx, r[k], i);
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) {
            const auto xv = K::load_x(xs[t] + i);
#pragma GCC unroll 4
            for (int k = 0; k < 4; ++k) acc[k][t] = K::dot(acc[k][t], xv, w[k]);
        }
    }
    float s[4][NT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) s[k][t] = K::hsum(acc[k][t]);
    for (; i < len; ++i) {  // tail: len not a multiple of W
        float wk[4];
        for (int k = 0; k < 4; ++k) wk[k] = F::scalar(r[k], i);
        for (int t = 0; t < NT; ++t) {
            const float xv = K::x2f(xs[t][i]);
            for (int k = 0; k < 4; ++k) s[k][t] += wk[k] * xv;
        }
    }
    for (int k = 0; k < 4; ++k)
        for (int t = 0; t < NT; ++t) o[k][t] = s[k][t];
}

// An expert with kTile4MinTokens <= T < NT4 tokens: one tile of all of them, every row summed unrolled once (four
// rows through dot4_tile, a chunk's leftover pair through dot2_tile<F, T, 1>), so again the same sums either way.
template <class F>
static void dot4_small(int nt, const typename F::Row* r, int64_t len, const typename K::X* const* xs,
                       float* const* o, const typename F::Row* ahead) {
    if constexpr (kHasTile4<F>) {
        if (nt == 4)
            dot4_tile<F, 4>(r, len, xs, o, ahead);
        else
            dot4_tile<F, 5>(r, len, xs, o, ahead);
    }
}
template <class F>
static void dot2_small(int nt, const typename F::Row& ra, const typename F::Row& rb, int64_t len,
                       const typename K::X* const* xs, float* oa, float* ob, int64_t pf) {
    if constexpr (kHasTile4<F>) {
        if (nt == 4)
            dot2_tile<F, 4, 1>(ra, rb, len, xs, oa, ob, pf);
        else
            dot2_tile<F, 5, 1>(ra, rb, len, xs, oa, ob, pf);
    }
}

// gate_up_rows for an expert with tile4_for(T): rows j, j + 1 (gate and up each) four at a time, NT4 tokens a
// tile; a chunk's odd last row and the last partial token tile through dot2 (the same sums, see above).
template <class F>
static void gate_up_rows4(const Job& job, int64_t e, int64_t j0, int64_t j1) {
    constexpr int NT = K::NT4;
    const ExpertArg& ex = job.experts[e];
    const int64_t H = job.H, I = ex.I, T = ex.T;
    const typename K::X* xbase = static_cast<const typename K::X*>(job.xact);
    typename K::Hd* hb = static_cast<typename K::Hd*>(job.hbuf) + job.hoff[e];
    const typename K::X* xs[NT];
    float y[2][4][NT];  // [buffer][gate j, up j, gate j + 1, up j + 1][token]
    const Mat m{ex.gate_up, ex.gate_up_scales, H, job.bn, job.bk};
    // silu after the next tile's dot products are issued, as gate_up_rows
    int cur = 0, pend_nt = 0, pend_nj = 0;
    int64_t pend_s = 0, pend_j = 0;
    const auto write = [&](int b) {
        for (int q = 0; q < pend_nj; ++q) {
            const int64_t at = F::x_position(pend_j + q, I);
            activate(job, ex, pend_j + q, pend_nt, y[b][2 * q], y[b][2 * q + 1],
                     [&](int t, auto h) { hb[(pend_s + t) * I + at] = h; });
        }
    };
    const SwiGLU& f = job.act;  // which gate_up rows hold intermediate row j's gate and up
    const auto gate = [&](int64_t j) { return F::Row::of(m, f.gate_row(j)); };
    const auto up = [&](int64_t j) { return F::Row::of(m, f.up_row(j, ex.ld)); };
    for (int64_t j = j0; j < j1; j += 2) {
        const int nj = j + 1 < j1 ? 2 : 1;
        const typename F::Row r[4] = {gate(j), up(j), gate(j + nj - 1), up(j + nj - 1)};
        // the next group's four rows, read into L2 during this group's first tile
        const bool next = j + 3 < j1;
        typename F::Row ahead[4];
        if (next) ahead[0] = gate(j + 2), ahead[1] = up(j + 2), ahead[2] = gate(j + 3), ahead[3] = up(j + 3);
        for (int64_t s = 0; s < T; s += NT) {
            const int nt = static_cast<int>(std::min<int64_t>(NT, T - s));
            for (int t = 0; t < nt; ++t) xs[t] = xbase + ex.idx[s + t] * H;
            float* const o[4] = {y[cur][0], y[cur][1], y[cur][2], y[cur][3]};
            if (nj == 2 && nt == NT)
                dot4_tile<F, NT>(r, H, xs, o, next && s == 0 ? ahead : nullptr);
            else if (T < NT && nj == 2)
                dot4_small<F>(nt, r, H, xs, o, next ? ahead : nullptr);
            else if (T < NT)
                dot2_small<F>(nt, r[0], r[1], H, xs, o[0], o[1], job.pf);
            else
                for (int q = 0; q < nj; ++q) dot2<F>(nt, r[2 * q], r[2 * q + 1], H, xs, o[2 * q], o[2 * q + 1], job.pf);
            write(cur ^ 1);
            pend_nt = nt, pend_nj = nj, pend_s = s, pend_j = j;
            cur ^= 1;
        }
    }
    write(cur ^ 1);
}

// down_rows' work on one expert with tile4_for(T), output rows [h0, h1): its row pairs (adjacent rows, or with
// down_split i and i + half) two at a time through dot4_tile, NT4 tokens a tile; an unpaired pair or row and the
// last partial token tile through dot2. Results are added into out as down_rows adds them (each element once).
template <class F>
static void down_expert_rows4(const Job& job, int64_t e, int64_t h0, int64_t h1) {
    constexpr int NT = K::NT4;
    const ExpertArg& ex = job.experts[e];
    const int64_t H = job.H, I = ex.I, T = ex.T, n = h1 - h0, half = (n + 1) / 2;
    const typename K::Hd* hb = static_cast<const typename K::Hd*>(job.hbuf) + job.hoff[e];
    const Mat m{ex.down, ex.down_scales, ex.ld, job.bn, job.bk};
    const typename K::Hd* xs[NT];
    float y[2][4][NT];  // [buffer][row][token]
    int cur = 0, pend_nt = 0;
    int64_t pend_s = 0, pend_row[4] = {-1, -1, -1, -1};  // < 0: no row
    const auto add = [&](int b) {
        for (int t = 0; t < pend_nt; ++t) {
            float* o = job.out + ex.idx[pend_s + t] * H;
            const float w = ex.w[pend_s + t];
            for (int k = 0; k < 4; ++k)
                if (pend_row[k] >= 0) o[pend_row[k]] += w * y[b][k][t];
        }
    };
    const auto row_a = [&](int64_t i) { return job.down_split ? h0 + i : h0 + 2 * i; };
    const auto row_b = [&](int64_t i) {  // -1: pair i has no second row
        const int64_t rb = job.down_split ? h0 + i + half : h0 + 2 * i + 1;
        return rb < h1 ? rb : -1;
    };
    for (int64_t i = 0; i < half; i += 2) {
        const bool second = i + 1 < half;  // pair i + 1
        const int64_t rows[4] = {row_a(i), row_b(i), second ? row_a(i + 1) : -1, second ? row_b(i + 1) : -1};
        const bool four = rows[1] >= 0 && rows[2] >= 0 && rows[3] >= 0;
        typename F::Row r[4], ahead[4];
        for (int k = 0; k < 4; ++k) r[k] = F::Row::of(m, rows[k] >= 0 ? rows[k] : rows[0]);  // (missing: unused copies)
        // the next group's four rows (where it has four), read into L2 during this group's first tile
        const bool next = i + 3 < half && row_b(i + 3) >= 0;
        if (next) ahead[0] = F::Row::of(m, row_a(i + 2)), ahead[1] = F::Row::of(m, row_b(i + 2)),
                  ahead[2] = F::Row::of(m, row_a(i + 3)), ahead[3] = F::Row::of(m, row_b(i + 3));
        for (int64_t s = 0; s < T; s += NT) {
            const int nt = static_cast<int>(std::min<int64_t>(NT, T - s));
            for (int t = 0; t < nt; ++t) xs[t] = hb + (s + t) * I;
            float* const o[4] = {y[cur][0], y[cur][1], y[cur][2], y[cur][3]};
            if (four && nt == NT)
                dot4_tile<F, NT>(r, I, xs, o, next && s == 0 ? ahead : nullptr);
            else if (T < NT && four)
                dot4_small<F>(nt, r, I, xs, o, next ? ahead : nullptr);
            else
                for (int q = 0; q < 2; ++q)
                    if (rows[2 * q] >= 0)
                        (T < NT ? dot2_small<F> : dot2<F>)(nt, r[2 * q], r[2 * q + 1], I, xs, o[2 * q], o[2 * q + 1],
                                                           job.pf);
            add(cur ^ 1);
            pend_nt = nt, pend_s = s;
            for (int k = 0; k < 4; ++k) pend_row[k] = rows[k];
            cur ^= 1;
        }
    }
    add(cur ^ 1);
}
