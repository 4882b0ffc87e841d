"""Warm-ahead: the CPU expert kernel's read-ahead of experts' leading gate/up rows into its threads' caches
(`cpu_experts.warm_rows`, csrc/cpu_experts.cpp's strata_cpu_warm) and the kernel computing those rows on the
thread that read them (`run_packed(..., warm=)`), then the mailbox worker doing it for the next layer's predicted
cold experts (csrc/cpu_mailbox.cpp, WarmCfg), listed by the plan kernel (strata.kernels.gpu.warm_plan) that
strata.runtime.offload.warm_ahead launches in one-graph split decode. Which thread computes which rows must never change a
result: every output is compared bit for bit with the plain kernel's."""

from __future__ import annotations

import array
import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from strata.kernels.cpu import experts as ce
from strata.kernels.gpu import warm_plan as wp

needs_kernel = pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")

H, INTER, E, K, S = 64, 32, 8, 2, 4


def _slab(experts: int, hidden: int, inter: int, seed: int = 0) -> torch.Tensor:
    """Experts as page-locked slots hold them: [experts, gate_up [2I, H] then down [H, I]] bf16."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 3 * inter * hidden, generator=g) / 8).to(torch.bfloat16)


def _meta(slab, chosen, rows, idx, w, hidden, inter) -> array.array:
    meta = array.array("q")
    for e, r in zip(chosen, rows, strict=True):
        a = slab[e].data_ptr()
        meta.extend((a, a + 2 * inter * hidden * 2, idx.data_ptr(), w.data_ptr(), idx.numel(), r, inter))
    return meta


@needs_kernel
@pytest.mark.parametrize("hidden,inter", [(64, 32), (130, 19)])
def test_warm_rows_change_no_result(hidden, inter):
    """Whole and split experts (the CPU's leading rows), warm counts of none, part, all and more than the rows
    computed, thread counts up to more than this machine's cores (owners late, their pieces taken by others)."""
    slab = _slab(6, hidden, inter, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, hidden, generator=g)
    idx, w = torch.tensor([0, 2], dtype=torch.int64), torch.rand(2, generator=g)
    chosen, rows = [1, 3, 4], [inter, inter, max(1, inter * 2 // 3)]  # the last one split with the GPU
    meta = _meta(slab, chosen, rows, idx, w, hidden, inter)
    ref = torch.zeros(3, hidden)
    assert ce.run_packed(x, meta, ref, threads=1)
    assert ref.abs().sum() > 0
    cases = [(warm, threads, read) for warm in ([0, 0, 0], [inter, 0, 0], [5, inter, inter], [inter + 9, 7, inter],
                                                 [3, 1, 2]) for threads in (1, 2, 3, 7) for read in ((1, 1), (4, 1))]
    cases += [([inter, 2, 1], 2, read) for read in ((2, 1), (4, 3), (8, 8))]  # the read's settings (warm_streams,
    for warm, threads, (streams, touch) in cases:                              # warm_touch) change no result either
        old = ce.tune(warm_streams=streams, warm_touch=touch)
        try:
            got = torch.zeros(3, hidden)
            ce.warm_rows([slab[e].data_ptr() for e in chosen], warm, hidden, inter, threads)
            assert ce.run_packed(x, meta, got, threads=threads, warm=array.array("q", warm))
        finally:
            ce.tune(**old)
        assert torch.equal(got, ref), (warm, threads, streams, touch)
    with pytest.raises(ValueError, match="warm has 2 entries for 3 experts"):
        ce.run_packed(x, meta, torch.zeros(3, hidden), warm=array.array("q", [1, 2]))


@needs_kernel
def test_dynamic_chunks_are_sized_from_the_rows_not_read_ahead():
    """With most rows read ahead, the rest are dealt in chunks sized from themselves (total / (8 P), at least
    32 KiB), not from the whole call's bytes: a few big chunks would leave threads waiting at the barrier."""
    hidden, inter, threads = 2048, 768, 2
    slab = _slab(1, hidden, inter)
    x, idx, w = torch.randn(1, hidden), torch.tensor([0]), torch.ones(1)
    meta = _meta(slab, [0], [inter], idx, w, hidden, inter)
    old = ce.tune(chunk_div=8, chunk_min=32 << 10, chunk_max=512 << 10, rest_chunks=1)
    try:
        counts, outs = [], []
        for warm in (None, [700]):
            out = torch.zeros(1, hidden)
            ce.trace(True)
            assert ce.run_packed(x, meta, out, threads=threads, warm=None if warm is None else array.array("q", warm))
            counts.append(ce.trace(False)["phase1_chunks"])
            outs.append(out)
    finally:
        ce.tune(**old)
    pair = 4 * hidden  # bytes of a gate row and an up row
    whole = (4 * inter * hidden // (8 * threads)) // pair  # rows a chunk without warm rows: 48
    assert counts[0] == -(-inter // whole) == 16
    rest = inter - 700  # 68 rows left: chunks of max(32 KiB, 68 rows / 16) = 4 rows
    assert counts[1] == threads + -(-rest // ((32 << 10) // pair)) == 2 + 17
    assert torch.equal(outs[0], outs[1])
    old = ce.tune(rest_chunks=0)  # the knob: sized from the whole call
    try:
        ce.trace(True)
        assert ce.run_packed(x, meta, torch.zeros(1, hidden), threads=threads, warm=array.array("q", [700]))
        assert ce.trace(False)["phase1_chunks"] == threads + -(-rest // whole) == 2 + 2
    finally:
        ce.tune(**old)


@needs_kernel
def test_the_trace_gives_each_threads_phase_ends():
    """`trace_threads`: per pool thread, the calls it joined and when (after the pool ran) it arrived, had done its
    warm rows' pieces and its part of the gate/up phase, in that order; the caller (thread 0) joins every call."""
    slab = _slab(2, H, INTER, seed=4)
    x, idx, w = torch.randn(1, H), torch.tensor([0]), torch.ones(1)
    meta = _meta(slab, [0, 1], [INTER, INTER], idx, w, H, INTER)
    ce.trace(True)
    for _ in range(6):
        ce.warm_rows([slab[0].data_ptr(), slab[1].data_ptr()], [INTER, INTER], H, INTER, threads=3)
        assert ce.run_packed(x, meta, torch.zeros(1, H), threads=3, warm=array.array("q", [INTER, INTER]))
    assert ce.trace(False)["calls"] == 6
    per = ce.trace_threads(3)
    assert len(per) == 3 and per[0]["calls"] == 6 and all(0 <= t["calls"] <= 6 for t in per)
    for t in per:
        if t["calls"]:
            assert 0 <= t["arrived_us"] <= t["warm_pieces_us"] <= t["phase1_us"], t
    ce.trace(True)  # zeroes them
    assert all(t["calls"] == 0 for t in ce.trace_threads(3))
    ce.trace(False)


@needs_kernel
def test_warm_read_counts_its_bytes_and_stops_when_told():
    slab = _slab(3, H, INTER)
    addr = [slab[e].data_ptr() for e in range(3)]
    # gate and up rows: 4 H bytes a row; rows past the expert's are not read
    assert ce.warm_rows(addr, [INTER, 5, 0], H, INTER, threads=3) == 4 * H * (INTER + 5)
    assert ce.warm_rows(addr[:1], [INTER + 50], H, INTER, threads=2) == 4 * H * INTER
    for streams, touch in ((2, 1), (3, 4), (8, 8)):  # rows read at once and lines touched count no differently
        old = ce.tune(warm_streams=streams, warm_touch=touch)
        try:
            assert ce.warm_rows(addr, [INTER, 5, 0], H, INTER, threads=3) == 4 * H * (INTER + 5)
        finally:
            assert ce.tune(**old) == {"warm_streams": streams, "warm_touch": touch}
    assert ce.tune(warm_streams=20, warm_touch=0) == old  # clamped to 1-8
    assert ce.tune(**old) == {"warm_streams": 8, "warm_touch": 1}
    assert old == {"warm_streams": 4, "warm_touch": 1}  # the defaults
    with pytest.raises(ValueError, match="one row count per address"):
        ce.warm_rows(addr, [1], H, INTER)
    lib = ce.library()
    a, r = array.array("q", addr), array.array("q", [INTER] * 3)
    word, held = ctypes.c_int64(7), ctypes.c_int64(-1)
    read = lib.strata_cpu_warm(a.buffer_info()[0], r.buffer_info()[0], 3, H, INTER, 2, ctypes.addressof(word), 7,
                               ctypes.addressof(held))
    assert read == 4 * H * INTER * 3  # the word unchanged: everything read
    assert 0 <= held.value < 1_000_000_000  # ns waited for the other thread once the caller was done
    word.value = 8  # the next layer posted: nothing more is read
    assert lib.strata_cpu_warm(a.buffer_info()[0], r.buffer_info()[0], 3, H, INTER, 2, ctypes.addressof(word), 7,
                               None) == 0


def _two_experts_on_a_pool_of_two(seed: int):
    """Two experts read ahead whole by a pool of 2 (its threads up): (addresses, rows, x [1, H], meta, the kernel's
    result computed on one thread, what meta points into: keep it alive)."""
    slab = _slab(2, H, INTER, seed=seed)
    addr, rows = array.array("q", [slab[0].data_ptr(), slab[1].data_ptr()]), array.array("q", [INTER, INTER])
    x, idx, w = torch.randn(1, H), torch.tensor([0]), torch.ones(1)
    meta = _meta(slab, [0, 1], [INTER, INTER], idx, w, H, INTER)
    ref = torch.zeros(1, H)
    assert ce.run_packed(x, meta, ref, threads=1)
    ce.warm_rows(list(addr), list(rows), H, INTER, threads=2)
    return addr, rows, x, meta, ref, (slab, idx, w)


def _post_once_asleep(lib, word: ctypes.c_int64, sleep_us: int, then_s: float = 0.0) -> threading.Thread:
    """Pool thread 1 sleeps `sleep_us` at the start of its piece of the next warm read; a started thread "posts"
    the next layer (word 7 -> 8) once it is asleep there, `then_s` later. Join it after the read."""
    entered = lib.strata_cpu_test_straggler(1, sleep_us)

    def post():
        while lib.strata_cpu_test_straggler(0, 0) == entered:
            time.sleep(0.001)
        time.sleep(then_s)
        word.value = 8

    poster = threading.Thread(target=post)
    poster.start()
    return poster


@needs_kernel
def test_a_stopped_read_does_not_wait_for_a_descheduled_thread():
    """Once the next layer is posted the read returns at once, even with a pool thread asleep mid-piece: the kernel
    call after it runs without that thread (another computes its piece; the same result), and only a later read
    reusing its slot waits for it (held)."""
    lib = ce.library()
    addr, rows, x, meta, ref, _keep = _two_experts_on_a_pool_of_two(seed=3)
    word, held = ctypes.c_int64(7), ctypes.c_int64(-1)
    poster = _post_once_asleep(lib, word, sleep_us=400_000)  # pool thread 1 sleeps 400 ms inside its next piece
    lib.strata_cpu_warm(addr.buffer_info()[0], rows.buffer_info()[0], 2, H, INTER, 2, ctypes.addressof(word), 7,
                        ctypes.addressof(held))
    poster.join()
    assert held.value == 0
    got, stolen = torch.zeros(1, H), ctypes.c_int64(-1)
    x32 = x.contiguous()
    old = ce.tune(read_split=0)  # thread 1's pieces stay its own though its read reached none of them
    try:
        assert lib.strata_cpu_experts_warm(ce.isa_code(), x32.data_ptr(), 1, H, 2, meta.buffer_info()[0],
                                           rows.buffer_info()[0], got.data_ptr(), 2, ctypes.addressof(stolen)) == 0
    finally:
        ce.tune(**old)
    assert stolen.value > 0  # thread 1 was still asleep in the read: its pieces were done by thread 0
    assert torch.equal(got, ref)
    word.value = 7
    lib.strata_cpu_warm(addr.buffer_info()[0], rows.buffer_info()[0], 2, H, INTER, 2, ctypes.addressof(word), 7,
                        ctypes.addressof(held))
    assert held.value > 0  # this read reused the first one's slot: it waited for thread 1 to leave
    assert lib.strata_cpu_warm_drain() == 0


@needs_kernel
def test_rows_a_threads_read_did_not_reach_go_to_whichever_thread_is_free():
    """A read stopped before a thread (descheduled) reached its piece: the kernel gives that thread no static rows
    (read_split=1, the default) rather than the whole piece it would stream from RAM alone (read_split=0); the
    trace's `warm_rows` shows each thread's, and the result is the same either way."""
    lib = ce.library()
    addr, rows, x, meta, ref, _keep = _two_experts_on_a_pool_of_two(seed=5)
    word = ctypes.c_int64(7)
    # pool thread 1 sleeps 150 ms before its piece; thread 0 has long read its own (a few KB) by the post
    poster = _post_once_asleep(lib, word, sleep_us=150_000, then_s=0.03)
    read = lib.strata_cpu_warm(addr.buffer_info()[0], rows.buffer_info()[0], 2, H, INTER, 2, ctypes.addressof(word),
                               7, None)
    poster.join()
    half = INTER // 2  # thread 0's piece of each expert: rows [0, INTER / 2)
    assert read == 2 * 4 * H * half  # thread 0's pieces, none of thread 1's
    assert lib.strata_cpu_warm_drain() == 0  # thread 1 woke, saw the post and left having read nothing
    per_setting = {}
    for split in (1, 0):
        old = ce.tune(read_split=split)
        try:
            got = torch.zeros(1, H)
            ce.trace(True)
            assert ce.run_packed(x, meta, got, threads=2, warm=rows)
            ce.trace(False)
        finally:
            ce.tune(**old)
        assert torch.equal(got, ref)
        per_setting[split] = [t["warm_rows"] for t in ce.trace_threads(2)]
    assert per_setting[1] == [2 * half, 0]  # thread 1's rows went to the dynamic chunks
    assert per_setting[0] == [2 * half, 2 * (INTER - half)]  # ...or stayed its own
    assert ce.tune(read_split=1) == {"read_split": 1}  # the default


def _mailbox(slab):
    from strata.runtime.offload.mailbox import CpuMailbox

    addr = np.array([[slab[e].data_ptr() for e in range(E)] for _ in range(2)], dtype=np.int64)
    return CpuMailbox([0, 1], addr, hidden=H, inter=INTER, gu_bytes=2 * INTER * H * 2, payload=3 * INTER * H * 2,
                      top_k=K, max_tokens=2, threads=2, device=torch.device("cpu"))


def _step(box, x, w, plans=None, plan=(), tag_ok=True):
    """One host-posted step over layers 0 and 1 (every pair cold): layer 1's plan (its parity's) lists the experts at
    the addresses `plan`, tagged for this step (or not); returns layer 1's answer."""
    box.begin_step()
    if plans is not None:
        p = plans[1]
        p.zero_()
        for s, a in enumerate(plan):
            p[1 + s] = a
        p[0] = (box._host_gen if tag_ok else box._host_gen - 1) * wp.TAG_STRIDE + 1
    cold = torch.full((2 * K,), -1, dtype=torch.int32)
    box.exchange(0, torch.tensor([1, 2, 3, 4]), cold, x, w)
    time.sleep(0.02)  # the worker reads layer 1's experts ahead meanwhile
    return box.exchange(1, torch.tensor([5, 2, 6, 5]), cold, x, w)


@needs_kernel
def test_worker_reads_the_next_layers_planned_experts_ahead():
    """After answering layer 0 the worker reads the gate/up rows of layer 1's planned experts (up to its byte budget,
    whole experts in order), then computes layer 1 with them; the answers equal a worker's without warm-ahead."""
    slab = _slab(E, H, INTER, seed=3)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, H, generator=g).to(torch.bfloat16), torch.rand(2, K, generator=g)
    plain = _mailbox(slab)
    try:
        ref = [_step(plain, x, w) for _ in range(3)]
    finally:
        plain.close()
    box = _mailbox(slab)
    at = [slab[e].data_ptr() for e in range(E)]
    plans = torch.zeros((2, 1 + S), dtype=torch.int64)
    budget = 4 * H * (INTER + 10)  # the first planned expert whole, 10 rows of the second
    try:
        counters = box.warm_ahead({0: 1}, plans, S, budget)
        assert counters is not None
        assert box.warm_ahead({0: 1}, plans, S, budget) is None  # once per worker
        assert torch.equal(_step(box, x, w, plans, [at[2], at[5], at[6]]), ref[0])
        assert counters.tolist()[:3] == [1, 0, budget]  # one plan used, nothing late, the budget read
        assert 0 <= counters[7] <= counters[6] < 10**9  # the waits for threads still reading, and the longest
        # computed from the warm rows: expert 2's 32 and expert 5's 10 (expert 6 was not read)
        assert counters[4] == budget and counters[3] > 0
        assert torch.equal(_step(box, x, w, plans, [at[0], at[7]]), ref[1])  # a wrong prediction: read, not computed
        assert counters[0] == 2 and counters[2] == 2 * budget and counters[4] == budget
        assert torch.equal(_step(box, x, w, plans, [at[2]], tag_ok=False), ref[2])  # last step's plan: skipped
        assert counters[0] == 2 and counters[1] == 1 and counters[2] == 2 * budget
    finally:
        box.close()


@needs_kernel
def test_warm_ahead_needs_plan_slots_and_is_set_once():
    slab = _slab(E, H, INTER)
    box = _mailbox(slab)
    try:
        plans = torch.zeros((2, 1 + S), dtype=torch.int64)
        assert box.warm_ahead({0: 1}, plans, 0, 1 << 20) is None  # no slots: refused
        assert box.warm_ahead({0: 1}, plans, S, 1 << 20) is not None
    finally:
        box.close()


def test_l2_size_from_sysfs_and_the_budget_it_caps(tmp_path):
    """Warm-ahead reads no more than three quarters of its threads' L2 caches hold (rows past that would be evicted
    before the kernel reaches them); sysfs says how big an L2 is, and a host that does not say keeps the cap."""
    from strata.runtime.offload.warm_ahead import warm_budget
    from strata.runtime.plan.host import l2_cache_bytes

    cache = tmp_path / "cpu0" / "cache"
    for idx, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                               (3, "Unified", "300M")]):
        d = cache / f"index{idx}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert l2_cache_bytes(sysfs=str(tmp_path)) == 2 << 20
    assert l2_cache_bytes(sysfs=str(tmp_path / "nowhere")) is None
    (cache / "index2" / "size").write_text("lots\n")
    assert l2_cache_bytes(sysfs=str(tmp_path)) is None
    assert warm_budget(8 << 20, 12, l2=2 << 20) == 8 << 20  # the H200 box: 18 MiB of L2 to spare
    assert warm_budget(8 << 20, 4, l2=1 << 20) == 3 << 20
    assert warm_budget(8 << 20, 0, l2=1 << 20) == 768 << 10  # at least one thread
    assert warm_budget(8 << 20, 4, l2=None) in (8 << 20, min(8 << 20, 3 * (l2_cache_bytes() or 0)))


# ---- the plan (strata.kernels.gpu.warm_plan) and its driver (strata.runtime.offload.warm_ahead) ---------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN_E = 16


def _plan_inputs(resident=(5, 0)):
    table = torch.arange(PLAN_E, dtype=torch.int64) * 4096 + (1 << 30)
    slot_of = torch.full((PLAN_E,), -1, dtype=torch.int32)
    slot_of[list(resident)] = torch.arange(len(resident), dtype=torch.int32)
    return table, slot_of


@pytest.mark.parametrize("slots", [8, 6, 4, 1])
def test_the_plan_lists_the_predicted_cold_experts_in_ascending_order(slots):
    """Only predicted experts without a GPU slot are listed, each once, in expert order, at most `slots` of them,
    0 after the last; the tag (the step's generation and the planned layer) is written too."""
    table, slot_of = _plan_inputs()
    ids = torch.tensor([3, 5, 9, 1, 12, 7, 0, 2, 3, 9])  # two tokens' predictions; 5 and 0 resident
    plan = torch.full((1 + slots,), -7, dtype=torch.int64)
    wp.plan_warm_torch(ids, slot_of, table, plan, torch.tensor([5]), 3)
    cold = [1, 2, 3, 7, 9, 12]
    assert int(plan[0]) == 5 * wp.TAG_STRIDE + 3
    assert plan[1:].tolist() == ([int(table[e]) for e in cold] + [0] * slots)[:slots]


def check_plan_kernel(dev: torch.device) -> None:
    """The plan kernel against its torch reference, over batch sizes, residency and both layer parities' rows of
    one plan tensor (their lists sit at different alignments)."""
    g = torch.Generator().manual_seed(0)
    table, _ = _plan_inputs()
    plans = [torch.zeros((2, 1 + 8), dtype=torch.int64, device=dev) for _ in range(2)]
    for n in (1, 2, 8):
        for layer in (2, 3):
            slot_of = torch.where(torch.rand(PLAN_E, generator=g) < 0.4, 1, -1).to(torch.int32)
            ids = torch.stack([torch.randperm(PLAN_E, generator=g)[:8] for _ in range(n)]).reshape(-1)
            gen = torch.tensor([n], dtype=torch.int64, device=dev)
            for plan, fn in zip(plans, (wp.plan_warm_torch, wp.plan_warm), strict=True):
                fn(ids.to(dev), slot_of.to(dev), table.to(dev), plan[layer % 2], gen, layer)
            assert torch.equal(plans[0].cpu(), plans[1].cpu()), (n, layer)
            assert int(plans[1][layer % 2, 0]) == n * wp.TAG_STRIDE + layer


def test_plan_kernel_under_tritons_interpreter():
    pytest.importorskip("triton")
    code = "import torch, tests.offload.test_warm_ahead as t\nt.check_plan_kernel(torch.device('cpu'))\nprint('ok')\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.gpu
def test_plan_kernel_on_the_gpu():
    check_plan_kernel(torch.device("cuda"))


def _warm_ahead(box, warm_bytes=None):
    from strata.runtime.offload.warm_ahead import WarmAhead

    table, slot_of = _plan_inputs(resident=(2,))
    predictors = {i: (lambda h: h) for i in (0, 1, 2, 4)}
    return WarmAhead(np.repeat(table.numpy()[None], 5, axis=0), slot_of.repeat(5, 1), predictors, [0, 1, 2, 4],
                     torch.device("cpu"), box, warm_bytes=warm_bytes)


@needs_kernel
def test_warm_ahead_plans_each_next_moe_layer_for_its_worker():
    """Layer l plans l + 1 where both are MoE layers with a predictor (3 is dense here): 0 -> 1 -> 2, not 2 -> 4; a plan
    lands in the planned layer's parity row with the step's tag; the byte budget is the L2-capped default or the one
    given; a worker takes one warm-ahead."""
    from strata.runtime.offload.warm_ahead import WarmAhead, warm_budget

    slab = _slab(E, H, INTER)
    boxes = [_mailbox(slab), _mailbox(slab)]
    try:
        ahead = _warm_ahead(boxes[0])
        assert ahead.next_of == {0: 1, 1: 2}
        assert ahead.warm_bytes == warm_budget(WarmAhead.WARM_BYTES, boxes[0].threads) > 0
        assert ahead.stats()["warm_bytes"] == ahead.warm_bytes and ahead.stats()["plans_used"] == 0
        boxes[0].gen.fill_(6)  # the step's generation, as `begin_step` counts it on a GPU
        ahead.plan(1, torch.tensor([[4, 2], [9, 4]]))  # 2 resident: 4 and 9 listed
        table = ahead.table[1]
        assert ahead.plans[1].tolist() == [6 * wp.TAG_STRIDE + 1, int(table[4]), int(table[9])] + [0] * 6
        assert not ahead.plans[0].any()  # the other parity's row
        assert _warm_ahead(boxes[1], warm_bytes=100000).warm_bytes == 100000
        with pytest.raises(RuntimeError, match="cannot read ahead"):
            _warm_ahead(boxes[0])  # one warm-ahead a worker
    finally:
        for box in boxes:
            box.close()


@pytest.mark.gpu
def test_one_graph_split_decode_with_warm_ahead_changes_no_token(tmp_path):
    """Warm-ahead (`[debug] warm_ahead`, on by default): the worker reads the next layer's predicted cold experts into
    its threads' caches; nothing is staged and the split is untouched, so at a fixed share the 16 tokens are those of
    the run without it, bit for bit, and the worker computed rows it had read ahead."""
    from mailbox_engines import one_graph_decode, tiny_split_setup

    from strata.runtime.offload.warm_ahead import WarmAhead, warm_budget

    model, cfg, ids, want = tiny_split_setup(tmp_path)
    tokens, stats = {}, {}
    for name, warm in (("off", False), ("on", True)):
        config = {**cfg, "debug": {"gpu_share": 0.35, "warm_ahead": warm}}
        with one_graph_decode(model, config, ids, want) as (tiered, read, groups):
            assert (tiered.executor.warm_ahead is None) == (not warm)
            tokens[name] = tiered.generate(ids, max_tokens=16).token_ids
            if warm:
                stats = tiered.executor.mailbox_stats()["warm_ahead"]
                threads = tiered.executor.mailbox.threads
    assert tokens["off"] == tokens["on"]
    assert stats["warm_bytes"] == warm_budget(WarmAhead.WARM_BYTES, threads) > 0
    assert stats["plans_used"] > 0 and stats["read_bytes"] > 0 and stats["computed_bytes"] > 0
