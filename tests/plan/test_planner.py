"""strata.runtime.plan.planner and strata.runtime.plan.host: expert placement from headers, on simulated hosts.

Hosts are `HostInfo` values, never the machine running the tests. Models: the tiny demo checkpoint
(and its store), and a Qwen3-30B-A3B-shaped checkpoint written as sparse files (real headers, ~57 GB
of holes) so the numbers are realistic.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
from test_inspect import qwen3_moe, write_sparse_checkpoint

from strata.errors import ConfigError, StrataError
from strata.runtime.demo.model import demo_config
from strata.runtime.plan import host as host_mod
from strata.runtime.plan import planner as planner_mod
from strata.runtime.plan.host import GpuInfo, HostInfo, probe_host
from strata.runtime.plan.planner import RAM_MARGIN_MIN, Plan, PlanError, cmd_plan, plan, read_footprint

GiB, MiB, TiB = 1 << 30, 1 << 20, 1 << 40
Q30B_EXPERT = 3 * 768 * 2048 * 2  # one Qwen3-30B-A3B expert in bf16: 9 MiB
Q30B_KV_PER_TOKEN = 48 * 2 * 4 * 128 * 2  # 48 layers, K and V, 4 heads of 128, bf16


def host(gpu: int | None = 80 * GiB, ram: int = 128 * GiB, tmpfs: int = 64 * GiB, disk: int = 4 * TiB) -> HostInfo:
    gpus = [GpuInfo(0, "sim", gpu, gpu)] if gpu else []
    return HostInfo(gpus=gpus, ram_total=ram, ram_available=ram, tmpfs_path="/dev/shm/strata", tmpfs_free=tmpfs,
                    disk_path="/data/strata", disk_free=disk, cpu_count=16)


@pytest.fixture(scope="module")
def q30b(tmp_path_factory):
    """Qwen3-30B-A3B's shapes and config.json, experts fused, as sparse files."""
    spec, _ = qwen3_moe(48, 2048, 32, 768, 128, fused=True)
    d = tmp_path_factory.mktemp("q30b") / "m"
    write_sparse_checkpoint(d, spec, demo_config("bench"), shards=4)
    return d


def check_invariants(p: Plan) -> None:
    """Fractions sum to 1, no tier exceeds its budget, no expert is counted twice."""
    assert sum(t.fraction for t in p.tiers) == pytest.approx(1.0)
    assert all(0.0 <= t.fraction <= 1.0 for t in p.tiers)
    for t in p.tiers:
        assert 0 <= t.bytes <= t.budget_bytes, t
    assert p.tier("gpu").slots <= p.total_experts and p.tier("pinned").slots <= p.total_experts  # pinned is inclusive
    assert p.tier("disk").slots == p.total_experts
    for g in p.gpus:
        assert g.non_expert_bytes + g.kv_bytes + g.reserve_bytes + g.expert_bytes <= g.free_bytes


def one_line_error(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------------------- small model


def test_tiny_model_fits_on_a_big_gpu(tiny_model_dir):
    p = plan(tiny_model_dir, host())
    check_invariants(p)
    assert (p.compute_device, p.compute_dtype, p.expert_compute) == ("cuda:0", "bfloat16", "gpu")
    assert p.moe_layers == 2 and p.experts_per_layer == 16
    assert p.tier("gpu").slots == 32 and p.tier("gpu").fraction == 1.0
    assert p.budgets() == {"gpu_slots": 32, "pinned_slots": 0, "tmpfs_bytes": 0, "per_layer": False}


def test_store_directory_is_planned_like_its_checkpoint(tiny_model_dir, tmp_path):
    from strata.runtime.plan.checkpoints.convert import convert_checkpoint

    store = convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False)
    a, b = read_footprint(tiny_model_dir), read_footprint(store)
    assert (b.source, b.moe_layers, b.experts_per_layer, b.expert_bytes, b.slot_bytes) == (
        "store", a.moe_layers, a.experts_per_layer, a.expert_bytes, a.slot_bytes)
    assert b.non_expert_bytes == a.non_expert_bytes
    assert abs(b.store_bytes - a.store_bytes) < 64 * 1024  # the estimate before conversion is close
    p = plan(store, host(disk=0))  # an existing store needs no free disk
    assert p.store_exists and p.source == "store"
    assert plan(tiny_model_dir, host(disk=0), store_dir=store).store_exists


