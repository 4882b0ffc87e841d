"""The native mailbox worker that computes a decode layer's cold experts for a one-graph split step
(strata.runtime.offload.mailbox, csrc/cpu_mailbox.cpp). The CPU tests drive the real worker through the same
mailboxes from Python; the GPU test runs an engine with it against the host-step path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.kernels.cpu import experts as ce
from strata.kernels.experts import apply_experts, group_by_expert
from strata.runtime.offload.mailbox import CpuMailbox

needs_kernel = pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")

H, INTER, E, K = 64, 32, 8, 2


def _slots(seed: int = 0):
    """E bf16 experts packed as slots (gate_up [2I, H] then down [H, INTER]), as the pinned pool holds them."""
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * INTER, H, generator=g) / 8).to(torch.bfloat16)
    dn = (torch.randn(E, H, INTER, generator=g) / 8).to(torch.bfloat16)
    gu_bytes, dn_bytes = 2 * INTER * H * 2, H * INTER * 2
    slab = torch.zeros(E, gu_bytes + dn_bytes, dtype=torch.uint8)
    for e in range(E):
        slab[e, :gu_bytes] = gu[e].reshape(-1).view(torch.uint8)
        slab[e, gu_bytes:] = dn[e].reshape(-1).view(torch.uint8)
    addr = np.array([[slab[e].data_ptr() for e in range(E)] for _ in range(3)], dtype=np.int64)  # 3 layers
    return gu, dn, slab, addr, gu_bytes


def box_payload(gu_bytes: int) -> int:
    """An expert's bytes: gate_up, then down (half its size)."""
    return gu_bytes * 3 // 2


def _mailbox(addr, gu_bytes, max_tokens=4):
    from strata.runtime.offload.mailbox import CpuMailbox

    return CpuMailbox([0, 2], addr, hidden=H, inter=INTER, gu_bytes=gu_bytes, payload=box_payload(gu_bytes), top_k=K,
                      max_tokens=max_tokens, threads=2, device=torch.device("cpu"))


