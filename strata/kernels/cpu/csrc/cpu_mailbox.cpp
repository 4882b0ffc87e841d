// strata mailbox worker: a split decode step's CPU share with no Python on its path.
//
// In the host-step design every MoE layer of a decode step ends its CUDA graph, and Python learns which
// pairs were cold, starts the CPU kernel, waits for it and uploads its sum before the next graph: on the
// H200 box that host work cost more than the CPU kernel itself (each CUDA call 10-15 us, a Python step
// ~0.5 ms a layer). Here the step is one graph. At each MoE layer the graph copies the layer's routing
// (expert and slot of every pair) and activations into the layer's mailbox in page-locked host memory,
// then the step's generation number into its `ready` word, and a one-thread kernel spins until the
// `done` word holds that generation. This worker thread polls every mailbox's `ready` word, computes the
// layer's cold pairs (slot -1; -2 marks a pair the GPU computes itself, reading its expert in place) with the
// CPU expert kernel (ascending experts, each expert's pairs ascending: the host path's order, so the same
// sums), writes the partial sum and then `done`. The graph copies the sum back and adds it in its combine
// kernel. A cold pair's `rows` says how many of its expert's leading intermediate rows are computed here: all
// I, or fewer for an expert split with the GPU, which reads the rest in place at the same time (the two
// partial sums add up in the combine: down is linear in the intermediate rows).
//
// Mailbox of one layer (host memory; offsets in bytes, all multiples of 64):
//   int64 hdr[8]    [0] ready (written by the GPU, last)  [1] done (written here, last)
//                   [2] status (0, or an error: -3 an expert not in page-locked RAM, kernel codes)
//                   [3] the generation the GPU gave up waiting for  [4] the GPU's reads of `done` while waiting
//   inbox at 64:    int32 N, k, P, 0; int32 expert[P]; int32 slot[P]; int32 rows[P]; float x[N*H] (at
//                   16 + 12P rounded up to 64); float w[P] (routing weight of each pair)
//   float out[N*H] at `out_off` (the CPU's weighted partial sum, zeros where no pair was cold)
// Every layer's experts are read by address from the table addr[layer * E + e] (the gate_up block of
// expert e's page-locked slot; down's values follow at gu_bytes; in FP8 and MXFP4 the scales of gate_up and down
// at gus_off and dns_off, strata.kernels.quant.ExpertLayout); 0 means "not resident in page-locked RAM".
// Each box's layer has its SwiGLU form (the kernel's act arguments, cpu_experts_act.h; none given: plain) and
// optionally a gate_up bias table, fp32 [E, 2I] in host memory: expert e's row is the kernel's bias of e.
//
// The worker also counts what it computed (experts, bytes, kernel seconds) and logs, per layer served,
// which experts were resident and which it computed, into a ring the Python side drains for the tier
// policy's history and promotions, off the step's path.
//
// This file holds the mailbox's layout, the worker's state, its polling loop and the C entry points; what it does
// with a posted layer (Mailbox::serve: the kernel call, the answer, the counters and the log entry, then warm-ahead's
// read, Mailbox::warm_next) is cpu_mailbox_serve.h's.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPIN_PAUSE() _mm_pause()
#else
#define SPIN_PAUSE() std::this_thread::yield()
#endif

#define C_EXPORTED extern "C" __attribute__((visibility("default")))

C_EXPORTED int strata_cpu_experts_act(int isa, const float* x, int64_t N, int64_t H, int64_t E, const int64_t* meta,
                                      const int64_t* fmt, const int64_t* scales, const int64_t* warm, const double* act,
                                      const int64_t* bias, float* out, int threads, int64_t* stolen);
C_EXPORTED int strata_cpu_warm_drain();
C_EXPORTED int64_t strata_cpu_warm_form(const int64_t* addr, const int64_t* rows, int64_t n, int64_t row_bytes,
                                        int64_t ld, int interleaved, int threads, const int64_t* stop,
                                        int64_t stop_val, int64_t* held_ns);