# ------------------------------------------------------------------------------- Qwen3-30B-A3B shapes


def test_qwen3_30b_on_a_24gib_gpu(q30b):
    p = plan(q30b, host(gpu=24 * GiB, ram=64 * GiB))
    check_invariants(p)
    g = p.gpus[0]
    assert p.expert_bytes == Q30B_EXPERT and g.slot_bytes == Q30B_EXPERT and p.total_experts == 48 * 128
    assert p.max_context == 40960 and p.kv_bytes == Q30B_KV_PER_TOKEN * 40960  # "auto": the model's limit fits
    assert 2.85 * GiB < g.non_expert_bytes < 2.9 * GiB  # attention, embeddings, lm_head, routers, norms
    room = 24 * GiB - g.non_expert_bytes - p.kv_bytes - 2 * GiB
    assert g.expert_room_bytes == room and g.slots == room // Q30B_EXPERT
    assert p.tier("gpu").fraction == pytest.approx(g.slots / 6144)
    # every expert fits in 64 GiB of RAM minus the 6.4 GiB margin: pinned holds them all (the GPU's too,
    # as the source of its copies), so nothing is ever read from disk
    assert p.ram_margin_bytes == int(0.1 * 64 * GiB)
    assert p.tier("pinned").slots == 6144 and p.tier("disk").fraction == pytest.approx(0.0)
    assert p.tier("pinned").fraction == pytest.approx(1 - g.slots / 6144)


def test_the_plan_resolves_the_prefill_chunk(q30b):
    """runtime.prefill_chunk = "auto": 3,584 tokens for this shape on a GPU with a 1 GiB reserve, 8,192 (the
    most) with the default 2 GiB, 512 on a CPU-only host; a number is kept. `format` says which."""
    long = {"max_context": 16384}
    p = plan(q30b, host(gpu=24 * GiB), {"runtime": long, "planner": {"activation_reserve": "1GiB"}})
    assert p.prefill_chunk == 3584 and "chunks of up to 3584 prompt tokens" in p.format()
    assert plan(q30b, host(gpu=24 * GiB), {"runtime": {"max_context": 4096}}).prefill_chunk == 4096  # the context's
    assert plan(q30b, host(gpu=24 * GiB), {"runtime": long}).prefill_chunk == 8192
    assert plan(q30b, host(gpu=None), {"runtime": long}).prefill_chunk == 512
    assert plan(q30b, host(gpu=24 * GiB), {"runtime": {**long, "prefill_chunk": 1000}}).prefill_chunk == 1000
    assert p.to_dict()["prefill_chunk"] == 3584


def test_small_ram_leaves_experts_on_disk(q30b):
    p = plan(q30b, host(gpu=24 * GiB, ram=16 * GiB))
    check_invariants(p)
    pinned = p.tier("pinned")
    assert p.ram_margin_bytes == RAM_MARGIN_MIN
    assert pinned.budget_bytes == 12 * GiB and pinned.slots == 12 * GiB // p.slot_bytes
    assert p.tier("disk").fraction > 0.3
    assert "16.00 GiB" in p.format() and "disk" in p.format()


def test_too_little_vram_names_a_context_that_fits(q30b):
    cfg = {"runtime": {"max_context": 40960}}
    with pytest.raises(PlanError) as e:
        plan(q30b, host(gpu=8 * GiB), cfg)
    msg = one_line_error(e)
    assert "non-expert weights" in msg and "KV cache for 40960 tokens" in msg and "cuda:0 has 8.00 GiB free" in msg
    fits = int(re.search(r"lower runtime.max_context to (\d+)", msg)[1])
    assert 16384 < fits < 40960 and "use a GPU with" in msg
    plan(q30b, host(gpu=8 * GiB), {"runtime": {"max_context": fits}})  # the suggestion is enough


