// Batched positional reads for strata's disk reader (strata/tiers/native_io.py).
//
// One call reads a list of runs (file offset, length) into one buffer with `threads` threads (the caller
// and threads - 1 started for the call), each taking the next run from a shared counter. The Python
// thread that calls it through ctypes gives up the GIL for the whole batch: an Engram layer's few dozen
// small O_DIRECT reads cost one Python call, not a task, a frame and a GIL hand-off per read (which the
// decode thread, busy launching the step, pays for).
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <thread>
#include <unistd.h>
#include <vector>

#define STRATA_API extern "C" __attribute__((visibility("default")))

namespace {

struct Runs {
    int fd;
    int64_t n;
    const int64_t* file_off;
    const int64_t* len;
    const int64_t* need;
    uint8_t* base;
    const int64_t* buf_off;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> status{0};  // 0, an errno (> 0), or -1 - i for run i short of its bytes
};

int64_t read_one(const Runs& r, int64_t i) {
    int64_t got = 0;
    while (got < r.need[i]) {
        ssize_t k = pread(r.fd, r.base + r.buf_off[i] + got, static_cast<size_t>(r.len[i] - got), r.file_off[i] + got);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (k == 0) return -1 - i;
        got += k;
    }
    return 0;
}

void work(Runs* r) {
    for (int64_t i; (i = r->next.fetch_add(1, std::memory_order_relaxed)) < r->n;) {
        if (r->status.load(std::memory_order_relaxed) != 0) return;  // a read failed: stop early
        int64_t s = read_one(*r, i);
        if (s != 0) {
            int64_t zero = 0;
            r->status.compare_exchange_strong(zero, s);
        }
    }
}

}  // namespace

// For i < n: read len[i] bytes at file_off[i] into base + buf_off[i], looping over partial reads; at least
// need[i] of them must exist (an O_DIRECT read asks for whole blocks; the file's last block may be short).
// Returns 0; the errno (> 0) of a read that failed; or -1 - i when run i met the end of the file first.
STRATA_API int64_t strata_pread_runs(int fd, int64_t n, const int64_t* file_off, const int64_t* len,
                                     const int64_t* need, uint8_t* base, const int64_t* buf_off, int threads) {
    Runs r{fd, n, file_off, len, need, base, buf_off};
    int64_t extra = std::min<int64_t>(std::max(threads, 1), n) - 1;
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(std::max<int64_t>(extra, 0)));
    try {
        for (int64_t t = 0; t < extra; ++t) pool.emplace_back(work, &r);
    } catch (...) {  // no more threads: the ones started (and this one) do the rest
    }
    work(&r);
    for (auto& t : pool) t.join();
    return r.status.load();
}
