"""The GPU's share of a one-graph split layer's cold experts (strata.runtime.offload.gpu_share): how the cold rows are cut
between the CPU worker and the GPU's in-place reads, and how the share follows how often the GPU waited for the
worker's answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_mailbox import INTER, E, H


def _share(table, share, granule=None, inter=INTER, **kw):  # granule None: whole experts (a granule of I rows)
    from strata.kernels.gpu.experts.grouped import HostExperts
    from strata.runtime.offload.gpu_share import GpuShare

    experts = HostExperts(torch.bfloat16, (2 * inter, H), (H, inter), 2 * inter * H * 2)
    return GpuShare(table, experts, torch.device("cpu"), share, granule=granule or inter, **kw)


# of 7 cold experts, the GPU's whole number g minimizing max(g / gpu rate, (7 - g) / cpu rate), share <= MAX


# of 7 cold experts, the GPU's whole number g minimizing max(g / gpu rate, (7 - g) / cpu rate), share <= MAX
@pytest.mark.parametrize("share, taken", [(0.0, 0), (0.25, 1), (0.5, 3), (1.0, 4)])
def test_gpu_share_of_whole_experts(share, taken):
    """Without a row split, the GPU's count of a layer's cold experts goes to the GPU whole; an expert's pairs
    all go one way (batched decode reads each expert once); resident pairs stay as they are."""
    table = np.arange(3 * E, dtype=np.int64).reshape(3, E) * 4096 + 4096
    gs = _share(table, share, adaptive=False)
    flat = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6])  # 3 tokens' pairs; expert 7 resident
    used = torch.tensor([-1] * 7 + [3] + [-1] * 4, dtype=torch.int32)
    new, addr, rows = gs.assign(2, flat, used)
    gpu = sorted({int(e) for e, u in zip(flat, new, strict=True) if u == -2})
    assert len(gpu) == taken
    for e, u, a, r in zip(flat.tolist(), new.tolist(), addr.tolist(), rows.tolist(), strict=True):
        assert (u == -2) == (e in gpu) and a == (table[2, e] if e in gpu else 0)
        if e != 7:
            assert r == (0 if e in gpu else INTER)  # the worker's rows: none or all
    assert new[7] == 3  # resident


@pytest.mark.parametrize("cold, share, taken", [(1, 0.5, 0), (1, 0.45, 0), (1, 0.58, 1), (2, 0.45, 1), (2, 0.3, 0),
                                                (3, 0.3, 1), (6, 0.36, 2)])
def test_gpu_share_gives_the_gpu_an_expert_only_where_the_layer_ends_sooner(cold, share, taken):
    """share = gpu rate / (gpu + cpu rate): an expert takes the GPU (1 - share) and the CPU share time units. With
    whole experts, a lone cold expert stays on the CPU unless the GPU is the faster side (share > 0.5; a tie
    stays on the CPU); in general the GPU's count is the one whose slower side is the shortest."""
    gs = _share(np.arange(E, dtype=np.int64)[None] + 1, share, adaptive=False)
    flat = torch.arange(8)
    used = torch.tensor([-1] * cold + [0] * (8 - cold), dtype=torch.int32)
    new, _, _ = gs.assign(0, flat, used)
    assert int((new == -2).sum()) == taken
    # the brute-force optimum: time units where the GPU does one expert in (1 - share), the CPU in share
    best = min(range(cold + 1), key=lambda g: (max(g * (1 - share), (cold - g) * share), g))
    assert max(taken * (1 - share), (cold - taken) * share) == pytest.approx(max(best * (1 - share), (cold - best) * share))


@pytest.mark.parametrize("cold, share", [(1, 0.4), (1, 0.1), (1, 0.6), (2, 0.35), (3, 0.4), (5, 0.3), (8, 0.45), (4, 0.0)])
def test_gpu_share_splits_experts_by_rows(cold, share):
    """With granules of 8 of an expert's 32 rows, the GPU takes the optimal number of the layer's cold granules
    (the last ones in expert order): at most one expert is split, its first rows on the worker, the rest read in
    place by the GPU; every pair of an expert is cut alike; resident pairs are left alone."""
    table = np.arange(E, dtype=np.int64)[None] * 4096 + 4096
    gs = _share(table, share, granule=8, adaptive=False)
    assert (gs.rows, gs.granules) == (8, 4)
    cold_experts = [6, 1, 4, 7, 0, 2, 5, 3][:cold]
    flat = torch.tensor([6, 1, 4, 7, 0, 2, 5, 3] * 2)  # 2 tokens of top-8
    used = torch.tensor([-1 if e in cold_experts else 2 for e in flat.tolist()], dtype=torch.int32)
    new, addr, rows = gs.assign(0, flat, used)
    per_expert = {}
    for e, u, a, r in zip(flat.tolist(), new.tolist(), addr.tolist(), rows.tolist(), strict=True):
        if e not in cold_experts:
            assert u == 2 and a == 0
            continue
        assert per_expert.setdefault(e, r) == r and r % 8 == 0 and 0 <= r <= INTER  # one cut an expert
        assert (u == -2) == (r == 0) and (a != 0) == (r < INTER) and a in (0, table[0, e])
    gpu_granules = sum(INTER - r for r in per_expert.values()) // 8
    total = 4 * cold
    ends = lambda q: max(q * (1 - share), (total - q) * share)  # noqa: E731 - the layer's time units
    assert ends(gpu_granules) == pytest.approx(min(ends(q) for q in range(total + 1)))  # (ties: float rounding)
    assert sum(0 < r < INTER for r in per_expert.values()) <= 1  # at most one expert split
    order = sorted(per_expert)  # the CPU's granules come first in expert order
    assert [per_expert[e] for e in order] == sorted((per_expert[e] for e in order), reverse=True)
    if (cold, share) == (1, 0.4):  # the lone cold expert: both sides work on it, the CPU on 2 or 3 of 4 granules
        assert per_expert[cold_experts[0]] in (16, 24)