def test_too_little_vram_even_for_the_weights(q30b):
    with pytest.raises(PlanError) as e:
        plan(q30b, host(gpu=4 * GiB))
    msg = one_line_error(e)
    assert "max_context" not in msg and re.search(r"use a GPU with \d+\.\d GiB free", msg)


def test_gpu_budget_larger_than_the_gpu_is_refused(q30b):
    with pytest.raises(PlanError) as e:
        plan(q30b, host(gpu=24 * GiB), {"tiers": {"gpu": {"budget": "40GiB"}}})
    msg = one_line_error(e)
    assert msg.startswith("tiers.gpu.budget (40.00 GiB)") and '"auto"' in msg
    room = int(re.search(r'set tiers.gpu.budget = "(\d+)MiB"', msg)[1]) * MiB
    p = plan(q30b, host(gpu=24 * GiB), {"tiers": {"gpu": {"budget": f"{room // MiB}MiB"}}})  # the fix works
    assert p.tier("gpu").bytes <= room


def test_explicit_gpu_budget_is_respected(q30b):
    p = plan(q30b, host(gpu=24 * GiB), {"tiers": {"gpu": {"budget": "4GiB"}}})
    check_invariants(p)
    assert p.tier("gpu").slots == 4 * GiB // Q30B_EXPERT and p.tier("gpu").bytes <= 4 * GiB
    with pytest.raises(PlanError, match="one per MoE layer"):
        plan(q30b, host(gpu=24 * GiB), {"tiers": {"gpu": {"budget": "100MiB"}}})
    p = plan(q30b, host(gpu=24 * GiB), {"tiers": {"gpu": {"budget": 0}}})
    assert p.tier("gpu").slots == 0 and p.expert_compute == "cpu" and p.compute_device == "cuda:0"


def test_per_layer_scope_gives_whole_rounds_of_layers(q30b):
    p = plan(q30b, host(gpu=24 * GiB, ram=32 * GiB), {"policy": {"budget_scope": "per_layer"}})
    check_invariants(p)
    assert p.tier("gpu").slots % 48 == 0 and p.tier("pinned").slots % 48 == 0
    assert p.budgets()["per_layer"] is True