namespace {

// Log entry: int64 seq, int32 layer, int32 n, then n int32 codes: e for a resident expert, -(e + 1) for one
// computed here. Fixed size: 16 + 4 * LOG_CODES bytes.
constexpr int LOG_CODES = 256;
constexpr int64_t LOG_ENTRY = 16 + 4 * LOG_CODES;

// Warm-ahead (strata.runtime.offload.warm_ahead): once the worker has answered layer l, it reads the gate/up rows of layer
// l+1's predicted cold experts into its threads' caches while the GPU runs the serial part between the two layers
// (the CPU idles then), each thread the rows the kernel will give it, so the next layer's kernel reads them from L2,
// not RAM. The prediction is the plan kernel's (strata.kernels.gpu.warm_plan; host memory, by the planned layer's
// parity: int64 [tag, src[S]], src the predicted cold experts' gate_up addresses in ascending expert order, the
// order in which the split gives the worker its experts, 0 after the last); a plan without this step's tag
// (generation * TAG_STRIDE + layer) is skipped. Every thread stops
// reading within 1 KB of the GPU posting the next layer, and the read returns then without waiting for a thread
// descheduled mid-piece (cpu_warm.h; a later read reusing its slot waits for it: [6] and [7]); a wrong or partial
// read changes no result.
struct WarmCfg {
    std::vector<int64_t> next;  // per box: the layer it plans (-1: none)
    std::vector<int> next_box;  // per box: the box of that layer (-1: none)
    const int64_t* plans = nullptr;  // [2, 1 + S] int64
    int64_t S = 0, bytes = 0;   // slots a plan; gate/up bytes read ahead a layer at most
    int64_t* counters = nullptr;  // [0] plans used [1] plans not ready [2] bytes read [3] ns reading
                                  // [4] bytes of read rows the kernel computed [5] pieces computed by another thread
                                  // [6] ns a read waited for a thread of an earlier read still inside (descheduled
                                  // mid-piece; a stopped read returns without waiting) [7] the longest such wait
};

constexpr int64_t TAG_STRIDE = 65536;  // a plan's tag: generation * TAG_STRIDE + the planned layer

constexpr int64_t STEP_GAP_MAX_NS = 5000000;  // a decode step's end (LM head, sampling, launch) is well under this

struct Mailbox {
    // configuration (read-only after start)
    std::vector<char*> boxes;       // base address of each served layer's mailbox
    std::vector<int32_t> layer_of;  // model layer of each box
    int64_t H = 0, E = 0, I = 0, gu_bytes = 0, out_off = 0, payload = 0, max_pairs = 0;
    const int64_t* addr = nullptr;  // [layers * E] expert gate_up addresses
    int64_t fmt[3] = {0, 1, 1};     // the experts' format (csrc/cpu_experts_formats.h's FMT_*) and fp8's block
    int64_t gus_off = 0, dns_off = 0;  // where gate_up's and down's scales start in a slot (GGUF: their type ids)
    int64_t gu_off = 0;             // where gate_up's values start in a slot (GGUF: past the header; else 0)
    int64_t pair_bytes = 0;         // a gate row and an up row's values (bf16 4 H, FP8 2 H, MXFP4 H, GGUF its widest)
    std::vector<double> acts;       // [n_boxes, 4] each box's SwiGLU form (strata_cpu_experts_act's act); empty: plain
    std::vector<int64_t> biases;    // [n_boxes] each box's gate_up bias table, fp32 [E, 2I] (0: none); empty: none
    int isa = 0, threads = 1;
    int64_t spin_ns = 2000000;      // poll without sleeping this long after the last layer served
    // ring log and counters (host memory the Python side reads)
    char* log = nullptr;
    int64_t log_cap = 0;
    int64_t* counters = nullptr;    // [0] experts computed, [1] bytes, [2] kernel ns, [3] layers served, [4] log head,
                                    // [5] ns from a layer's done to the next layer's ready seen, same step (the GPU's
                                    // own time between two CPU shares), [6] how many such gaps, [7] ns serving layers,
                                    // [8] when the latest step's first layer was seen ready, [9] when the latest
                                    // layer's done was written (steady clock: CLOCK_MONOTONIC, Python's monotonic_ns),
                                    // [10] layers whose GPU wait was read (the worker computed some of them), [11] of
                                    // those, the ones where the GPU found no answer yet and waited, [12] its reads of
                                    // `done` while it waited in them (strata.runtime.offload.gpu_share balances on [11] / [10]),
                                    // [13] ns from a step's last done to the next step's first ready seen (the LM head,
                                    // sampling, the launch, the first attention), [14] how many such gaps, [15] how many
                                    // were longer than STEP_GAP_MAX_NS and left out of [13] and [14] (a pause in decode:
                                    // between requests, a prefill; one such gap outweighed a window's steps)
    int64_t last_done_ns = 0, last_done_gen = -1;  // when the last layer's done was written, and its generation
    int last_box = -1;  // the box served last, if the worker computed some of its experts (else -1)
    std::atomic<bool> stop{false};
    std::atomic<WarmCfg*> warm{nullptr};  // warm-ahead, set once before use
    int warm_box = -1;  // the box whose experts were read ahead last, for generation warm_gen
    int64_t warm_gen = -1;
    std::vector<int64_t> warm_addr, warm_rows;  // what was read: gate_up addresses and leading rows
    std::thread th;