@pytest.mark.parametrize("inter, rows", [(768, 64), (1408, 64), (96, 16), (32, 8), (24, 24), (2048, 64)])
def test_row_granules_divide_the_expert(inter, rows):
    from strata.runtime.offload.gpu_share import row_granule

    assert row_granule(inter) == rows
    assert _share(np.ones((1, E), dtype=np.int64), 0.4, granule=row_granule(inter), inter=inter).granules == inter // rows


@pytest.mark.parametrize("inter, block, rows", [(768, 256, 256), (1408, 256, 1408), (2048, 32, 64), (768, 1, 64)])
def test_a_gguf_experts_cuts_fall_between_downs_blocks(inter, block, rows):
    """A GGUF expert is cut only between down's blocks (256 values for K-quants, 32 for Q8_0): where the block does
    not divide I, the expert is not split."""
    from strata.kernels.gpu.experts.grouped import HostExperts
    from strata.kernels.quant import ExpertFormat, ExpertLayout
    from strata.runtime.offload.gpu_share import down_block, row_granule

    assert row_granule(inter, block) == rows
    fmt = ExpertFormat("gguf", ggml=(("Q4_K",), ("Q4_K",), ("Q4_K", "Q6_K")))
    assert down_block(HostExperts.of_layout(ExpertLayout.build(fmt, 256, 512))) == 256
    q8 = ExpertFormat("gguf", ggml=(("Q8_0",), ("Q8_0",), ("Q8_0",)))
    assert down_block(HostExperts.of_layout(ExpertLayout.build(q8, 256, 512))) == 32
    assert down_block(HostExperts(torch.bfloat16, (1024, 256), (256, 512), 0)) == 1


def test_gpu_share_balances_on_how_often_the_gpu_waited():
    from strata.runtime.offload.gpu_share import GpuShare

    gs = _share(np.zeros((1, E), dtype=np.int64), 0.3, granule=8)
    assert gs.wait_target == GpuShare.WAIT_TARGET
    gs.balance(GpuShare.WAIT_TARGET)  # balanced: stays
    assert gs.target == pytest.approx(0.3)
    gs.balance(1.0)  # the GPU waited in every layer: the worker is the long pole, the GPU takes more
    up = gs.target
    assert up == pytest.approx(0.3 + GpuShare.GAIN * (1 - GpuShare.WAIT_TARGET)) and gs.value == 0.3
    gs.balance(0.0)  # the GPU's own work ran past every answer: it takes less
    assert gs.target == pytest.approx(up - GpuShare.GAIN * GpuShare.WAIT_TARGET) and gs.target < 0.3
    for _ in range(100):
        gs.balance(0.0)
    assert gs.target == 0.0  # floored: with no in-place rows the GPU waits again, and the share comes back
    for _ in range(100):
        gs.balance(1.0)
    assert gs.target == GpuShare.MAX
    flat, used = torch.arange(2), torch.full((2,), -1, dtype=torch.int32)  # 2 cold experts of 4 granules each
    assert gs.value == 0.3 and float(gs.share) == pytest.approx(0.3)  # the device's value follows between steps
    assert gs.assign(0, flat, used)[2].tolist() == [INTER, 16]  # 0.3 of 8 granules: the GPU takes 2
    gs.apply()
    assert gs.value == GpuShare.MAX and float(gs.share) == pytest.approx(GpuShare.MAX)  # what the captured step reads
    assert gs.assign(0, flat, used)[2].tolist() == [24, 0]  # 0.6 of 8: the GPU takes 5 (4.8 rounded to the sooner end)
    fixed = _share(np.zeros((1, E), dtype=np.int64), 0.3, adaptive=False)
    fixed.balance(0.0)
    assert fixed.target == 0.3
    assert _share(np.zeros((1, E), dtype=np.int64), 0.3, wait_target=0.5).wait_target == 0.5
    with pytest.raises(ValueError, match="wait target"):
        _share(np.zeros((1, E), dtype=np.int64), 0.3, wait_target=1.0)

