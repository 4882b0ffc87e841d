// GGUF (llama.cpp) block types as the CPU expert kernel reads them: strata/kernels/gguf_blocks.py lists the types and
// strata/kernels/quant.py the blob (3 header bytes, the gate, up and down type ids; gate_up's two halves, gate's rows
// then up's at a fixed offset; down's rows). Every matrix is read in its own type, as stored.
//
// A row is read a step at a time: a 256-value superblock (Q8_0: two 32-value blocks). A step's codes become bf16 words,
// each the code q itself or 128 + q (an OR with 0x4300 makes those), in 32-word vectors; vdpbf16ps sums products
// pairwise into 16 fp32 lanes, and every lane of a vector belongs to one sub-block (one scale). Vectors with the same
// lane -> sub-block map form a "chain": summed together, then added times a vector of their lanes' sub-block scales
// (one FMA). Where a type has mins (Q4_K, Q2_K) or the step used 128 + q, sum_s c_s X_s is subtracted, X_s the
// sub-block's sum of activations: w = a_s q - b_s gives sum x w = a_s sum x q - b_s X_s. The activations stay bf16
// (never quantized to int8 as llama.cpp does), so the products are those of the dequantized weights. A pass reads two
// rows of a matrix (gate and up of one type, or two down rows) for the same activations, each row summed as alone.
//
// The word order a type's decoder produces fixes where each activation of a step is read (`GgufLayout::elem`): the
// call's activations (x for gate/up, each expert's silu(gate) * up for down) are stored permuted so, with the sub-block
// sums, by `gguf_prepare_row` (once a call and token for x, once an expert for its intermediate). The layouts and the
// call's activations in them are cpu_experts_gguf_layout.h's; this file holds the block types (sizes, scale unpacking,
// the scalar values) and what the call asks of a blob's header.
//
// Decoders: cpu_experts_gguf_avx512.h (avx512_bf16), `GgufEmuDecode` below (its emulation: the same words, lanes and
// scale products, so bit-identical). Included once, by cpu_experts.cpp, after its Job, before the instruction sets.
#pragma once

