"""Several GPUs for one model, on CPU: placement of stages, the planner's split and refusals on simulated
cards, `runtime.devices` / `--gpus`, and the staged forward (stages on the CPU device) against one device."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
import torch
from staged_models import CPU, IDS, score_in_chunks
from test_planner import check_invariants, host, one_line_error

from strata.cli import build_parser
from strata.config import load_config, parse_gpus
from strata.errors import ConfigError
from strata.runtime.plan import planner as planner_mod
from strata.runtime.plan.planner import Plan, PlanError, cmd_plan, plan
from strata.runtime.plan.stages import (
    DeviceInfo,
    LayerSizes,
    PlacementError,
    _Split,
    layer_sizes,
    place_stages,
    simulate_gpus,
)

GiB, MiB = 1 << 30, 1 << 20


def cards(*gib: float) -> list[DeviceInfo]:
    return [DeviceInfo(i, f"sim{i}", int(g * GiB), int(g * GiB)) for i, g in enumerate(gib)]


def uniform(layers: int = 48, layer: int = 400 * MiB, kv: int = 100 * 1024, dense: int = 0) -> LayerSizes:
    """A synthetic model: `dense` leading dense layers, then MoE layers of 128 experts."""
    return LayerSizes([layer] * layers, [i >= dense for i in range(layers)], [kv] * layers,
                      embed_bytes=600 * MiB, head_bytes=600 * MiB, num_experts=128)


def check_stages(stages, sizes: LayerSizes, devices: list[DeviceInfo]) -> None:
    """Contiguous cover of every layer, one stage per card in order, nothing over a card's free memory."""
    assert [s.index for s in stages] == [d.index for d in devices]
    assert stages[0].start == 0 and stages[-1].end == sizes.num_layers
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))
    for s in stages:
        assert s.end > s.start
        assert s.non_expert_bytes + s.kv_bytes + s.reserve_bytes + s.slots * s.slot_bytes <= s.free_bytes
        assert s.moe_layers == sum(sizes.moe[s.start : s.end])


# ---------------------------------------------------------------------------------------- place_stages


def test_uneven_cards_get_layers_by_free_memory():
    sizes, devices = uniform(), cards(96, 24, 24)
    stages = place_stages(sizes, devices, context=4096, reserve=2 * GiB, slot_bytes=9 * MiB)
    check_stages(stages, sizes, devices)
    n = [s.end - s.start for s in stages]
    assert n[0] > n[1] and n[0] > n[2]  # the 96 GB card runs most layers
    per_layer = [s.slots / s.moe_layers for s in stages]
    assert max(per_layer) - min(per_layer) < 0.25 * max(per_layer)  # expert slots per layer about equal
    # embeddings count on the first card only, norm + lm_head on the last only
    assert stages[0].non_expert_bytes == sum(sizes.layer_bytes[: n[0]]) + sizes.embed_bytes
    assert stages[-1].non_expert_bytes == sum(sizes.layer_bytes[stages[-1].start :]) + sizes.head_bytes


def test_split_is_the_best_contiguous_split():
    """Brute force over every split of a small model: none gives a larger smallest per-layer budget."""
    sizes = LayerSizes([300, 100, 100, 500, 100, 200, 100, 100], [False] + [True] * 7, [1] * 8, 50, 70, num_experts=64)
    devices = [DeviceInfo(0, "a", 4000, 4000), DeviceInfo(1, "b", 1500, 1500), DeviceInfo(2, "c", 2500, 2500)]
    split = _Split(sizes, devices, 16, 100, 10, None)
    best = max(min(split.score(p, a, b) for p, (a, b) in enumerate(zip((0, *ends), (*ends, 8), strict=True)))
               for ends in itertools.combinations(range(1, 8), 2)
               if all(split.score(p, a, b) is not None for p, (a, b) in enumerate(zip((0, *ends), (*ends, 8), strict=True))))
    stages = place_stages(sizes, devices, context=16, reserve=100, slot_bytes=10)
    got = min(split.score(p, s.start, s.end) for p, s in enumerate(stages))
    assert got == pytest.approx(best, abs=1.0)


