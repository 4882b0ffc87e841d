// The emulation's decoders of GGUF steps (k_emu512bf16's K::Gguf; cpu_experts_gguf.h says what a step is): the words,
// lane scales and mins cpu_experts_gguf_avx512.h's decoders produce, computed value by value with the same fp32
// operations, so the emulated kernel is bit-identical to avx512_bf16 on any x86-64 machine.
//
// Included by cpu_experts_gguf.h, at its end.
#pragma once

namespace {

// The emulation's decoders (k_emu512bf16's K::Gguf): the words, lane scales and mins cpu_experts_gguf_avx512.h's
// produce, computed value by value with the same fp32 operations.
template <class Wv, class Fv>
struct GgufEmuDecode {
    using Scales = GgufScales<Fv>;
    static inline Fv load_sums(const float* p) {
        Fv r;
        std::memcpy(r.v, p, sizeof(r.v));
        return r;
    }
    static inline void chains(const GgufLayout& L, const float* a, int n, Scales& d) {  // vpermps of the scales
        for (int c = 0; c < n; ++c)
            for (int m = 0; m < 16; ++m) d.s[c].v[m] = a[L.chain_sb[c][m]];
    }
    template <class F>
    static inline void words(const GgufLayout& L, int c, F word_of, Wv* w, int vpc = 2) {  // chain c's vectors
        for (int r = 0; r < vpc; ++r)
            for (int i = 0; i < 32; ++i) w[r].v[i] = word_of(L.elem[32 * (vpc * c + r) + i]);
    }
    static inline float fnmsub(float a, float b, float c) { return std::fma(-a, b, -c); }  // -(a b) - c

    static inline void scales(TQ4K, const uint8_t* b, Scales& d) {
        uint8_t sm[16];
        gguf_q4k_scales(b + 4, sm);
        const float dd[2] = {gg_f16(b), gg_f16(b + 2)};
        float a[16];
        for (int l = 0; l < 16; ++l) a[l] = float(sm[l]) * dd[l >> 3];  // [d sc_s | dmin m_s]
        chains(g_gguf_layouts.l[GL_Q4K], a, 4, d);
        for (int l = 0; l < 16; ++l) d.c.v[l] = a[l];  // the sums carry -128 and -1
    }
    static inline void codes(TQ4K, const uint8_t* b, int c, Wv* w) {
        words(g_gguf_layouts.l[GL_Q4K], c, [&](int e) {
            return uint16_t(0x4300 | ((b[16 + 32 * (e >> 6) + (e & 31)] >> (4 * ((e >> 5) & 1))) & 15));
        }, w);
    }
    static inline void scales(TQ2K, const uint8_t* b, Scales& d) {
        const float dv = gg_f16(b + 80), mv = gg_f16(b + 82);
        float a[16];
        for (int s = 0; s < 16; ++s) {
            a[s] = float(b[s] & 15) * dv;
            d.c.v[s] = fnmsub(a[s], kGgufQ2Offset[s], float(b[s] >> 4) * mv);
        }
        chains(g_gguf_layouts.l[GL_Q2K], a, 4, d);
    }
    static inline void codes(TQ2K, const uint8_t* b, int c, Wv* w) {
        words(g_gguf_layouts.l[GL_Q2K], c, [&](int e) {
            const int j = (e >> 5) & 3, q = (b[16 + 32 * (e >> 7) + (e & 31)] >> (2 * j)) & 3;
            return uint16_t(0x4300 | (j == 3 ? q : q << (2 * j)));
        }, w);
    }
    static inline void scales(TQ6K, const uint8_t* b, Scales& d) {
        const float dv = gg_f16(b + 208);
        float a[16];
        for (int s = 0; s < 16; ++s) a[s] = float(int8_t(b[192 + s])) * dv;
        chains(g_gguf_layouts.l[GL_Q6K], a, 4, d);
    }
    static inline void codes(TQ6K, const uint8_t* b, int c, Wv* w) {
        words(g_gguf_layouts.l[GL_Q6K], c, [&](int e) {
            const int h = e >> 7, nib = (e >> 6) & 1, pos = e & 63;
            const int lo = (b[64 * h + pos] >> (4 * nib)) & 15;
            const int hi = (b[128 + 32 * h + (pos & 31)] >> (2 * (2 * nib + (pos >> 5)))) & 3;
            return f32_to_bf16(float((lo | (hi << 4)) - 32));
        }, w);
    }
    static inline void scales(TQ80, const uint8_t* b, Scales& d) {
        const float a[2] = {gg_f16(b), gg_f16(b + 34)};
        chains(g_gguf_layouts.l[GL_Q80], a, 1, d);
    }
    static inline void codes(TQ80, const uint8_t* b, int c, Wv* w) {
        words(g_gguf_layouts.l[GL_Q80], c, [&](int e) {
            return f32_to_bf16(float(int8_t(b[34 * (e >> 5) + 2 + (e & 31)])));
        }, w);
    }
    static inline void scales(TQ5K, const uint8_t* b, Scales& d) { scales(TQ4K{}, b, d); }  // Q4_K's scales and mins
    static inline void codes(TQ5K, const uint8_t* b, int c, Wv* w) {
        words(g_gguf_layouts.l[GL_Q4K], c, [&](int e) {
            const int s = e >> 5, l = e & 31;
            const int q = ((b[48 + 32 * (s >> 1) + l] >> (4 * (s & 1))) & 15) | (((b[16 + l] >> s) & 1) << 4);
            return uint16_t(0x4300 | q);
        }, w);
    }
    static inline void scales(TQ3K, const uint8_t* b, Scales& d) {
        uint64_t sc[2];
        gguf_q3k_scales64(b + 96, sc[0], sc[1]);
        const float dv = gg_f16(b + 108);
        float a[16];
        for (int s = 0; s < 16; ++s) {
            a[s] = float(int(reinterpret_cast<const uint8_t*>(sc)[s]) - 32) * dv;
            d.c.v[s] = a[s];  // the sums carry -(128 4^-j + 4)
        }
        chains(g_gguf_layouts.l[GL_Q3K], a, 4, d);
    }
    static inline void codes(TQ3K, const uint8_t* b, int c, Wv* w) {
        words(g_gguf_layouts.l[GL_Q3K], c, [&](int e) {
            const int j = (e >> 5) & 3, l = e & 31, hf = e >> 7;
            const int q = ((b[32 + 32 * hf + l] >> (2 * j)) & 3) | (((b[l] >> (4 * hf + j)) & 1) << 2);
            return uint16_t(0x4300 | (j == 3 ? q : q << (2 * j)));
        }, w);
    }
    static inline void scales(TIQ4, const uint8_t* b, Scales& d) {
        int8_t ls[8];
        gguf_iq4xs_scales(b, ls);
        const float dv = gg_f16(b);
        float a[8];
        for (int ib = 0; ib < 8; ++ib) a[ib] = float(ls[ib]) * dv;
        chains(g_gguf_layouts.l[GL_IQ4], a, 2, d);
    }
    static inline void codes(TIQ4, const uint8_t* b, int c, Wv* w) {
        words(g_gguf_layouts.l[GL_IQ4], c, [&](int e) {
            return f32_to_bf16(float(kGgufIq4nl[(b[8 + 16 * (e >> 5) + (e & 15)] >> (4 * ((e >> 4) & 1))) & 15]));
        }, w, 4);
    }
};

}  // namespace