namespace {

enum : int { GG_Q8_0 = 8, GG_Q2_K = 10, GG_Q3_K = 11, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14, GG_IQ4_XS = 23 };
enum : int { GL_Q4K, GL_Q2K, GL_Q6K, GL_Q80, GL_IQ4, GL_Q3K, GL_COUNT };  // activation layouts (a type's step order)

struct GgufBlock {
    int values = 0, bytes = 0;
};
inline GgufBlock gguf_block(int t) {
    switch (t) {
        case GG_Q8_0: return {32, 34};
        case GG_Q2_K: return {256, 84};
        case GG_Q3_K: return {256, 110};
        case GG_Q4_K: return {256, 144};
        case GG_Q5_K: return {256, 176};
        case GG_Q6_K: return {256, 210};
        case GG_IQ4_XS: return {256, 136};
        default: return {};
    }
}
// Bytes of the blocks holding a row's first `cols` values.
inline int64_t gguf_row_bytes(int t, int64_t cols) {
    const GgufBlock b = gguf_block(t);
    return b.values ? (cols + b.values - 1) / b.values * b.bytes : 0;
}
// The types the vector kernel reads, and the activation layout each is read in (-1: not read).
inline int gguf_layout_of(int t) {
    switch (t) {
        case GG_Q4_K: return GL_Q4K;
        case GG_Q2_K: return GL_Q2K;
        case GG_Q6_K: return GL_Q6K;
        case GG_Q8_0: return GL_Q80;
        case GG_Q5_K: return GL_Q4K;
        case GG_IQ4_XS: return GL_IQ4;
        case GG_Q3_K: return GL_Q3K;
        default: return -1;
    }
}

// A type as the kernel body reads it: bytes and values a step, chains a step and vectors a chain (32 values each),
// whether sum_s c_s X_s is subtracted.
template <int Id, int Layout, int Bytes, int Step, int Chains, int Vpc, bool Min>
struct GgufT {
    static constexpr int kId = Id, kLayout = Layout, kBytes = Bytes, kStep = Step, kChains = Chains, kVpc = Vpc;
    static constexpr bool kMin = Min;
};
using TQ4K = GgufT<GG_Q4_K, GL_Q4K, 144, 256, 4, 2, true>;
using TQ2K = GgufT<GG_Q2_K, GL_Q2K, 84, 256, 4, 2, true>;
using TQ6K = GgufT<GG_Q6_K, GL_Q6K, 210, 256, 4, 2, false>;
using TQ80 = GgufT<GG_Q8_0, GL_Q80, 68, 64, 1, 2, false>;
using TQ5K = GgufT<GG_Q5_K, GL_Q4K, 176, 256, 4, 2, true>;
using TIQ4 = GgufT<GG_IQ4_XS, GL_IQ4, 136, 256, 2, 4, false>;
using TQ3K = GgufT<GG_Q3_K, GL_Q3K, 110, 256, 4, 2, true>;

// A step's scales, decoded: each chain's lane scales, and the lanes of -c (the mins and offsets, times the sums).
template <class Fv>
struct GgufScales {
    Fv s[4];
    Fv c;
};

inline uint16_t gg_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}
inline float gg_f16(const uint8_t* p) { return f16_to_f32(gg_u16(p)); }
// Every f16's value in fp32 (256 KiB, built at load): the vector decoders broadcast a block's scale straight from here,
// a load alone (vcvtph2ps and register broadcasts of zmm take pipes the FMAs need; the scales a model uses are a few
// KiB of it).
struct GgufF16Table {
    float v[65536];
    GgufF16Table() {
        for (int h = 0; h < 65536; ++h) v[h] = f16_to_f32(uint16_t(h));
    }
};
const GgufF16Table g_gguf_f16;
inline const float* gg_f16_ref(const uint8_t* p) { return &g_gguf_f16.v[gg_u16(p)]; }

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> sc[0..7], m[0..7] (llama.cpp's unpacking)
inline void gguf_q4k_scales(const uint8_t* s12, uint8_t out[16]) {
    uint32_t u[4];
    std::memcpy(u, s12, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t aux = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = aux;
    u[0] &= 0x3f3f3f3fu;
    std::memcpy(out, u, 16);
}

// The same as two 64-bit words (sc0..7, m0..7), the vector decoders' way into a register (no bytes through memory)
inline void gguf_q4k_scales64(const uint8_t* s12, uint64_t& lo, uint64_t& hi) {
    uint64_t u01;
    uint32_t u2;
    std::memcpy(&u01, s12, 8);
    std::memcpy(&u2, s12 + 8, 4);
    const uint64_t low6 = u01 & 0x3f3f3f3f3f3f3f3full;  // sc0..3, m0..3
    const uint64_t sc47 = (u2 & 0x0f0f0f0fu) | (((u01 >> 6) & 0x03030303u) << 4);
    const uint64_t m47 = ((u2 >> 4) & 0x0f0f0f0fu) | (((u01 >> 38) & 0x03030303u) << 4);
    lo = (low6 & 0xffffffffull) | sc47 << 32;
    hi = (low6 >> 32) | m47 << 32;
}

// IQ4_XS's non-linear 4-bit grid, and its 6-bit block scales less 32 (8 a superblock)
constexpr int8_t kGgufIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
inline void gguf_iq4xs_scales(const uint8_t* b, int8_t ls[8]) {
    const int hi = gg_u16(b + 2);
    for (int ib = 0; ib < 8; ++ib)
        ls[ib] = int8_t((((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 15) | (((hi >> (2 * ib)) & 3) << 4)) - 32);
}

// Q3_K's 12 bytes of 6-bit scales -> 16 bytes, each the scale + 32 (llama.cpp's unpacking), as two 64-bit words
inline void gguf_q3k_scales64(const uint8_t* s12, uint64_t& lo, uint64_t& hi) {
    uint32_t a[3];
    std::memcpy(a, s12, 12);
    const uint32_t m1 = 0x03030303u, m2 = 0x0f0f0f0fu, t = a[2];
    const uint32_t a0 = (a[0] & m2) | (((t >> 0) & m1) << 4), a1 = (a[1] & m2) | (((t >> 2) & m1) << 4);
    const uint32_t a2 = ((a[0] >> 4) & m2) | (((t >> 4) & m1) << 4), a3 = ((a[1] >> 4) & m2) | (((t >> 6) & m1) << 4);
    lo = a0 | uint64_t(a1) << 32, hi = a2 | uint64_t(a3) << 32;
}

// A block's weights as gguf's numpy dequantizes them (the same fp32 products): the scalar tails' values.
inline void gguf_block_values(int t, const uint8_t* b, float* w) {
    switch (t) {
        case GG_Q8_0: {
            const float d = gg_f16(b);
            for (int i = 0; i < 32; ++i) w[i] = float(int8_t(b[2 + i])) * d;
            break;
        }
        case GG_Q2_K: {
            const float d = gg_f16(b + 80), dmin = gg_f16(b + 82);
            for (int e = 0; e < 256; ++e) {
                const int s = e >> 4, j = (e >> 5) & 3, q = (b[16 + 32 * (e >> 7) + (e & 31)] >> (2 * j)) & 3;
                w[e] = d * float(b[s] & 15) * float(q) - dmin * float(b[s] >> 4);
            }
            break;
        }
        case GG_Q4_K: {
            uint8_t sm[16];
            gguf_q4k_scales(b + 4, sm);
            const float d = gg_f16(b), dmin = gg_f16(b + 2);
            for (int e = 0; e < 256; ++e) {
                const int s = e >> 5, q = (b[16 + 32 * (e >> 6) + (e & 31)] >> (4 * (s & 1))) & 15;
                w[e] = d * float(sm[s]) * float(q) - dmin * float(sm[8 + s]);
            }
            break;
        }
        case GG_Q6_K: {
            const float d = gg_f16(b + 208);
            for (int e = 0; e < 256; ++e) {
                const int h = e >> 7, nib = (e >> 6) & 1, pos = e & 63;
                const int lo = (b[64 * h + pos] >> (4 * nib)) & 15;
                const int hi = (b[128 + 32 * h + (pos & 31)] >> (2 * (2 * nib + (pos >> 5)))) & 3;
                w[e] = d * float(int8_t(b[192 + (e >> 4)])) * float((lo | (hi << 4)) - 32);
            }
            break;
        }
        case GG_Q3_K: {
            uint64_t sc[2];
            gguf_q3k_scales64(b + 96, sc[0], sc[1]);
            const float d = gg_f16(b + 108);
            for (int e = 0; e < 256; ++e) {
                const int j = (e >> 5) & 3, l = e & 31, hf = e >> 7;
                const int ql = (b[32 + 32 * hf + l] >> (2 * j)) & 3, hb = (b[l] >> (4 * hf + j)) & 1;
                const float dl = d * float(int(reinterpret_cast<const uint8_t*>(sc)[e >> 4]) - 32);
                w[e] = dl * float(ql - 4 * (1 - hb));
            }
            break;
        }
        case GG_Q5_K: {
            uint8_t sm[16];
            gguf_q4k_scales(b + 4, sm);
            const float d = gg_f16(b), dmin = gg_f16(b + 2);
            for (int e = 0; e < 256; ++e) {
                const int s = e >> 5, l = e & 31, q = ((b[48 + 32 * (s >> 1) + l] >> (4 * (s & 1))) & 15) |
                                                     (((b[16 + l] >> s) & 1) << 4);
                w[e] = d * float(sm[s]) * float(q) - dmin * float(sm[8 + s]);
            }
            break;
        }
        case GG_IQ4_XS: {
            int8_t ls[8];
            gguf_iq4xs_scales(b, ls);
            const float d = gg_f16(b);
            for (int e = 0; e < 256; ++e) {
                const int ib = e >> 5, j = e & 15, nib = (e >> 4) & 1;
                w[e] = d * float(ls[ib]) * float(kGgufIq4nl[(b[8 + 16 * ib + j] >> (4 * nib)) & 15]);
            }
            break;
        }
        default:
            for (int e = 0; e < gguf_block(t).values; ++e) w[e] = 0.0f;
    }
}

// A matrix's type id in the blob's header: gate's (which 0) and up's (1) at gate_up's scales pointer, down's at down's.
inline int gguf_type(const void* header, int which) { return static_cast<const uint8_t*>(header)[which]; }
inline int gguf_down_type(const ExpertArg& ex) { return gguf_type(ex.down_scales, 0); }

// Bytes of a down row's first `cols` values in the call's format (GGUF: the expert's down type).
inline int64_t down_bytes(int fmt, const ExpertArg& ex, int64_t cols) {
    return fmt == FMT_GGUF ? gguf_row_bytes(gguf_down_type(ex), cols) : fmt_bytes(fmt, cols);
}

// Whether the vector kernel reads every matrix of these experts: their types, and whole blocks along H (gate/up rows)
// and I (down's row stride); a split expert's rows may end inside a block (its tail is read value by value).
inline bool gguf_readable(const std::vector<ExpertArg>& experts, int64_t H) {
    for (const ExpertArg& ex : experts)
        for (int which = 0; which < 3; ++which) {
            const int t = gguf_type(which < 2 ? ex.gate_up_scales : ex.down_scales, which < 2 ? which : 0);
            if (gguf_layout_of(t) < 0 || (which < 2 ? H : ex.ld) % gguf_block(t).values) return false;
        }
    return true;
}

// Bytes of one gate row and one up row, and of an expert's down rows' first I values (the chunks' sizes).
inline int64_t gguf_pair_bytes(const ExpertArg& ex, int64_t H) {
    return gguf_row_bytes(gguf_type(ex.gate_up_scales, 0), H) + gguf_row_bytes(gguf_type(ex.gate_up_scales, 1), H);
}

template <class KK, class = void>
struct has_gguf : std::false_type {};
template <class KK>
struct has_gguf<KK, std::void_t<typename KK::Gguf>> : std::true_type {};

}  // namespace

#include "cpu_experts_gguf_layout.h"  // GgufLayout: where a step keeps each activation; the call's (g_gguf)
#include "cpu_experts_gguf_emu.h"  // GgufEmuDecode: the emulation's decoders
#if ON_X86
#include "cpu_experts_gguf_avx512.h"
#endif