def test_fixed_budget_balances_moe_layers():
    sizes, devices = uniform(), cards(96, 24, 24)
    stages = place_stages(sizes, devices, context=4096, reserve=2 * GiB, slot_bytes=9 * MiB, budget=4 * GiB)
    check_stages(stages, sizes, devices)
    assert [s.slots for s in stages] == [4 * GiB // (9 * MiB)] * 3
    assert max(s.moe_layers for s in stages) - min(s.moe_layers for s in stages) <= 1


def test_budget_zero_and_per_layer():
    sizes, devices = uniform(dense=1), cards(40, 24)
    none = place_stages(sizes, devices, context=4096, reserve=2 * GiB, slot_bytes=9 * MiB, budget=0)
    assert [s.slots for s in none] == [0, 0]
    scoped = place_stages(sizes, devices, context=4096, reserve=2 * GiB, slot_bytes=9 * MiB, per_layer=True)
    assert all(s.slots % s.moe_layers == 0 and s.slots > 0 for s in scoped)


def test_all_experts_fit_caps_slots_at_the_stage_experts():
    sizes = uniform(layers=4, layer=10 * MiB)
    stages = place_stages(sizes, cards(80, 80), context=16, reserve=GiB, slot_bytes=MiB)
    assert [s.slots for s in stages] == [s.moe_layers * 128 for s in stages]


def test_refuses_a_card_that_cannot_hold_one_layer():
    with pytest.raises(PlacementError) as e:
        place_stages(uniform(), cards(96, 1, 24), context=4096, reserve=2 * GiB, slot_bytes=9 * MiB)
    msg = one_line_error(e)
    assert msg.startswith("cuda:1 (1.00 GiB free) cannot hold its stage, layer ")
    assert "add a GPU to --gpus" in msg


def test_refusal_suggests_a_context_that_fits():
    sizes = uniform(kv=2 * MiB)  # 96 MiB of KV per token position over 48 layers
    devices = cards(24, 24)
    with pytest.raises(PlacementError) as e:
        place_stages(sizes, devices, context=4096, reserve=2 * GiB, slot_bytes=9 * MiB)
    msg = one_line_error(e)
    assert "KV cache" in msg and "lower runtime.max_context to " in msg
    fits = int(msg.split("lower runtime.max_context to ")[1].split(",")[0])
    check_stages(place_stages(sizes, devices, context=fits, reserve=2 * GiB, slot_bytes=9 * MiB), sizes, devices)
    with pytest.raises(PlacementError):
        place_stages(sizes, devices, context=fits + 1024, reserve=2 * GiB, slot_bytes=9 * MiB)


def test_refuses_a_budget_that_does_not_fit_and_too_few_layers():
    with pytest.raises(PlacementError, match=r"tiers\.gpu\.budget \(30\.00 GiB\)"):
        place_stages(uniform(), cards(96, 24), context=4096, reserve=2 * GiB, slot_bytes=9 * MiB, budget=30 * GiB)
    with pytest.raises(PlacementError, match="fewer than the 3 GPUs"):
        place_stages(uniform(layers=2), cards(96, 24, 24), context=16, reserve=0, slot_bytes=9 * MiB)


def test_layer_sizes_match_the_loaded_model(tiny6_dir):
    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.loader import load_model

    ckpt = Checkpoint.open(tiny6_dir)
    model = load_model(ckpt, torch.float32, "cpu")
    sizes = layer_sizes(ckpt.config, torch.float32)
    for i, layer in enumerate(model.layers):
        loaded = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if not n.startswith("mlp.experts."))
        assert sizes.layer_bytes[i] == loaded
    assert sizes.moe == [bool(m) for m in ckpt.config.moe_layers]
    assert sizes.embed_bytes == model.embed_tokens.weight.numel() * 4
    with_experts = layer_sizes(ckpt.config, torch.float32, experts=True)
    moe = ckpt.config.moe_layers.index(True)
    assert with_experts.layer_bytes[moe] == sum(p.numel() * 4 for p in model.layers[moe].parameters())


# --------------------------------------------------------------------------------------------- planner


def multi_host(*gib: float):
    h = host(gpu=None)
    h.gpus = cards(*gib)
    return h


def test_planner_splits_over_uneven_cards(q30b_multi):
    p = plan(q30b_multi, multi_host(96, 24, 24), {"runtime": {"devices": [0, 1, 2]}})
    check_invariants(p)
    assert [g.device for g in p.gpus] == ["cuda:0", "cuda:1", "cuda:2"] and p.compute_device == "cuda:0"
    assert p.gpus[0].layers[0] == 0 and p.gpus[-1].layers[1] == 48
    assert all(a.layers[1] == b.layers[0] for a, b in itertools.pairwise(p.gpus))
    assert p.gpus[0].layers[1] - p.gpus[0].layers[0] > p.gpus[1].layers[1] - p.gpus[1].layers[0]
    assert p.tier("gpu").slots == sum(g.slots for g in p.gpus) == p.budgets()["gpu_slots"]
    text = p.format()
    assert "layers 0-" in text and "stage hop cuda:0 -> cuda:1" in text
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).gpus[1].layers == p.gpus[1].layers
    three, one = plan(q30b_multi, multi_host(24, 24, 24), {"runtime": {"devices": [0, 1, 2]}}), plan(q30b_multi, host(gpu=24 * GiB))
    assert three.tier("gpu").slots > 2.5 * one.tier("gpu").slots  # the cards' VRAM adds up for experts


