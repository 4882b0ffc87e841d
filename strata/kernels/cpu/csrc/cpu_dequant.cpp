// strata CPU dequantizer: quantized expert matrices (GGUF blocks, block-scaled FP8, MXFP4) -> bf16, for torch's GEMMs.
//
// On a CPU whose AMX tiles torch's bf16 GEMMs run on, a prompt's expert with a few dozen tokens computes ~2x faster
// there than on the expert kernel's registers (strata/kernels/cpu/experts.py, AMX_KERNEL_TOKENS). A quantized expert
// takes that path by being dequantized into a bf16 scratch first: gate_up [2I, H] and down [H, I], about 9.4 MB for
// the bench model's expert, written here at several GB/s a thread (torch ops took ~18 ms an expert).
//
// Each weight is the oracle's fp32 value (gguf's numpy dequantize, strata.kernels.quant's dequantize_fp8 and
// dequantize_mxfp4: the same operations in the same order) rounded to bf16 to nearest even, as `.to(torch.bfloat16)`
// of that value gives: bit for bit, for every type and format (cpu_dequant_rows.h).
//
// Threads: the rows of each matrix are split evenly over the team of the OpenMP runtime torch's GEMMs run on (its
// GOMP_parallel, found by the Python side: strata/kernels/cpu/dequant.py), so the scratch is written by the threads
// that then read it, and no other pool spins beside them (the expert kernel's pool spins ~1 ms after each call: its
// worker would take a core from every GEMM that follows a dequantization). Without that runtime, one thread.
//
// A translation unit of its own: code added to cpu_experts.cpp's unit moved its kernels and slowed decode.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include <immintrin.h>

#include "cpu_bits.h"

#define C_EXPORTED extern "C" __attribute__((visibility("default")))

#pragma GCC diagnostic ignored "-Wpsabi"  // the vector helpers are inlined: no vector crosses a call
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's AVX-512 headers (`__m512 __Y = __Y;`)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

enum { kFp8 = 1, kMxfp4 = 2, kGguf = 3 };  // expert_args.FORMAT_CODES
constexpr int kSegmentFields = 9;

// One matrix (or a gate_up half) to dequantize: int64 [format, ggml type, values, scales, rows, k, bn, bk, out]
struct Segment {
    int fmt = 0, type = 0;
    const uint8_t* values = nullptr;  // GGUF: rows of row_bytes; FP8: [rows, k]; MXFP4: [rows, k / 2]
    const float* fp8_scales = nullptr;   // [ceil(rows / bn), ceil(k / bk)]
    const uint8_t* mx_scales = nullptr;  // [rows, k / 32]
    int64_t rows = 0, k = 0, bn = 1, bk = 1, row_bytes = 0;
    uint16_t* out = nullptr;  // [rows, k] bf16
};

// f16 at p (little-endian) -> fp32, exact (ggml's GGML_FP16_TO_FP32 without F16C; subnormals, inf and NaN kept)
inline float f16_to_f32(const uint8_t* p) {
    const uint32_t w = uint32_t(p[0] | (p[1] << 8)) << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
    return float_of(sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized)));
}

