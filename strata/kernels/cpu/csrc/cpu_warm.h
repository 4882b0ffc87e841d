// Warm-ahead's read (strata_cpu_warm): the gate/up rows of the next layer's predicted cold experts read into the
// caches of the kernel's threads, each thread the piece the kernel will give it, while the GPU runs the serial part of
// a layer; the kernel (strata_cpu_experts_warm) then computes those rows on those threads, from their L2.
//
// Included once, by cpu_experts.cpp, after its pool, its globals (g_call, get_pool, the g_warm_* knobs) and
// warm_bound.
#pragma once

namespace {
// One warm-ahead read. Detached (the caller does not wait for a thread descheduled mid-piece once the next layer is
// posted), so it lives in a slot of its own per pool slot (g_warm_jobs), with its own copy of the addresses (plain
// arrays: nothing to destroy under a straggler at exit), until its last thread has left; `halt`, set by the caller
// once it returns, keeps such a thread off `stop` afterwards.
struct WarmJob {
    static constexpr int64_t kMax = 64;  // experts a read (more are not read; a few fill warm-ahead's budget)
    static constexpr int kMaxThreads = 64;  // threads whose progress is kept (a larger pool: the kernel assumes all read)
    int64_t addr[kMax] = {};  // [n] each expert's gate_up values [2 ld, H], rows of row_bytes
    int64_t rows[kMax] = {};  // [n] leading rows to read (gate rows j and up rows ld + j; interleaved: 2j, 2j + 1)
    int64_t n = 0, row_bytes = 0, ld = 0, P = 1;
    bool interleaved = false;  // the experts' SwiGLU form interleaves gate and up rows (cpu_experts_act.h)
    int64_t streams = 1, touch = 1;  // rows read at once, line-interleaved; one 64-byte line touched in `touch`
    const volatile int64_t* stop = nullptr;  // stop reading once *stop != stop_val (the next layer is posted)
    int64_t stop_val = 0;
    std::atomic<bool> halt{false};
    std::atomic<int64_t> bytes{0}, finished{0};
    // [P] rows thread t has read so far in its order (experts in turn; gate row j, then up row ld + j): a read stopped
    // early leaves each thread's piece read only up to here, and the kernel shares out the rest (warm_read_pairs)
    std::atomic<int64_t> got[kMaxThreads] = {};
    bool stopped() const { return halt.load(std::memory_order_acquire) || (stop && *stop != stop_val); }
};

WarmJob g_warm_jobs[2];  // strata_cpu_warm's, one per pool slot (Pool::next_slot)
const WarmJob* g_warm_last = nullptr;  // the read started last (its rows are what the next kernel call finds warm)
// strata_cpu_test_straggler: pool thread g_straggler_tid sleeps g_straggler_us inside its next warm read (a thread
// descheduled mid-piece, for the tests); g_straggler_in counts such entries
std::atomic<int> g_straggler_tid{-1}, g_straggler_in{0};
int64_t g_straggler_us = 0;

// Thread tid's piece of every expert's warm rows, gate row j and up row ld + j (interleaved: 2j, 2j + 1), one load
// a touched 64-byte line (volatile: kept), `streams` rows at a time interleaved line by line, so the kernel's static
// pieces find them in this core's L2. Stops early once *stop changes.
void warm_job(void* ctx, int tid) {
    WarmJob& job = *static_cast<WarmJob*>(ctx);
    if (tid > 0 && g_straggler_tid.load() == tid && g_straggler_tid.exchange(-1) == tid) {
        g_straggler_in.fetch_add(1);
        std::this_thread::sleep_for(std::chrono::microseconds(g_straggler_us));
    }
    const int64_t row = job.row_bytes, step = 64 * job.touch;  // bytes
    int64_t bytes = 0, g = 0, rows_read = 0;
    const volatile uint8_t* group[8];
    auto read_group = [&]() {  // false once stopped
        for (int64_t b = 0; b < row; b += step) {
            if ((b & 1023) < step && job.stopped()) return false;  // every 1 KB: the GPU waits for nobody
            for (int64_t q = 0; q < g; ++q) (void)group[q][b];
        }
        bytes += g * row, rows_read += g, g = 0;
        if (tid < WarmJob::kMaxThreads) job.got[tid].store(rows_read, std::memory_order_relaxed);
        return true;
    };
    for (int64_t e = 0; e < job.n; ++e) {
        const auto* gu = reinterpret_cast<const volatile uint8_t*>(job.addr[e]);
        const int64_t w = std::clamp<int64_t>(job.rows[e], 0, job.ld);  // as the kernel clamps it
        for (int64_t j = warm_bound(w, tid, job.P); j < warm_bound(w, tid + 1, job.P); ++j)
            for (const int64_t r : {job.interleaved ? 2 * j : j, job.interleaved ? 2 * j + 1 : job.ld + j}) {
                group[g++] = gu + r * row;
                if (g == job.streams && !read_group()) goto done;
            }
    }
    if (g) read_group();
done:
    job.bytes.fetch_add(bytes, std::memory_order_relaxed);
    job.finished.fetch_add(1, std::memory_order_acq_rel);
    // the caller keeps the job open until every thread has read its piece (unlike the kernel's chunks, a piece
    // belongs to one thread), or until the next layer is posted; then it leaves without waiting for the rest
    if (tid == 0) spin_until([&] { return job.finished.load(std::memory_order_acquire) == job.P || job.stopped(); });
}

// Of the leading `warm` rows of the expert whose gate_up is at `gu`, how many of thread t's piece (from
// warm_bound(warm, t, P)) the last read brought into t's caches, counted in gate/up row pairs; -1 when that read
// did not cover this expert with these rows and threads (the kernel then takes the whole piece as read).
int64_t warm_read_pairs(const void* gu, int64_t warm, int64_t t, int64_t P) {
    const WarmJob* job = g_warm_last;
    if (!job || job->P != P || P > WarmJob::kMaxThreads) return -1;
    int64_t before = 0;  // rows thread t read of the experts ahead of this one, in its order
    for (int64_t q = 0; q < job->n; ++q) {
        const int64_t w = std::clamp<int64_t>(job->rows[q], 0, job->ld);
        const int64_t piece = 2 * (warm_bound(w, t + 1, P) - warm_bound(w, t, P));
        if (job->addr[q] == reinterpret_cast<int64_t>(gu) && w == warm) {
            const int64_t got = job->got[t].load(std::memory_order_relaxed) - before;
            return std::clamp<int64_t>(got, 0, piece) / 2;
        }
        before += piece;
    }
    return -1;
}
}  // namespace

