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
// tail; an FP8 row block by block, see dot2_tile in cpu_experts_dot2.h), and every output element is written by
// exactly one thread (see cpu_experts.cpp), so the results are bit-identical for any thread count and any scheduling.
//
// The body, in the order it is included in each namespace: each format's reader (here), the two-row tile
// (cpu_experts_dot2.h), the activation and the four-row tile (cpu_experts_tile4.h), the row loops of the two phases
// (here), GGUF experts' (cpu_experts_gguf_kernel.h), a thread's share of the job (cpu_experts_job.h).

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

#include "cpu_experts_dot2.h"  // dot2: two weight rows against a tile of up to K::NTMAX tokens

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
