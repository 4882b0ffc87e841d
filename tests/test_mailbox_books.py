"""The bookkeeping of one-graph split decode (strata.runtime.mailbox_books), on the real mailbox worker: when its
thread runs, and how it moves the GPU share from the worker's readings."""

from __future__ import annotations

import pytest
import torch
from test_cpu_mailbox import INTER, H, K, _mailbox, _slots, needs_kernel


@needs_kernel
def test_books_run_after_the_launch_not_before(tiny_model_dir, tmp_path):
    """The books' thread is woken once a step's work is queued (`queued`), not by the pre-launch checks (`step`):
    its Python would hold the GIL the launch needs. Each layer the worker served is booked once."""
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
    books = MailboxBooks(box, m, lambda layer, experts: promoted.append((layer, sorted(experts))), lambda *a: None)
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
