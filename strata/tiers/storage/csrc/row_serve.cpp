// One Engram layer of a decode step served from the host row cache in one native call (the rows' handshake,
// strata/tiers/rows/handshake.py; Python side: strata/tiers/rows/serve.py).
//
// The cache's bookkeeping is RowCache's (strata/tiers/rows/cache.py), in its own numpy arrays, updated in place
// with the same rules: a lookup adds the current weight to every hit's score and then grows the weight (decayed
// LFU), a miss takes a free slot, and when free slots run out the lowest-scored max(needed, capacity / 16)
// slots that are neither free nor protected are evicted at once. The misses' 4 KiB blocks are read with one
// Linux AIO batch (strata_aio_runs, threads where AIO is refused) into an aligned scratch buffer and copied
// into their slots of the slab (page-locked RAM the GPU gathers from in place).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#define C_EXPORTED extern "C" __attribute__((visibility("default")))

extern "C" int64_t strata_aio_runs(int fd, int64_t n, const int64_t* file_off, const int64_t* len,
                                   const int64_t* need, uint8_t* base, const int64_t* buf_off);
extern "C" int64_t strata_pread_runs(int fd, int64_t n, const int64_t* file_off, const int64_t* len,
                                     const int64_t* need, uint8_t* base, const int64_t* buf_off, int threads);

namespace {

constexpr int64_t BLOCK = 4096;
// beyond any -1 - i a read can return
constexpr int64_t NO_ROOM = -(int64_t{1} << 40), PAST_END = NO_ROOM - 1, SMALL_SCRATCH = NO_ROOM - 2;
constexpr int64_t AIO_UNAVAILABLE = std::numeric_limits<int64_t>::min();

struct Cache {  // RowCache's arrays (strata/tiers/rows/cache.py)
    int32_t* slot_of;   // [total rows] slot, -1 absent
    int64_t* row_of;    // [capacity] global row, -1 free
    double* score;      // [capacity]
    int64_t* free_;     // [capacity] stack of free slots: the first counts[0]
    int64_t* counts;    // [n_free, evictions]
    double* decay;      // [inc, growth]
    int64_t capacity;
};

// Evict the `n` lowest-scored slots that are neither free nor in `protect` (sorted); RowCache._evict.
void evict(Cache& c, int64_t n, const std::vector<int64_t>& protect) {
    std::vector<std::pair<double, int64_t>> cand;
    cand.reserve(static_cast<size_t>(c.capacity));
    for (int64_t s = 0; s < c.capacity; ++s) {
        if (c.row_of[s] < 0 || std::binary_search(protect.begin(), protect.end(), s)) continue;
        cand.emplace_back(c.score[s], s);
    }
    n = std::min<int64_t>(n, static_cast<int64_t>(cand.size()));
    if (n <= 0) return;
    std::nth_element(cand.begin(), cand.begin() + (n - 1), cand.end());
    for (int64_t k = 0; k < n; ++k) {
        int64_t s = cand[k].second;
        c.slot_of[c.row_of[s]] = -1;
        c.row_of[s] = -1;
        c.score[s] = 0.0;
        c.free_[c.counts[0]++] = s;
    }
    c.counts[1] += n;
}

}  // namespace

