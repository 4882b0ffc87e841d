"""runtime.max_context = "auto" (the default): the model's limit where its KV cache takes at most a quarter of the
memory left after the weights, else the longest multiple of 1024 tokens that does (at least 4096 where half the
memory holds them); `strata plan` shows it; a model loaded without a plan measures its device."""

from __future__ import annotations

import argparse

import pytest
from test_planner import Q30B_KV_PER_TOKEN, GiB, host

from strata.config import ConfigError, load_config
from strata.runtime.plan.context import AUTO_KV_SHARE, plan_context
from strata.runtime.plan.planner import PlanError, cmd_plan, plan


@pytest.fixture(scope="module")
def q30b(tmp_path_factory):
    from test_planner import demo_config, qwen3_moe, write_sparse_checkpoint

    spec, _ = qwen3_moe(48, 2048, 32, 768, 128, fused=True)
    d = tmp_path_factory.mktemp("q30b-context") / "m"
    write_sparse_checkpoint(d, spec, demo_config("bench"), shards=4)
    return d


def _room(p) -> int:
    g = p.gpus[0]
    return g.free_bytes - g.non_expert_bytes - g.reserve_bytes


def test_auto_is_the_longest_context_whose_kv_takes_a_quarter(q30b):
    for gpu, batch in ((24, 8), (48, 16), (80, 32)):
        p = plan(q30b, host(gpu=gpu * GiB), {"planner": {"max_batch": batch}})
        per_token = Q30B_KV_PER_TOKEN * batch
        assert p.max_context < 40960 and p.max_context % 1024 == 0 and p.kv_bytes == per_token * p.max_context
        share = AUTO_KV_SHARE * _room(p)
        assert p.kv_bytes <= share < per_token * (p.max_context + 1024), (gpu, batch)  # the longest that fits
        assert any('"auto"' in n and str(p.max_context) in n for n in p.notes)
    big = plan(q30b, host(gpu=141 * GiB), {"planner": {"max_batch": 8}})  # an H200: the model's whole context
    assert big.max_context == 40960 and any("the model's limit" in n for n in big.notes)
    assert "KV cache     8 x 40960 tokens" in big.format()


def test_auto_keeps_4096_tokens_while_half_the_memory_holds_them(q30b):
    p = plan(q30b, host(gpu=12 * GiB), {"planner": {"max_batch": 8}})
    assert p.max_context == 4096  # a quarter holds fewer, half holds these
    assert p.kv_bytes > AUTO_KV_SHARE * _room(p) and p.kv_bytes <= _room(p) / 2
    small = plan(q30b, host(gpu=None, ram=24 * GiB), {"planner": {"max_batch": 64}})  # half holds fewer still
    assert 16 <= small.max_context < 4096 and small.max_context % 16 == 0


def test_a_number_is_kept_and_capped_at_the_models_limit(q30b):
    p = plan(q30b, host(gpu=141 * GiB), {"runtime": {"max_context": 2048}})
    assert p.max_context == 2048 and p.kv_bytes == 2048 * Q30B_KV_PER_TOKEN * p.max_batch
    p = plan(q30b, host(gpu=141 * GiB), {"runtime": {"max_context": 1 << 20}})
    assert p.max_context == 40960 and any("capped" in n for n in p.notes)
    with pytest.raises(PlanError, match="lower runtime.max_context to"):  # a number that does not fit is refused
        plan(q30b, host(gpu=12 * GiB), {"runtime": {"max_context": 40960}, "planner": {"max_batch": 8}})


def test_plan_context_rules():
    assert plan_context("auto", 8192, 1000, None)[0] == 8192  # nothing known: the model's limit
    assert plan_context("auto", 8192, 1000, 4 * 8192 * 1000)[0] == 8192  # the quarter holds it exactly
    assert plan_context("auto", 40960, 1000, 4 * 10_000 * 1000)[0] == 9216  # rounded down to 1024s
    assert plan_context("auto", 2048, 1000, 4 * 1000 * 1000)[0] == 1024  # the floor is the model's limit at most
    assert plan_context("auto", 40960, 1000, 0)[0] == 16  # nothing fits: the planner refuses it
    assert plan_context(512, 40960, 1000, 0) == (512, "context 512 tokens (runtime.max_context)")


def test_the_setting_is_checked():
    assert load_config({}).runtime.max_context == "auto"
    assert load_config({"runtime": {"max_context": 4096}}).runtime.max_context == 4096
    for bad in ("big", 8, True, 1.5, "AUTO"):
        with pytest.raises(ConfigError, match="runtime.max_context"):
            load_config({"runtime": {"max_context": bad}})


