// The CPU expert kernel's job, per weight format: a thread's share of a layer's two phases (gate/up chunks, then down
// chunks), the warm rows' pieces and the down chunks read ahead. cpu_experts_kernel.h includes it at its end, inside
// each instruction set's namespace, after the row loops it calls (gate_up_rows, down_rows, the GGUF passes).

// A phase's rows in the format F (GGUF experts through their own row loops).
template <class F>
static inline void gate_up_of(const Job& job, int64_t e, int64_t j0, int64_t j1) {
    if constexpr (std::is_same_v<F, ReadGguf>)
        gguf_gate_up_rows<K>(job, e, j0, j1);
    else
        gate_up_rows<F>(job, e, j0, j1);
}
template <class F>
static inline void down_of(const Job& job, int64_t h0, int64_t h1) {
    if constexpr (std::is_same_v<F, ReadGguf>)
        gguf_down_rows<K>(job, h0, h1);
    else
        down_rows<F>(job, h0, h1);
}

// Read phase-2 chunk c's down rows once (every expert's [h0, h1) x I), so that computing it later hits this
// core's L2: what a thread does with its wait for the last phase-1 chunks instead of spinning.
static void read_ahead_down(const Job& job, int64_t c) {
    const int64_t h0 = c * job.down_rows, h1 = std::min(job.H, h0 + job.down_rows);
    for (int64_t e = 0; e < job.E; ++e) {
        const ExpertArg& ex = job.experts[e];
        const int64_t stride = down_bytes(job.fmt, ex, ex.ld), n = down_bytes(job.fmt, ex, ex.I);
        for (int64_t h = h0; h < h1; ++h) {
            const volatile uint8_t* row = ex.down + h * stride;
            for (int64_t b = 0; b < n; b += 64) (void)row[b];  // one load a 64-byte line (volatile: kept)
        }
    }
}

template <class F>
static void down_chunk(Job& job, int64_t c) {
    const int64_t h0 = c * job.down_rows;
    down_of<F>(job, h0, std::min(job.H, h0 + job.down_rows));
    job.done2.fetch_add(1, std::memory_order_acq_rel);
}

// One thread's share of a layer: gate/up chunks; once every gate/up chunk is finished, down chunks.
// The warm rows' pieces go to the thread that read them ahead (strata_cpu_warm), the rest is taken
// dynamically; tid 0 (the caller) returns only when every down chunk is finished. A thread that finds no
// gate/up chunk left claims up to `claim_max` down chunks and reads their weights while the others finish
// phase 1, then computes them first: the same writer per element, so the same sums.
template <class F>
static void run_job_fmt(void* ctx, int tid) {
    Job& job = *static_cast<Job*>(ctx);
    int64_t* tr = job.trace ? job.trace + kTraceRow * tid : nullptr;
    if (tr) tr[0] = mono_ns();
    const int64_t n1 = static_cast<int64_t>(job.chunks1.size()), n2 = job.n_down_chunks, ns = job.n_static;
    auto piece = [&](int64_t k) {  // static piece k, if nobody has taken it yet
        if (job.taken[k].exchange(1, std::memory_order_acq_rel) != 0) return;
        const Chunk& ch = job.chunks1[k];
        if (ch.r0 < ch.r1) {  // empty: its owner's read reached none of it (the dynamic chunks hold its rows)
            gate_up_of<F>(job, ch.e, ch.r0, ch.r1);
            if (k % job.P != tid) job.stolen.fetch_add(1, std::memory_order_relaxed);
        }
        job.done1.fetch_add(1, std::memory_order_acq_rel);
    };
    if (ns) job.arrived[tid].store(1, std::memory_order_release);
    for (int64_t k = tid; k < ns; k += job.P) piece(k);  // this thread's warm rows first: they are in its caches
    if (tr) tr[5] = mono_ns();
    for (;;) {
        const int64_t c = ns + job.next1.fetch_add(1, std::memory_order_relaxed);
        if (c >= n1) break;
        const Chunk& ch = job.chunks1[c];
        gate_up_of<F>(job, ch.e, ch.r0, ch.r1);
        job.done1.fetch_add(1, std::memory_order_acq_rel);
    }
    // pieces of threads that have not come (yet); not an arrived thread's: read from another core's L2 they cost
    // twice what they cost from RAM (`bench/cpu/cpu_kernel_trace.py --warm`, code 4d973f8), and their owner is on its
    // way to them
    for (int64_t k = 0; k < ns; ++k)
        if (!job.arrived[k % job.P].load(std::memory_order_acquire)) piece(k);
    if (tr) tr[1] = mono_ns();
    int64_t claimed[kMaxClaim];
    int64_t nc = 0;
    while (nc < job.claim_max && job.done1.load(std::memory_order_acquire) != n1) {
        const int64_t c = job.next2.fetch_add(1, std::memory_order_relaxed);
        if (c >= n2) break;
        claimed[nc++] = c;
        read_ahead_down(job, c);
    }
    spin_until([&] { return job.done1.load(std::memory_order_acquire) == n1; });
    if (tr) tr[2] = mono_ns(), tr[4] = nc;
    for (int64_t i = 0; i < nc; ++i) down_chunk<F>(job, claimed[i]);
    for (;;) {
        const int64_t c = job.next2.fetch_add(1, std::memory_order_relaxed);
        if (c >= n2) break;
        down_chunk<F>(job, c);
    }
    if (tr) tr[3] = mono_ns();
    if (tid == 0) spin_until([&] { return job.done2.load(std::memory_order_acquire) == n2; });
}

// The job's entry point for its weight format (Job::fmt).
static void run_job(void* ctx, int tid) {
    switch (static_cast<Job*>(ctx)->fmt) {
        case FMT_FP8: run_job_fmt<ReadFp8>(ctx, tid); break;
        case FMT_MXFP4: run_job_fmt<ReadMx>(ctx, tid); break;
        case FMT_GGUF: run_job_fmt<ReadGguf>(ctx, tid); break;
        default: run_job_fmt<ReadBf16>(ctx, tid); break;
    }
}