    static int64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch()).count();
    }

    // Box i's layer, posted with generation gen: its cold pairs computed, the answer and `done` written, then the
    // counters, the log entry and warm-ahead's read of the next planned layer (cpu_mailbox_serve.h). The vectors are
    // loop()'s, reused from layer to layer.
    void serve(size_t i, int64_t gen, std::vector<int64_t>& tok, std::vector<float>& wts, std::vector<int64_t>& meta,
               std::vector<int32_t>& order, std::vector<int64_t>& warm_of, std::vector<int64_t>& scales,
               std::vector<int64_t>& bias_of);
    // After answering box i of generation gen: read the planned layer's predicted cold experts' leading gate/up rows
    // (cpu_mailbox_serve.h).
    void warm_next(size_t i, int64_t gen, WarmCfg& wc);

    std::vector<int64_t> seen;  // the generation last served per box (read at start, before the thread runs)

    const double* act_of(size_t i) const { return acts.empty() ? nullptr : acts.data() + 4 * i; }

    void loop();  // the worker thread (defined after serve, below)
};

}  // namespace

#include "cpu_mailbox_serve.h"  // Mailbox::serve, Mailbox::warm_next: what the worker does with a posted layer

namespace {

// The worker thread: poll every box's `ready` word and serve each layer posted since; between layers spin for spin_ns,
// then sleep between polls.
inline void Mailbox::loop() {
    std::vector<int64_t> tok, meta, warm_of, scales, bias_of;
    std::vector<float> wts;
    std::vector<int32_t> order;
    auto last = std::chrono::steady_clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
        bool served = false;
        for (size_t i = 0; i < boxes.size(); ++i) {
            const int64_t gen = reinterpret_cast<volatile int64_t*>(boxes[i])[0];
            if (gen != seen[i]) {
                std::atomic_thread_fence(std::memory_order_acquire);
                serve(i, gen, tok, wts, meta, order, warm_of, scales, bias_of);
                seen[i] = gen;
                served = true;
            }
        }
        if (served) {
            last = std::chrono::steady_clock::now();
            continue;
        }
        const auto idle = std::chrono::steady_clock::now() - last;
        if (idle < std::chrono::nanoseconds(spin_ns)) {
            for (int j = 0; j < 16; ++j) SPIN_PAUSE();
        } else if (idle < std::chrono::milliseconds(100)) {  // between requests: poll every 50 us
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else {  // idle: every millisecond (a step after a long pause starts up to that much later, once)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
    }
}

}  // namespace

// cfg: int64 [H, E, I, gu_bytes, out_off, payload, max_pairs, isa, threads, spin_ns, n_boxes, log_cap, format, bn, bk,
// gus_off, dns_off, gu_off, pair_bytes] (payload: an expert's bytes in its format, for the counters; format: FMT_*,
// bn, bk: fp8's block, GGUF's up offset; the offsets: of gate_up's scales (GGUF: the header's type ids), down's
// scales and gate_up's values in a slot; pair_bytes: a gate row and an up row's bytes, what warm-ahead reads a row)
// boxes: int64 [n_boxes] mailbox addresses; layers: int32 [n_boxes]; addr: int64 [layers * E];
// log: log_cap entries of 16 + 4 * 256 bytes; counters: int64 [16]; acts (optional): double [n_boxes, 4], each box's
// SwiGLU form (strata_cpu_experts_act's act: limit or +inf, alpha, up_offset, interleaved); biases (optional): int64
// [n_boxes], each box's fp32 gate_up bias table [E, 2I] (0: none), read while the worker runs. Returns a handle for
// stop (0: failed).
C_EXPORTED int64_t strata_mailbox_start(const int64_t* cfg, const int64_t* boxes, const int32_t* layers,
                                        const int64_t* addr, char* log, int64_t* counters, const double* acts,
                                        const int64_t* biases) {
    auto* m = new Mailbox();
    m->H = cfg[0], m->E = cfg[1], m->I = cfg[2], m->gu_bytes = cfg[3], m->out_off = cfg[4], m->payload = cfg[5];
    m->max_pairs = cfg[6], m->isa = int(cfg[7]), m->threads = int(cfg[8]), m->spin_ns = cfg[9];
    const int64_t n = cfg[10];
    m->log_cap = cfg[11];
    m->fmt[0] = cfg[12], m->fmt[1] = cfg[13], m->fmt[2] = cfg[14], m->gus_off = cfg[15], m->dns_off = cfg[16];
    m->gu_off = cfg[17], m->pair_bytes = cfg[18];
    for (int64_t i = 0; i < n; ++i) {
        m->boxes.push_back(reinterpret_cast<char*>(boxes[i]));
        m->layer_of.push_back(layers[i]);
    }
    if (acts) m->acts.assign(acts, acts + 4 * n);
    if (biases) m->biases.assign(biases, biases + n);
    m->addr = addr, m->log = log, m->counters = counters;
    for (char* box : m->boxes) m->seen.push_back(int64_t(reinterpret_cast<volatile int64_t*>(box)[0]));
    m->th = std::thread([m] { m->loop(); });
    return reinterpret_cast<int64_t>(m);
}

C_EXPORTED int strata_mailbox_stop(int64_t handle) {
    auto* m = reinterpret_cast<Mailbox*>(handle);
    if (!m) return 0;
    m->stop.store(true);
    if (m->th.joinable()) m->th.join();
    if (m->warm.load()) strata_cpu_warm_drain();  // a read's straggler may still touch the boxes and the experts
    delete m->warm.load();
    delete m;
    return 0;
}

// Warm-ahead (WarmCfg above), once per worker, before any step plans it: next int64 [n_boxes] (the layer each box
// plans, -1: none); plans int64 [2, 1 + S] (host, strata.kernels.gpu.warm_plan's layout); bytes: gate/up bytes read a
// layer at most; counters int64 [8]. Returns 0, or -1 (no worker, or already set).
C_EXPORTED int strata_mailbox_warm(int64_t handle, const int64_t* next, const int64_t* plans, int64_t S,
                                   int64_t bytes, int64_t* counters) {
    auto* m = reinterpret_cast<Mailbox*>(handle);
    if (!m || m->warm.load() || S <= 0) return -1;
    auto* w = new WarmCfg();
    for (size_t i = 0; i < m->boxes.size(); ++i) {
        w->next.push_back(next[i]);
        int box = -1;
        for (size_t j = 0; j < m->layer_of.size(); ++j)
            if (next[i] >= 0 && m->layer_of[j] == next[i]) box = int(j);
        w->next_box.push_back(box);
    }
    w->plans = plans, w->S = S, w->bytes = bytes, w->counters = counters;
    m->warm.store(w, std::memory_order_release);
    return 0;
}

C_EXPORTED int strata_mailbox_log_codes() { return LOG_CODES; }
