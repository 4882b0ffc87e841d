// strata CPU dense kernel: y[M, N] = x[M, K] @ w[N, K]^T for bf16 weights and a few rows of activations (decode:
// one row per sequence), on the expert kernel's thread pool.
//
// For M <= kDenseMaxRows the product is memory-bound: every weight row is read once from RAM and used for all M
// rows of x. Chunks of weight rows are taken dynamically by the pool's threads (a thread the OS has not scheduled
// holds no work, so nobody waits for it); a chunk's rows are read one after the other, one sequential stream, with
// U independent accumulator chains along a row, and (avx512_bf16) a software prefetch `pf` bytes ahead on that
// stream, the expert kernel's distance: an AMX Xeon VM's hardware prefetchers alone read the LM head at 21.0 GB/s,
// 23.3-24.3 with it; a Zen 4's read faster alone, so AMD CPUs run without it (library.PREFETCH_BYTES_BY_VENDOR).
// Several rows read at once lost a quarter of the rate on a Zen 4.
// Every output element is written by one thread, its dot product summed in an order fixed by the code (and M), so
// results do not depend on the thread count or the prefetch distance.
//
// Instruction sets (the file is compiled for plain x86-64, these functions under target pragmas):
//   avx512_bf16  vdpbf16ps on the bf16 activations as they are (the model's bf16 activations): products of bf16
//                pairs summed in fp32, as a bf16 GEMM (torch's, llama.cpp's) accumulates
//   avx512, avx2 the bf16 weights and activations widened to fp32 by shifts, fp32 FMA (same products, exact)
// Output fp32, or bf16 rounded to nearest even (what torch's bf16 F.linear returns).
//
// Included once, by cpu_experts.cpp, after its pool (g_call, get_pool) and ISA codes; the C entry point is
// strata_cpu_dense (strata/kernels/cpu/dense.py).
#pragma once

namespace {

constexpr int64_t kDenseMaxRows = 16;  // rows of x a call takes (more: compute-bound, torch's GEMM does better)
constexpr int64_t kDenseInlineBytes = 512 << 10;  // weights below this are read by the calling thread alone

struct DenseJob {
    const uint16_t* x = nullptr;  // [M, K] bf16
    const uint16_t* xp = nullptr;  // x's whole 32-column steps packed [K / 32][M][32]: a step's M rows in one block
    const uint16_t* w = nullptr;  // [N, ldw] bf16
    void* y = nullptr;            // [M, ldy] fp32 or bf16
    bool y_bf16 = false;
    int64_t M = 0, N = 0, K = 0, ldw = 0, ldy = 0, chunk = 0, n_chunks = 0;
    int64_t pf = 0;  // software prefetch this many bytes ahead along the weights (whole lines; 0: none)
    std::atomic<int64_t> next{0}, done{0};
};

inline void dense_store(const DenseJob& j, int64_t t, int64_t n, float v) {
    if (j.y_bf16)
        static_cast<uint16_t*>(j.y)[t * j.ldy + n] = f32_to_bf16(v);
    else
        static_cast<float*>(j.y)[t * j.ldy + n] = v;
}

// The scalar tail of a dot product (K not a multiple of the vector width), in the same order for every row.
inline float dense_tail(const uint16_t* w, const uint16_t* x, int64_t k0, int64_t K) {
    float s = 0.0f;
    for (int64_t k = k0; k < K; ++k) s += bf16_to_f32(w[k]) * bf16_to_f32(x[k]);
    return s;
}

}  // namespace

#if ON_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx512bw,avx512vl,avx2,fma,f16c")
namespace k_dense_bf16 {

// One weight row x M rows of x, read as one sequential stream (the rows of a chunk follow each other in memory, so
// the chunk is one stream for the prefetchers), 32 bf16 a step (vdpbf16ps: 16 fp32 lanes, each summing a pair); U
// accumulator sets take the steps in turn (U independent chains: a lone row's sums would wait on each other).
// The accumulators must live in registers: the prefetch is decided once a call (PF; a test of j.pf inside the loop
// let GCC version the loop around them) and their zeroing is unrolled (a loop GCC turns into a memset of a stack
// array). Either kept them on the stack, which cost a Zen 4 thread 30% of its read rate (bench/cpu/cpu_dense.py).
template <int M, int U, bool PF>
inline void row(const DenseJob& j, int64_t n) {
    __m512 acc[U][M];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 16
        for (int t = 0; t < M; ++t) acc[u][t] = _mm512_setzero_ps();
    const int64_t K = j.K, group = 32 * U, kg = K / group * group, kv = K / 32 * 32, pf = j.pf;
    const uint16_t* w = j.w + n * j.ldw;
    int64_t k = 0;
    for (; k < kg; k += group) {
        for (int u = 0; u < U; ++u) {
            if (PF) __builtin_prefetch(reinterpret_cast<const char*>(w + k + 32 * u) + pf, 0, 3);  // a line a step
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
            const uint16_t* xs = j.xp + (k + 32 * u) * M;  // step (k + 32 u) / 32's M rows of x, one after the other
            for (int t = 0; t < M; ++t)
                acc[u][t] = _mm512_dpbf16_ps(acc[u][t], wv, (__m512bh)_mm512_loadu_si512(xs + 32 * t));
        }
    }
    for (; k < kv; k += 32) {  // whole steps past the last group: the first set
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int t = 0; t < M; ++t)
            acc[0][t] = _mm512_dpbf16_ps(acc[0][t], wv, (__m512bh)_mm512_loadu_si512(j.xp + k * M + 32 * t));
    }
#pragma GCC unroll 16
    for (int t = 0; t < M; ++t) {
        __m512 a = acc[0][t];
#pragma GCC unroll 16
        for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[u][t]);
        float s = _mm512_reduce_add_ps(a);
        if (kv < K) s += dense_tail(w, j.x + t * K, kv, K);
        dense_store(j, t, n, s);
    }
}