// Serve `n` layer-local row ids `ids` of one Engram layer (global row = base + id; the table's row r at byte
// file_off + r * row_bytes of `fd`, a file of file_size bytes). `protect` (n_protect slots) must not be evicted;
// this layer's own hits are protected too. Writes each id's cache slot to out_slots[n] and, in info:
// [0] distinct rows, [1] of them cache hits, [2] rows read, [3] nanoseconds reading.
// Returns 0; an errno (> 0) or -1 - i (the file ended before read run i) from the reads; NO_ROOM when the cache
// has no room for every miss (nothing is then admitted); PAST_END when a row lies past the end of the file;
// SMALL_SCRATCH when scratch cannot hold the misses' blocks.
C_EXPORTED int64_t strata_serve_rows(const int64_t* ids, int64_t n, int64_t base, int fd, int64_t file_off,
                                     int64_t row_bytes, int64_t file_size, int32_t* slot_of, int64_t* row_of,
                                     double* score, int64_t* free_stack, int64_t* counts, double* decay,
                                     int64_t capacity, uint8_t* slab, const int64_t* protect, int64_t n_protect,
                                     uint8_t* scratch, int64_t scratch_bytes, int64_t* out_slots, int64_t* info) {
    Cache c{slot_of, row_of, score, free_stack, counts, decay, capacity};
    // distinct ids and each id's place among them
    std::vector<std::pair<int64_t, int64_t>> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = {ids[i], i};
    std::sort(order.begin(), order.end());
    std::vector<int64_t> uniq, inverse(static_cast<size_t>(n));
    uniq.reserve(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k) {
        if (k == 0 || order[k].first != order[k - 1].first) uniq.push_back(order[k].first);
        inverse[order[k].second] = static_cast<int64_t>(uniq.size()) - 1;
    }
    int64_t m = static_cast<int64_t>(uniq.size());
    std::vector<int64_t> slots(static_cast<size_t>(m));
    std::vector<int64_t> miss;  // positions in uniq
    std::vector<int64_t> keep(protect, protect + n_protect);
    int64_t hits = 0;
    for (int64_t u = 0; u < m; ++u) {  // RowCache.lookup
        int64_t s = slot_of[base + uniq[u]];
        slots[u] = s;
        if (s >= 0) {
            score[s] += decay[0];
            keep.push_back(s);
            ++hits;
        } else {
            miss.push_back(u);
        }
    }
    if (hits) {
        decay[0] *= decay[1];
        if (decay[0] > 1e100) {  // renormalise before float64 overflows
            for (int64_t s = 0; s < capacity; ++s) score[s] /= decay[0];
            decay[0] = 1.0;
        }
    }
    info[0] = m;
    info[1] = hits;
    info[2] = static_cast<int64_t>(miss.size());
    info[3] = 0;
    if (!miss.empty()) {
        std::sort(keep.begin(), keep.end());
        keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
        int64_t need_slots = static_cast<int64_t>(miss.size());
        if (need_slots > capacity - static_cast<int64_t>(keep.size())) return NO_ROOM;
        // the misses' blocks, deduplicated and coalesced into runs of consecutive blocks
        std::vector<int64_t> blocks;
        for (int64_t u : miss) {
            int64_t start = file_off + uniq[u] * row_bytes;
            if (uniq[u] < 0 || start + row_bytes > file_size) return PAST_END;
            for (int64_t b = start / BLOCK; b <= (start + row_bytes - 1) / BLOCK; ++b) blocks.push_back(b);
        }
        std::sort(blocks.begin(), blocks.end());
        blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
        if (static_cast<int64_t>(blocks.size()) * BLOCK > scratch_bytes) return SMALL_SCRATCH;
        std::vector<int64_t> off, len, need, buf_off;
        for (size_t j = 0; j < blocks.size();) {
            size_t k = j + 1;
            while (k < blocks.size() && blocks[k] == blocks[k - 1] + 1) ++k;
            off.push_back(blocks[j] * BLOCK);
            len.push_back(static_cast<int64_t>(k - j) * BLOCK);
            need.push_back(std::min(len.back(), file_size - off.back()));
            buf_off.push_back(static_cast<int64_t>(j) * BLOCK);
            j = k;
        }
        auto t0 = std::chrono::steady_clock::now();
        int64_t runs = static_cast<int64_t>(off.size());
        int64_t rc = runs > 1 ? strata_aio_runs(fd, runs, off.data(), len.data(), need.data(), scratch, buf_off.data())
                              : AIO_UNAVAILABLE;
        if (rc == AIO_UNAVAILABLE)
            rc = strata_pread_runs(fd, runs, off.data(), len.data(), need.data(), scratch, buf_off.data(), 8);
        info[3] = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
        if (rc != 0) return rc;
        // RowCache.place: free slots, evicting the lowest-scored unprotected ones when they run out
        if (counts[0] < need_slots) evict(c, std::max(need_slots - counts[0], capacity / 16), keep);
        if (counts[0] < need_slots) return NO_ROOM;
        for (int64_t u : miss) {
            int64_t s = free_stack[--counts[0]];
            int64_t g = base + uniq[u];
            slots[u] = s;
            row_of[s] = g;
            slot_of[g] = static_cast<int32_t>(s);
            score[s] = decay[0];
            int64_t start = file_off + uniq[u] * row_bytes;
            int64_t pos = (std::lower_bound(blocks.begin(), blocks.end(), start / BLOCK) - blocks.begin()) * BLOCK +
                          start % BLOCK;
            std::memcpy(slab + s * row_bytes, scratch + pos, static_cast<size_t>(row_bytes));
        }
    }
    for (int64_t i = 0; i < n; ++i) out_slots[i] = slots[inverse[i]];
    return 0;
}