@needs_kernel
def test_worker_computes_the_cold_pairs_as_the_host_path_does():
    import time

    gu, dn, slab, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes)
    try:
        assert box.self_test() is None and box.drain() == []  # a round trip, its log entry dropped
        start = box.timing()["totals"]  # after the self-test's layer: a window of the steps below alone
        g = torch.Generator().manual_seed(3)
        computed = 0
        for step in range(3):
            n = 1 + step
            x = torch.randn(n, H, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
            w = torch.rand(n, K, generator=g)
            slots = torch.where(ids.reshape(-1) % 2 == 0, -1, 5).to(torch.int32)  # even experts cold
            box.begin_step()
            for layer in (0, 2):
                out = box.exchange(layer, ids.reshape(-1), slots, x, w)
                # the host path: the cold experts ascending, each one's pairs ascending, through the same kernel
                cold = [(e, sel) for e, sel in group_by_expert(ids, E) if e % 2 == 0]
                computed += len(cold)
                want = torch.zeros(n, H)
                ce.cpu_experts_forward(x.float(), [(gu[e], dn[e]) for e, _ in cold], [sel // K for _, sel in cold],
                                       [w.reshape(-1)[sel] for _, sel in cold], out=want, threads=2)
                assert torch.equal(out, want)
                ref = apply_experts(x.float(), w, K, cold, lambda e: (gu[e].float(), dn[e].float()))
                torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)  # bf16 activations in the kernel
        assert box.experts_computed == computed > 0
        entries = box.drain()
        assert len(entries) == 6 and [layer for layer, _, _ in entries] == [0, 2] * 3
        layer, resident, computed = entries[-1]
        assert all(e % 2 == 1 for e in resident) and all(e % 2 == 0 for e in computed)
        assert sorted(resident + computed) == sorted(set(ids.reshape(-1).tolist()))
        assert box.drain() == []  # drained once
        t = box.timing()  # 3 steps of layers 0 and 2 (and the self-test's layer): 3 gaps between 0 and 2, same step
        assert t["layers"] == 7 and int(box.counters[6]) == 3
        assert t["serve_us"] >= t["kernel_us"] > 0 and t["gpu_gap_us"] > 0
        win = CpuMailbox.window(start, t["totals"])  # the six layers of the three steps, not the self-test's
        assert win["layers"] == 6 and win["serve_us"] >= win["kernel_us"] > 0 and win["gpu_gap_us"] > 0
        # the waiter's reads of done (Python's here, the GPU's acquire kernel in decode) are read back by the worker
        # at its next layer: the first five of the six layers, each waited for (the worker computes cold pairs)
        layers, waited = box.gpu_waits()
        assert layers - start["waits"] == 5 and 0 < waited - start["waited"] <= 5 and 0 < win["gpu_waited"] <= 1
        # and the three gaps from a step's last layer to the next step's first (the self-test's one-layer step to the
        # first, then 2 -> 0 twice), apart from the layers' own: in the mean, or counted as pauses where over 5 ms
        # (this test's own Python between steps may take that long)
        gaps, pauses = (t["totals"][k] - start[k] for k in ("step_gaps", "pauses"))
        assert gaps + pauses == 3 and (win["step_gap_us"] or 0) >= 0 and (win["step_gap_us"] is None) == (gaps == 0)
        assert win["kernel_GB_s"] > 0 and CpuMailbox.window(t["totals"], box.timing()["totals"]) is None
        box.begin_step()  # a pause longer than a step's end: counted apart, not in the gaps' mean
        time.sleep(0.02)
        box.exchange(0, ids.reshape(-1), slots, x, w)
        after = box.timing()["totals"]
        assert after["pauses"] == t["totals"]["pauses"] + 1 and after["step_gap_ns"] == t["totals"]["step_gap_ns"]
    finally:
        box.close()


def test_a_window_keeps_a_slow_kernels_rate():
    """A loaded CI host's tiny experts read far below 0.05 GB/s: the window keeps three significant figures, not
    one decimal that would read as no bytes at all."""
    totals = {"layers": 6, "serve_ns": 6_000_000, "kernel_ns": 5_000_000, "gaps": 3, "gap_ns": 99_000,
              "bytes": 150_000}
    win = CpuMailbox.window({}, totals)
    assert win == {"layers": 6, "serve_us": 1000.0, "kernel_us": 833.3, "gpu_gap_us": 33.0, "kernel_GB_s": 0.03,
                   "gpu_waited": None, "step_gap_us": None}
    more = CpuMailbox.window({}, {**totals, "waits": 8, "waited": 6, "step_gaps": 2, "step_gap_ns": 500_000})
    assert more["gpu_waited"] == 0.75 and more["step_gap_us"] == 250.0
    assert CpuMailbox.window({}, {**totals, "bytes": 387_654_321_000})["kernel_GB_s"] == 77500.0
    assert CpuMailbox.window(totals, totals) is None


@needs_kernel
def test_worker_reports_an_expert_missing_from_pinned_ram():
    _, _, slab, addr, gu_bytes = _slots()
    addr[2, 3] = 0  # expert 3 of layer 2 not in page-locked RAM
    box = _mailbox(addr, gu_bytes)
    try:
        box.begin_step()
        ids = torch.tensor([[3, 1]])
        cold = torch.tensor([-1, -1], dtype=torch.int32)
        x, w = torch.randn(1, H), torch.rand(1, K)
        box.exchange(0, ids.reshape(-1), cold, x, w)  # layer 0 has it
        with pytest.raises(RuntimeError, match="layer 2: an expert not resident in page-locked RAM"):
            box.exchange(2, ids.reshape(-1), cold, x, w)
    finally:
        box.close()


@needs_kernel
def test_mailbox_refuses_a_batch_larger_than_it_holds():
    _, _, slab, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes, max_tokens=2)
    try:
        with pytest.raises(ValueError, match="holds 2 tokens"):
            box.exchange(0, torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int32), torch.randn(3, H),
                         torch.rand(3, K))
    finally:
        box.close()


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [True, False])
def test_one_graph_split_decode_equals_the_host_step_path(tmp_path, monkeypatch, direct):
    """Every expert in pinned RAM, two in VRAM: decode steps run as one graph with the mailbox worker, and
    give the tokens and hidden states the host-step path gives when it too sends every cold expert to the
    CPU (promotions off, so both keep the same experts resident; no GPU share, so the CPU computes them all),
    with the inbox and answer exchanged by the kernels themselves, or (`direct` False: their build failed) copied
    through the device by copy nodes around `host_signal.wait_for_host`."""
    from decode_checks import assert_batched_decode_identical
    from mailbox_engines import host_and_graph_engines

    from strata.kernels.gpu import host_signal

    if not direct:  # the direct exchange's fetch kernel "fails to build": the mailbox falls back to copy nodes
        def unbuildable(*args, **kwargs):
            raise RuntimeError("no such kernel")

        monkeypatch.setattr(host_signal, "wait_and_fetch", unbuildable)
    from strata import Engine
    from strata.runtime.demo.model import write_demo_model

    model = write_demo_model(tmp_path / "tiny", size="tiny", engram=False)
    slot = 12288
    base = {"tiers": {"gpu": {"budget": str(2 * slot)}, "pinned": {"budget": str(64 * slot)}},
            "policy": {"promote": False}}
    engines = host_and_graph_engines(model, base)
    memory = Engine.from_pretrained(model, device="cuda", config={"runtime": {"experts": "memory"}})
    try:
        ids = memory.tokenizer.encode("The river runs through the valley and the town")
        got = {mode: e.generate(ids, max_tokens=24) for mode, e in engines.items()}
        graph = engines["graph"]
        assert graph.model.graphs.mode() == "mailbox" and not graph.model.graphs.failed
        assert any(key[3] == "mailbox" for key in graph.model.graphs.graphs)
        assert engines["host"].model.graphs.mode() == "segmented"
        assert got["graph"].token_ids == got["host"].token_ids
        assert got["graph"].token_ids[:4] == memory.generate(ids, max_tokens=4).token_ids
        assert graph.executor.mailbox.experts_computed > 0 and graph.executor.gpu_share is None
        assert graph.executor.mailbox.direct == direct
        stats = graph.stats()
        assert stats["cpu_experts_computed"] >= graph.executor.mailbox.experts_computed
        assert stats["tiers"]["tiers"]["pinned"]["hits"] > 0 and stats["tiers"]["tiers"]["gpu"]["hits"] > 0
        assert_batched_decode_identical(engines["host"], graph, steps=12)
    finally:
        for e in (*engines.values(), memory):
            e.close()


