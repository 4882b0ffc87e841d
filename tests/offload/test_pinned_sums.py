"""The CPU shares' partial sums in reused buffers (`PinnedSums`) and their upload (`CpuShare.copy_to`): each buffer
comes back zeroed, in turn, grown where a share needs more, and never while a copy out of it may still be reading."""

from __future__ import annotations

import pytest
import torch

from strata.runtime.offload.cpu_compute import CpuShare, PinnedSums


def test_buffers_come_in_turn_zeroed_and_grow_where_a_share_needs_more():
    sums = PinnedSums(depth=2, pin=False)
    i0, a = sums.take(torch.Size((3, 4)))
    a.fill_(1.0)
    i1, b = sums.take(torch.Size((3, 4)))
    b.fill_(2.0)
    assert i0 != i1 and a.data_ptr() != b.data_ptr()
    i2, c = sums.take(torch.Size((2, 4)))  # the first buffer's turn again: the same memory, zeroed
    assert i2 == i0 and c.data_ptr() == a.data_ptr() and c.shape == (2, 4) and not c.any()
    assert torch.equal(b, torch.full((3, 4), 2.0))  # the other buffer untouched
    i3, d = sums.take(torch.Size((10, 4)))  # more than that buffer holds: it grows
    assert i3 == i1 and d.shape == (10, 4) and not d.any()


def test_a_share_is_copied_where_it_is_asked_for():
    sum_ = torch.arange(12, dtype=torch.float32).view(3, 4)
    started = CpuShare(lambda: sum_ * 2, ())
    assert torch.equal(started.copy_to(torch.empty(3, 4)), sum_ * 2)
    assert torch.equal(CpuShare.done(sum_).to(torch.device("cpu")), sum_)


@pytest.mark.gpu
def test_a_buffer_is_not_handed_out_again_while_the_gpu_still_reads_it():
    """One buffer (depth 1), its upload queued behind ~50 ms of GPU work, then taken again and overwritten at once:
    the upload still carries what the share computed, because `take` waits for the copy that read the buffer."""
    sums = PinnedSums(depth=1)
    index, out = sums.take(torch.Size((64, 256)))
    out.fill_(3.0)
    share = CpuShare(lambda: out, (), sums, index)
    torch.cuda._sleep(50_000_000)  # ~50 ms of the GPU's clock ahead of the copy
    on_gpu = share.to(torch.device("cuda"))
    again_index, again = sums.take(torch.Size((64, 256)))
    assert again_index == index and again.data_ptr() == out.data_ptr()
    again.fill_(7.0)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), torch.full((64, 256), 3.0))
