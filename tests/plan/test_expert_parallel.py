"""The expert-parallel layout on simulated cards: shares, ownership, refusals, and the planner's report of it beside
the stages it runs."""

from __future__ import annotations

import json

import pytest
from test_placement import cards, multi_host, uniform
from test_planner import host, one_line_error

from strata.runtime.plan.expert_parallel import ExpertParallelError, place_expert_parallel, stage_cold_bytes
from strata.runtime.plan.planner import Plan, plan
from strata.runtime.plan.stages import place_stages

GiB, MiB = 1 << 30, 1 << 20
SLOT = 9 * MiB  # one bf16 expert of the bench model (2048 x 768, three projections)


def bench_sizes():
    """The bench model's shape: 48 MoE layers of 64 MiB of attention, 2 KiB of KV a token each, 128 experts."""
    return uniform(layer=64 * MiB, kv=2048)


def layout(*gib: float, **kw):
    options = dict(context=4096, reserve=2 * GiB, slot_bytes=SLOT, experts_per_token=8) | kw
    return place_expert_parallel(bench_sizes(), cards(*gib), **options)


def check(ep, free: list[float]) -> None:
    """Every expert of a layer owned by exactly one card, in contiguous ranges; nothing over a card's memory."""
    assert sum(c.owned for c in ep.cards) == ep.experts_per_layer
    starts = [c.first_expert for c in ep.cards]
    assert starts == [sum(c.owned for c in ep.cards[:i]) for i in range(len(ep.cards))]
    for c, gib in zip(ep.cards, free, strict=True):
        assert c.non_expert_bytes + c.kv_bytes + c.reserve_bytes + c.slots * ep.slot_bytes <= gib * GiB
        assert c.slots <= c.owned * ep.moe_layers  # a card holds only experts it computes
        assert c.owned >= 1


def test_first_card_holds_the_dense_part_and_every_card_gets_slots():
    ep = layout(24, 24)
    check(ep, [24, 24])
    first, second = ep.cards
    assert first.non_expert_bytes == 48 * 64 * MiB + 1200 * MiB and first.kv_bytes == 48 * 2048 * 4096
    assert second.non_expert_bytes == second.kv_bytes == 0
    assert second.slots > first.slots > 0  # the second card gives all but its reserve to experts
    # equal cold share: each card owns its residents a layer plus half the unheld experts
    cold = [c.owned - c.resident for c in ep.cards]
    assert abs(cold[0] - cold[1]) <= 1


def test_uneven_cards_share_in_proportion_to_what_they_hold():
    ep = layout(48, 24, 12)
    check(ep, [48, 24, 12])
    assert [c.slots for c in ep.cards] == sorted((c.slots for c in ep.cards), reverse=True)
    assert ep.cards[0].owned > ep.cards[1].owned > ep.cards[2].owned
    cold = [c.owned - c.resident for c in ep.cards]
    assert max(cold) - min(cold) <= 1.0  # every link carries about the same cold experts


def test_cards_that_hold_every_expert_own_in_proportion():
    ep = layout(200, 100)
    check(ep, [200, 100])
    assert sum(c.slots for c in ep.cards) == 48 * 128  # capped at the model's experts
    assert ep.cold_bytes_per_link() == 0
    assert ep.cards[0].owned > ep.cards[1].owned


def test_budget_and_per_layer_scope():
    ep = layout(24, 24, budget=4 * GiB)
    assert [c.slots for c in ep.cards] == [4 * GiB // SLOT] * 2
    scoped = layout(24, 24, per_layer=True)
    assert all(c.slots % 48 == 0 for c in scoped.cards)


def test_cold_bytes_halve_against_stages_on_two_equal_cards():
    sizes = bench_sizes()
    devices = cards(24, 24)
    stages = place_stages(sizes, devices, context=4096, reserve=2 * GiB, slot_bytes=SLOT, budget=4 * GiB)
    ep = place_expert_parallel(sizes, devices, context=4096, reserve=2 * GiB, slot_bytes=SLOT, experts_per_token=8,
                               budget=4 * GiB)

    class G:  # GpuPlan's fields stage_cold_bytes reads
        def __init__(self, s):
            self.layers, self.slots, self.slot_bytes = [s.start, s.end], s.slots, s.slot_bytes

    staged = stage_cold_bytes([G(s) for s in stages], sizes, 8)
    # same slots in both layouts: the same cold bytes a token, over two links at once instead of one at a time
    assert sum(s.slots for s in stages) == sum(c.slots for c in ep.cards)
    assert staged / ep.cold_bytes_per_link() == pytest.approx(2.0, rel=0.02)


def test_refuses_a_first_card_without_room_for_the_dense_part():
    with pytest.raises(ExpertParallelError) as e:
        layout(5, 80)
    msg = one_line_error(e)
    assert msg.startswith("cuda:0 (5.00 GiB free) cannot hold what the expert-parallel layout keeps on the first card")
    assert "list cuda:1 first in --gpus" in msg
    with pytest.raises(ExpertParallelError, match="lower runtime.max_context to"):
        layout(8, 8, context=100_000)


def test_refuses_a_card_without_room_for_its_budget():
    with pytest.raises(ExpertParallelError) as e:
        layout(24, 4, budget=4 * GiB)
    assert one_line_error(e).startswith("cuda:1 (4.00 GiB free) cannot hold its expert slots")
    with pytest.raises(ExpertParallelError, match="at least two GPUs"):
        layout(24)


def test_planner_reports_the_layout_beside_the_stages(q30b_multi):
    p = plan(q30b_multi, multi_host(24, 24), {"runtime": {"devices": [0, 1]}, "tiers": {"gpu": {"budget": "4GiB"}}})
    ep = p.expert_parallel
    assert ep is not None and [c.device for c in ep.cards] == ["cuda:0", "cuda:1"]
    assert sum(c.slots for c in ep.cards) == p.tier("gpu").slots  # the same VRAM for experts as the stages
    assert ep.stage_cold_bytes / ep.cold_bytes_per_link() == pytest.approx(2.0, rel=0.05)
    text = p.format()
    assert "split        stages" in text and "expert-parallel, planned (not run yet)" in text
    assert "over one link at a time in stages (2.0" in text
    back = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back.expert_parallel == ep


def test_planner_notes_why_the_layout_does_not_fit(q30b_multi):
    p = plan(q30b_multi, multi_host(4, 24), {"runtime": {"devices": [0, 1]}})  # stages fit; the first card alone cannot
    assert p.expert_parallel is None
    assert any(n.startswith("expert-parallel layout: cuda:0 (4.00 GiB free) cannot hold") for n in p.notes)
    assert plan(q30b_multi, host(gpu=24 * GiB)).expert_parallel is None  # one card: nothing to share out