@needs_kernel
@pytest.mark.parametrize("cut", [8, 16, 24, 32])
def test_worker_computes_a_split_experts_first_rows(cut):
    """A cold pair's `rows` < I: the worker computes its expert's first rows only; with the rest computed apart
    (the GPU's part) the two partial sums make the whole expert, within the kernel's bf16 rounding."""
    gu, dn, slab, addr, gu_bytes = _slots(seed=5)
    box = _mailbox(addr, gu_bytes)
    try:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, H, generator=g)
        ids = torch.tensor([[3, 5], [3, 6]])
        w = torch.rand(2, K, generator=g)
        slots = torch.tensor([-1, 4, -1, -1], dtype=torch.int32)  # expert 3 (both tokens) and 6 cold, 5 resident
        rows = torch.tensor([cut, INTER, cut, INTER], dtype=torch.int32)  # expert 3 split at `cut`, 6 whole
        box.begin_step()
        out = box.exchange(0, ids.reshape(-1), slots, x, w, rows=rows)

        def part(e, lo, hi):  # rows [lo, hi) of expert e on x, fp32: [N, H]
            gate, up = gu[e][lo:hi].float(), gu[e][INTER + lo : INTER + hi].float()
            return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ dn[e][:, lo:hi].float().T

        want = w[:, :1] * part(3, 0, cut) + torch.stack([torch.zeros(H), w[1, 1] * part(6, 0, INTER)[1]])
        torch.testing.assert_close(out, want, rtol=0.05, atol=0.05)
        whole = w[:, :1] * part(3, 0, INTER) + torch.stack([torch.zeros(H), w[1, 1] * part(6, 0, INTER)[1]])
        torch.testing.assert_close(out + w[:, :1] * part(3, cut, INTER), whole, rtol=0.05, atol=0.05)
        assert box.experts_computed == 2
        assert int(box.counters[1]) == box_payload(gu_bytes) * (cut + INTER) // INTER  # bytes read: the rows used
    finally:
        box.close()


