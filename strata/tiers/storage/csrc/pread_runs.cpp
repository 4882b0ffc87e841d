// Batched positional reads for strata's disk reader (strata/tiers/storage/native_io.py), and a wait on a word of
// page-locked memory that a GPU writes (the Engram rows' handshake, strata/tiers/rows/handshake.py).
//
// One call reads a list of runs (file offset, length) into one buffer with `threads` threads (the caller
// and threads - 1 started for the call), each taking the next run from a shared counter. The Python
// thread that calls it through ctypes gives up the GIL for the whole batch: an Engram layer's few dozen
// small O_DIRECT reads cost one Python call, not a task, a frame and a GIL hand-off per read (which the
// decode thread, busy launching the step, pays for).
#include <linux/aio_abi.h>
#include <sys/syscall.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <thread>
#include <time.h>
#include <unistd.h>
#include <vector>

#define C_EXPORTED extern "C" __attribute__((visibility("default")))

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
C_EXPORTED int64_t strata_pread_runs(int fd, int64_t n, const int64_t* file_off, const int64_t* len,
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

// The same reads submitted at once through Linux native AIO (io_submit on an O_DIRECT fd is asynchronous: all
// of a layer's small reads are in flight together from one thread, with no threads to start). Same returns as
// strata_pread_runs, or AIO_UNAVAILABLE when the kernel refuses the context (the caller then uses threads).
// A run that comes back short of its `need` (or -EAGAIN) is finished with pread.
static constexpr int64_t AIO_UNAVAILABLE = INT64_MIN;
static constexpr long AIO_DEPTH = 256;

C_EXPORTED int64_t strata_aio_runs(int fd, int64_t n, const int64_t* file_off, const int64_t* len, const int64_t* need,
                                   uint8_t* base, const int64_t* buf_off) {
    thread_local aio_context_t ctx = 0;
    thread_local bool failed = false;
    if (failed) return AIO_UNAVAILABLE;
    if (ctx == 0 && syscall(SYS_io_setup, AIO_DEPTH, &ctx) < 0) {
        failed = true;
        return AIO_UNAVAILABLE;
    }
    Runs r{fd, n, file_off, len, need, base, buf_off};
    std::vector<iocb> cbs(static_cast<size_t>(std::min<int64_t>(n, AIO_DEPTH)));
    std::vector<iocb*> ptrs(cbs.size());
    std::vector<io_event> events(cbs.size());
    for (int64_t a = 0; a < n; a += AIO_DEPTH) {  // waves of at most AIO_DEPTH reads
        int64_t m = std::min<int64_t>(AIO_DEPTH, n - a);
        for (int64_t j = 0; j < m; ++j) {
            int64_t i = a + j;
            iocb& cb = cbs[j];
            cb = iocb{};
            cb.aio_data = static_cast<uint64_t>(i);
            cb.aio_lio_opcode = IOCB_CMD_PREAD;
            cb.aio_fildes = static_cast<uint32_t>(fd);
            cb.aio_buf = reinterpret_cast<uint64_t>(base + buf_off[i]);
            cb.aio_nbytes = static_cast<uint64_t>(len[i]);
            cb.aio_offset = file_off[i];
            ptrs[j] = &cb;
        }
        int64_t submitted = 0;
        while (submitted < m) {
            long k = syscall(SYS_io_submit, ctx, m - submitted, ptrs.data() + submitted);
            if (k < 0) {
                if (errno == EINTR || errno == EAGAIN) continue;
                int64_t err = errno;
                for (int64_t j = submitted; j < m; ++j) {  // read the rest here, then reap what is in flight
                    int64_t s = read_one(r, a + j);
                    if (s != 0 && err == 0) err = s;
                }
                m = submitted;
                if (err != 0 && submitted == 0) return err;
                break;
            }
            submitted += k;
        }
        int64_t status = 0;
        for (int64_t got = 0; got < m;) {
            long k = syscall(SYS_io_getevents, ctx, 1, m - got, events.data(), nullptr);
            if (k < 0) {
                if (errno == EINTR) continue;
                return errno;  // the context is unusable; the caller reports the error
            }
            for (long e = 0; e < k; ++e) {
                int64_t i = static_cast<int64_t>(events[e].data);
                int64_t res = events[e].res;
                if (res < 0 && res != -EAGAIN && res != -EINTR) {
                    if (status == 0) status = -res;
                } else if (res < need[i]) {  // short (or retryable): finish the run with plain reads
                    int64_t s = read_one(r, i);
                    if (s != 0 && status == 0) status = s;
                }
            }
            got += k;
        }
        if (status != 0) return status;
    }
    return 0;
}

// Wait until the int64 at `addr` equals `want`: polled without sleeping for `spin_ns`, then every ~20 us
// until `timeout_ns` have passed. Returns 1 when it did, 0 on timeout. Called through ctypes, so the
// waiting Python thread holds no GIL; the word is written by another agent (a GPU kernel over PCIe), hence
// the volatile reads.
C_EXPORTED int strata_wait_word(const volatile int64_t* addr, int64_t want, int64_t spin_ns, int64_t timeout_ns) {
    using clock = std::chrono::steady_clock;
    auto start = clock::now();
    auto elapsed = [&] { return std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count(); };
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (*addr == want) return 1;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        int64_t t = elapsed();
        if (t >= timeout_ns) return *addr == want;
        if (t >= spin_ns) {
            timespec ts{0, 20000};
            nanosleep(&ts, nullptr);
        }
    }
}
