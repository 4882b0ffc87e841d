// The CPU expert kernel's asynchronous calls (strata.kernels.cpu.experts.start_packed): one call at a time on a
// persistent launcher thread, while the thread that drives the GPU goes on.
//
// Included once, by cpu_experts.cpp, after strata_cpu_experts_act (cpu_experts_call.h).
#pragma once

// Asynchronous calls: `strata_cpu_experts_start` hands one call to a persistent launcher thread (share 0
// of the pool's job) and returns at once; `strata_cpu_experts_wait` blocks until it is done and returns
// its code, with the kernel's own run time in *seconds. The thread that drives the GPU can so start a
// layer's CPU experts and then issue its copies while they run. One call in flight at a time; every
// pointer must stay valid until `wait` returns.
namespace {
struct Launcher {
    std::mutex m;
    std::condition_variable cv;
    bool has_job = false, busy = false;
    int rc = 0, isa = 0, threads = 1;
    double seconds = 0.0;
    const float* x = nullptr;
    int64_t N = 0, H = 0, E = 0;
    const int64_t *meta = nullptr, *fmt = nullptr, *scales = nullptr, *bias = nullptr;
    const double* act = nullptr;
    float* out = nullptr;
    pid_t pid = getpid();
    std::thread th;

    Launcher() { th = std::thread([this] { loop(); }); th.detach(); }
    void loop() {
        for (;;) {
            std::unique_lock<std::mutex> lk(m);
            cv.wait(lk, [&] { return has_job; });
            has_job = false;
            lk.unlock();
            const auto t0 = std::chrono::steady_clock::now();
            const int r = strata_cpu_experts_act(isa, x, N, H, E, meta, fmt, scales, nullptr, act, bias, out, threads,
                                                 nullptr);
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            lk.lock();
            rc = r, seconds = dt, busy = false;
            lk.unlock();
            cv.notify_all();
        }
    }
};
Launcher* g_launcher = nullptr;  // never freed: its detached thread lives as long as the process
std::mutex g_launcher_m;
}  // namespace

// (act, bias: strata_cpu_experts_act's, optional)
C_EXPORTED int strata_cpu_experts_start(int isa, const float* x, int64_t N, int64_t H, int64_t E, const int64_t* meta,
                                        const int64_t* fmt, const int64_t* scales, const double* act,
                                        const int64_t* bias, float* out, int threads) {
    Launcher* l;
    {
        std::lock_guard<std::mutex> lk(g_launcher_m);
        if (g_launcher && g_launcher->pid != getpid()) g_launcher = nullptr;  // inherited through fork(): no thread
        if (!g_launcher) g_launcher = new Launcher();
        l = g_launcher;
    }
    std::unique_lock<std::mutex> lk(l->m);
    l->cv.wait(lk, [&] { return !l->busy; });  // one call in flight
    l->isa = isa, l->x = x, l->N = N, l->H = H, l->E = E, l->meta = meta, l->out = out, l->threads = threads;
    l->fmt = fmt, l->scales = scales, l->act = act, l->bias = bias;
    l->busy = l->has_job = true;
    lk.unlock();
    l->cv.notify_all();
    return 0;
}

C_EXPORTED int strata_cpu_experts_wait(double* seconds) {
    Launcher* l;
    {
        std::lock_guard<std::mutex> lk(g_launcher_m);
        l = g_launcher;
    }
    if (!l) return 0;
    std::unique_lock<std::mutex> lk(l->m);
    l->cv.wait(lk, [&] { return !l->busy; });
    if (seconds) *seconds = l->seconds;
    return l->rc;
}