@needs_kernel
def test_worker_refuses_a_bad_row_count():
    _, _, slab, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes)
    try:
        box.begin_step()
        ids, cold = torch.tensor([[3, 1]]), torch.tensor([-1, -1], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="layer 0: a malformed mailbox"):
            box.exchange(0, ids.reshape(-1), cold, torch.randn(1, H), torch.rand(1, K),
                         rows=torch.tensor([INTER + 1, 8], dtype=torch.int32))
    finally:
        box.close()


@pytest.mark.gpu
def test_one_graph_split_decode_with_a_gpu_share_follows_memory(tmp_path):
    """A 0.6 share (a GPU faster than the CPU, `[debug] gpu_share`): cold experts split by rows, read in place by the
    GPU, the rest on the worker, within the forked numerics' tolerance of the all-in-memory engine, in one graph a
    step, and the worker reads far fewer expert bytes; a smaller share leaves it more of them."""
    from mailbox_engines import one_graph_decode, tiny_split_setup

    model, cfg, ids, want = tiny_split_setup(tmp_path)
    computed = {}  # bytes of experts the worker read
    for share in (0, 0.6, 0.35):
        with one_graph_decode(model, {**cfg, "debug": {"gpu_share": share}}, ids, want) as (tiered, read, _):
            assert (tiered.executor.gpu_share is None) == (share == 0)
            if share:
                assert tiered.executor.gpu_share.granules == 4  # tiny: 32 rows, 8 a granule
                assert not tiered.executor.gpu_share.adaptive and tiered.executor.gpu_share.value == share
            computed[share] = read
    assert 0 < computed[0.6] < 0.75 * computed[0]
    assert computed[0.6] < computed[0.35] < computed[0]


@needs_kernel
def test_a_worker_error_is_raised_once_and_retires_the_mailbox(tiny_model_dir, tmp_path):
    """A layer the worker could not serve fails that step with a one-line reason; the engine's later steps
    take the host steps (no mailbox), and its statistics still work."""
    from strata.runtime.offload.expert_compute import ExpertCompute
    from strata.runtime.offload.mailbox_books import MailboxBooks
    from strata.runtime.plan.checkpoints.convert import convert_checkpoint
    from strata.tiers.manager import TierBudgets, TierManager
    from strata.tiers.store.store import ExpertStore

    store = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    m = TierManager(store, TierBudgets(gpu_slots=0, pinned_slots=4), io_threads=1)
    try:
        compute = ExpertCompute(m, "cpu", "fork")
        _, _, slab, addr, gu_bytes = _slots()
        addr[0, 5] = 0
        compute.mailbox = _mailbox(addr, gu_bytes)
        compute.books = MailboxBooks(compute.mailbox, m, compute)
        compute._mailbox_kernel = (0, 0, 0.0)
        compute.mailbox.begin_step()
        with pytest.raises(RuntimeError, match="layer 0: an expert not resident"):
            compute.mailbox.exchange(0, torch.tensor([5, 1]), torch.tensor([-1, -1], dtype=torch.int32),
                                     torch.randn(1, H), torch.rand(1, K))
        with pytest.raises(RuntimeError, match="an expert not resident"):
            compute.before_step()  # the next step's check
        assert compute.mailbox is None and compute.books is None and not compute.mailbox_ready()
        compute.before_step()  # nothing left to check
        assert m.stats()["lookups"] >= 0
    finally:
        m.close()
        store.close()


