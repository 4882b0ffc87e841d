// The CPU expert kernel's per-call trace (strata_cpu_trace, strata_cpu_trace_threads) and its scheduling knobs
// (strata_cpu_tune): what bench/cpu/cpu_kernel_trace.py and bench/tools/hotpath.py measure with, through
// strata/kernels/cpu/tuning.py. None of the knobs changes a result.
//
// Included once, by cpu_experts.cpp, after its Job, its globals (g_call, g_trace*, the knobs) and the kernels.
#pragma once

namespace {
// Sums over traced calls (strata_cpu_trace): [0] calls, ns of [1] set-up before the pool runs, [2] the last
// thread's arrival, [3] phase 1 (until its last chunk is done), [4] a thread's mean wait at the barrier,
// [5] phase 2 (after phase 1), [6] a thread's mean idle time at the end, [7] closing the job, [8] threads that
// joined, [9] the whole call, [10] bytes of weights read, [11] phase-1 chunks, [12] down chunks claimed ahead.
void trace_add(const Job& job, int P, int64_t t_call, int64_t t_run, int64_t bytes) {
    const int64_t t_ret = mono_ns();
    int64_t joined = 0, claimed = 0, last_in = t_run, p1_end = t_run, p2_end = t_run, wait = 0, idle = 0;
    for (int t = 0; t < P; ++t) {
        const int64_t* r = job.trace + kTraceRow * t;
        if (!r[0]) continue;
        ++joined;
        last_in = std::max(last_in, r[0]), p1_end = std::max(p1_end, r[1]), p2_end = std::max(p2_end, r[3]);
    }
    for (int t = 0; t < P; ++t) {
        const int64_t* r = job.trace + kTraceRow * t;
        if (!r[0]) continue;
        wait += r[2] - r[1];
        idle += p2_end - r[3];
        claimed += r[4];
        if (t < kTraceThreads) {
            int64_t* th = g_trace_thr[t];
            th[0] += 1, th[1] += r[0] - t_run, th[2] += r[5] - t_run, th[3] += r[1] - t_run;
        }
    }
    for (size_t t = 0; t < job.static_rows.size() && t < size_t(kTraceThreads); ++t)
        g_trace_thr[t][4] += job.static_rows[t];  // joined or not: the piece was its own
    int64_t* a = g_trace_acc;
    a[0] += 1, a[1] += t_run - t_call, a[2] += last_in - t_run, a[3] += p1_end - t_run;
    a[4] += joined ? wait / joined : 0, a[5] += p2_end - p1_end, a[6] += joined ? idle / joined : 0;
    a[7] += t_ret - p2_end, a[8] += joined, a[9] += t_ret - t_call, a[10] += bytes;
    a[11] += int64_t(job.chunks1.size()), a[12] += claimed;
}
}  // namespace

// Turn the per-call trace on (1: and zero its sums) or off (0); with `acc` (13 int64), copy the sums out first.
C_EXPORTED int strata_cpu_trace(int on, int64_t* acc) {
    std::lock_guard<std::mutex> lk(g_call);
    if (acc) std::memcpy(acc, g_trace_acc, sizeof(g_trace_acc));
    if (on == 1) std::memset(g_trace_acc, 0, sizeof(g_trace_acc)), std::memset(g_trace_thr, 0, sizeof(g_trace_thr));
    if (on >= 0) g_trace = on == 1;
    return 0;
}

// The trace's per-thread sums (since it was last turned on) for threads [0, n), n <= 64, into out [n, 5]: calls
// joined, then ns after the pool ran until the thread arrived, had done its warm rows' pieces, had done its part of
// the gate/up phase, then the rows its warm pieces held in every call, joined or not (what its read reached).
// Returns the threads copied.
C_EXPORTED int strata_cpu_trace_threads(int64_t* out, int n) {
    std::lock_guard<std::mutex> lk(g_call);
    n = std::clamp(n, 0, kTraceThreads);
    std::memcpy(out, g_trace_thr, sizeof(int64_t) * kTraceThrRow * size_t(n));
    return n;
}

// Set knob `key` to `value` (< 0: leave it) and return its value before: 1 down chunks a thread claims and
// reads ahead while phase 1 finishes (0 off, at most 16), 2 the chunk divisor (chunks of total / (div x
// threads) bytes), 3 and 4 the chunk size's floor and ceiling in bytes, 5 down rows paired across a chunk's
// halves (1) or adjacent (0), 6 warm-ahead's rows read at once (1-8), 7 one line in N touched by it (1-8),
// 8 the dynamic chunks sized from the rows not read ahead (1) or from the whole call (0), 9 the rows of a warm piece
// its thread's read did not reach left to the dynamic chunks (1) or to that thread (0). -1 for an unknown key.
C_EXPORTED int64_t strata_cpu_tune(int64_t key, int64_t value) {
    std::lock_guard<std::mutex> lk(g_call);
    int64_t* knob = key == 1 ? &g_claim_max : key == 2 ? &g_chunk_div : key == 3 ? &g_chunk_min
                  : key == 4 ? &g_chunk_max : key == 5 ? &g_down_split : key == 6 ? &g_warm_streams
                  : key == 7 ? &g_warm_touch : key == 8 ? &g_rest_chunks : key == 9 ? &g_read_split
                  : key == 10 ? &g_down_stream : nullptr;
    if (!knob) return -1;
    const int64_t old = *knob;
    if (value >= 0)
        *knob = key == 1   ? std::min<int64_t>(value, kMaxClaim)
                : key == 10 ? value
                : key == 5 || key >= 8 ? int64_t(value != 0)
                : key >= 6 ? std::clamp<int64_t>(value, 1, 8)
                           : std::max<int64_t>(value, 1);
    return old;
}
