// strata mailbox worker, copy-engine copy-ahead: once the worker has answered layer l, it issues the copies of
// layer l+1's predicted cold experts' tails (their last intermediate rows) from page-locked RAM into VRAM staging
// slots, on a stream of its own, through the CUDA driver. The copy engine moves them while the GPU runs the
// serial part between the two layers (the combine, attention, routing), which an SM copy would slow down.
//
// The plan comes from the GPU (strata.kernels.copy_ahead.plan_ahead, on the step's copy-ahead stream) in host
// memory, one per layer parity b: int64 [tag, src[S], dst[S], rows[S]]; `tag` (written last, with release
// semantics) is generation * TAG_STRIDE + the planned layer, so the worker copies only this step's plan. A plan
// not yet written when the worker looks (a late plan kernel) is skipped and counted. After a layer's copies the
// worker copies that tag into the layer's device flag (stream order: after the data), and the next layer's pack
// uses the staged rows only if the flag holds this step's tag (strata.kernels.mailbox_pack, GATE): a copy that
// lands late is simply not used.
//
// The copies are issued by a thread of their own (`Copier::loop`), which the worker only posts to: a driver call can
// block (on the H200 box one did, the first version issued them from the worker: while the decoding thread sat in a
// synchronous CUDA call, the worker waited in cuMemcpyHtoDAsync, and the GPU waited for the worker's next answer).
// However late the copier gets, the worker keeps answering and the flags keep late tails out; its requests are
// served in order on one stream, so every tail copy of a layer lands before any later flag does.
//
// No CUDA header or library is linked: the driver's entry points come as addresses (from Python's ctypes), with
// their documented signatures; CPU tests pass host-memcpy stand-ins.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STRATA_AHEAD_PAUSE() _mm_pause()
#else
#define STRATA_AHEAD_PAUSE() std::this_thread::yield()
#endif

namespace strata_ahead {

constexpr int64_t TAG_STRIDE = 65536;  // tag = generation * TAG_STRIDE + layer (strata.runtime.copy_ahead)

// cuda.h's CUDA_MEMCPY2D (v2), field for field
struct Memcpy2D {
    size_t srcXInBytes, srcY;
    int srcMemoryType;  // CU_MEMORYTYPE_HOST = 1, DEVICE = 2
    const void* srcHost;
    uint64_t srcDevice;
    void* srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void* dstHost;
    uint64_t dstDevice;
    void* dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
};

using CtxSetCurrent = int (*)(void* ctx);                                                // cuCtxSetCurrent
using MemcpyHtoDAsync = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);  // cuMemcpyHtoDAsync_v2
using Memcpy2DAsync = int (*)(const Memcpy2D* p, void* stream);                          // cuMemcpy2DAsync_v2

struct Copier {
    int64_t S = 0, H = 0, I = 0, elem = 2, down_off = 0;  // slots a plan, hidden, intermediate, bytes, down's offset
    void* ctx = nullptr;
    void* stream = nullptr;
    CtxSetCurrent set_ctx = nullptr;
    MemcpyHtoDAsync h2d = nullptr;
    Memcpy2DAsync h2d_2d = nullptr;
    std::vector<int64_t> next;   // per box: the layer it plans (-1: none)
    int64_t* plans = nullptr;    // [2, 1 + 3S] int64, host (written by the GPU)
    int64_t* flag_host = nullptr;  // [boxes, 2] int64: each box's tag by generation parity, its flag copy's source
    std::vector<uint64_t> flag_dev;  // per box: the device flag of the layer it plans
    int64_t* counters = nullptr;  // [0] tails copied [1] bytes [2] plans not ready [3] driver errors [4] copies issued
                                  // [5] requests dropped (the copier RING requests behind)
    bool ctx_set = false, broken = false;
    int64_t spin_ns = 2000000;  // poll without sleeping this long after the last request
    static constexpr int64_t RING = 64;
    int64_t ring_box[RING] = {}, ring_gen[RING] = {};
    std::atomic<int64_t> head{0}, tail{0};  // requests posted (by the worker), served (by the copier)
    std::atomic<bool> stop{false};
    std::thread th;

    void start() { th = std::thread([this] { loop(); }); }

    ~Copier() {
        stop.store(true);
        if (th.joinable()) th.join();
    }