@needs_kernel
def test_a_dropped_mailbox_stops_its_worker():
    """An engine dropped without close(): collecting its mailbox stops the native worker (which would otherwise
    poll for the rest of the process), and close() afterwards is not needed."""
    import gc

    _, _, slab, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes)
    stop = box._finalizer
    assert stop.alive
    del box
    gc.collect()
    assert not stop.alive  # ran: strata_mailbox_stop joined the thread


def test_engine_stats_say_why_one_graph_decode_is_off(tiny_model_dir):
    """On a CPU host the mailbox never opens; the engine's statistics say so (and the reason once asked)."""
    from strata import Engine

    engine = Engine.from_pretrained(tiny_model_dir, device="cpu")
    try:
        state = engine.stats()["one_graph_decode"]
        assert state["on"] is False and "worker_experts" not in state
        engine.tiers.wait_settled(30)
        assert engine.executor.mailbox_ready() is False
        assert engine.stats()["one_graph_decode"]["off_because"] == "no forked CPU compute beside a CUDA device"
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("share", [None, 0.0, 0.37, 0.55])
@pytest.mark.parametrize("n, k, experts", [(1, 8, 128), (3, 8, 128), (16, 8, 128), (5, 2, 16), (2, 8, 256)])
def test_fused_pack_writes_what_the_torch_ops_write(share, n, k, experts):
    """`mailbox_pack.pack_mailbox` (one kernel) gives the inbox bytes, the GPU's addresses and the worker's rows of
    the torch path (`GpuShare.assign`, then `pack_inbox`), with and without a share, for batches up to the graphs'."""
    check_fused_pack(share, n, k, experts, torch.device("cuda"))


@pytest.mark.gpu
def test_wait_and_fetch_on_the_gpu():
    """The wait for the worker's answer (a one-warp system-scope acquire) and its fetch, on the GPU."""
    check_wait_and_fetch(torch.device("cuda"))


@pytest.mark.gpu
def test_the_fetch_copies_what_the_host_wrote_before_done():
    """The GPU waits for a host thread's `done` and copies the answer that thread wrote just before it (not the
    stale one there when the wait began)."""
    import threading
    import time

    from strata.kernels.gpu import host_signal

    n = 2048
    src = torch.zeros(n, pin_memory=True)
    header = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    answer = torch.randn(n)
    out = torch.full((n,), -1.0, device="cuda")
    host_signal.wait_and_fetch(header, torch.tensor([0], device="cuda"), src, out)  # compiled before the timed wait
    torch.cuda.synchronize()

    def worker() -> None:
        time.sleep(0.05)  # the GPU is spinning by now
        src.copy_(answer)
        header[1] = 3  # `done` after the answer, as the worker's release store does

    t = threading.Thread(target=worker)
    t.start()
    host_signal.wait_and_fetch(header, torch.tensor([3], device="cuda"), src, out)
    torch.cuda.synchronize()
    t.join()
    assert torch.equal(out.cpu(), answer) and header[3] == 0 and header[4] > 0  # it waited, then copied the new


