"""strata.runtime.model.hugepages: large CPU weights copied into 2 MiB-aligned mappings advised for huge pages, values
and sharing unchanged."""

from __future__ import annotations

import torch
from torch import nn

from strata.runtime.model.hugepages import HUGE_PAGE, copy_to_huge_pages, use_huge_pages


def test_a_copy_is_aligned_and_equal():
    t = torch.randn(1000, 1031).bfloat16()
    c = copy_to_huge_pages(t)
    assert torch.equal(c, t) and c.dtype == t.dtype and c.shape == t.shape
    assert c.data_ptr() % HUGE_PAGE == 0 and c.data_ptr() != t.data_ptr()


class _Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(4096, 256)
        self.proj = nn.Linear(256, 4096, bias=False)  # 4 MiB in fp32: moved
        self.small = nn.Linear(16, 16)  # left where it is
        self.head = nn.Linear(256, 4096, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_large_parameters_move_and_ties_survive():
    for tied in (False, True):
        m = _Tiny(tied)
        before = {n: (p.detach().clone(), p.data_ptr()) for n, p in m.named_parameters()}
        moved = use_huge_pages(m)
        after = dict(m.named_parameters())
        for n, (values, _) in before.items():
            assert torch.equal(after[n].detach(), values), n
        assert after["proj.weight"].data_ptr() % HUGE_PAGE == 0  # moved
        assert after["small.weight"].data_ptr() == before["small.weight"][1]  # below the size: left
        if tied:  # the head moves, and the embedding tied to it with it: still one tensor
            assert m.head.weight is m.embed.weight and m.embed.weight.data_ptr() % HUGE_PAGE == 0
            assert moved == 2 * 4096 * 256 * 4
        else:  # the embedding table is read a row a token: left; the untied head moved
            assert m.embed.weight.data_ptr() == before["embed.weight"][1]
            assert m.head.weight.data_ptr() % HUGE_PAGE == 0 and moved == 2 * 4096 * 256 * 4
        x = torch.randn(3, 256)
        assert torch.equal(m.proj(x), x @ before["proj.weight"][0].T)
