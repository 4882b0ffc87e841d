// The mailbox worker's answer to one layer (Mailbox::serve): the layer's cold pairs read from its inbox and grouped by
// expert, the CPU expert kernel run on them (strata_cpu_experts_act), the status and then `done` written; then, off the
// step's path, the counters, the log entry and warm-ahead's read of the next planned layer (Mailbox::warm_next).
// cpu_mailbox.cpp describes the mailbox, its counters, the log and warm-ahead's plans.
//
// Included once, by cpu_mailbox.cpp, after its Mailbox (which declares these two), before the worker's loop and the C
// entry points.
#pragma once

namespace {

inline void Mailbox::serve(size_t i, int64_t gen, std::vector<int64_t>& tok, std::vector<float>& wts,
                           std::vector<int64_t>& meta, std::vector<int32_t>& order, std::vector<int64_t>& warm_of,
                           std::vector<int64_t>& scales, std::vector<int64_t>& bias_of) {
    const int64_t seen_ns = now_ns();
    if (last_box >= 0) {  // that layer's acquire kernel wrote its reads of `done` before this layer's post
        const int64_t spins = reinterpret_cast<volatile int64_t*>(boxes[size_t(last_box)])[4];
        counters[10] += 1;
        counters[11] += spins > 0;
        counters[12] += spins;
    }
    char* box = boxes[i];
    volatile int64_t* hdr = reinterpret_cast<volatile int64_t*>(box);
    const int32_t* inbox = reinterpret_cast<const int32_t*>(box + 64);
    const int64_t N = inbox[0], k = inbox[1], P = inbox[2];
    const int32_t* expert = inbox + 4;
    const int32_t* slot = expert + P;
    const int32_t* rows = slot + P;  // of a cold pair: its expert's leading intermediate rows computed here
    const int64_t x_off = (16 + 12 * P + 63) / 64 * 64;
    const float* x = reinterpret_cast<const float*>(box + 64 + x_off);
    const float* w = x + N * H;
    float* out = reinterpret_cast<float*>(box + out_off);
    int64_t status = 0;
    if (P < 0 || P > max_pairs || k <= 0 || N * k != P) status = -4;
    std::memset(out, 0, sizeof(float) * size_t(std::max<int64_t>(0, N) * H));
    // cold pairs grouped by expert: sort pair indices by (expert, pair)
    order.clear();
    for (int64_t p = 0; status == 0 && p < P; ++p)
        if (slot[p] == -1) order.push_back(int32_t(p));  // -2: the GPU reads this one in place
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return expert[a] < expert[b]; });
    tok.resize(order.size());
    wts.resize(order.size());
    meta.clear();
    warm_of.clear();
    scales.clear();
    bias_of.clear();
    const int64_t bias_table = biases.empty() ? 0 : biases[i];
    WarmCfg* wc = warm.load(std::memory_order_acquire);
    const bool warmed = wc && warm_box == int(i) && warm_gen == gen;  // this layer's experts were read ahead
    int64_t warm_used = 0;
    const int64_t layer = layer_of[i];
    int64_t groups = 0, bytes = 0;
    for (size_t j = 0; j < order.size();) {
        const int32_t e = expert[order[j]];
        size_t end = j;
        while (end < order.size() && expert[order[end]] == e) {
            tok[end] = order[end] / k;
            wts[end] = w[order[end]];
            ++end;
        }
        const int64_t base = (e >= 0 && e < E) ? addr[layer * E + e] : 0;
        if (base == 0) {
            status = -3;
            break;
        }
        const int64_t r = rows[order[j]];  // the same for every pair of the expert (split per expert)
        if (r <= 0 || r > I) {
            status = -4;
            break;
        }
        meta.insert(meta.end(), {base + gu_off, base + gu_bytes, reinterpret_cast<int64_t>(tok.data() + j),
                                 reinterpret_cast<int64_t>(wts.data() + j), int64_t(end - j), r, I});
        scales.insert(scales.end(), {base + gus_off, base + dns_off});
        bias_of.push_back(bias_table ? bias_table + int64_t(sizeof(float)) * 2 * I * e : 0);
        int64_t wr = 0;
        for (size_t q = 0; warmed && q < warm_addr.size(); ++q)
            if (warm_addr[q] == base + gu_off) wr = warm_rows[q];
        warm_of.push_back(wr);
        warm_used += pair_bytes * std::min(wr, r);
        ++groups;
        bytes += payload * r / I;
        j = end;
    }
    int64_t ns = 0;
    if (status == 0 && groups) {
        const auto t0 = std::chrono::steady_clock::now();
        int64_t stolen = 0;
        status = strata_cpu_experts_act(isa, x, N, H, groups, meta.data(), fmt, scales.data(),
                                        warmed ? warm_of.data() : nullptr, act_of(i),
                                        bias_table ? bias_of.data() : nullptr, out, threads, &stolen);
        if (warmed) wc->counters[4] += warm_used, wc->counters[5] += stolen;
        ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    }
    hdr[2] = status;
    std::atomic_thread_fence(std::memory_order_release);
    hdr[1] = gen;  // the GPU copies `out` back once it sees this
    // off the step's path from here
    const int64_t done_ns = now_ns();
    counters[7] += done_ns - seen_ns;
    if (i == 0) counters[8] = seen_ns;
    counters[9] = done_ns;
    if (gen == last_done_gen) {  // the previous layer of the same step: the GPU's time between the two
        counters[5] += seen_ns - last_done_ns;
        counters[6] += 1;
    } else if (gen == last_done_gen + 1) {  // the step before's last layer: the GPU's time between two steps
        const int64_t gap = seen_ns - last_done_ns;
        if (gap <= STEP_GAP_MAX_NS) {
            counters[13] += gap;
            counters[14] += 1;
        } else {
            counters[15] += 1;
        }
    }
    last_done_ns = done_ns, last_done_gen = gen;
    last_box = groups > 0 ? int(i) : -1;
    counters[0] += groups;
    counters[1] += bytes;
    counters[2] += ns;
    counters[3] += 1;
    if (log_cap > 0 && status == 0) {
        const int64_t seq = counters[4];
        char* entry = log + (seq % log_cap) * LOG_ENTRY;
        int32_t* codes = reinterpret_cast<int32_t*>(entry + 16);
        int32_t n = 0;
        for (int64_t p = 0; p < P && n < LOG_CODES; ++p) {  // each expert once (the first of its pairs)
            bool seen = false;
            for (int64_t q = 0; q < p && !seen; ++q) seen = expert[q] == expert[p];
            if (!seen) codes[n++] = slot[p] >= 0 ? expert[p] : -(expert[p] + 1);
        }
        *reinterpret_cast<int64_t*>(entry) = seq;
        reinterpret_cast<int32_t*>(entry + 8)[0] = int32_t(layer);
        reinterpret_cast<int32_t*>(entry + 8)[1] = n;
        std::atomic_thread_fence(std::memory_order_release);
        reinterpret_cast<volatile int64_t*>(counters)[4] = seq + 1;
    }
    if (wc) warm_next(i, gen, *wc);
}

