// Batched positional reads for strata's disk reader (strata/tiers/native_io.py).
//
// One call reads a list of runs (file offset, length) into one buffer, in a plain loop of pread(2): the
// Python thread that calls it through ctypes gives up the GIL for the whole batch, instead of taking it
// back after every read (a dozen small O_DIRECT reads of Engram rows per thread and decode step, each
// otherwise a Python frame and a GIL hand-off with the decode thread).
#include <cerrno>
#include <cstdint>
#include <unistd.h>

#define STRATA_API extern "C" __attribute__((visibility("default")))

// For i < n: read len[i] bytes at file_off[i] into base + buf_off[i], looping over partial reads; at least
// need[i] of them must exist (an O_DIRECT read asks for whole blocks; the file's last block may be short).
// Returns 0; the errno (> 0) of the first read that failed; or -1 - i when run i met the end of the file
// before need[i] bytes.
STRATA_API int64_t strata_pread_runs(int fd, int64_t n, const int64_t* file_off, const int64_t* len,
                                     const int64_t* need, uint8_t* base, const int64_t* buf_off) {
    for (int64_t i = 0; i < n; ++i) {
        int64_t got = 0;
        while (got < need[i]) {
            ssize_t r = pread(fd, base + buf_off[i] + got, static_cast<size_t>(len[i] - got), file_off[i] + got);
            if (r < 0) {
                if (errno == EINTR) continue;
                return errno;
            }
            if (r == 0) return -1 - i;
            got += r;
        }
    }
    return 0;
}