def test_planner_refuses_clearly(q30b_multi):
    with pytest.raises(PlanError) as e:
        plan(q30b_multi, multi_host(24, 2), {"runtime": {"devices": [0, 1]}})
    assert one_line_error(e).startswith("cuda:1 (2.00 GiB free) cannot hold its stage")
    with pytest.raises(PlanError, match="lists GPU 2 but this host has GPUs 0, 1"):
        plan(q30b_multi, multi_host(24, 24), {"runtime": {"devices": [0, 2]}})
    with pytest.raises(PlanError, match="no CUDA GPU"):
        plan(q30b_multi, host(gpu=None), {"runtime": {"devices": [0, 1]}})


def test_cmd_plan_with_gpus(tiny6_dir, monkeypatch, capsys):
    monkeypatch.setattr(planner_mod, "probe_host", lambda tmpfs, disk: host(gpu=None, ram=32 * GiB))
    args = argparse.Namespace(model=str(tiny6_dir), gpu_mem="6GiB,3GiB", ram=None, config=None, json=True, gpus="0,1")
    assert cmd_plan(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(g["device"], g["free_bytes"]) for g in d["gpus"]] == [("cuda:0", 6 * GiB), ("cuda:1", 3 * GiB)]
    assert d["gpus"][0]["layers"][1] == d["gpus"][1]["layers"][0]
    args.gpu_mem = "6GiB,3GiB,3GiB"
    with pytest.raises(PlanError, match="3 sizes for 2 GPUs"):
        cmd_plan(args)
    args.gpu_mem, args.json = "3GiB", False
    assert cmd_plan(args) == 0 and "cuda:1" in capsys.readouterr().out


def test_simulate_gpus():
    h = simulate_gpus(host(gpu=None), [2, 5], [GiB])
    assert [(g.index, g.free_bytes) for g in h.gpus] == [(2, GiB), (5, GiB)]


# ---------------------------------------------------------------------------------------- config, CLI


def test_devices_config():
    cfg = load_config({"runtime": {"devices": [1, 0]}})
    assert cfg.runtime.devices == [1, 0] and cfg.runtime.primary_device == "cuda:1"
    assert load_config(None).runtime.devices == [] and load_config(None).runtime.primary_device == "auto"
    assert load_config({"runtime": {"devices": [1], "device": "cuda:1"}}).runtime.primary_device == "cuda:1"
    for bad, match in (([0, 0], "names a device twice"), ([0, -1], "invalid"), ("0,1", "invalid"),
                       ([0, True], "invalid")):
        with pytest.raises(ConfigError, match=match):
            load_config({"runtime": {"devices": bad}})
    with pytest.raises(ConfigError, match="conflicts with runtime.devices"):
        load_config({"runtime": {"devices": [0, 1], "device": "cpu"}})
    assert parse_gpus("0,1") == [0, 1] and parse_gpus(" 2 , 3 ") == [2, 3]
    with pytest.raises(ConfigError, match="--gpus"):
        parse_gpus("0;1")


def test_cli_takes_gpus():
    parser = build_parser()
    for argv in (["plan", "m", "--gpus", "0,1"], ["serve", "m", "--gpus", "0,1"],
                 ["generate", "m", "--prompt", "x", "--gpus", "0,1"]):
        assert parser.parse_args(argv).gpus == "0,1"