def test_strata_plan_shows_the_context(q30b, capsys):
    args = argparse.Namespace(model=str(q30b), gpu_mem="24GiB", ram="64GiB", config=None, json=False, gpus=None)
    assert cmd_plan(args) == 0
    out = capsys.readouterr().out
    assert "KV cache     1 x 40960 tokens" in out and 'note: context 40960 tokens' in out


def test_a_model_loaded_whole_measures_its_device(tiny_model_dir):
    from strata import Engine

    engine = Engine.from_pretrained(tiny_model_dir, config={"runtime": {"experts": "memory"}}, device="cpu")
    try:
        assert engine.max_context == engine.checkpoint.config.max_position_embeddings  # tiny: RAM holds it all
    finally:
        engine.close()


def test_a_whole_model_counts_the_bytes_loading_it_takes(tiny_model_dir, engram6_dir, tmp_path):
    """`whole_model_bytes` is what `runtime.experts = "memory"` puts in memory: every parameter of the loaded model,
    routed experts and Engram tables included, in each compute dtype; an LM head tied to the embeddings (a checkpoint
    without one of its own) once."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.loader import load_model
    from strata.runtime.plan.context import whole_model_bytes

    tied = tmp_path / "tied"  # the tiny model with its head tied: no lm_head.weight, tie_word_embeddings
    shutil.copytree(tiny_model_dir, tied)
    (tied / "strata_demo.json").unlink(missing_ok=True)
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors")
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    for d in (tiny_model_dir, engram6_dir, tied):
        ckpt = Checkpoint.open(d)
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(ckpt, dtype, "cpu")
            loaded = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
            assert whole_model_bytes(ckpt, dtype) == sum(loaded.values()), (d.name, dtype)
    assert whole_model_bytes(Checkpoint.open(tied), torch.float32) < whole_model_bytes(
        Checkpoint.open(tiny_model_dir), torch.float32)


def test_a_gpu_without_room_for_the_whole_model_refuses_it_before_loading(tiny_model_dir, monkeypatch):
    """`check_whole_fits` (build_model's, before `runtime.experts = "memory"` loads anything): a GPU whose free memory
    holds the weights and the activation reserve passes, one byte less is a PlanError naming the tiered fix; the CPU
    (weights read through the page cache) is never refused."""
    import torch

    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.plan.context import check_whole_fits, whole_model_bytes

    cfg = load_config({"runtime": {"experts": "memory"}})
    checkpoint = Checkpoint.open(tiny_model_dir)
    need = whole_model_bytes(checkpoint, torch.bfloat16) + cfg.planner.activation_reserve_bytes
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need, 80 * GiB))
    check_whole_fits(cfg, checkpoint, gpu, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 1, 80 * GiB))
    with pytest.raises(PlanError, match='runtime.experts = "tiered"') as refused:
        check_whole_fits(cfg, checkpoint, gpu, torch.bfloat16)
    assert "\n" not in str(refused.value) and "activation reserve" in str(refused.value)
    check_whole_fits(cfg, checkpoint, torch.device("cpu"), torch.bfloat16)


def test_a_gpu_without_room_for_the_whole_models_kv_cache_refuses_it_at_start_up(tiny_model_dir, monkeypatch):
    """`check_kv_fits` (build_model's, once a whole model's weights are loaded): the KV cache of every sequence slot
    at the context, allocated at start-up, against what the GPU has left beside the activation reserve; one byte
    short is a PlanError naming the settings that shrink it. The CPU is not checked."""
    import torch

    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.kv_cache import KVCache
    from strata.runtime.plan.context import check_kv_fits

    cfg = load_config({"runtime": {"experts": "memory", "max_context": 2048}, "planner": {"max_batch": 4}})
    model_config = Checkpoint.open(tiny_model_dir).config
    slots = 4 + cfg.runtime.prefix_only_slots
    need = KVCache.bytes_per_token(model_config, torch.bfloat16) * slots * 2048 + cfg.planner.activation_reserve_bytes
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need, 80 * GiB))
    check_kv_fits(cfg, model_config, gpu, torch.bfloat16, 2048)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 1, 80 * GiB))
    with pytest.raises(PlanError, match="lower runtime.max_context or planner.max_batch") as refused:
        check_kv_fits(cfg, model_config, gpu, torch.bfloat16, 2048)
    assert f"{slots} sequences at 2048 tokens" in str(refused.value)
    check_kv_fits(cfg, model_config, torch.device("cpu"), torch.bfloat16, 2048)
