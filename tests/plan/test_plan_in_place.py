"""The planner on a checkpoint larger than the disk's free space: read in place, it needs no second copy.

`strata plan` shows a layout even where a packed store would not fit. A Qwen3-235B-A22B-shaped checkpoint (94 layers x 128 experts, 438 GiB of bf16) written as sparse safetensors files
(real headers, holes for the data) on a simulated host with 24 GiB of VRAM, 64 GiB of RAM and 70 GiB of free disk.
"""

from __future__ import annotations

import pytest
from test_inspect import qwen3_moe, write_sparse_checkpoint
from test_planner import host

from strata.runtime.demo.model import demo_config
from strata.runtime.plan.planner import PlanError, plan

GiB = 1 << 30
Q235B_EXPERT = 3 * 1536 * 4096 * 2  # one expert in bf16: 36 MiB


@pytest.fixture(scope="module")
def q235b(tmp_path_factory):
    spec, _ = qwen3_moe(94, 4096, 64, 1536, 128)
    config = {**demo_config("bench"), "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
              "num_key_value_heads": 4, "intermediate_size": 12288, "moe_intermediate_size": 1536,
              "max_window_layers": 94}
    d = tmp_path_factory.mktemp("q235b") / "m"
    expected = write_sparse_checkpoint(d, spec, config, shards=24)
    assert 437 * GiB < sum(expected.values()) < 439 * GiB
    return d


def test_a_checkpoint_larger_than_the_free_disk_is_planned_in_place(q235b):
    small_host = host(gpu=24 * GiB, ram=64 * GiB, disk=70 * GiB)
    p = plan(q235b, small_host)
    assert p.store_mode == "in_place"
    assert p.total_experts == 94 * 128 and p.slot_bytes >= Q235B_EXPERT
    text = p.format()
    assert "in place" in text and "no extra disk" in text
    # every expert is placed: GPU and pinned slots hold some, the disk tier (the checkpoint's files) all
    assert 0 < p.tier("gpu").slots < p.tier("pinned").slots < 94 * 128
    assert p.tier("pinned").bytes <= 64 * GiB
    # packed, the same checkpoint needs a 438 GiB store on a disk with 70 GiB free: refused for serving,
    # while `strata plan` (refuse=False) shows the layout and lists the store with the disk it needs
    packed = {"store": {"mode": "packed"}, "tiers": {"pinned": {"budget": "80GiB"}}}
    with pytest.raises(PlanError, match="tiers.pinned.budget"):
        plan(q235b, small_host, packed)
    with pytest.raises(PlanError, match="expert store"):
        plan(q235b, small_host, {"store": {"mode": "packed"}})
    shown = plan(q235b, small_host, packed, refuse=False)
    assert shown.store_mode == "packed" and len(shown.does_not_fit) == 2
    pinned, store = shown.does_not_fit
    assert "tiers.pinned.budget" in pinned and "expert store (437.90 GiB)" in store and "437.9 GiB free" in store
    assert shown.tier("pinned").bytes <= 64 * GiB  # planned as if the budget were the RAM left
    assert [t.slots for t in shown.tiers] == [t.slots for t in p.tiers]
    text = shown.format()
    assert "does not fit: tiers.pinned.budget" in text and "does not fit: the expert store" in text


def test_plan_shows_a_layout_for_every_memory_refusal(q235b):
    """What serving refuses for memory (a card too small for the weights, KV cache and one expert per layer; a GPU
    budget above what the card has left or below one expert per layer; a host too small on the CPU) is a note in
    `strata plan`, with the layout planned as if the note's change were made."""
    tiny_card = host(gpu=8 * GiB, ram=64 * GiB, disk=70 * GiB)
    with pytest.raises(PlanError, match="use a GPU with"):
        plan(q235b, tiny_card)
    shown = plan(q235b, tiny_card, refuse=False)
    (short,) = shown.does_not_fit
    assert "non-expert weights" in short and "use a GPU with" in short
    assert shown.tier("gpu").slots == 94  # the minimum: one expert per MoE layer
    assert "does not fit: non-expert weights" in shown.format()

    card = host(gpu=24 * GiB, ram=64 * GiB, disk=70 * GiB)
    fits = plan(q235b, card)
    for budget, words, slots in (("200GiB", "is more than", fits.tier("gpu").slots), ("100MiB", "minimum is one", 94)):
        cfg = {"tiers": {"gpu": {"budget": budget}}}
        with pytest.raises(PlanError, match=words):
            plan(q235b, card, cfg)
        shown = plan(q235b, card, cfg, refuse=False)
        assert len(shown.does_not_fit) == 1 and words in shown.does_not_fit[0]
        assert shown.tier("gpu").slots == slots

    small_host = host(gpu=None, ram=8 * GiB, disk=70 * GiB)
    with pytest.raises(PlanError, match="of RAM available"):
        plan(q235b, small_host)
    shown = plan(q235b, small_host, refuse=False)
    assert any("use a host with" in n for n in shown.does_not_fit) and shown.tier("disk").slots == 94 * 128