def test_serve_dry_run_refuses_missing_gpus(tiny6_dir, capsys):
    from strata.cli import main

    assert main(["serve", str(tiny6_dir), "--gpus", "0,7", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("strata: error: runtime.devices lists GPU") and "\n" not in err


# ------------------------------------------------------------------------ staged forward on the CPU device


def test_staged_memory_model_matches_one_device(tiny6_dir):
    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.loader import load_model
    from strata.runtime.model.stages import stage_model

    ckpt = Checkpoint.open(tiny6_dir)
    want = score_in_chunks(load_model(ckpt, torch.float32, "cpu"), ckpt.config, IDS)
    model = load_model(ckpt, torch.float32, "cpu")
    seen = []
    model.layers[3].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    stage_model(model, [(CPU, 0, 2), (CPU, 2, 4), (CPU, 4, 6)])
    assert torch.equal(score_in_chunks(model, ckpt.config, IDS), want)
    assert seen and model.stage_map.stage_of(3) == 1 and model.stage_map.stage_of(5) == 2
    with pytest.raises(ValueError, match="contiguously"):
        stage_model(load_model(ckpt, torch.float32, "cpu"), [(CPU, 0, 2), (CPU, 3, 6)])


def test_staged_tiered_model_matches_memory_model(tiny6_dir, staged_tiered):
    from strata.runtime.generation.prefill import prefill
    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.kv_cache import KVCache, StepBatch
    from strata.runtime.model.loader import load_model

    ckpt = Checkpoint.open(tiny6_dir)
    ref = load_model(ckpt, torch.float32, "cpu")
    assert torch.equal(score_in_chunks(staged_tiered.model, ckpt.config, IDS), score_in_chunks(ref, ckpt.config, IDS))

    def greedy(model) -> list[int]:  # 12 tokens: a prefill in chunks of 4, then one decode step a token
        cache = KVCache(ckpt.config, 1, 64, torch.float32, "cpu")
        logits, out = prefill(model, cache, 0, IDS, 4), []
        for position in range(len(IDS), len(IDS) + 12):
            out.append(int(logits.argmax()))
            with torch.inference_mode():
                logits = model.logits(model(torch.tensor(out[-1:]), StepBatch([0], [position], [1]), cache))[0]
        return out

    assert greedy(staged_tiered.model) == greedy(ref)


def test_each_stage_uses_its_own_tiers(staged_tiered):
    tiers = staged_tiered.manager
    score_in_chunks(staged_tiered.model, staged_tiered.checkpoint.config, IDS)
    st = tiers.stats()
    first, second = st["devices"]["cpu/0"], st["devices"]["cpu/1"]
    assert (first["stage_layers"], second["stage_layers"]) == ([0, 3], [3, 6])
    assert {int(k) for k in first["layers"]} == {1, 2} and {int(k) for k in second["layers"]} == {3, 4, 5}
    assert {int(k) for k in st["layers"]} == {1, 2, 3, 4, 5}
    assert first["lookups"] > 0 and second["lookups"] > 0
    assert first["tiers"]["gpu"]["capacity"] == 8 and st["tiers"]["gpu"]["capacity"] == 16
    assert st["lookups"] == first["lookups"] + second["lookups"]
    assert second["prefetch"]["issued"] > 0  # layer 2 (card 0) predicted layer 3 for card 1
    assert "stage_hops" in st
    assert tiers.manager_for(4) is tiers.managers[1] and tiers.residency((4, 0))[-1] == "disk"


def test_dashboard_grid_and_compute_facade(staged_tiered):
    from strata.server.dashboard import residency_grid

    grid = residency_grid(staged_tiered.manager)
    assert grid["layers"] == [1, 2, 3, 4, 5] and "gpu" in grid["present"]
    compute = staged_tiered.compute
    compute.reproducible = True
    assert all(c.reproducible for c in compute.computes)
    compute.reproducible = False
    assert compute.cpu_experts == sum(c.cpu_experts for c in compute.computes)
    assert compute.computes[1].rates is compute.computes[0].rates


# ----------------------------------------------------------------------------- Engram over several stages


def test_layer_sizes_leave_engram_tables_to_the_tiers(engram6_dir):
    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.loader import load_model

    ckpt = Checkpoint.open(engram6_dir)
    assert ckpt.config.engram.layer_ids == [1, 4]
    model = load_model(ckpt, torch.float32, "cpu")
    tiered, memory = layer_sizes(ckpt.config, torch.float32), layer_sizes(ckpt.config, torch.float32, experts=True)
    table = model.layers[1].engram.multi_head_embedding.embedding.weight.numel() * 4
    dense = sum(p.numel() * 4 for n, p in model.layers[1].named_parameters()
                if not n.startswith("mlp.experts.") and ".multi_head_embedding." not in n)
    assert tiered.layer_bytes[1] == dense  # tiered: the table lives in the Engram row store's tier
    assert memory.layer_bytes[1] == sum(p.numel() * 4 for p in model.layers[1].parameters()) > dense + table - 1


def test_staged_tiered_engram_model_matches_memory_model(engram6_dir, tmp_path_factory):
    """An Engram model over two stages: its tables leave the layers, a row store serves each stage's
    Engram layer, and the scores equal the all-in-memory model's."""
    import os

    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.loader import load_model
    from strata.runtime.plan.build import ensure_store
    from strata.runtime.plan.multi_device import assemble_tiered
    from strata.tiers.slots import TierBudgets

    os.environ.setdefault("STRATA_CACHE", str(tmp_path_factory.mktemp("cache")))
    cfg = load_config({"runtime": {"cpu_numerics": "gpu", "max_context": 64}, "tiers": {"disk": {"scrub": False}},
                       "engram": {"tier": "disk", "row_cache": "1KiB"}, "debug": {"engram_read_batch": 7}})
    store = ensure_store(engram6_dir, cfg, False)
    loaded = assemble_tiered(Checkpoint.open(store), [(CPU, 0, 3), (CPU, 3, 6)], [8, 8],
                             TierBudgets(gpu_slots=16, pinned_slots=20), cfg, torch.float32, ram_available=1 << 30)
    try:
        model = loaded.model
        assert all(layer.engram.multi_head_embedding is None for layer in model.layers if layer.engram is not None)
        ref = load_model(Checkpoint.open(engram6_dir), torch.float32, "cpu")
        torch.testing.assert_close(score_in_chunks(model, loaded.checkpoint.config, IDS), score_in_chunks(ref, ref.cfg, IDS),
                                   rtol=1e-5, atol=1e-5)
        st = model.engram.stats()
        assert st["tier"] == "disk" and st["lookups"] > 0 and st["hits"].get("disk", 0) > 0
    finally:
        loaded.manager.close()
        model.engram.source.close()


def test_staged_rows_serve_each_layer_from_its_own_store(engram6_dir, tmp_path_factory):
    """`StagedRows` (one row store per card) routes every Engram layer to its store, reports each card's
    statistics under "devices", and the model's outputs equal the all-in-memory model's."""
    import os

    from strata import Engine
    from strata.runtime.model.engram.store import StagedRows
    from strata.tiers.rows.store import EngramRowStore

    os.environ.setdefault("STRATA_CACHE", str(tmp_path_factory.mktemp("cache")))
    memory = Engine.from_pretrained(engram6_dir, device="cpu", config={"runtime": {"experts": "memory"}})
    # exact CPU numerics: this test is about which store serves each layer, not the forked kernel's rounding
    conf = {"runtime": {"cpu_numerics": "gpu"}, "tiers": {"disk": {"scrub": False}},
            "engram": {"tier": "disk", "row_cache": "1KiB"}}
    with Engine.from_pretrained(engram6_dir, device="cpu", config=conf) as eng:
        store = eng.checkpoint.store
        parts = {"card-a": EngramRowStore(store, [1], "disk", CPU, 8), "card-b": EngramRowStore(store, [4], "pinned", CPU, 8)}
        eng.model.engram.source = StagedRows(parts)
        try:
            torch.testing.assert_close(eng.score(IDS.tolist()), memory.score(IDS.tolist()), rtol=1e-5, atol=1e-5)
            st = eng.model.engram.stats()
            a, b = st["devices"]["card-a"], st["devices"]["card-b"]
            assert a["lookups"] > 0 and b["lookups"] > 0 and a["lookups"] == b["lookups"]
            assert a["hits"].get("disk", 0) > 0 and b["hits"].get("pinned", 0) > 0
        finally:
            eng.model.engram.source.close()


def test_a_failed_staged_load_stops_every_stage_s_tier_threads(tiny6_dir, monkeypatch):
    """Loading over two stages that fails after both stages' tier managers started closes both."""
    import threading

    import strata.runtime.plan.multi_device as multi_device
    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.plan.build import ensure_store
    from strata.tiers.slots import TierBudgets

    def fail(*args, **kwargs):
        raise RuntimeError("the weights could not be read")

    cfg = load_config({"runtime": {"cpu_numerics": "gpu", "max_context": 64}, "tiers": {"disk": {"scrub": False}}})
    store = ensure_store(tiny6_dir, cfg, False)
    before = {t.ident for t in threading.enumerate()}
    monkeypatch.setattr(multi_device, "load_model", fail)
    with pytest.raises(RuntimeError, match="could not be read"):
        multi_device.assemble_tiered(Checkpoint.open(store), [(CPU, 0, 3), (CPU, 3, 6)], [8, 8],
                                     TierBudgets(gpu_slots=16, pinned_slots=20), cfg, torch.float32)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [name for name in left if name.startswith("strata-")], left