def test_pinned_and_tmpfs_budgets(q30b):
    layer = 128 * Q30B_EXPERT
    cfg = {"tiers": {"gpu": {"budget": "2GiB"}, "pinned": {"budget": "10GiB"}, "tmpfs": {"budget": "5GiB"}}}
    p = plan(q30b, host(gpu=24 * GiB, ram=128 * GiB, tmpfs=3 * GiB), cfg)
    check_invariants(p)
    assert p.tier("pinned").slots == 10 * GiB // Q30B_EXPERT
    tmpfs = p.tier("tmpfs")  # capped by the 3 GiB free there, whole layer files only
    assert tmpfs.budget_bytes == 3 * GiB and tmpfs.bytes == (3 * GiB // layer) * layer and tmpfs.slots == 2 * 128
    assert any("tmpfs" in n for n in p.notes)
    auto = plan(q30b, host(gpu=24 * GiB, ram=32 * GiB, tmpfs=64 * GiB), {"tiers": {"tmpfs": {"budget": "10GiB"}}})
    # tmpfs is RAM: its layers come out of the automatic pinned budget
    assert auto.tier("pinned").budget_bytes == 32 * GiB - 4 * GiB - auto.tier("tmpfs").bytes
    with pytest.raises(PlanError, match=r'tiers\.pinned\.budget .*"auto"'):
        plan(q30b, host(gpu=24 * GiB, ram=32 * GiB), {"tiers": {"pinned": {"budget": "30GiB"}}})


def test_too_little_disk_for_the_store(q30b):
    with pytest.raises(PlanError) as e:
        plan(q30b, host(disk=20 * GiB), {"store": {"mode": "packed"}})
    msg = one_line_error(e)
    assert "expert store" in msg and "/data/strata" in msg and "tiers.disk.path" in msg
    in_place = plan(q30b, host(disk=20 * GiB))  # read from the checkpoint's own files: no disk beyond them
    assert in_place.store_mode == "in_place" and "in place" in in_place.format()


def test_cpu_only_host(q30b, tiny_model_dir):
    p = plan(q30b, host(gpu=None, ram=256 * GiB), {"runtime": {"dtype": "float32"}})
    check_invariants(p)
    assert (p.compute_device, p.compute_dtype, p.expert_compute, p.gpus) == ("cpu", "float32", "cpu", [])
    assert p.tier("gpu").slots == 0 and any("CPU" in n for n in p.notes)
    width = 2 if p.compute_dtype == "float32" else 1  # KV per token in bf16, times 2 in fp32
    assert p.kv_bytes == width * Q30B_KV_PER_TOKEN * 40960  # the model's whole context: RAM has room
    # RAM also holds the fp32 weights, the KV cache and the reserve
    used = p.non_expert_bytes + p.kv_bytes + 2 * GiB + p.ram_margin_bytes
    assert p.tier("pinned").budget_bytes == 256 * GiB - used
    with pytest.raises(PlanError, match="of RAM available; use a host with"):
        plan(q30b, host(gpu=None, ram=4 * GiB))
    assert plan(tiny_model_dir, host(gpu=80 * GiB), {"runtime": {"device": "cpu"}}).compute_device == "cpu"
    with pytest.raises(PlanError, match="no CUDA GPU"):
        plan(tiny_model_dir, host(gpu=None), {"runtime": {"device": "cuda"}})
    with pytest.raises(PlanError, match="cuda:3"):
        plan(tiny_model_dir, host(), {"runtime": {"device": "cuda:3"}})
    auto = plan(q30b, host(gpu=None, ram=256 * GiB))  # "auto" on the CPU: the bf16 checkpoint's own dtype
    check_invariants(auto)
    assert auto.compute_dtype == "bfloat16" and auto.kv_bytes == p.kv_bytes // 2
    assert auto.non_expert_bytes == p.non_expert_bytes // 2


def test_gpu_mem_and_ram_overrides(q30b):
    p = plan(q30b, host(gpu=140 * GiB, ram=1024 * GiB), gpu_mem=24 * GiB, ram=64 * GiB)
    assert p.gpus[0].free_bytes == 24 * GiB and p.host.ram_available == 64 * GiB
    assert p.to_dict() == plan(q30b, host(gpu=24 * GiB, ram=64 * GiB)).to_dict()
    assert plan(q30b, host(gpu=None), gpu_mem=24 * GiB).compute_device == "cuda:0"  # plan for a GPU we lack
    assert plan(q30b, host(), gpu_mem=0).compute_device == "cpu"


def test_max_batch_and_model_context_limit(q30b):
    p = plan(q30b, host(), {"planner": {"max_batch": 4}, "runtime": {"max_context": 1 << 20}})
    assert p.max_context == 40960 and p.kv_bytes == 4 * 40960 * Q30B_KV_PER_TOKEN
    assert any("capped" in n for n in p.notes)


def test_json_round_trip(q30b):
    p = plan(q30b, host(gpu=24 * GiB, ram=32 * GiB), {"tiers": {"tmpfs": {"budget": "4GiB"}}})
    d = json.loads(json.dumps(p.to_dict()))
    assert Plan.from_dict(d) == p
    assert d["tiers"][0]["name"] == "gpu" and d["gpus"][0]["device"] == "cuda:0"


# ------------------------------------------------------------------------------------------- CLI, host


def test_cmd_plan(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(planner_mod, "probe_host", lambda tmpfs, disk: host(gpu=None, ram=32 * GiB))
    args = argparse.Namespace(model=str(tiny_model_dir), gpu_mem="24GiB", ram=None, config=None, json=True)
    assert cmd_plan(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpus"][0]["free_bytes"] == 24 * GiB and d["compute_device"] == "cuda:0"
    args.json, args.gpu_mem = False, None
    assert cmd_plan(args) == 0 and "experts compute on the CPU" in capsys.readouterr().out
    args.ram = "64 gigs"
    with pytest.raises(ConfigError, match="--ram"):
        cmd_plan(args)


def test_plan_error_is_a_strata_error():
    assert issubclass(PlanError, StrataError)


def test_probe_host_never_fails(tmp_path, monkeypatch):
    shm, disk = str(tmp_path / "no" / "such" / "shm"), str(tmp_path / "missing" / "disk")
    h = probe_host(shm, disk)
    assert h.ram_total > 0 and 0 < h.ram_available <= h.ram_total and h.cpu_count >= 1
    assert h.disk_free > 0  # measured on the nearest existing parent
    assert HostInfo.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    if not h.gpus:
        assert h.gpus == []
    # a tmpfs path that is not on a RAM filesystem (e.g. no /dev/shm) gives no tmpfs tier
    monkeypatch.setattr(host_mod, "_fs_type", lambda path: "ext4")
    assert probe_host(shm, disk).tmpfs_free == 0
    monkeypatch.setattr(host_mod, "_fs_type", lambda path: "tmpfs")
    assert probe_host(shm, disk).tmpfs_free > 0


# ---- Engram tables ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q30b_engram(tmp_path_factory):
    """The Qwen3-30B-A3B shapes with two Engram layers whose tables hold 8 GiB each (sparse files)."""
    spec, _ = qwen3_moe(48, 2048, 32, 768, 128, fused=True)
    cfg = demo_config("bench")
    assert cfg["engram"]["layer_ids"] == [1, 24]
    spec += [("engram_tables", f"model.layers.{i}.engram.multi_head_embedding.embedding.weight", "BF16",
              (8 * GiB // 1024, 512)) for i in (1, 24)]
    d = tmp_path_factory.mktemp("q30b-engram") / "m"
    write_sparse_checkpoint(d, spec, cfg, shards=4)
    return d


def test_engram_tables_are_planned_per_tier(q30b_engram):
    """Where the tables go decides what they take: the GPU's expert room (tier gpu), pinned RAM (pinned),
    tmpfs and RAM (tmpfs), or only the row cache (disk); on a GPU, pinned and tmpfs tables need no cache."""
    base = plan(q30b_engram, host(gpu=48 * GiB), {"engram": {"tier": "disk", "row_cache": "1GiB"}})
    assert base.engram.table_bytes == 16 * GiB and base.engram.row_cache_bytes == 1 * GiB
    gpu = plan(q30b_engram, host(gpu=48 * GiB), {"engram": {"tier": "gpu"}})
    assert gpu.engram.gpu_bytes == 16 * GiB and gpu.engram.row_cache_bytes == 0
    slot = base.gpus[0].slot_bytes
    # disk tables on a GPU: the row cache is pinned RAM the GPU reads in place, so 16 GiB of tables in VRAM
    # cost 16 GiB of expert slots; without zero copy the cache is in VRAM (and the tables then cost 15)
    assert base.engram.row_cache_in_ram and base.engram.gpu_bytes == 0 and base.engram.ram_bytes == 1 * GiB
    assert "row cache 1.00 GiB in pinned RAM" in base.format() or "row cache 1.0 GiB in pinned RAM" in base.format()
    assert (base.tier("gpu").slots - gpu.tier("gpu").slots) * slot == pytest.approx(16 * GiB, abs=slot)
    vram = plan(q30b_engram, host(gpu=48 * GiB), {"engram": {"tier": "disk", "row_cache": "1GiB"}, "debug": {"engram_zero_copy": False}})
    assert not vram.engram.row_cache_in_ram and vram.engram.gpu_bytes == 1 * GiB and vram.engram.ram_bytes == 0
    assert (vram.tier("gpu").slots - gpu.tier("gpu").slots) * slot == pytest.approx(15 * GiB, abs=slot)
    pinned = plan(q30b_engram, host(gpu=48 * GiB), {"engram": {"tier": "pinned"}})
    assert pinned.engram.zero_copy and pinned.engram.gpu_bytes == 0 and pinned.engram.ram_bytes == 16 * GiB
    # pinned tables take 16 GiB of RAM where the disk case's row cache took 1 GiB
    assert (base.tier("pinned").budget_bytes - pinned.tier("pinned").budget_bytes) == 15 * GiB
    tmpfs = plan(q30b_engram, host(gpu=48 * GiB), {"engram": {"tier": "tmpfs"}, "tiers": {"tmpfs": {"budget": "32GiB"}}})
    assert tmpfs.engram.tmpfs_bytes == 16 * GiB and tmpfs.tier("tmpfs").budget_bytes == 16 * GiB  # the experts' share
    assert plan(q30b_engram, host(gpu=48 * GiB), {"engram": {"tier": "tmpfs"}}).engram.tier == "tmpfs"  # budget 0
    for p in (base, gpu, pinned, tmpfs):
        check_invariants(p)
        assert "engram       tables 16.00 GiB" in p.format() or "engram       tables 16.0 GiB" in p.format()
    assert Plan.from_dict(json.loads(json.dumps(pinned.to_dict()))).engram == pinned.engram


def test_engram_auto_tier_follows_the_host(q30b_engram):
    assert plan(q30b_engram, host(ram=128 * GiB), {}).engram.tier == "pinned"  # 16 GiB <= half the RAM room
    assert plan(q30b_engram, host(ram=24 * GiB), {"tiers": {"tmpfs": {"budget": "20GiB"}}}).engram.tier == "tmpfs"
    low = plan(q30b_engram, host(ram=24 * GiB, tmpfs=8 * GiB), {})
    assert low.engram.tier == "disk" and low.engram.row_cache_bytes == 1 * GiB  # auto cache: 1/8, <= 1 GiB
    cpu = plan(q30b_engram, host(gpu=None, ram=256 * GiB), {"engram": {"tier": "pinned"}})
    assert not cpu.engram.zero_copy and cpu.engram.ram_bytes == 16 * GiB and cpu.engram.gpu_bytes == 0


def test_engram_tables_that_do_not_fit_are_refused(q30b_engram):
    with pytest.raises(PlanError, match='Engram tables .* VRAM.*engram.tier = "pinned"') as e:
        plan(q30b_engram, host(gpu=16 * GiB), {"engram": {"tier": "gpu"}})
    one_line_error(e)
    assert plan(q30b_engram, host(gpu=16 * GiB), {"engram": {"tier": "pinned"}}).engram.gpu_bytes == 0
    with pytest.raises(PlanError, match='engram.tier = "tmpfs" or "disk"') as e:
        plan(q30b_engram, host(ram=16 * GiB), {"engram": {"tier": "pinned"}})
    one_line_error(e)
    with pytest.raises(PlanError, match="do not fit in tmpfs") as e:
        plan(q30b_engram, host(tmpfs=4 * GiB), {"engram": {"tier": "tmpfs"}})
    one_line_error(e)
    with pytest.raises(PlanError, match="several GPUs"):
        h = host()
        h.gpus = [GpuInfo(0, "a", 80 * GiB, 80 * GiB), GpuInfo(1, "b", 80 * GiB, 80 * GiB)]
        plan(q30b_engram, h, {"engram": {"tier": "gpu"}, "runtime": {"devices": [0, 1]}})
