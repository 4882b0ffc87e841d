// The SwiGLU form between an expert's gate/up rows and its down rows (strata.kernels.experts.SwiGLUForm), and the
// per-expert gate_up bias added before it. With gu = <gate_up row, x> + bias [T, 2 ld] in gate_up's row order:
//
//   gate_j = gu[gate_row(j)], up_j = gu[up_row(j)]       rows j and ld + j; interleaved: 2j and 2j + 1
//   gate_j = min(gate_j, limit); up_j = clamp(up_j, -limit, limit)        (limit +inf: neither)
//   h_j = (up_j + up_offset) * gate_j * sigmoid(alpha * gate_j)
//
// The plain form (silu(gate) * up, gate rows first, no bias) takes the kernel's own activation (silu_mul): plain
// experts' bits do not depend on the form machinery; the rest take `swiglu_form`. Either is chosen once an
// intermediate row and token tile, after its dot products (cpu_experts_kernel.h's `activate`), never inside them.
// A split expert's CPU part is its first I of ld intermediate rows: the form is per row, so it splits the same way.
// The down bias is not the kernel's: strata.kernels.experts.down_bias_term adds it once outside.
//
// Included once, by cpu_experts.cpp, before its ExpertArg and Job (which hold a SwiGLU and each expert's bias row).
#pragma once

namespace {

struct SwiGLU {
    bool plain = true;         // silu(gate) * up on rows j, ld + j: the kernel's original activation
    bool interleaved = false;  // gate row j at 2j, up row j at 2j + 1 of gate_up [2 ld, H]
    float limit = INFINITY;    // gate clipped above, up to [-limit, limit]
    float alpha = 1.0f, up_offset = 0.0f;

    // gate_up's row holding intermediate row j's gate / up, of an expert of ld intermediate rows
    int64_t gate_row(int64_t j) const { return interleaved ? 2 * j : j; }
    int64_t up_row(int64_t j, int64_t ld) const { return interleaved ? 2 * j + 1 : ld + j; }
};

// The form from its C arguments: act double [4] = limit (+inf: none), alpha, up_offset, interleaved (0 / 1); nullptr:
// plain. False for arguments no form has (NaN, a limit <= 0, interleaved not 0 or 1).
inline bool swiglu_of(const double* act, SwiGLU& f) {
    f = SwiGLU{};
    if (!act) return true;
    if (!(act[0] > 0.0) || std::isnan(act[1]) || std::isnan(act[2]) || (act[3] != 0.0 && act[3] != 1.0)) return false;
    f.limit = static_cast<float>(act[0]), f.alpha = static_cast<float>(act[1]);
    f.up_offset = static_cast<float>(act[2]), f.interleaved = act[3] != 0.0;
    f.plain = std::isinf(f.limit) && f.alpha == 1.0f && f.up_offset == 0.0f && !f.interleaved;
    return true;
}

// h of one intermediate row and token: gate g and up u with their biases added. NaN stays NaN through the clamps
// (std::min / std::clamp return the NaN operand), as torch's clamp does.
inline float swiglu_form(const SwiGLU& f, float g, float u) {
    g = std::min(g, f.limit);
    u = std::clamp(u, -f.limit, f.limit);
    return (u + f.up_offset) * (g / (1.0f + std::exp(-(f.alpha * g))));
}

}  // namespace