// (values per block, bytes per block) of the ggml types read here (strata.kernels.gguf_blocks.BLOCK_TYPES)
bool gguf_block(int type, int64_t& values, int64_t& bytes) {
    switch (type) {
        case 8: values = 32, bytes = 34; return true;
        case 10: values = 256, bytes = 84; return true;
        case 11: values = 256, bytes = 110; return true;
        case 12: values = 256, bytes = 144; return true;
        case 13: values = 256, bytes = 176; return true;
        case 14: values = 256, bytes = 210; return true;
        case 23: values = 256, bytes = 136; return true;
    }
    return false;
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2")
namespace dq_avx512 {
#include "cpu_dequant_rows.h"
#include "cpu_dequant_avx512.h"
}  // namespace dq_avx512
#pragma GCC pop_options

namespace dq_portable {
#include "cpu_dequant_rows.h"
}  // namespace dq_portable

namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
using OmpInt = int (*)();
GompParallel g_parallel = nullptr;
OmpInt g_thread_num = nullptr, g_num_threads = nullptr;

struct Job {
    const Segment* segs = nullptr;
    int n = 0;
    bool vector = false;
};

// share `t` of `P`: the same slice of every segment's rows
void run_share(const Job& j, int t, int P) {
    for (int i = 0; i < j.n; ++i) {
        const Segment& g = j.segs[i];
        const int64_t r0 = g.rows * t / P, r1 = g.rows * (t + 1) / P;
        if (j.vector)
            dq_avx512::v_segment_rows(g, r0, r1);
        else
            dq_portable::segment_rows(g, r0, r1);
    }
}

void omp_body(void* ctx) { run_share(*static_cast<const Job*>(ctx), g_thread_num(), g_num_threads()); }

}  // namespace

// The OpenMP runtime's GOMP_parallel, omp_get_thread_num and omp_get_num_threads (libgomp's, or libiomp's
// compatible ones), from the library torch's parallel ops run on; nulls: every call on the calling thread.
C_EXPORTED int strata_cpu_dequant_runtime(void* parallel, void* thread_num, void* num_threads) {
    const bool ok = parallel && thread_num && num_threads;
    g_parallel = ok ? reinterpret_cast<GompParallel>(parallel) : nullptr;
    g_thread_num = ok ? reinterpret_cast<OmpInt>(thread_num) : nullptr;
    g_num_threads = ok ? reinterpret_cast<OmpInt>(num_threads) : nullptr;
    return ok ? 0 : -1;
}

// Dequantize n segments (int64 [n, 9]: format (1 fp8, 2 mxfp4, 3 gguf), ggml type id (gguf), values address, scales
// address (fp8: fp32 [ceil(rows / bn), ceil(k / bk)]; mxfp4: uint8 [rows, k / 32]; gguf: unused), rows, k, bn, bk
// (fp8's block), out address (bf16 [rows, k], contiguous)) on `threads` threads of the OpenMP runtime (1, or no
// runtime: the calling thread). flags bit 0: the portable code even where the CPU has AVX-512 (tests). Returns 0, or -1
// (nothing written) for a format, type or shape it does not read (a GGUF k not a multiple of its block, an MXFP4 k not
// of 32).
C_EXPORTED int strata_cpu_dequant(const int64_t* segs, int64_t n, int threads, int flags) {
    constexpr int kMaxSegments = 8;
    if (n < 0 || n > kMaxSegments) return -1;
    Segment g[kMaxSegments];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* f = segs + i * kSegmentFields;
        Segment& s = g[i];
        s.fmt = int(f[0]), s.type = int(f[1]), s.values = reinterpret_cast<const uint8_t*>(f[2]);
        s.rows = f[4], s.k = f[5], s.bn = f[6], s.bk = f[7], s.out = reinterpret_cast<uint16_t*>(f[8]);
        if (s.rows < 0 || s.k < 1) return -1;
        if (s.fmt == kFp8) {
            if (s.bn < 1 || s.bk < 1) return -1;
            s.fp8_scales = reinterpret_cast<const float*>(f[3]);
        } else if (s.fmt == kMxfp4) {
            if (s.k % 32) return -1;
            s.mx_scales = reinterpret_cast<const uint8_t*>(f[3]);
        } else if (s.fmt == kGguf) {
            int64_t values, bytes;
            if (!gguf_block(s.type, values, bytes) || s.k % values) return -1;
            s.row_bytes = s.k / values * bytes;
        } else {
            return -1;
        }
    }
    Job j;
    j.segs = g, j.n = int(n);
    j.vector = !(flags & 1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (threads > 1 && g_parallel)
        g_parallel(omp_body, &j, unsigned(threads), 0);
    else
        run_share(j, 0, 1);
    return 0;
}
