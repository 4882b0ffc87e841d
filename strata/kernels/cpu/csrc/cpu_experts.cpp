// strata CPU expert kernel: all the cold experts of one MoE layer in one threaded call.
//
// SwiGLU expert: y = down(act(gate(x), up(x))), act silu(gate) * up or the call's SwiGLU form (clamped, scaled, offset,
// a gate_up bias added first: cpu_experts_act.h); per expert a gate_up [2I, H] (gate rows then up rows, or the two
// interleaved) and a down [H, I], each its own buffer, in bf16, block-scaled FP8, MXFP4 or GGUF blocks (one format a
// call; cpu_experts_formats.h, cpu_experts_gguf.h), converted in registers as they are read. For N = 1..32 tokens per
// expert the work is a memory-bound GEMV: every weight row is read once from RAM and used for all of the expert's
// tokens.
//
//   phase 1  (gate/up)  chunks of intermediate rows j of every expert, taken dynamically by the
//                       threads: h_e[t, j] = act(<gate_j, x_t>, <up_j, x_t>)   (one writer per element)
//   then, once every phase-1 chunk is finished (a thread waits only for chunks in progress, never
//   for a thread that has not woken up yet; one that finds no phase-1 chunk left claims a few phase-2
//   chunks and reads their weights meanwhile, so its wait is spent on RAM traffic):
//   phase 2  (down)     chunks of output rows h, each over all experts in the given order, two rows at a
//                       time from the chunk's two halves (two streams a thread):
//                       out[tok, h] += w_e,t * <down_h, h_e[t]>                    (one writer per element)
//
// One fork/join per layer on a persistent pool (the caller is thread 0; workers spin for a while
// between calls, then sleep; cpu_pool.h); the layer's call, which checks its arguments and builds the job, is in
// cpu_experts_call.h, warm-ahead's read of the next layer's rows in cpu_warm.h, the trace and the scheduling knobs in
// cpu_tuning.h. No torch headers: the Python side calls the extern "C" functions below (and those of the headers
// included at the end) through ctypes with raw pointers (which also releases the GIL while the kernel runs).
//
// Instruction sets, chosen at run time (the file itself is compiled for plain x86-64):
//   1  avx2         AVX2 + FMA, bf16 -> fp32 by shifts, fp32 activations, fp32 accumulation
//   2  avx512       AVX-512F, same numerics as avx2 with 16 lanes
//   3  avx512_bf16  AVX-512 BF16 vdpbf16ps: activations and the intermediate rounded to bf16 (RNE),
//                   products summed in fp32; FP8 weights need AVX512_VBMI too (bit ISA_VBMI of the mask)
// and the portable emulations of 2 and 3 (4, 5: cpu_experts_emu.h). The weight loads are in cpu_experts_isa.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#define ON_X86 1
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's AVX-512 headers (`__m512 __Y = __Y;`)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#else
#define ON_X86 0
#endif

#define C_EXPORTED extern "C" __attribute__((visibility("default")))
#define META_FIELDS 7  // int64 fields of an expert's meta row (strata_cpu_experts)

#include "cpu_pool.h"

#include "cpu_bf16.h"

#include "cpu_experts_formats.h"  // FMT_*, Mat and the rows of each format, the conversion tables
#include "cpu_experts_act.h"      // SwiGLU: the form between gate/up and down, which rows pair, the gate_up bias

