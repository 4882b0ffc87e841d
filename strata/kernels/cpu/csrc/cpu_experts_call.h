// One layer's call of the CPU expert kernel, the entry point the Python side packs its experts for
// (strata.kernels.cpu.experts.run_packed): strata_cpu_experts_act checks the arguments, converts the activations for
// the instruction set (bf16, MXFP4's order, GGUF's layouts), builds the job (the warm rows' pieces, the gate/up and
// down chunks, sized by the knobs) and runs it on the pool; strata_cpu_experts_fmt, strata_cpu_experts_warm and
// strata_cpu_experts are it with fewer arguments.
//
// Included once, by cpu_experts.cpp, after its Job, its globals (g_call, get_pool, the knobs), the kernels, the ISA
// codes, cpu_tuning.h (trace_add) and cpu_warm.h (warm_read_pairs); cpu_experts_async.h follows it.
#pragma once

// out[N, H] (fp32, contiguous) += sum over experts of w * expert(x[idx]).
// meta: E rows of META_FIELDS int64: gate_up ptr, down ptr (their values), idx ptr (int64), w ptr (fp32), T, I, ld:
// the expert's first I of its ld intermediate rows (I < ld: the CPU's part of an expert split with the GPU, which
// computes the rest). fmt (optional: bf16): int64 [format, bn, bk] (FMT_*; fp8's block; GGUF: bn the byte offset of
// up's rows in gate_up); scales (with fmt FP8, MXFP4 or GGUF): E rows of int64 [gate_up scales ptr, down scales ptr]
// (GGUF: the blob's header, gate's and up's type ids, and down's). Every expert of a call has the one format.
// Returns 0, -1 (instruction set unavailable or bad sizes), -2 (token index out of range), -5 (a format this
// instruction set cannot read, or bad format arguments).
// warm (optional, [E] int64): of each expert, the leading rows whose gate/up `strata_cpu_warm` read ahead on this
// pool with the same thread count; each thread computes its own piece of them first (its caches hold them).
// stolen (optional): set to how many of those pieces another thread computed. The results do not depend on it.
// act (optional: plain): double [limit (+inf: none), alpha, up_offset, interleaved], the SwiGLU form; bias (optional):
// E int64, the address of each expert's fp32 gate_up bias [2 ld] (0: none). -6: a form no SwiGLU has.
C_EXPORTED int strata_cpu_experts_act(int isa, const float* x, int64_t N, int64_t H, int64_t E, const int64_t* meta,
                                      const int64_t* fmt, const int64_t* scales, const int64_t* warm, const double* act,
                                      const int64_t* bias, float* out, int threads, int64_t* stolen) {
    if (stolen) *stolen = 0;
    if (N <= 0 || H <= 0 || E < 0) return -1;
    SwiGLU form;
    if (!swiglu_of(act, form)) return -6;
    const int mask = strata_cpu_isa_mask();
    if (isa < ISA_AVX2 || isa > ISA_EMU_AVX512_BF16 || !(mask & (1 << isa))) return -1;
    const int f = fmt ? int(fmt[0]) : FMT_BF16;
    const int64_t bn = fmt ? fmt[1] : 1, bk = fmt ? fmt[2] : 1;
    if (f != FMT_BF16 && f != FMT_FP8 && f != FMT_MXFP4 && f != FMT_GGUF) return -5;
    if (f != FMT_BF16 && !scales) return -5;
    if (f == FMT_FP8 && (bn <= 0 || bk <= 0)) return -5;
    if (f == FMT_FP8 && isa == ISA_AVX512_BF16 && !(mask & (1 << ISA_VBMI))) return -5;
    if (f == FMT_MXFP4 && H % kMxGroup) return -5;
    if (f == FMT_GGUF && (bn <= 0 || (isa != ISA_AVX512_BF16 && isa != ISA_EMU_AVX512_BF16))) return -5;  // bn: up's
    std::vector<ExpertArg> experts;
    experts.reserve(E);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t* m = meta + META_FIELDS * e;
        ExpertArg a{reinterpret_cast<const uint8_t*>(m[0]), reinterpret_cast<const uint8_t*>(m[1]),
                    reinterpret_cast<const int64_t*>(m[2]), reinterpret_cast<const float*>(m[3]), m[4], m[5], m[6]};
        if (a.T < 0 || a.I <= 0 || a.ld < a.I) return -1;
        if (f == FMT_MXFP4 && a.ld % kMxGroup) return -5;
        if (a.T == 0) continue;
        if (f != FMT_BF16) {
            a.gate_up_scales = reinterpret_cast<const void*>(scales[2 * e]);
            a.down_scales = reinterpret_cast<const void*>(scales[2 * e + 1]);
        }
        a.warm = warm ? std::clamp<int64_t>(warm[e], 0, a.ld) : 0;
        a.bias = bias ? reinterpret_cast<const float*>(bias[e]) : nullptr;
        for (int64_t t = 0; t < a.T; ++t)
            if (a.idx[t] < 0 || a.idx[t] >= N) return -2;
        experts.push_back(a);
    }
    if (experts.empty()) return 0;
    if (f == FMT_GGUF && !gguf_readable(experts, H)) return -5;
    std::lock_guard<std::mutex> lk(g_call);
    const int64_t t_call = g_trace ? mono_ns() : 0;
    const int P = std::max(1, threads);
    Job job;
    job.N = N;
    job.H = H;
    job.E = static_cast<int64_t>(experts.size());
    job.fmt = f, job.bn = bn, job.bk = bk, job.act = form;
    job.experts = experts.data();
    job.out = out;

    const bool bf16_act = isa == ISA_AVX512_BF16 || isa == ISA_EMU_AVX512_BF16;
    const size_t hsz = bf16_act ? 2 : 4;
    // bytes of weight values read (scales, 1/16 of MXFP4's and less of FP8's, are not counted)
    const int64_t pair_bytes = f == FMT_GGUF ? gguf_pair_bytes(experts[0], H) : 2 * fmt_bytes(f, H);  // gate + up row
    int64_t htotal = 0, gate_up_bytes = 0, down_row_bytes = 0;
    for (const auto& ex : experts) {
        job.hoff.push_back(htotal);
        htotal += ex.T * ex.I;
        gate_up_bytes += pair_bytes * ex.I;
        down_row_bytes += down_bytes(f, ex, ex.I);
    }
    if (g_hbuf.size() < size_t(htotal) * hsz + 64) g_hbuf.resize(size_t(htotal) * hsz + 64);
    job.hbuf = g_hbuf.data();
    if (bf16_act) {
        if (g_xbuf.size() < size_t(N * H) * 2) g_xbuf.resize(size_t(N * H) * 2);
        uint16_t* xb = reinterpret_cast<uint16_t*>(g_xbuf.data());
        if (f == FMT_MXFP4) {  // in the order avx512_bf16 reads MXFP4 values (K::mx_x_position)
            for (int64_t n = 0; n < N; ++n)
                for (int64_t i = 0; i < H; ++i) xb[n * H + mx_step_x_position(i, H)] = f32_to_bf16(x[n * H + i]);
        } else {
            for (int64_t i = 0; i < N * H; ++i) xb[i] = f32_to_bf16(x[i]);
        }
        job.xact = xb;
    } else {
        job.xact = x;
    }
    if (f == FMT_GGUF) gguf_begin(job, static_cast<const uint16_t*>(job.xact), htotal);  // (bf16 backends only)

    // Chunks of about total / (8 P) bytes, clamped to [32 KiB, 512 KiB]: long sequential streams for the
    // prefetchers, and enough chunks that a thread delayed by the OS does not hold the others back.
    auto chunk_bytes = [&](int64_t total) {
        return std::clamp<int64_t>(total / (g_chunk_div * int64_t(P)), g_chunk_min, g_chunk_max);
    };
    // The warm rows' pieces first (thread t's: index t mod P), clipped to I: of each, the rows t's read brought into
    // its caches (warm_read_pairs; all of them with g_read_split off, or when that read is not known); the rest of a
    // piece, read from RAM whoever computes it, joins the dynamic chunks (a thread descheduled in the read would
    // otherwise stream its piece's rest alone while the others wait at the barrier).
    std::vector<Chunk> rest;  // rows left to the dynamic chunks: pieces' unread tails, then each expert's cold rows
    job.P = P;
    for (int64_t e = 0; e < job.E; ++e) {
        const ExpertArg& ex = experts[e];
        if (ex.warm <= 0) continue;
        if (job.static_rows.empty()) job.static_rows.assign(size_t(P), 0);  // (a call with nothing warm: none)
        for (int64_t t = 0; t < P; ++t) {
            const int64_t r0 = warm_bound(ex.warm, t, P), b0 = std::min(ex.I, r0);
            const int64_t b1 = std::min(ex.I, warm_bound(ex.warm, t + 1, P));
            const int64_t got = g_read_split ? warm_read_pairs(ex.gate_up, ex.warm, t, P) : -1;
            const int64_t mid = got < 0 ? b1 : std::clamp(r0 + got, b0, b1);
            job.chunks1.push_back({e, b0, mid});
            job.static_rows[size_t(t)] += mid - b0;
            if (mid < b1) rest.push_back({e, mid, b1});
        }
    }
    for (int64_t e = 0; e < job.E; ++e)
        if (experts[e].warm < experts[e].I) rest.push_back({e, std::max<int64_t>(0, experts[e].warm), experts[e].I});
    // the dynamic chunks share out the rows not in the static pieces: sized from those alone, or a few chunks sized
    // from the whole call (the warm rows being most of it) leave threads waiting at the barrier for the last one
    int64_t dynamic_bytes = gate_up_bytes;
    for (const int64_t r : job.static_rows) dynamic_bytes -= g_rest_chunks ? pair_bytes * r : 0;
    const int64_t pairs = std::max<int64_t>(1, chunk_bytes(dynamic_bytes) / pair_bytes);
    job.n_static = static_cast<int64_t>(job.chunks1.size());
    if (job.n_static) {
        job.taken.reset(new std::atomic<int32_t>[size_t(job.n_static)]);
        for (int64_t k = 0; k < job.n_static; ++k) job.taken[k].store(0, std::memory_order_relaxed);
        job.arrived.reset(new std::atomic<int32_t>[size_t(P)]);
        for (int t = 0; t < P; ++t) job.arrived[t].store(0, std::memory_order_relaxed);
    }
    for (const Chunk& r : rest)
        for (int64_t j = r.r0; j < r.r1; j += pairs) job.chunks1.push_back({r.e, j, std::min(r.r1, j + pairs)});
    int64_t rows = std::max<int64_t>(2, chunk_bytes(down_row_bytes * H) / down_row_bytes);
    const int64_t row_mean = std::max<int64_t>(1, down_row_bytes / std::max<int64_t>(1, job.E));  // one expert's row
    const int64_t streams = g_down_split ? 2 : 1;
    rows = std::max(rows, std::min(streams * ((g_down_stream + row_mean - 1) / row_mean), H / (g_chunk_div * P)));
    rows += rows & 1;
    job.down_rows = rows;
    job.n_down_chunks = (H + rows - 1) / rows;
    job.pf = (g_prefetch_bytes + 63) / 64 * 64;  // whole 64-byte lines
    // claimed chunks are read into this core's L2 while phase 1 finishes: no more than kClaimBytes of them
    job.claim_max = std::min<int64_t>(g_claim_max, kClaimBytes / std::max<int64_t>(1, rows * down_row_bytes));
    job.down_split = g_down_split != 0;
    if (g_trace) {
        g_trace_rows.assign(size_t(kTraceRow * P), 0);
        job.trace = g_trace_rows.data();
    }

    JobFn fn = k_emu512::run_job;
    switch (isa) {
#if ON_X86
        case ISA_AVX2: fn = k_avx2::run_job; break;
        case ISA_AVX512: fn = k_avx512::run_job; break;
        case ISA_AVX512_BF16: fn = k_avx512bf16::run_job; break;
#endif
        case ISA_EMU_AVX512: fn = k_emu512::run_job; break;
        case ISA_EMU_AVX512_BF16: fn = k_emu512bf16::run_job; break;
        default: return -1;
    }
    const int64_t t_run = job.trace ? mono_ns() : 0;
    if (P == 1) {
        fn(&job, 0);
    } else {
        get_pool(P)->run(fn, &job);
    }
    if (job.trace) trace_add(job, P, t_call, t_run, gate_up_bytes + down_row_bytes * H);
    if (stolen) *stolen = job.stolen.load();
    return 0;
}

// strata_cpu_experts_act on the plain SwiGLU.
C_EXPORTED int strata_cpu_experts_fmt(int isa, const float* x, int64_t N, int64_t H, int64_t E, const int64_t* meta,
                                      const int64_t* fmt, const int64_t* scales, const int64_t* warm, float* out,
                                      int threads, int64_t* stolen) {
    return strata_cpu_experts_act(isa, x, N, H, E, meta, fmt, scales, warm, nullptr, nullptr, out, threads, stolen);
}

// strata_cpu_experts_fmt on bf16 experts.
C_EXPORTED int strata_cpu_experts_warm(int isa, const float* x, int64_t N, int64_t H, int64_t E, const int64_t* meta,
                                       const int64_t* warm, float* out, int threads, int64_t* stolen) {
    return strata_cpu_experts_fmt(isa, x, N, H, E, meta, nullptr, nullptr, warm, out, threads, stolen);
}

C_EXPORTED int strata_cpu_experts(int isa, const float* x, int64_t N, int64_t H, int64_t E, const int64_t* meta,
                                  const int64_t* fmt, const int64_t* scales, float* out, int threads) {
    return strata_cpu_experts_fmt(isa, x, N, H, E, meta, fmt, scales, nullptr, out, threads, nullptr);
}