template <int M>
void chunk(const DenseJob& j, int64_t n0, int64_t n1) {
    constexpr int U = M >= 16 ? 1 : 16 / M;  // 16 chains in all
    if (j.pf)
        for (int64_t n = n0; n < n1; ++n) row<M, U, true>(j, n);
    else
        for (int64_t n = n0; n < n1; ++n) row<M, U, false>(j, n);
}

}  // namespace k_dense_bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace k_dense_512 {

inline __m512 widen(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// As k_dense_bf16::row, 16 bf16 a step widened to fp32 (FMA).
template <int M, int U>
inline void row(const DenseJob& j, int64_t n) {
    __m512 acc[U][M];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 16
        for (int t = 0; t < M; ++t) acc[u][t] = _mm512_setzero_ps();
    const int64_t K = j.K, group = 16 * U, kg = K / group * group, kv = K / 16 * 16;
    const uint16_t* w = j.w + n * j.ldw;
    int64_t k = 0;
    for (; k < kg; k += group)
        for (int u = 0; u < U; ++u) {
            const __m512 wv = widen(w + k + 16 * u);
            for (int t = 0; t < M; ++t) acc[u][t] = _mm512_fmadd_ps(wv, widen(j.x + t * K + k + 16 * u), acc[u][t]);
        }
    for (; k < kv; k += 16) {
        const __m512 wv = widen(w + k);
        for (int t = 0; t < M; ++t) acc[0][t] = _mm512_fmadd_ps(wv, widen(j.x + t * K + k), acc[0][t]);
    }
#pragma GCC unroll 16
    for (int t = 0; t < M; ++t) {
        __m512 a = acc[0][t];
#pragma GCC unroll 16
        for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[u][t]);
        float s = _mm512_reduce_add_ps(a);
        if (kv < K) s += dense_tail(w, j.x + t * K, kv, K);
        dense_store(j, t, n, s);
    }
}

template <int M>
void chunk(const DenseJob& j, int64_t n0, int64_t n1) {
    constexpr int U = M >= 16 ? 1 : 16 / M;  // 16 chains in all (fewer lost half the rate: the sums' latency)
    for (int64_t n = n0; n < n1; ++n) row<M, U>(j, n);
}

}  // namespace k_dense_512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace k_dense_avx2 {

inline __m256 widen(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// As k_dense_bf16::row, 8 bf16 a step widened to fp32 (FMA).
template <int M, int U>
inline void row(const DenseJob& j, int64_t n) {
    __m256 acc[U][M];
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 16
        for (int t = 0; t < M; ++t) acc[u][t] = _mm256_setzero_ps();
    const int64_t K = j.K, group = 8 * U, kg = K / group * group, kv = K / 8 * 8;
    const uint16_t* w = j.w + n * j.ldw;
    int64_t k = 0;
    for (; k < kg; k += group)
        for (int u = 0; u < U; ++u) {
            const __m256 wv = widen(w + k + 8 * u);
            for (int t = 0; t < M; ++t) acc[u][t] = _mm256_fmadd_ps(wv, widen(j.x + t * K + k + 8 * u), acc[u][t]);
        }
    for (; k < kv; k += 8) {
        const __m256 wv = widen(w + k);
        for (int t = 0; t < M; ++t) acc[0][t] = _mm256_fmadd_ps(wv, widen(j.x + t * K + k), acc[0][t]);
    }
    for (int t = 0; t < M; ++t) {
        __m256 a = acc[0][t];
        for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[u][t]);
        float s = hsum(a);
        if (kv < K) s += dense_tail(w, j.x + t * K, kv, K);
        dense_store(j, t, n, s);
    }
}

template <int M>
void chunk(const DenseJob& j, int64_t n0, int64_t n1) {
    constexpr int U = M == 1 ? 4 : M == 2 ? 2 : 1;  // 16 ymm registers
    for (int64_t n = n0; n < n1; ++n) row<M, U>(j, n);
}

}  // namespace k_dense_avx2
#pragma GCC pop_options
#endif  // ON_X86