namespace {
struct ExpertArg {
    const uint8_t* gate_up;  // values [2 ld, H] in the call's format (cpu_experts_formats.h): gate rows, then up rows
                             // (or the two interleaved: Job::act)
    const uint8_t* down;     // values [H, ld]
    const int64_t* idx;       // [T] rows of x
    const float* w;           // [T] routing weights
    int64_t T;
    int64_t I;   // the leading intermediate rows computed here: all (ld), or a split expert's CPU part
    int64_t ld;  // the expert's intermediate size: the row stride of down, and where up starts in gate_up
    int64_t warm = 0;  // leading rows whose gate/up the pool read ahead (strata_cpu_warm): computed by the same threads
    const void* gate_up_scales = nullptr;  // fp8: float [ceil(2 ld / bn), ceil(H / bk)]; mxfp4: uint8 [2 ld, H / 32]
    const void* down_scales = nullptr;     // fp8: float [ceil(H / bn), ceil(ld / bk)]; mxfp4: uint8 [H, ld / 32]
    const float* bias = nullptr;           // [2 ld] gate_up's bias in its row order, added before the form (none: 0)
};

struct Chunk {
    int64_t e, r0, r1;
};

constexpr int64_t kClaimBytes = 2 << 20;  // down chunks' bytes one thread may claim and read ahead
constexpr int64_t kMaxClaim = 16;  // down chunks one thread may claim ahead (strata_cpu_tune clamps to it)
constexpr int64_t kTraceRow = 6;   // entries of a thread's row in Job::trace

struct Job {
    int64_t N = 0, H = 0, E = 0;
    int fmt = FMT_BF16;    // every expert's weight format
    int64_t bn = 1, bk = 1;  // fp8's block
    SwiGLU act;              // the experts' form (cpu_experts_act.h)
    const void* xact = nullptr;  // [N, H] activations: float, or bf16 for avx512_bf16
    void* hbuf = nullptr;        // intermediate activations of every expert: [T_e, I_e] at hoff[e]
    std::vector<int64_t> hoff;
    const ExpertArg* experts = nullptr;  // the experts with tokens, in the caller's order
    float* out = nullptr;                // [N, H] fp32, added into
    std::vector<Chunk> chunks1;
    int64_t down_rows = 2, n_down_chunks = 0;
    int64_t pf = 0;  // software prefetch distance in bytes, whole 64-byte lines (0: off)
    bool down_split = false;  // phase 2 pairs a row from each half of a chunk (two streams) instead of adjacent rows
    int64_t claim_max = 0;  // down chunks a thread may claim and read ahead while phase 1 finishes (0 off, <= kMaxClaim)
    int64_t* trace = nullptr;  // tracing only: per thread [entered, phase 1 left, phase 2 begun, left] ns, claimed,
                               // its warm rows' pieces done (ns): kTraceRow entries
    // Phase-1 chunks [0, n_static) are the warm rows' pieces (strata_cpu_warm's split): piece k belongs to thread
    // k % P, which read its rows into its own caches; a piece its owner has not taken by the time a thread runs
    // out of other work is taken by that thread (`taken`), so a late thread delays nobody.
    int64_t n_static = 0, P = 1;
    std::vector<int64_t> static_rows;  // [P] rows of thread t's static pieces (empty: no warm rows)
    std::unique_ptr<std::atomic<int32_t>[]> taken;
    std::unique_ptr<std::atomic<int32_t>[]> arrived;  // [P] 1 once thread t is in the job: its pieces are its own
    std::atomic<int64_t> stolen{0};  // static pieces computed by a thread other than their owner
    std::atomic<int64_t> next1{0}, next2{0};  // next chunk to take, per phase (phase 1: past the static pieces)
    std::atomic<int64_t> done1{0}, done2{0};  // chunks finished, per phase
};

// Thread t's piece of an expert's leading `warm` rows: [warm t / P, warm (t + 1) / P). strata_cpu_warm reads
// exactly these rows on thread t, and the kernel computes them there first.
inline int64_t warm_bound(int64_t warm, int64_t t, int64_t P) { return warm * t / P; }

struct ReadJob {
    std::vector<std::pair<const char*, int64_t>> chunks;
    int64_t pf = 0;
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<uint64_t> checksum{0};
};

std::mutex g_call;  // one layer at a time; guards everything below
Pool* g_pool = nullptr;
int g_spin_us = 100;
int64_t g_prefetch_bytes = 2048;
// strata_cpu_tune's knobs: down chunks claimed ahead, chunk size = total / (g_chunk_div * threads) in
// [g_chunk_min, g_chunk_max] bytes, down rows paired across a chunk's halves (g_down_split)
// Defaults from bench/cpu/cpu_kernel_trace.py on the H200 box's 16-core Xeon (code ca71889):
// claiming 4 down chunks ahead took a quarter to 0.6 of an expert from 44.7 / 83.4 to 38-39 / 72-75 us a call, and
// pairing down rows across a chunk's halves read a whole expert's down 10-17% faster.
int64_t g_claim_max = 4, g_chunk_div = 8, g_chunk_min = 32 << 10, g_chunk_max = 512 << 10, g_down_split = 1;
// Warm-ahead's read (strata_cpu_warm): g_warm_streams rows at once, interleaved line by line (more misses in
// flight, the L2 streamer on each: 4 read ~30% more bytes in decode's serial phase than 1, bench/tools/hotpath.py,
// code 4f07018), one line touched in g_warm_touch (more than 1 loses: the prefetcher does not fill the
// others). The kernel's dynamic gate/up chunks sized from the rows not read ahead (g_rest_chunks; 0: the call's);
// the rows of a thread's piece its read did not reach left to them (g_read_split; 0: the piece's owner does them).
int64_t g_warm_streams = 4, g_warm_touch = 1, g_rest_chunks = 1, g_read_split = 1;
// Down chunks hold at least g_down_stream bytes of each expert's rows in a row (per stream: half of them with
// g_down_split), as long as every thread still gets g_chunk_div chunks: a chunk's bytes are spread over every expert
// of the call, and each expert's run starts with a RAM latency, so a prompt's call (every expert: chunks of two rows)
// read its down rows at about half the RAM rate (bench/cpu/cpu_experts.py --experts-per-call, docs/benchmarks.md).
int64_t g_down_stream = 128 << 10;
bool g_trace = false;
std::vector<int64_t> g_trace_rows;
int64_t g_trace_acc[13] = {};
// per pool thread (up to kTraceThreads): calls joined, then ns after the pool ran until it arrived, finished its
// warm rows' pieces, finished its part of the gate/up phase, then the rows of its warm pieces (summed over calls;
// strata_cpu_trace_threads)
constexpr int kTraceThreads = 64, kTraceThrRow = 5;
int64_t g_trace_thr[kTraceThreads][kTraceThrRow] = {};
std::vector<int> g_cpus;
std::vector<uint8_t> g_hbuf, g_xbuf;

void drop_pool() {
    if (g_pool && g_pool->pid() == getpid()) delete g_pool;
    g_pool = nullptr;  // a pool inherited through fork() has no threads: leak it
}

Pool* get_pool(int n) {
    if (g_pool && (g_pool->pid() != getpid() || g_pool->size() != n)) drop_pool();
    if (!g_pool) g_pool = new Pool(n, g_spin_us, g_cpus);
    return g_pool;
}

struct AtFork {
    AtFork() {
        pthread_atfork([] { g_call.lock(); }, [] { g_call.unlock(); }, [] { g_call.unlock(); });
    }
} g_atfork;

}  // namespace

