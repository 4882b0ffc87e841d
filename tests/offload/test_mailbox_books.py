"""The bookkeeping of one-graph split decode (strata.runtime.offload.mailbox_books), on the real mailbox worker: when it
runs, where it stops, and how it moves the GPU share from the worker's readings."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from test_cpu_mailbox import INTER, H, K, _mailbox, _slots, needs_kernel


@contextlib.contextmanager
def _rig(tiny_model_dir, tmp_path, gpu_slots: int = 0):
    """The tiny model's store, its tier manager and a real mailbox worker (closed after): without a GPU tier, or with
    a CPU-simulated one of `gpu_slots` (LFU) and every expert of the first MoE layer (`layer`) in pinned RAM."""
    from strata.runtime.plan.checkpoints.convert import convert_checkpoint
    from strata.tiers.manager import TierBudgets, TierManager
    from strata.tiers.store.store import ExpertStore

    store = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    layer = store.index.moe_layers[0]
    if gpu_slots:
        n_experts = max(k[1] for k in store.keys()) + 1
        m = TierManager(store, TierBudgets(gpu_slots=gpu_slots, pinned_slots=n_experts),
                        gpu_device=torch.device("cpu"), io_threads=1, policy="lfu")
        m.release(m.acquire([(layer, e) for e in range(n_experts)], "cpu"))
        assert m.wait_settled(10)
    else:
        m = TierManager(store, TierBudgets(gpu_slots=0, pinned_slots=4), io_threads=1)
    _, _, _, addr, gu_bytes = _slots()
    box = _mailbox(addr, gu_bytes)
    try:
        yield SimpleNamespace(store=store, layer=layer, m=m, box=box, addr=addr, gu_bytes=gu_bytes)
    finally:
        box.close()
        m.close()
        store.close()


def _serve(box, layers=(0,)) -> None:
    """One step of the worker: `layers` each posted with experts 3 and 4 cold and answered."""
    box.begin_step()
    for layer in layers:
        box.exchange(layer, torch.tensor([3, 4]), torch.tensor([-1, -1], dtype=torch.int32), torch.randn(1, H),
                     torch.rand(1, K))


class Owner:
    """The books' `BooksOwner`: promotions picked by `pick` (none without it), the worker's totals ignored."""

    def __init__(self, pick=lambda layer, experts: None):
        self.pick = pick

    def pick_promotion(self, layer, experts):
        return self.pick(layer, experts)

    def count_mailbox_work(self, experts, nbytes, seconds) -> None:
        pass


@needs_kernel
def test_inline_books_issue_their_promotions_on_the_queuing_thread(tiny_model_dir, tmp_path):
    """The books run on the thread that queued the step (the decoding thread, while its GPU works), not in the
    pre-launch checks (`step`), and so do their promotions: when `queued` returns, the picked expert already sits in a
    GPU slot (a CPU-simulated tier here), with no transfer worker's job queued for it. Each layer is booked once."""
    from strata.runtime.offload.mailbox_books import MailboxBooks

    picked = []
    with _rig(tiny_model_dir, tmp_path, gpu_slots=2) as r:
        store, layer, m = r.store, r.layer, r.m

        def pick(mailbox_layer, experts):
            picked.append((mailbox_layer, sorted(experts)))
            return layer, max(experts)

        books = MailboxBooks(r.box, m, Owner(pick))
        _serve(r.box)
        books.step()
        assert picked == [] and (layer, 4) not in m.gpu.slot_of  # the pre-launch checks book nothing
        books.queued()
        assert picked == [(0, [3, 4])] and books.error is None and books.seconds > 0
        assert (layer, 4) in m.gpu.slot_of and (layer, 4) not in m.gpu.inflight and not m.jobs.queued()
        assert r.box.drain() == []  # booked once
        assert m.stats()["promotions"]["done"] == 1
        gate_up, down = store.expert_views(store.read_expert((layer, 4)))
        got_gu, got_dn = store.expert_views(m.slots.view(m.gpu.slot_of[(layer, 4)]))
        assert torch.equal(got_gu, gate_up) and torch.equal(got_dn, down)


class _Gpu:
    """A stand-in for the step's done event: `query()` answers from `busy` (True: the GPU still works) in turn."""

    def __init__(self, *busy: bool):
        self.busy, self.queries = list(busy), 0

    def query(self) -> bool:
        self.queries += 1
        return not (self.busy.pop(0) if len(self.busy) > 1 else self.busy[0])