namespace {

using DenseChunkFn = void (*)(const DenseJob&, int64_t, int64_t);

#if ON_X86
// chunk functions indexed by M - 1, per instruction set
#define STRATA_DENSE_TABLE(ns)                                                                                     \
    {ns::chunk<1>,  ns::chunk<2>,  ns::chunk<3>,  ns::chunk<4>,  ns::chunk<5>,  ns::chunk<6>,  ns::chunk<7>,       \
     ns::chunk<8>,  ns::chunk<9>,  ns::chunk<10>, ns::chunk<11>, ns::chunk<12>, ns::chunk<13>, ns::chunk<14>,      \
     ns::chunk<15>, ns::chunk<16>}
const DenseChunkFn kDenseBf16[kDenseMaxRows] = STRATA_DENSE_TABLE(k_dense_bf16);
const DenseChunkFn kDense512[kDenseMaxRows] = STRATA_DENSE_TABLE(k_dense_512);
const DenseChunkFn kDenseAvx2[kDenseMaxRows] = STRATA_DENSE_TABLE(k_dense_avx2);
#undef STRATA_DENSE_TABLE
#endif

DenseChunkFn g_dense_fn = nullptr;  // the call's chunk function (set under g_call)
std::vector<uint16_t> g_dense_xp;   // the call's packed x (under g_call)

void dense_job(void* ctx, int tid) {
    DenseJob& j = *static_cast<DenseJob*>(ctx);
    for (;;) {
        const int64_t c = j.next.fetch_add(1, std::memory_order_relaxed);
        if (c >= j.n_chunks) break;
        const int64_t n0 = c * j.chunk;
        g_dense_fn(j, n0, std::min(j.N, n0 + j.chunk));
        j.done.fetch_add(1, std::memory_order_acq_rel);
    }
    if (tid == 0) spin_until([&] { return j.done.load(std::memory_order_acquire) >= j.n_chunks; });
}

}  // namespace

// y[M, ldy] (its first N columns; fp32, or bf16 with y_bf16) = x[M, K] @ w[N, ldw]^T (its first K columns), x and w
// bf16, M in [1, kDenseMaxRows], on `threads` threads of the kernel's pool. isa: ISA_AVX512_BF16, ISA_AVX512 or
// ISA_AVX2. Returns 0, or -1 (instruction set unavailable, bad sizes).
C_EXPORTED int strata_cpu_dense(int isa, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                int64_t ldw, void* y, int64_t ldy, int y_bf16, int threads) {
#if ON_X86
    if (M < 1 || M > kDenseMaxRows || K < 1 || N < 1 || ldw < K || ldy < N) return -1;
    if (!(strata_cpu_isa_mask() & (1 << isa))) return -1;
    const DenseChunkFn* table = isa == ISA_AVX512_BF16 ? kDenseBf16 : isa == ISA_AVX512 ? kDense512
                              : isa == ISA_AVX2 ? kDenseAvx2 : nullptr;
    if (!table) return -1;
    std::lock_guard<std::mutex> lk(g_call);
    g_dense_fn = table[M - 1];
    DenseJob j;
    j.x = x, j.w = w, j.y = y, j.y_bf16 = y_bf16 != 0;
    j.M = M, j.N = N, j.K = K, j.ldw = ldw, j.ldy = ldy;
    j.pf = (g_prefetch_bytes + 63) / 64 * 64;
    // x packed step by step ([K / 32][M][32]), so a step's M vectors are one block of L1, not M rows 2K bytes apart
    // (which share L1 sets with each other and with the weight row: M = 4 ran at half the one-row rate)
    const int64_t kv = K / 32 * 32;
    if (g_dense_xp.size() < size_t(M * kv)) g_dense_xp.resize(size_t(M * kv));
    for (int64_t k = 0; k < kv; k += 32)
        for (int64_t t = 0; t < M; ++t) std::memcpy(&g_dense_xp[size_t(k * M + 32 * t)], x + t * K + k, 64);
    j.xp = g_dense_xp.data();
    const int P = std::max(1, threads);
    // chunks of about total / (8 P) bytes in [32 KiB, 512 KiB], whole groups of 8 rows: long sequential streams, and
    // enough chunks that a thread delayed by the OS does not hold the others back
    const int64_t row_bytes = 2 * K, total = row_bytes * N;
    const int64_t bytes = std::clamp<int64_t>(total / (8 * int64_t(P)), 32 << 10, 512 << 10);
    j.chunk = std::max<int64_t>(8, bytes / row_bytes / 8 * 8);
    j.n_chunks = (N + j.chunk - 1) / j.chunk;
    // a small matrix (a router, a small model's projection) on the calling thread: waking the pool would cost
    // more than reading it (about 20 us at 25 GB/s)
    if (P == 1 || j.n_chunks == 1 || total < kDenseInlineBytes)
        dense_job(&j, 0);
    else
        get_pool(P)->run(dense_job, &j);
    return 0;
#else
    (void)isa, (void)x, (void)M, (void)K, (void)w, (void)N, (void)ldw, (void)y, (void)ldy, (void)y_bf16, (void)threads;
    return -1;
#endif
}
