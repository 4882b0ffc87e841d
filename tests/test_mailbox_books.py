"""The bookkeeping of one-graph split decode (strata.runtime.mailbox_books), on the real mailbox worker: when its
thread runs, and how it moves the GPU share from the worker's readings."""

from __future__ import annotations

import pytest
import torch
from test_cpu_mailbox import INTER, H, K, _mailbox, _slots, needs_kernel


@needs_kernel
def test_books_on_their_thread_run_after_the_launch_not_before(tiny_model_dir, tmp_path):
    """With a thread of their own (`inline=False`), the books are woken once a step's work is queued (`queued`), not
    by the pre-launch checks (`step`): their Python would hold the GIL the launch needs. Each layer the worker served
    is booked once."""
    import time

    from strata.runtime.convert import convert_checkpoint
    from strata.runtime.mailbox_books import MailboxBooks
    from strata.tiers.manager import TierBudgets, TierManager
    from strata.tiers.store import ExpertStore

    store = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    m = TierManager(store, TierBudgets(gpu_slots=0, pinned_slots=4), io_threads=1)
    _, _, slab, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes)
    promoted = []
    books = MailboxBooks(box, m, lambda layer, experts: promoted.append((layer, sorted(experts))), lambda *a: None,
                         inline=False)
    try:
        time.sleep(0.1)  # the thread's first timed wake-up (it finds nothing to book)
        box.begin_step()
        box.exchange(0, torch.tensor([3, 4]), torch.tensor([-1, -1], dtype=torch.int32), torch.randn(1, H),
                     torch.rand(1, K))
        books.step()
        # the checks alone wake nobody (the thread's own 50 ms timed wake-up may still book it: not asserted)
        assert not books._wake.is_set()
        books.queued()
        deadline = time.monotonic() + 5
        while not promoted and time.monotonic() < deadline:
            time.sleep(0.005)
        assert books.error is None and promoted == [(0, [3, 4])] and books.seconds > 0
        assert box.drain() == []  # booked once
    finally:
        books.close()
        box.close()
        m.close()
        store.close()


@needs_kernel
def test_inline_books_issue_their_promotions_on_the_queuing_thread(tiny_model_dir, tmp_path):
    """By default the books run on the thread that queued the step (the decoding thread, while its GPU works), and
    so do their promotions: when `queued` returns, the picked expert already sits in a GPU slot (a CPU-simulated
    tier here), with no thread of the books' own and no transfer worker's job queued for it."""
    from strata.runtime.convert import convert_checkpoint
    from strata.runtime.mailbox_books import MailboxBooks
    from strata.tiers.manager import TierBudgets, TierManager
    from strata.tiers.store import ExpertStore

    store = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    layer = store.index.moe_layers[0]
    n_experts = max(k[1] for k in store.keys()) + 1
    m = TierManager(store, TierBudgets(gpu_slots=2, pinned_slots=n_experts), gpu_device=torch.device("cpu"),
                    io_threads=1, policy="lfu")
    m.release(m.acquire([(layer, e) for e in range(n_experts)], "cpu"))  # every expert in pinned RAM
    assert m.wait_settled(10)
    _, _, slab, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes)
    picked = []

    def pick(mailbox_layer, experts):
        picked.append((mailbox_layer, sorted(experts)))
        return layer, max(experts)

    books = MailboxBooks(box, m, pick, lambda *a: None)
    try:
        assert books._thread is None
        box.begin_step()
        box.exchange(0, torch.tensor([3, 4]), torch.tensor([-1, -1], dtype=torch.int32), torch.randn(1, H),
                     torch.rand(1, K))
        books.step()
        assert picked == [] and (layer, 4) not in m.gpu.slot_of  # the pre-launch checks book nothing
        books.queued()
        assert picked == [(0, [3, 4])] and books.error is None
        assert (layer, 4) in m.gpu.slot_of and (layer, 4) not in m.gpu.inflight and not m._jobs
        assert m.stats()["promotions"]["done"] == 1
        gate_up, down = store.expert_views(store.read_expert((layer, 4)))
        got_gu, got_dn = store.expert_views(m.slots.view(m.gpu.slot_of[(layer, 4)]))
        assert torch.equal(got_gu, gate_up) and torch.equal(got_dn, down)
    finally:
        books.close()
        box.close()
        m.close()
        store.close()


@needs_kernel
def test_books_balance_the_gpu_share_on_the_gpus_waits(tiny_model_dir, tmp_path):
    """The real worker reads back each layer's waits (here Python's, which always finds the worker still busy) and
    the books move the share: up while the waiter waited, down once it finds every answer there (the waits word
    cleared, as the GPU's acquire kernel writes it when `done` is already set)."""
    from strata.kernels.grouped import HostExperts
    from strata.runtime.convert import convert_checkpoint
    from strata.runtime.gpu_share import GpuShare
    from strata.runtime.mailbox_books import BALANCE_WINDOW, MailboxBooks
    from strata.tiers.manager import TierBudgets, TierManager
    from strata.tiers.store import ExpertStore

    store = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    m = TierManager(store, TierBudgets(gpu_slots=0, pinned_slots=4), io_threads=1)
    _, _, slab, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes)
    share = GpuShare(addr, HostExperts(torch.bfloat16, (2 * INTER, H), (H, INTER), gu_bytes), torch.device("cpu"), 0.3)
    books = MailboxBooks(box, m, lambda *a: None, lambda *a: None, share)

    def steps(n: int, answered: bool) -> None:
        for _ in range(n):
            box.begin_step()
            for layer in (0, 2):
                box.exchange(layer, torch.tensor([3, 4]), torch.tensor([-1, -1], dtype=torch.int32), torch.randn(1, H),
                             torch.rand(1, K))
                if answered:
                    box.headers[box._box[layer]][4] = 0

    try:
        steps(BALANCE_WINDOW, answered=False)
        books.flush()
        risen = share.target
        assert risen > 0.3 and share.value == 0.3  # the device's value follows between steps
        books.step()
        assert share.value == risen and float(share.share) == pytest.approx(risen)
        steps(2 * BALANCE_WINDOW, answered=True)
        books.flush()
        assert books.error is None and share.target < risen  # (how far: how the books' wake-ups cut the windows)
    finally:
        books.close()
        box.close()
        m.close()
        store.close()


def test_where_the_books_run_from_the_environment_names_a_bad_value(monkeypatch):
    from strata.runtime.expert_compute import _books_inline

    monkeypatch.delenv("STRATA_MAILBOX_BOOKS", raising=False)
    assert _books_inline() is True
    monkeypatch.setenv("STRATA_MAILBOX_BOOKS", "thread")
    assert _books_inline() is False
    monkeypatch.setenv("STRATA_MAILBOX_BOOKS", "threads")
    with pytest.raises(ValueError, match="STRATA_MAILBOX_BOOKS"):
        _books_inline()