// ---------------------------------------------------------------------------------------------------
// The kernel, once per instruction set.
#include "cpu_experts_gguf.h"  // GGUF block types: layouts, decoders, the call's permuted activations (g_gguf)
#if ON_X86
#include "cpu_experts_isa.h"  // k_avx2, k_avx512, k_avx512bf16 (and the AVX2 read probe)
#endif

#include "cpu_experts_emu.h"

// ---------------------------------------------------------------------------------------------------
// C API (ctypes): the instruction sets, the pool's settings and the read probe here; the layer's call and the rest
// in the headers included below.

enum { ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3, ISA_EMU_AVX512 = 4, ISA_EMU_AVX512_BF16 = 5, ISA_VBMI = 6 };

// Bit (1 << isa) set for every instruction set this CPU (and OS) can run; bit ISA_VBMI: AVX512_VBMI, which
// avx512_bf16 needs for FP8 weights.
C_EXPORTED int strata_cpu_isa_mask() {
    int mask = (1 << ISA_EMU_AVX512) | (1 << ISA_EMU_AVX512_BF16);
#if ON_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        mask |= 1 << ISA_AVX2;
    if ((mask & (1 << ISA_AVX2)) && __builtin_cpu_supports("avx512f")) mask |= 1 << ISA_AVX512;
    if ((mask & (1 << ISA_AVX512)) && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bf16"))
        mask |= 1 << ISA_AVX512_BF16;
    if ((mask & (1 << ISA_AVX512_BF16)) && __builtin_cpu_supports("avx512vbmi")) mask |= 1 << ISA_VBMI;
#endif
    return mask;
}

// Worker pinning (ncpus < 0: unchanged), spin time (< 0: unchanged) and software prefetch distance
// in bytes (< 0: unchanged, 0: off). The pool is re-created on the next call.
C_EXPORTED int strata_cpu_configure(int spin_us, const int* cpus, int ncpus, int64_t prefetch_bytes) {
    std::lock_guard<std::mutex> lk(g_call);
    if (spin_us >= 0) g_spin_us = spin_us;
    if (ncpus >= 0) g_cpus.assign(cpus, cpus + ncpus);
    if (prefetch_bytes >= 0) g_prefetch_bytes = prefetch_bytes;
    drop_pool();
    return 0;
}

// Read n buffers once with `threads` threads (the pool of the kernel), for a RAM bandwidth figure.
// Returns an xor checksum of the data (so the reads cannot be optimised away); 0 without AVX2.
C_EXPORTED uint64_t strata_cpu_read_sweep(const void* const* ptrs, const int64_t* sizes, int64_t n, int threads) {
#if ON_X86
    if (!(strata_cpu_isa_mask() & (1 << ISA_AVX2))) return 0;
    std::lock_guard<std::mutex> lk(g_call);
    ReadJob job;
    const int64_t piece = 256 << 10;
    for (int64_t b = 0; b < n; ++b)
        for (int64_t off = 0; off < sizes[b]; off += piece)
            job.chunks.push_back({static_cast<const char*>(ptrs[b]) + off, std::min(piece, sizes[b] - off)});
    job.pf = g_prefetch_bytes;
    const int P = std::max(1, threads);
    if (P == 1)
        k_avx2::read_job(&job, 0);
    else
        get_pool(P)->run(k_avx2::read_job, &job);
    return job.checksum.load();
#else
    (void)ptrs, (void)sizes, (void)n, (void)threads;
    return 0;
#endif
}

C_EXPORTED int strata_cpu_meta_fields() { return META_FIELDS; }

C_EXPORTED int strata_cpu_shutdown() {
    std::lock_guard<std::mutex> lk(g_call);
    drop_pool();
    return 0;
}

#include "cpu_tuning.h"  // the per-call trace and the knobs
#include "cpu_warm.h"  // warm-ahead's read; the kernel asks it how far each thread got (warm_read_pairs)

#include "cpu_experts_call.h"  // strata_cpu_experts_act and its shorter forms: one layer's call

#include "cpu_experts_async.h"  // strata_cpu_experts_start / _wait: one call on a launcher thread

#include "cpu_dense.h"  // strata_cpu_dense: bf16 weight rows times a few rows of activations, on the same pool
