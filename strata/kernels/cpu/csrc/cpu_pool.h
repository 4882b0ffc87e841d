// strata CPU kernels' thread pool: one fork/join per call, workers that spin between calls and then sleep.
//
// Included once, by cpu_experts.cpp (after it defines ON_X86 and includes <immintrin.h> on x86-64).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <ctime>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

namespace {

inline void cpu_relax() {
#if ON_X86
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

using Clock = std::chrono::steady_clock;

inline int64_t mono_ns() {  // CLOCK_MONOTONIC, as Python's time.monotonic_ns
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Spin with pause; after `patience` of spinning, yield the core on every further check.
template <class Pred>
inline void spin_until(Pred done, std::chrono::microseconds patience = std::chrono::microseconds(200)) {
    for (int k = 0; k < 4096; ++k) {
        if (done()) return;
        cpu_relax();
    }
    const auto t0 = Clock::now();
    while (!done()) {
        if (Clock::now() - t0 > patience) {
            sched_yield();
        } else {
            for (int k = 0; k < 64; ++k) cpu_relax();
        }
    }
}

using JobFn = void (*)(void*, int);

// Persistent worker pool. The caller runs share 0 of every job; workers join it when they wake up.
// A worker that wakes late (descheduled, oversubscribed machine) joins only while the job is open and
// simply finds no chunks left: nobody waits for a thread that holds no work. The caller closes the job
// when all chunks are done and waits for the workers still inside it (finishing their last chunk), unless
// the job is detached: then a worker still inside (descheduled mid-piece) finishes on its own while the next
// job runs. Jobs alternate between two slots by generation parity, each with its own entry word, function
// and context, so such a worker never sees the next job's; a slot is reused only once its workers have left
// (`drain_next`), and a detached job's context must stay valid until then.
class Pool {
   public:
    Pool(int n, int spin_us, const std::vector<int>& cpus) : n_(n), spin_us_(spin_us), cpus_(cpus), pid_(getpid()) {
        for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t] { loop(t); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_.store(true, std::memory_order_relaxed);
            gen_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        for (auto& w : workers_) w.join();
    }
    int size() const { return n_; }
    pid_t pid() const { return pid_; }

    // The slot (0 or 1) the next run() uses.
    int next_slot() const { return int((gen_.load(std::memory_order_relaxed) + 1) & 1); }
    // Wait until no worker is left inside the job that last used the next run()'s slot (a detached job's); returns
    // the ns waited. A detached job's caller calls it before rewriting that slot's context.
    int64_t drain_next() {
        Slot& s = slots_[next_slot()];
        if ((s.entry.load(std::memory_order_acquire) & kCount) == 0) return 0;
        const int64_t t0 = mono_ns();
        spin_until([&] { return (s.entry.load(std::memory_order_acquire) & kCount) == 0; });
        return mono_ns() - t0;
    }

    // Wait until no worker is left inside any job (detached ones included).
    void drain_all() {
        for (Slot& s : slots_) spin_until([&] { return (s.entry.load(std::memory_order_acquire) & kCount) == 0; });
    }

    // fn(ctx, 0) must return only when the whole job is done; workers run fn(ctx, tid) to help. With `detach`, run()
    // returns without waiting for workers still inside fn (ctx must outlive them: see drain_next).
    void run(JobFn fn, void* ctx, bool detach = false) {
        drain_next();
        const uint64_t g = gen_.load(std::memory_order_relaxed) + 1;
        Slot& s = slots_[g & 1];
        s.fn = fn;
        s.ctx = ctx;
        s.entry.store(((g & kGenMask) << 32) | kOpen, std::memory_order_release);
        bool wake;
        {
            std::lock_guard<std::mutex> lk(m_);
            gen_.store(g, std::memory_order_release);
            wake = sleepers_ > 0;
        }
        if (wake) cv_.notify_all();
        fn(ctx, 0);
        s.entry.fetch_and(~kOpen, std::memory_order_acq_rel);
        if (!detach) spin_until([&] { return (s.entry.load(std::memory_order_acquire) & kCount) == 0; });
    }

   private:
    static constexpr uint64_t kOpen = 1ull << 31, kCount = kOpen - 1, kGenMask = 0xffffffffull;

    struct Slot {
        std::atomic<uint64_t> entry{0};  // (job number << 32) | open bit | workers inside the job
        JobFn fn = nullptr;              // written before entry opens the job, read by workers that entered it
        void* ctx = nullptr;
    };

    bool enter(Slot& slot, uint64_t g) {
        uint64_t s = slot.entry.load(std::memory_order_acquire);
        for (;;) {
            if ((s >> 32) != (g & kGenMask) || !(s & kOpen)) return false;
            if (slot.entry.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire))
                return true;
        }
    }

    void loop(int tid) {
        if (!cpus_.empty()) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus_[tid % cpus_.size()], &set);
            pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
        }
        uint64_t seen = 0;  // gen_ at construction: a worker that starts late still sees every job and stop
        for (;;) {
            uint64_t g = gen_.load(std::memory_order_acquire);
            if (g == seen) {  // spin for spin_us, then sleep
                const auto t0 = Clock::now();
                const auto patience = std::chrono::microseconds(spin_us_);
                for (int k = 0;; ++k) {
                    g = gen_.load(std::memory_order_acquire);
                    if (g != seen) break;
                    if ((k & 255) == 255 && Clock::now() - t0 > patience) {
                        std::unique_lock<std::mutex> lk(m_);
                        ++sleepers_;
                        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen || stop_.load(); });
                        --sleepers_;
                        g = gen_.load(std::memory_order_acquire);
                        break;
                    }
                    cpu_relax();
                }
            }
            seen = g;
            if (stop_.load(std::memory_order_relaxed)) return;
            Slot& slot = slots_[g & 1];
            if (enter(slot, g)) {
                slot.fn(slot.ctx, tid);
                slot.entry.fetch_sub(1, std::memory_order_acq_rel);
            }
        }
    }

    const int n_;
    const int spin_us_;
    const std::vector<int> cpus_;
    const pid_t pid_;
    std::vector<std::thread> workers_;
    std::mutex m_;
    std::condition_variable cv_;
    int sleepers_ = 0;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> gen_{0};  // job number, bumped by run()
    Slot slots_[2];                 // job g uses slots_[g & 1]
};

}  // namespace
