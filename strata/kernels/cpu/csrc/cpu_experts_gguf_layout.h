// GGUF activation layouts and the call's activations in them (cpu_experts_gguf.h says what a step, a chain and the
// sums are): for each layout (GL_*, a type's step order) where a step keeps each activation and which sub-block each
// lane sums (GgufLayout, built once at load: g_gguf_layouts); a row of activations permuted into a layout with its
// sub-block sums (gguf_prepare_row); the call in progress (g_gguf): x in every layout its gate and up matrices use
// (gguf_begin), each expert's intermediate in its down matrix's (gguf_prepare_down).
//
// Included by cpu_experts_gguf.h, after the block types and before the decoders (which read the layouts).
#pragma once

namespace {

// Q2_K: the words of sub-block s hold 128 + q << 2j for its 2-bit field j = (s >> 1) & 3 < 3 (128 + q for j = 3), so
// its activations are stored times 4^-j (kGgufQ2Inv[s]) and the offset it subtracts is 128 * 4^-j (kGgufQ2Offset[s]).
constexpr float kGgufQ2Inv[16] = {1.0f, 1.0f, 0.25f, 0.25f, 0.0625f, 0.0625f, 1.0f, 1.0f,
                                  1.0f, 1.0f, 0.25f, 0.25f, 0.0625f, 0.0625f, 1.0f, 1.0f};
constexpr float kGgufQ2Offset[16] = {128.0f, 128.0f, 32.0f, 32.0f, 8.0f, 8.0f, 128.0f, 128.0f,
                                     128.0f, 128.0f, 32.0f, 32.0f, 8.0f, 8.0f, 128.0f, 128.0f};

// Where a layout's step keeps each activation, which sub-block each fp32 lane of each chain sums, and which
// sub-block each lane of the sums holds.
struct GgufLayout {
    int step = 0;
    int sub = 0;                  // values a sum covers (0: no sums)
    int16_t elem[256] = {};       // position p of a step's activations: element elem[p] (p = 32 * vector + word)
    float scale[8] = {1, 1, 1, 1, 1, 1, 1, 1};  // vector v's activations are stored times scale[v] (a power of two)
    alignas(64) int32_t chain_sb[4][16] = {};  // chain c, lane m: the sub-block (an index into the step's scales)
    int8_t sum_sb[16] = {};       // lane l of the sums: its sub-block (-1: zero)
    float sum_scale[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};  // ... times this (a power of two)
};

struct GgufLayouts {
    GgufLayout l[GL_COUNT];
    GgufLayouts() {
        GgufLayout& q4 = l[GL_Q4K];  // vector v: half v >> 2, words k = 0, 2, 1, 3: nibble k & 1 of byte 2i + (k >> 1)
        q4.step = 256, q4.sub = 32;
        for (int v = 0; v < 8; ++v)
            for (int i = 0; i < 32; ++i) {
                const int h = v >> 2, k = "\0\2\1\3"[v & 3], b = 2 * i + (k >> 1), nib = k & 1;
                q4.elem[32 * v + i] = int16_t(128 * h + 64 * (b >> 5) + 32 * nib + (b & 31));
            }
        for (int c = 0; c < 4; ++c)
            for (int m = 0; m < 16; ++m) q4.chain_sb[c][m] = 4 * (c >> 1) + 2 * (m >> 3) + (c & 1);
        for (int s = 0; s < 16; ++s) {  // against [d sc_s | dmin m_s]: -(128 d sc_s + dmin m_s) X_s
            q4.sum_sb[s] = int8_t(s & 7);
            q4.sum_scale[s] = s < 8 ? -128.0f : -1.0f;
        }

        GgufLayout& q2 = l[GL_Q2K];  // vector 2j + r: 2-bit field j of byte 2i + r
        q2.step = 256, q2.sub = 16;
        for (int v = 0; v < 8; ++v)
            for (int i = 0; i < 32; ++i) {
                const int j = v >> 1, b = 2 * i + (v & 1);
                q2.elem[32 * v + i] = int16_t(128 * (b >> 5) + 32 * j + (b & 31));
            }
        for (int c = 0; c < 4; ++c)
            for (int m = 0; m < 16; ++m) q2.chain_sb[c][m] = 8 * (m >> 3) + 2 * c + ((m >> 2) & 1);
        for (int s = 0; s < 16; ++s) q2.sum_sb[s] = int8_t(s);
        for (int v = 0; v < 8; ++v) q2.scale[v] = kGgufQ2Inv[2 * (v >> 1)];  // field j's words hold 128 + q << 2j

        GgufLayout& q6 = l[GL_Q6K];  // vector 4h + 2 nib + r: nibble nib of ql byte 64h + 2i + r
        q6.step = 256;
        for (int v = 0; v < 8; ++v)
            for (int i = 0; i < 32; ++i) {
                const int h = v >> 2, nib = (v >> 1) & 1, b = 2 * i + (v & 1);
                q6.elem[32 * v + i] = int16_t(128 * h + 64 * nib + b);
            }
        for (int c = 0; c < 4; ++c)
            for (int m = 0; m < 16; ++m) q6.chain_sb[c][m] = 8 * (c >> 1) + 4 * (c & 1) + (m >> 2);

        GgufLayout& q8 = l[GL_Q80];  // vector v: words 0-15 block 0's values 16v.., words 16-31 block 1's
        q8.step = 64;
        for (int v = 0; v < 2; ++v)
            for (int i = 0; i < 32; ++i) q8.elem[32 * v + i] = int16_t(32 * (i >> 4) + 16 * v + (i & 15));
        for (int m = 0; m < 16; ++m) q8.chain_sb[0][m] = m >> 3;

        GgufLayout& iq = l[GL_IQ4];  // vector 4h + k: nibble k of the words of half h (every lane one 32-value block)
        iq.step = 256;
        for (int v = 0; v < 8; ++v)
            for (int i = 0; i < 32; ++i) {
                const int h = v >> 2, k = v & 3, b = 2 * i + (k >> 1);
                iq.elem[32 * v + i] = int16_t(32 * (4 * h + (b >> 4)) + 16 * (k & 1) + (b & 15));
            }
        for (int c = 0; c < 2; ++c)
            for (int m = 0; m < 16; ++m) iq.chain_sb[c][m] = 4 * c + (m >> 2);

        GgufLayout& q3 = l[GL_Q3K];  // Q2_K's order; codes 128 + (q + 4) << 2j: minus (128 4^-j + 4) X_s a sub-block
        q3 = q2;
        for (int s = 0; s < 16; ++s) q3.sum_scale[s] = -(kGgufQ2Offset[s] + 4.0f);
    }
};
const GgufLayouts g_gguf_layouts;

inline float gg_x2f(uint16_t v) { return bf16_to_f32(v); }
inline float gg_x2f(float v) { return v; }
inline uint16_t gg_times(uint16_t v, float s) { return s == 1.0f ? v : f32_to_bf16(bf16_to_f32(v) * s); }  // exact
inline float gg_times(float v, float s) { return v * s; }

// A row of `len` activations in layout L: whole steps permuted (and their sums, 16 a step), the rest in order.
template <class X>
void gguf_prepare_row(const GgufLayout& L, const X* src, int64_t len, X* dst, float* sums) {
    const int64_t steps = len / L.step;
    for (int64_t st = 0; st < steps; ++st) {
        const X* s = src + st * L.step;
        X* d = dst + st * L.step;
        for (int p = 0; p < L.step; ++p) d[p] = gg_times(s[L.elem[p]], L.scale[p >> 5]);
        if (!L.sub) continue;
        for (int l = 0; l < 16; ++l) {
            float acc = 0.0f;
            if (L.sum_sb[l] >= 0)
                for (int i = 0; i < L.sub; ++i) acc += gg_x2f(s[L.sum_sb[l] * L.sub + i]);
            sums[st * 16 + l] = acc * L.sum_scale[l];
        }
    }
    for (int64_t e = steps * L.step; e < len; ++e) dst[e] = src[e];
}
inline int64_t gguf_sums_len(int64_t len) { return (len / 64 + 1) * 16; }  // sums a row of len values has room for

// The GGUF state of the call in progress (one at a time: g_call): the activations in each layout a gate or up matrix
// needs, each expert's intermediate in its down matrix's layout once its last gate/up rows are done.
struct GgufCall {
    int64_t N = 0, H = 0;
    std::vector<uint8_t> x[GL_COUNT];  // [N, H] activations (the kernel's X) in each layout used
    std::vector<float> xs[GL_COUNT];   // [N, gguf_sums_len(H)]
    std::vector<uint8_t> h;            // each expert's [T, I] intermediate at Job::hoff, in its down layout
    std::vector<float> hs;             // [T, gguf_sums_len(I)] an expert, from hs_off[e]
    std::vector<int64_t> hs_off;
    std::unique_ptr<std::atomic<int64_t>[]> rows_left;  // gate/up rows of an expert not computed yet
};
GgufCall g_gguf;

// Set up the call: the activations (xact, [N, H] of X) in every layout the experts' gate and up matrices use, and room
// for each expert's intermediate (htotal values of X) and its sums.
template <class X>
void gguf_begin(const Job& job, const X* xact, int64_t htotal) {
    GgufCall& g = g_gguf;
    g.N = job.N, g.H = job.H;
    bool used[GL_COUNT] = {};
    for (int64_t e = 0; e < job.E; ++e)
        for (int which = 0; which < 2; ++which)
            used[gguf_layout_of(gguf_type(job.experts[e].gate_up_scales, which))] = true;
    const int64_t ns = gguf_sums_len(job.H);
    for (int L = 0; L < GL_COUNT; ++L) {
        if (!used[L]) continue;
        if (g.x[L].size() < size_t(job.N * job.H) * sizeof(X)) g.x[L].resize(size_t(job.N * job.H) * sizeof(X));
        if (g.xs[L].size() < size_t(job.N * ns)) g.xs[L].resize(size_t(job.N * ns));
        X* dst = reinterpret_cast<X*>(g.x[L].data());
        for (int64_t n = 0; n < job.N; ++n)
            gguf_prepare_row(g_gguf_layouts.l[L], xact + n * job.H, job.H, dst + n * job.H, g.xs[L].data() + n * ns);
    }
    if (g.h.size() < size_t(htotal) * sizeof(X) + 64) g.h.resize(size_t(htotal) * sizeof(X) + 64);
    g.hs_off.assign(size_t(job.E) + 1, 0);
    for (int64_t e = 0; e < job.E; ++e)
        g.hs_off[e + 1] = g.hs_off[e] + job.experts[e].T * gguf_sums_len(job.experts[e].I);
    if (g.hs.size() < size_t(g.hs_off[job.E])) g.hs.resize(size_t(g.hs_off[job.E]));
    g.rows_left.reset(new std::atomic<int64_t>[size_t(std::max<int64_t>(1, job.E))]);
    for (int64_t e = 0; e < job.E; ++e) g.rows_left[e].store(job.experts[e].I, std::memory_order_relaxed);
}

// Expert e's intermediate (hbuf's [T, I] of X, in order) into its down matrix's layout, with its sums: by the thread
// that computes the expert's last gate/up rows.
template <class X>
void gguf_prepare_down(const Job& job, int64_t e) {
    const ExpertArg& ex = job.experts[e];
    const GgufLayout& L = g_gguf_layouts.l[gguf_layout_of(gguf_down_type(ex))];
    const X* src = static_cast<const X*>(job.hbuf) + job.hoff[e];
    X* dst = reinterpret_cast<X*>(g_gguf.h.data()) + job.hoff[e];
    const int64_t ns = gguf_sums_len(ex.I);
    for (int64_t t = 0; t < ex.T; ++t)
        gguf_prepare_row(L, src + t * ex.I, ex.I, dst + t * ex.I, g_gguf.hs.data() + g_gguf.hs_off[e] + t * ns);
}

}  // namespace
