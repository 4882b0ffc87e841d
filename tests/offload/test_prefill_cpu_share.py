"""A prompt chunk's CPU share (`PrefillPath._start_cpu_share`): only its tokens' rows are shipped, its pairs renumbered
into them, and the share starts on the kernel's launcher or, where that declines, on the Python worker.

The split itself needs a GPU tier (tests/tiers/test_gpu_tiers.py runs it end to end); here the compute it hands the
share to records what it is given."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from strata.kernels.experts import group_by_expert, group_by_expert_with_host
from strata.runtime.offload.tiered_prefill import PrefillPath


class RecordingCompute:
    """What `_start_cpu_share` calls on `ExpertCompute`: `start_cpu` (declining when `native` is False, as it does
    for experts not resident in pinned RAM) and `cpu_forward` on `pool`; each records its arguments and returns the
    rows it was given doubled, so a test can see which rows arrived and which partial sum came back."""

    def __init__(self, native: bool):
        self.native, self.use_fast_cpu = native, True
        self.pool = ThreadPoolExecutor(1)
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor, int, list]] = []

    def _record(self, how, x, weights, k, groups):
        self.calls.append((how, x.clone(), weights.clone(), k, [(e, np.asarray(s).copy()) for e, s in groups]))
        return x * 2

    def start_cpu(self, layer, x, weights, k, groups):
        if not self.native:
            return None
        from strata.runtime.offload.cpu_compute import CpuShare

        out = self._record("native", x, weights, k, groups)
        return CpuShare(lambda: out, ())

    def cpu_forward(self, layer, x, weights, k, groups):
        return self._record("worker", x, weights, k, groups)


class Layer(PrefillPath):
    def __init__(self, compute):
        self.compute, self.layer = compute, 3


@pytest.mark.parametrize("native", [True, False])
def test_the_share_gets_its_tokens_rows_and_its_pairs_renumbered_into_them(native):
    n, k, experts = 12, 2, 6
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])  # [N, k] distinct a token
    x, weights = torch.randn(n, 8, generator=g), torch.rand(n, k, generator=g)
    groups, host = group_by_expert_with_host(ids, experts)
    share_groups = [(e, host[e]) for e, _ in groups if e in (1, 4)]  # the experts the cost model left to the CPU
    compute = RecordingCompute(native)
    rows, share = Layer(compute)._start_cpu_share(x, weights, k, share_groups)
    out = share.wait()
    how, x_host, w_host, kk, local = compute.calls[0]
    assert how == ("native" if native else "worker") and kk == k
    want_rows = sorted({int(p) // k for _, sel in share_groups for p in sel})
    assert rows.tolist() == want_rows and len(want_rows) < n  # only the share's tokens, ascending
    assert torch.equal(x_host, x[want_rows].float()) and torch.equal(w_host, weights[want_rows])
    assert [e for e, _ in local] == [e for e, _ in share_groups]
    for (_, sel), (_, renumbered) in zip(share_groups, local, strict=True):
        # pair p (token p // k, slot p % k) becomes the same slot of its token's place among the shipped rows
        assert [want_rows[q // k] * k + q % k for q in renumbered.tolist()] == sel.tolist()
    torch.testing.assert_close(out, x[want_rows].float() * 2)


@pytest.mark.parametrize("n, k, experts", [(1, 1, 4), (37, 8, 128), (300, 4, 16)])
def test_host_pairs_are_group_by_experts_groups_brought_in_one_copy(n, k, experts):
    """The split's CPU share reads its pairs from `group_by_expert_with_host`'s host arrays: the same experts in the
    same order as `group_by_expert`'s, each with the same pair indices (stable: ascending within an expert)."""
    g = torch.Generator().manual_seed(n)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    want = group_by_expert(ids, experts)
    groups, host = group_by_expert_with_host(ids, experts)
    assert [e for e, _ in groups] == [e for e, _ in want] == sorted(host)
    for (e, sel), (_, want_sel) in zip(groups, want, strict=True):
        assert torch.equal(sel, want_sel) and host[e].dtype == np.int64
        assert host[e].tolist() == want_sel.tolist() == sorted(p for p in range(n * k) if ids.reshape(-1)[p] == e)
