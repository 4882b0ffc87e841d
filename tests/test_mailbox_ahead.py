"""The mailbox worker's copy-ahead on the copy engine (csrc/mailbox_ahead.h): after answering a layer it copies the
next layer's planned tails and then the plan's tag into that layer's flag. On CPU the real worker runs against
host-memcpy stand-ins for the CUDA driver's entry points (same signatures, CUDA_MEMCPY2D field for field), with host
tensors as the "device"; the GPU tests (tests/test_copy_ahead.py) run it with the driver."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch

from strata.kernels import copy_ahead as ca
from strata.kernels import cpu_experts as ce
from strata.kernels.cuda_driver import Memcpy2D

needs_kernel = pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")

H, INTER, E, K, S = 64, 32, 8, 2, 4

SET_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
H2D = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
H2D_2D = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Memcpy2D), ctypes.c_void_p)


class FakeDriver:
    """cuCtxSetCurrent, cuMemcpyHtoDAsync_v2 and cuMemcpy2DAsync_v2 as host memcpys, logging each call;
    `fail_after` copies succeed, then every call returns an error code."""

    def __init__(self, fail_after: int | None = None):
        self.calls: list[tuple] = []
        self.fail_after = fail_after

    def _ok(self) -> bool:
        return self.fail_after is None or len(self.calls) <= self.fail_after

    def set_ctx(self, ctx):
        self.calls.append(("ctx", ctx))
        return 0

    def h2d(self, dst, src, n, stream):
        self.calls.append(("h2d", n, stream))
        if not self._ok():
            return 700
        ctypes.memmove(dst, src, n)
        return 0

    def h2d_2d(self, p, stream):
        c = p.contents
        self.calls.append(("2d", c.WidthInBytes, c.Height, stream))
        if not self._ok() or c.srcMemoryType != 1 or c.dstMemoryType != 2 or c.srcXInBytes or c.dstY:
            return 1
        for r in range(c.Height):
            ctypes.memmove(c.dstDevice + r * c.dstPitch, c.srcHost + r * c.srcPitch, c.WidthInBytes)
        return 0

    def entry(self) -> tuple[int, list[int]]:
        self._fns = (SET_CTX(self.set_ctx), H2D(self.h2d), H2D_2D(self.h2d_2d))  # kept alive with the driver
        return 1234, [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]


class FakeStream:
    cuda_stream = 42


def _experts():
    """E bf16 experts as page-locked slots hold them: gate_up [2I, H], then down [H, I]."""
    g = torch.Generator().manual_seed(0)
    slab = (torch.randn(E, 3 * INTER * H, generator=g) / 8).to(torch.bfloat16)
    addr = np.array([[slab[e].data_ptr() for e in range(E)] for _ in range(2)], dtype=np.int64)
    return slab, addr


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"the worker did not {what}")
        time.sleep(0.001)


def _run(driver: FakeDriver):
    """A mailbox of layers 0 and 1 whose worker copies layer 1's plan after answering layer 0, through `driver`:
    (mailbox, expert slots, plans, flags, staging slots, the worker's copy counters)."""
    from strata.runtime.cpu_mailbox import CpuMailbox

    slab, addr = _experts()
    box = CpuMailbox([0, 1], addr, hidden=H, inter=INTER, gu_bytes=2 * INTER * H * 2, payload=3 * INTER * H * 2,
                     top_k=K, max_tokens=2, threads=2, device=torch.device("cpu"))
    plans = torch.zeros((2, 1 + 3 * S), dtype=torch.int64)
    flags = torch.zeros(2, dtype=torch.int64)
    stage = torch.zeros((S, 3 * INTER * H), dtype=torch.bfloat16)
    counters = box.copy_ahead({0: 1}, plans, flags, FakeStream(), S, INTER, H, 2, 2 * INTER * H * 2,
                              entry=driver.entry())
    assert counters is not None
    assert box.copy_ahead({0: 1}, plans, flags, FakeStream(), S, INTER, H, 2, 2 * INTER * H * 2,
                          entry=driver.entry()) is None  # once per worker
    return box, slab, plans, flags, stage, counters


def _plan_one_tail(box, plans, slot: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
    """Layer 1's plan (its parity's) for the next step: one tail of `rows` rows of expert `slot` into `dst`."""
    plan = plans[1]
    plan[1], plan[1 + S], plan[1 + 2 * S] = slot.data_ptr(), dst.data_ptr(), rows
    plan[0] = (box._host_gen + 1) * ca.TAG_STRIDE + 1


def _step(box, x, ids, w):
    box.begin_step()
    box.exchange(0, ids.reshape(-1), torch.full((ids.numel(),), -1, dtype=torch.int32), x, w)
    return box._host_gen


@needs_kernel
def test_worker_copies_the_planned_tails_then_the_flag():
    driver = FakeDriver()
    box, slab, plans, flags, stage, counters = _run(driver)
    try:
        g = torch.Generator().manual_seed(1)
        x, w = torch.randn(1, H, generator=g).to(torch.bfloat16), torch.rand(1, K, generator=g)
        ids = torch.tensor([[3, 6]])
        plan = plans[1]  # layer 1's parity
        gen = box._host_gen + 1
        experts, rows = [6, 2], [16, 8]  # tails of 16 and 8 of the 32 rows
        for s, (e, a) in enumerate(zip(experts, rows, strict=True)):
            plan[1 + s], plan[1 + S + s], plan[1 + 2 * S + s] = slab[e].data_ptr(), stage[s].data_ptr(), a
        plan[0] = gen * ca.TAG_STRIDE + 1
        assert _step(box, x, ids, w) == gen
        _wait(lambda: int(flags[1]) != 0, "write layer 1's flag")
        assert int(flags[1]) == gen * ca.TAG_STRIDE + 1 and int(flags[0]) == 0
        ref = torch.zeros_like(stage)
        ca.copy_ahead_torch(slab, torch.tensor(experts + [0, 0]), torch.tensor(rows + [0, 0]), ref, INTER, H,
                            2 * INTER * H)
        assert torch.equal(stage, ref) and int((stage != 0).sum()) == 3 * H * sum(rows)
        assert counters.tolist() == [2, 3 * H * sum(rows) * 2, 0, 0, 6, 0]
        assert [c[0] for c in driver.calls] == ["ctx", "h2d", "h2d", "2d", "h2d", "h2d", "2d", "h2d"]
        assert all(c[-1] == 42 for c in driver.calls[1:])  # on the stream given
        assert driver.calls[3][1:3] == (16 * 2, H)  # down's last 16 columns: H runs of 32 bytes
        # the pack's gate: the tails count in this step, not in the next
        tag_rows = torch.tensor([0, 0, 8, 0, 0, 0, 16, 0], dtype=torch.int32)
        assert torch.equal(ca.gated_rows(tag_rows, (flags[1:2], torch.tensor([gen]), 1)), tag_rows)
        assert not ca.gated_rows(tag_rows, (flags[1:2], torch.tensor([gen + 1]), 1)).any()
        # a plan not tagged with this step's generation (its kernel late): skipped, no copy, the flag unchanged
        stage.zero_()
        n_calls = len(driver.calls)
        _step(box, x, ids, w)
        _wait(lambda: int(counters[2]) == 1, "skip the stale plan")
        assert len(driver.calls) == n_calls and not stage.any() and int(flags[1]) == gen * ca.TAG_STRIDE + 1
    finally:
        box.close()


@needs_kernel
def test_worker_stops_copying_after_a_driver_error_and_writes_no_flag():
    driver = FakeDriver(fail_after=2)  # the context and one copy succeed
    box, slab, plans, flags, stage, counters = _run(driver)
    try:
        x, w, ids = torch.zeros(1, H, dtype=torch.bfloat16), torch.ones(1, K), torch.tensor([[1, 2]])
        for _ in range(2):
            _plan_one_tail(box, plans, slab[1], stage[0], 8)
            _step(box, x, ids, w)
            _wait(lambda: int(counters[3]) == 1, "report the driver's error")
        time.sleep(0.05)
        assert int(flags[1]) == 0 and int(counters[3]) == 1  # no flag: the pack would leave the tails unused
        assert len(driver.calls) == 3  # the context, a copy, the failed one; nothing after (the second step)
    finally:
        box.close()


class BlockingDriver(FakeDriver):
    """A driver whose copies wait until `release` is set (a driver call blocked on a lock another thread holds)."""

    def __init__(self):
        super().__init__()
        import threading

        self.release = threading.Event()

    def h2d(self, dst, src, n, stream):
        self.release.wait(30)
        return super().h2d(dst, src, n, stream)


@needs_kernel
def test_worker_keeps_answering_while_a_copy_blocks():
    """The copies are issued by the copier thread, not the worker: with the driver blocked, every layer is still
    answered (the GPU, waiting for those answers, would otherwise hang, as the first version did on the H200 box);
    once the driver returns, the copier catches up."""
    driver = BlockingDriver()
    box, slab, plans, flags, stage, counters = _run(driver)
    try:
        x, w, ids = torch.zeros(1, H, dtype=torch.bfloat16), torch.ones(1, K), torch.tensor([[1, 2]])
        for _ in range(3):
            _plan_one_tail(box, plans, slab[5], stage[0], 8)
            _step(box, x, ids, w)  # returns: the worker answered
        assert int(flags[1]) == 0 and int(counters[0]) == 0  # nothing copied yet
        driver.release.set()
        _wait(lambda: int(counters[0]) + int(counters[2]) == 3, "catch up")  # each request copied, or its plan stale
        _wait(lambda: int(flags[1]) != 0, "write the flag")
        assert int(counters[3]) == 0 and int(counters[0]) >= 1
    finally:
        driver.release.set()
        box.close()