// Read the gate/up weights of experts' leading rows into the caches of the pool's threads, each thread the piece
// the kernel will give it (`strata_cpu_experts_fmt` with the same rows and thread count): addr [n] the addresses of
// gate_up's values ([2 ld] rows of row_bytes: 2 H in bf16, H in FP8, H / 2 in MXFP4; scales are not read), rows [n].
// Returns the bytes read; stops early (a partial read is harmless) once
// *stop != stop_val, where stop is given: the word the next layer's post changes, and then returns without
// waiting for threads still inside (descheduled mid-piece: they finish on their own, their bytes uncounted, and
// take no part in the next kernel call, whose other threads do their pieces). held_ns (optional): set to how long
// the call waited for such threads of an earlier call before it could reuse their slot. interleaved: the rows of
// experts whose SwiGLU form interleaves gate and up (gate_up rows 2j and 2j + 1 for row j).
C_EXPORTED int64_t strata_cpu_warm_form(const int64_t* addr, const int64_t* rows, int64_t n, int64_t row_bytes,
                                        int64_t ld, int interleaved, int threads, const int64_t* stop,
                                        int64_t stop_val, int64_t* held_ns) {
    if (held_ns) *held_ns = 0;
    if (n <= 0 || row_bytes <= 0 || ld <= 0) return 0;
    std::lock_guard<std::mutex> lk(g_call);
    const int P = std::max(1, threads);
    Pool* pool = P > 1 ? get_pool(P) : nullptr;
    // the slot's last job may still hold a straggler (one thread: slot 0, whatever pool holds it)
    int64_t held = 0;
    if (pool) {
        held = pool->drain_next();
    } else if (g_pool && g_pool->pid() == getpid()) {
        const int64_t t0 = mono_ns();
        g_pool->drain_all();
        held = mono_ns() - t0;
    }
    if (held_ns) *held_ns = held;
    WarmJob& job = g_warm_jobs[pool ? pool->next_slot() : 0];
    n = std::min(n, WarmJob::kMax);
    std::copy(addr, addr + n, job.addr), std::copy(rows, rows + n, job.rows);
    job.n = n, job.row_bytes = row_bytes, job.ld = ld, job.P = P, job.interleaved = interleaved != 0;
    job.stop = stop, job.stop_val = stop_val;
    job.streams = g_warm_streams, job.touch = g_warm_touch;
    job.halt.store(false, std::memory_order_relaxed);
    job.bytes.store(0, std::memory_order_relaxed);
    job.finished.store(0, std::memory_order_relaxed);
    for (int t = 0; t < std::min(P, WarmJob::kMaxThreads); ++t) job.got[t].store(0, std::memory_order_relaxed);
    g_warm_last = &job;
    if (pool)
        pool->run(warm_job, &job, /*detach=*/true);
    else
        warm_job(&job, 0);
    const int64_t bytes = job.bytes.load();
    job.halt.store(true, std::memory_order_release);  // a thread still inside reads nothing more, `stop` included
    return bytes;
}

// strata_cpu_warm_form on experts whose gate rows come first.
C_EXPORTED int64_t strata_cpu_warm_bytes(const int64_t* addr, const int64_t* rows, int64_t n, int64_t row_bytes,
                                         int64_t ld, int threads, const int64_t* stop, int64_t stop_val,
                                         int64_t* held_ns) {
    return strata_cpu_warm_form(addr, rows, n, row_bytes, ld, 0, threads, stop, stop_val, held_ns);
}

// strata_cpu_warm_bytes on bf16 experts of hidden size H (rows of 2 H bytes).
C_EXPORTED int64_t strata_cpu_warm(const int64_t* addr, const int64_t* rows, int64_t n, int64_t H, int64_t ld,
                                   int threads, const int64_t* stop, int64_t stop_val, int64_t* held_ns) {
    return strata_cpu_warm_bytes(addr, rows, n, 2 * H, ld, threads, stop, stop_val, held_ns);
}

// For the tests: pool thread `tid` (> 0) sleeps `us` at the start of its piece of the next warm read, as if
// descheduled there. Returns how many such sleeps have begun so far.
C_EXPORTED int strata_cpu_test_straggler(int tid, int64_t us) {
    if (tid > 0) g_straggler_us = us, g_straggler_tid.store(tid);
    return g_straggler_in.load();
}

// Wait until no thread of the pool is inside a job (a warm-ahead read's stragglers): before freeing what such a
// read may touch (the experts' memory, the stop word).
C_EXPORTED int strata_cpu_warm_drain() {
    std::lock_guard<std::mutex> lk(g_call);
    if (g_pool && g_pool->pid() == getpid()) g_pool->drain_all();
    return 0;
}