def test_fused_pack_under_tritons_interpreter():
    """The same comparison on the CPU, through Triton's interpreter (a subprocess: TRITON_INTERPRET is read when
    Triton is imported), for a few of the GPU test's cases."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    code = ("import torch, tests.offload.test_cpu_mailbox as t\n"
            "for share, n, k, e in [(None, 3, 8, 128), (0.37, 1, 8, 128), (0.37, 16, 8, 128), (0.55, 5, 2, 16)]:\n"
            "    t.check_fused_pack(share, n, k, e, torch.device('cpu'))\n"
            "t.check_wait_and_fetch(torch.device('cpu'))\n"
            "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def check_fused_pack(share, n, k, experts, dev) -> None:
    from strata.kernels.gpu import mailbox_pack
    from strata.kernels.gpu.experts.grouped import HostExperts
    from strata.runtime.offload.gpu_share import GpuShare
    from strata.runtime.offload.mailbox import _up, pack_inbox

    g = torch.Generator().manual_seed(n * 1000 + experts)
    h, inter, layer = 256, 768, 1
    table = (torch.randint(1, 1 << 40, (3, experts), generator=g) * 64).numpy()
    gs = None
    if share is not None:
        gs = GpuShare(table, HostExperts(torch.bfloat16, (2 * inter, h), (h, inter), 2 * inter * h * 2), dev, share,
                      adaptive=False)
    for dtype in (torch.bfloat16, torch.float32):
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).reshape(-1).to(dev)
        used = torch.where(torch.rand(n * k, generator=g) < 0.6, -1, torch.randint(0, 50, (n * k,), generator=g))
        used = used.to(torch.int32).to(dev)
        x = torch.randn(n, h, generator=g).to(dtype).to(dev)
        w = torch.rand(n, k, generator=g).to(dtype).to(dev)
        p = n * k
        x_off = _up(16 + 12 * p, 64)
        nbytes = x_off + 4 * n * h + 4 * p
        want = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        shape = torch.tensor([n, k, p, 0], dtype=torch.int32, device=dev)
        if gs is not None:
            slots, want_addr, want_rows = gs.assign(layer, ids, used)
        else:
            slots, want_addr, want_rows = used, None, torch.full((p,), inter, dtype=torch.int32, device=dev)
        pack_inbox(want, shape, ids, slots, want_rows, x, w, x_off)
        got = torch.zeros_like(want)
        rows = torch.empty(p, dtype=torch.int32, device=dev)
        addr = torch.empty(p, dtype=torch.int64, device=dev) if gs is not None else None
        # the pairs' outputs zeroed by the same kernel: every element of [P, H], nothing past it
        zero = torch.full((p * h + 5,), float("nan"), device=dev)
        mailbox_pack.pack_mailbox(got, ids, used, x, w, x_off, inter, gs, layer, rows=rows, addr=addr,
                                  zero=zero[: p * h].view(p, h))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert not zero[: p * h].any() and zero[p * h :].isnan().all()
        assert torch.equal(rows, want_rows)
        if gs is not None:
            assert torch.equal(addr, want_addr)
            if share == 0.37:
                assert bool((rows < inter).any()) == bool((used < 0).any())  # a share this size gives the GPU rows
        assert torch.equal(got, want)
        # the direct variant: the same bytes written straight into a page-locked inbox, then `ready` posted once
        # every program is done (twice: the program count resets for the next step)
        pin = dev.type == "cuda"
        host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        header = torch.zeros(8, dtype=torch.int64, pin_memory=pin)
        count = torch.zeros(1, dtype=torch.int32, device=dev)
        for gen in (5, 6):
            host.zero_()
            mailbox_pack.pack_mailbox(host, ids, used, x, w, x_off, inter, gs, layer, rows=rows, addr=addr,
                                      ready=(header, torch.tensor([gen], device=dev), count))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(host, want.cpu()) and header.tolist() == [gen] + [0] * 7 and int(count) == 0


def check_wait_and_fetch(dev) -> None:
    """`host_signal.wait_and_fetch` copies the answer once `done` holds the generation, and on a dead worker gives
    up after its spins, saying so in the header."""
    from strata.kernels.gpu.host_signal import wait_and_fetch

    pin = dev.type == "cuda"
    for n in (8, 2048, 5000):  # one program, two, several with a ragged end
        src = torch.randn(n, pin_memory=pin)
        header = torch.zeros(8, dtype=torch.int64, pin_memory=pin)
        header[1] = 9  # the worker answered step 9
        out = torch.zeros(n, device=dev)
        wait_and_fetch(header, torch.tensor([9], device=dev), src, out, 1000)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(out.cpu(), src) and header[3] == 0 and header[4] == 0
        wait_and_fetch(header, torch.tensor([10], device=dev), src, out, 50)  # step 10 never answered
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert header[3] == 10 and header[4] == 50