// After answering box i of generation gen: read the planned layer's predicted cold experts' leading gate/up rows
// (whole experts in ascending order, up to wc.bytes), stopping once the GPU posts that layer.
inline void Mailbox::warm_next(size_t i, int64_t gen, WarmCfg& wc) {
    warm_box = -1;
    const int64_t m = wc.next[i];
    const int j = wc.next_box[i];
    if (m < 0 || j < 0) return;
    const int64_t* plan = wc.plans + (m & 1) * (1 + wc.S);
    const int64_t tag = gen * TAG_STRIDE + m;
    const volatile int64_t* ready = reinterpret_cast<const volatile int64_t*>(boxes[size_t(j)]);
    // the plan may land a little after this answer (its kernel queued behind the layer's own): wait for it, as
    // long as the GPU has not posted the layer (the worker idles until then anyway)
    const int64_t t_wait = now_ns();
    while (reinterpret_cast<const volatile int64_t*>(plan)[0] != tag) {
        if (*ready != seen[size_t(j)] || now_ns() - t_wait > 1000000) {  // posted (or a plan that never comes)
            wc.counters[1] += 1;
            return;
        }
        SPIN_PAUSE();
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    warm_addr.clear();
    warm_rows.clear();
    const int64_t row_bytes = pair_bytes;  // a gate row and an up row
    int64_t left = wc.bytes;
    for (int64_t s = 0; s < wc.S && left >= row_bytes; ++s) {
        const int64_t a = plan[1 + s];
        if (a == 0) continue;
        const int64_t r = std::min(I, left / row_bytes);
        warm_addr.push_back(a + gu_off);
        warm_rows.push_back(r);
        left -= r * row_bytes;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (reinterpret_cast<const volatile int64_t*>(plan)[0] != tag || warm_addr.empty()) return;  // rewritten
    wc.counters[0] += 1;
    warm_box = j, warm_gen = gen;
    const int64_t t0 = now_ns();
    int64_t held = 0;
    const double* act = act_of(size_t(j));  // the planned layer's rows: interleaved or not
    wc.counters[2] += strata_cpu_warm_form(warm_addr.data(), warm_rows.data(), int64_t(warm_addr.size()),
                                           pair_bytes / 2, I, act && act[3] != 0.0, threads,
                                           const_cast<const int64_t*>(ready), seen[size_t(j)], &held);
    wc.counters[3] += now_ns() - t0;
    wc.counters[6] += held;
    wc.counters[7] = std::max(wc.counters[7], held);
}

}  // namespace