@needs_kernel
def test_inline_books_stop_when_the_gpu_is_done_and_catch_up_later(tiny_model_dir, tmp_path, monkeypatch):
    """Inline books book layers only while the step's GPU work runs: once its event is reached they leave the rest
    (and promotions picked but not issued) for the next step, unless more than BACKLOG_MAX layers wait; statistics
    (`flush` with no event) book everything. No layer is booked twice or lost."""
    from strata.runtime.offload import mailbox_books
    from strata.runtime.offload.mailbox_books import MailboxBooks

    picked = []
    with _rig(tiny_model_dir, tmp_path, gpu_slots=4) as r:
        layer, m = r.layer, r.m

        def pick(mailbox_layer, experts):
            picked.append(mailbox_layer)
            return layer, mailbox_layer + 3

        books = MailboxBooks(r.box, m, Owner(pick))
        _serve(r.box, (0, 2))
        books.queued(_Gpu(False))  # the GPU was done first: nothing booked
        assert picked == [] and books.deferred == 1 and len(books._backlog) == 2
        books.queued(_Gpu(True, False))  # one layer booked, then the GPU is done: its promotion waits
        assert picked == [0] and (layer, 3) not in m.gpu.slot_of and list(books._promote) == [(layer, 3)]
        books.queued(_Gpu(True))  # the rest, and both promotions issued
        assert picked == [0, 2] and (layer, 3) in m.gpu.slot_of and (layer, 5) in m.gpu.slot_of
        assert not books._promote and not books._backlog and books.deferred == 2
        monkeypatch.setattr(mailbox_books, "BACKLOG_MAX", 3)
        for _ in range(3):
            _serve(r.box, (0, 2))
        books.queued(_Gpu(False))  # 6 wait: the books catch up to 3 even though the GPU is done
        assert picked == [0, 2, 0, 2, 0] and len(books._backlog) == 3 and len(books._promote) == 3
        books._issue_promotions(_Gpu(True, False))  # each promotion only while the GPU is busy: one, then it is done
        assert len(books._promote) == 2
        m.stats()  # a statistics read books the rest, but leaves promotions to the decoding thread (its stream)
        assert picked == [0, 2, 0, 2, 0, 2, 0, 2] and not books._backlog and books.error is None
        assert len(books._promote) == 5 and m.stats()["promotions"]["done"] == 3
        books.queued(_Gpu(True))
        assert not books._promote and m.stats()["promotions"]["done"] == 8  # every pick issued once...
        assert sorted(m.gpu.slot_of) == [(layer, 3), (layer, 5)]  # ...the later ones finding their expert there


@needs_kernel
def test_books_balance_the_gpu_share_on_the_gpus_waits(tiny_model_dir, tmp_path):
    """The real worker reads back each layer's waits (here Python's, which always finds the worker still busy) and
    the books move the share: up while the waiter waited, down once it finds every answer there (the waits word
    cleared, as the GPU's acquire kernel writes it when `done` is already set)."""
    from strata.kernels.gpu.experts.grouped import HostExperts
    from strata.runtime.offload.gpu_share import GpuShare
    from strata.runtime.offload.mailbox_books import BALANCE_WINDOW, MailboxBooks

    with _rig(tiny_model_dir, tmp_path) as r:
        box = r.box
        share = GpuShare(r.addr, HostExperts(torch.bfloat16, (2 * INTER, H), (H, INTER), r.gu_bytes),
                         torch.device("cpu"), 0.3)
        books = MailboxBooks(box, r.m, Owner(), share)

        def steps(n: int, answered: bool) -> None:
            for _ in range(n):
                box.begin_step()
                for layer in (0, 2):
                    box.exchange(layer, torch.tensor([3, 4]), torch.tensor([-1, -1], dtype=torch.int32),
                                 torch.randn(1, H), torch.rand(1, K))
                    if answered:  # cleared as soon as answered, before the next layer's post reads it back
                        box.headers[box._box[layer]][4] = 0

        steps(BALANCE_WINDOW, answered=False)
        books.flush()
        risen = share.target
        assert risen > 0.3 and share.value == 0.3  # the device's value follows between steps
        books.step()
        assert share.value == risen and float(share.share) == pytest.approx(risen)
        steps(2 * BALANCE_WINDOW, answered=True)
        books.flush()
        assert books.error is None and share.target < risen  # (how far: where the flushes cut the windows)
