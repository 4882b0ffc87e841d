// A CPU-only host's decode MoE layer in one call, on experts pinned in RAM for good (strata.kernels.cpu.expert_rows):
// the router's picks grouped by expert, each expert's blob found by address in the layer's table, the layer's call
// (strata_cpu_experts_act), then the combine with the residual. The Python side did the grouping, the argument
// packing and the combine as ~20 small ops a layer, each slowed several-fold by the weights the layer had just
// streamed through the caches (docs/benchmarks.md, "A decode step's host work").
//
// A translation unit of its own, as cpu_rows.cpp: code added to cpu_experts.cpp's unit moves its dense kernel's hot
// loop, which has cost the LM head ~8% of its read rate.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bf16.h"

#define C_EXPORTED extern "C" __attribute__((visibility("default")))

// cpu_experts_call.h
C_EXPORTED int strata_cpu_experts_act(int isa, const float* x, int64_t N, int64_t H, int64_t E, const int64_t* meta,
                                      const int64_t* fmt, const int64_t* scales, const int64_t* warm, const double* act,
                                      const int64_t* bias, float* out, int threads, int64_t* stolen);

namespace {

constexpr int kMetaFields = 7;  // cpu_experts.cpp's META_FIELDS
constexpr int64_t kFmtBf16 = 0;  // cpu_experts_formats.h's FMT_BF16

}  // namespace

// x [N, H] bf16 (the normed activations); ids [N, k] int64 and w [N, k] fp32 the router's picks; table [E] int64 each
// expert's blob address (0: not in pinned RAM: -7, nothing done); at [4] int64 the offsets in a blob of gate_up's
// values, down's, gate_up's scales and down's (the scales read with a quantized fmt only); inter: each expert's I;
// fmt and threads as strata_cpu_experts_act (the plain SwiGLU, no biases). y [N, H] bf16 = bf16(residual +
// bf16(sum)) (residual [N, H] bf16; null: bf16(sum)), sum over each token's picks of w * expert(x) in fp32, experts
// ascending, each expert's pairs ascending: the order of the Python side's grouping, so y equals its result bit for
// bit. *experts_out: how many distinct experts were computed.
C_EXPORTED int strata_cpu_experts_rows(int isa, const uint16_t* x, int64_t N, int64_t H, int64_t k, const int64_t* ids,
                                       const float* w, const int64_t* table, int64_t E, const int64_t* at,
                                       int64_t inter, const int64_t* fmt, const uint16_t* residual, uint16_t* y,
                                       int threads, int64_t* experts_out) {
    if (N <= 0 || H <= 0 || k <= 0 || E <= 0 || inter <= 0) return -1;
    const int64_t P = N * k;
    std::vector<int64_t> order(static_cast<size_t>(P));
    for (int64_t p = 0; p < P; ++p) {
        if (ids[p] < 0 || ids[p] >= E) return -2;
        if (!table[ids[p]]) return -7;
        order[p] = p;
    }
    std::stable_sort(order.begin(), order.end(), [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    std::vector<int64_t> tok(static_cast<size_t>(P)), meta, scales;
    std::vector<float> wp(static_cast<size_t>(P));
    const bool quantized = fmt && fmt[0] != kFmtBf16;
    for (int64_t i = 0; i < P;) {  // one meta row per distinct expert: its run of pairs in `order`
        const int64_t e = ids[order[i]], base = table[e];
        int64_t j = i;
        for (; j < P && ids[order[j]] == e; ++j) tok[j] = order[j] / k, wp[j] = w[order[j]];
        const int64_t row[kMetaFields] = {base + at[0], base + at[1], reinterpret_cast<int64_t>(tok.data() + i),
                                          reinterpret_cast<int64_t>(wp.data() + i), j - i, inter, inter};
        meta.insert(meta.end(), row, row + kMetaFields);
        if (quantized) scales.push_back(base + at[2]), scales.push_back(base + at[3]);
        i = j;
    }
    const int64_t experts = static_cast<int64_t>(meta.size()) / kMetaFields;
    std::vector<float> x32(static_cast<size_t>(N * H)), out(static_cast<size_t>(N * H), 0.f);
    for (int64_t i = 0; i < N * H; ++i) x32[i] = bf16_to_f32(x[i]);
    const int rc = strata_cpu_experts_act(isa, x32.data(), N, H, experts, meta.data(), fmt,
                                          quantized ? scales.data() : nullptr, nullptr, nullptr, nullptr, out.data(),
                                          threads, nullptr);
    if (rc) return rc;
    for (int64_t i = 0; i < N * H; ++i) {
        const uint16_t sum = f32_to_bf16(out[i]);
        y[i] = residual ? f32_to_bf16(bf16_to_f32(residual[i]) + bf16_to_f32(sum)) : sum;
    }
    if (experts_out) *experts_out = experts;
    return 0;
}
