// The expert weight formats the CPU kernel reads (strata/kernels/quant.py is the contract): how a row of each is
// found, and the scalar decoders and lookup tables the vector code and its emulations share.
//
//   FMT_BF16   values bf16 [rows, cols]
//   FMT_FP8    values float8_e4m3fn bits [rows, cols] uint8; scale_inv float [ceil(rows / bn), ceil(cols / bk)]:
//              w = value * scale_inv of the row's and column's block
//   FMT_MXFP4  values [rows, cols / 2] uint8, element 2j in byte j's low nibble, 2j + 1 in its high nibble (e2m1
//              codes); scales [rows, cols / 32] uint8 e8m0: w = E2M1[code] * 2^(scale - 127)
//   FMT_GGUF   each matrix in a ggml block type, its id in the blob's header (cpu_experts_gguf.h)
//
// Included once, by cpu_experts.cpp, after bf16_to_f32 / f32_to_bf16 and before the instruction sets' kernels.
#pragma once

namespace {

enum { FMT_BF16 = 0, FMT_FP8 = 1, FMT_MXFP4 = 2, FMT_GGUF = 3 };
constexpr int64_t kMxGroup = 32;  // values per e8m0 scale

// Bytes of `cols` consecutive elements of a row in format `fmt` (mxfp4: whole bytes, a half byte rounded up).
inline int64_t fmt_bytes(int fmt, int64_t cols) {
    return fmt == FMT_BF16 ? 2 * cols : fmt == FMT_FP8 ? cols : (cols + 1) / 2;
}

// One matrix of an expert, as the kernel reads it: values, scales (fp8, mxfp4) and its row length.
struct Mat {
    const uint8_t* v;
    const void* s;
    int64_t cols;    // elements a row (the row stride: a split expert's down is read on its first I columns)
    int64_t bn, bk;  // fp8's block
};

// A row of each format: its values and, where the format has them, the scales of its block row / groups.
struct RowBf16 {
    const uint16_t* v;
    static RowBf16 of(const Mat& m, int64_t r) { return {reinterpret_cast<const uint16_t*>(m.v) + r * m.cols}; }
};
struct RowFp8 {
    const uint8_t* v;
    const float* s;  // [ceil(cols / bk)] the scale_inv of each block of bk columns
    int64_t bk;
    static RowFp8 of(const Mat& m, int64_t r) {
        return {m.v + r * m.cols, static_cast<const float*>(m.s) + (r / m.bn) * ((m.cols + m.bk - 1) / m.bk), m.bk};
    }
};
struct RowMx {
    const uint8_t* v;  // [cols / 2]
    const uint8_t* s;  // [cols / 32]
    static RowMx of(const Mat& m, int64_t r) {
        return {m.v + r * (m.cols / 2), static_cast<const uint8_t*>(m.s) + r * (m.cols / kMxGroup)};
    }
    uint8_t code(int64_t i) const { return (v[i >> 1] >> ((i & 1) * 4)) & 15; }
};

// avx512_bf16 reads an MXFP4 group (32 values) into one vector in this order: word w holds element
// 16 ((w >> 2) & 1) + 4 (w & 3) + (w >> 3) (cpu_experts_isa.h's load_mx), so its activations are stored permuted
// the same way within each whole group of a row's len elements (the rest, a partial last group, in order).
inline int64_t mx_lane_element(int64_t w) { return 16 * ((w >> 2) & 1) + 4 * (w & 3) + (w >> 3); }
inline int64_t mx_lane_position(int64_t e) { return 8 * (e & 3) + 4 * (e >> 4) + ((e >> 2) & 3); }
inline int64_t mx_x_position(int64_t e, int64_t len) {
    return e < (len & ~(kMxGroup - 1)) ? (e & ~(kMxGroup - 1)) | mx_lane_position(e & (kMxGroup - 1)) : e;
}

// avx512_bf16 reads MXFP4 rows 128 values (four groups, 64 bytes) a step into four vectors: vector k's 128-bit lane L
// holds group L, its word 4h + r element 32L + 16h + 4r + k (load_mx4). A row's activations are stored so: each
// whole step's 128 permuted so, then each whole group past them as mx_x_position, the partial last group in order.
constexpr int64_t kMxStep = 128;
inline int64_t mx_step_position(int64_t e) {  // position of element e (0..127) in a step's vectors
    return 32 * (e & 3) + 8 * (e >> 5) + 4 * ((e >> 4) & 1) + ((e >> 2) & 3);
}
inline int64_t mx_step_x_position(int64_t e, int64_t len) {
    return e < (len & ~(kMxStep - 1)) ? (e & ~(kMxStep - 1)) | mx_step_position(e & (kMxStep - 1)) : mx_x_position(e, len);
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; subnormals; 0x7f and 0xff are NaN, no infinities.
inline float fp8_e4m3_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
    return (b & 0x80) ? -v : v;
}

// IEEE binary16 bits -> float, exactly (subnormals included): the scalar form of vcvtph2ps.
inline float f16_to_f32(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp(float(m), -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(float(m | 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}

// The fp32 kernels' FP8 load: the byte sign-extended to 16 bits, shifted left by 7 and masked with 0xBF80 puts its
// exponent and mantissa in fp16's places, which is the value / 256 exactly (e4m3's subnormals become fp16
// subnormals); vcvtph2ps then widens it exactly. The two NaN codes read as +-480 this way (no quantizer writes them).
inline uint16_t fp8_as_f16_over_256(uint8_t b) {
    const uint16_t w = static_cast<uint16_t>(static_cast<int16_t>(static_cast<int8_t>(b)));
    return static_cast<uint16_t>((w << 7) & 0xBF80);
}
constexpr float kFp8F16Unit = 256.0f;  // what the fp16 path's values are to be multiplied by

constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) in fp32 for an e8m0 byte: 2^-127 (a subnormal) for 0, +inf for 255 (as torch.exp2 gives them).
inline float e8m0_value(uint8_t s) {
    const uint32_t bits = s == 0 ? 0x00400000u : uint32_t(s) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

struct FormatTables {
    float fp8_f32[256];            // e4m3 byte -> value
    uint16_t fp8_bf16[256];        // the same in bf16 (exact: 3 mantissa bits, exponents in range)
    alignas(64) uint8_t fp8_hi[128];  // bf16 high byte of the magnitude (byte & 0x7f), for vpermi2b
    alignas(64) uint8_t fp8_lo[128];  // its low byte
    alignas(64) uint8_t fp8_interleave[64];     // vpermt2b indices: word j = (lo[j], hi[j]), j < 32
    alignas(64) uint8_t fp8_interleave_hi[64];  // the same for j = 32..63
    alignas(64) float mx_f32[256][16];       // [scale][code] E2M1[code] * 2^(scale - 127) in fp32 (torch's product)
    alignas(64) uint16_t mx_bf16[256][32];   // the same rounded to bf16 (exact unless the scale is 0, 1 or > 252),
                                             // codes 16..31 repeating 0..15 (vpermw reads 5 index bits)
    FormatTables() {
        for (int b = 0; b < 256; ++b) {
            fp8_f32[b] = fp8_e4m3_value(uint8_t(b));
            fp8_bf16[b] = f32_to_bf16(fp8_f32[b]);
        }
        for (int m = 0; m < 128; ++m) fp8_hi[m] = uint8_t(fp8_bf16[m] >> 8), fp8_lo[m] = uint8_t(fp8_bf16[m] & 0xff);
        for (int j = 0; j < 32; ++j) {
            fp8_interleave[2 * j] = uint8_t(j), fp8_interleave[2 * j + 1] = uint8_t(64 + j);
            fp8_interleave_hi[2 * j] = uint8_t(32 + j), fp8_interleave_hi[2 * j + 1] = uint8_t(96 + j);
        }
        for (int s = 0; s < 256; ++s)
            for (int c = 0; c < 32; ++c) {
                const float v = kE2M1[c & 15] * e8m0_value(uint8_t(s));
                if (c < 16) mx_f32[s][c] = v;
                mx_bf16[s][c] = f32_to_bf16(v);
            }
    }
};
const FormatTables g_fmt;

}  // namespace