    // The worker, after answering box i of generation gen: have its planned layer's tails copied. Never blocks.
    void post(size_t i, int64_t gen) {
        const int64_t h = head.load(std::memory_order_relaxed);
        if (next[i] < 0) return;
        if (h - tail.load(std::memory_order_acquire) >= RING) {
            counters[5] += 1;
            return;
        }
        ring_box[h % RING] = int64_t(i), ring_gen[h % RING] = gen;
        head.store(h + 1, std::memory_order_release);
    }

    void loop() {
        auto last = std::chrono::steady_clock::now();
        while (!stop.load(std::memory_order_relaxed)) {
            const int64_t t = tail.load(std::memory_order_relaxed);
            if (t < head.load(std::memory_order_acquire)) {
                issue(size_t(ring_box[t % RING]), ring_gen[t % RING]);
                tail.store(t + 1, std::memory_order_release);
                last = std::chrono::steady_clock::now();
                continue;
            }
            const auto idle = std::chrono::steady_clock::now() - last;
            if (idle < std::chrono::nanoseconds(spin_ns)) {
                for (int j = 0; j < 16; ++j) STRATA_AHEAD_PAUSE();
            } else {
                std::this_thread::sleep_for(std::chrono::microseconds(50));
            }
        }
    }

    // After box i (generation gen) is answered: issue its planned layer's tail copies and the flag.
    void issue(size_t i, int64_t gen) {
        const int64_t m = next[i];
        if (m < 0 || broken) return;
        if (!ctx_set) {
            if (set_ctx(ctx) != 0) {
                broken = true;
                counters[3] += 1;
                return;
            }
            ctx_set = true;
        }
        const int64_t* plan = plans + (m & 1) * (1 + 3 * S);
        const int64_t tag = gen * TAG_STRIDE + m;
        if (reinterpret_cast<const volatile int64_t*>(plan)[0] != tag) {  // this step's plan not written (yet)
            counters[2] += 1;
            return;
        }
        std::atomic_thread_fence(std::memory_order_acquire);
        int64_t src[64], dst[64], rows[64];  // the plan read once, then its tag again: not rewritten meanwhile
        const int64_t n = S < 64 ? S : 64;
        for (int64_t s = 0; s < n; ++s) src[s] = plan[1 + s], dst[s] = plan[1 + S + s], rows[s] = plan[1 + 2 * S + s];
        std::atomic_thread_fence(std::memory_order_acquire);
        if (reinterpret_cast<const volatile int64_t*>(plan)[0] != tag) {
            counters[2] += 1;
            return;
        }
        int rc = 0;
        for (int64_t s = 0; s < n && rc == 0; ++s) {
            const int64_t a = rows[s];
            if (a <= 0 || a > I || src[s] == 0 || dst[s] == 0) continue;
            const auto* host = reinterpret_cast<const char*>(src[s]);
            const uint64_t dev = uint64_t(dst[s]);
            const size_t run = size_t(a * H * elem);
            for (const int64_t first : {I - a, 2 * I - a}) {  // gate's last a rows, then up's, of gate_up [2I, H]
                const int64_t off = first * H * elem;
                rc = rc ? rc : h2d(dev + off, host + off, run, stream);
            }
            Memcpy2D p{};  // down [H, I]: its last a columns, H runs of a elements
            const int64_t off = down_off + (I - a) * elem;
            p.srcMemoryType = 1, p.srcHost = host + off, p.srcPitch = size_t(I * elem);
            p.dstMemoryType = 2, p.dstDevice = dev + uint64_t(off), p.dstPitch = size_t(I * elem);
            p.WidthInBytes = size_t(a * elem), p.Height = size_t(H);
            rc = rc ? rc : h2d_2d(&p, stream);
            counters[0] += 1;
            counters[1] += 3 * run;
            counters[4] += 3;
        }
        if (rc == 0) {  // the flag's source, read by the copy engine after the tails (stream order). By parity: a
            // slot is rewritten two steps later, when its last copy (queued ~1 ms of link time at most) is long done
            int64_t* source = flag_host + 2 * i + (gen & 1);
            *source = tag;
            rc = h2d(flag_dev[i], source, sizeof(int64_t), stream);
        }
        if (rc != 0) {  // no flag written: the pack leaves this layer's tails unused; stop copying for good
            broken = true;
            counters[3] += 1;
        }
    }
};

}  // namespace strata_ahead
