"""bench/cpu/cpu_vs_llamacpp.py: its plans, its summary, and the strata side on a small Qwen3-MoE checkpoint (the
llama.cpp side needs the benchmark's own llama-cpp-python build and is not run here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.cpu import cpu_vs_llamacpp as bench
from bench.cpu import strata_cpu_side

MINI = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8448, "num_experts": 8,
        "num_experts_per_tok": 2, "max_window_layers": 2, "max_position_embeddings": 4096}


def _args(**kw):
    base = {"prefill": [64, 512], "prompt": 64, "tokens": 32, "streams": [1, 4], "temperature": 1.0}
    return SimpleNamespace(**{**base, **kw})


def test_plans_are_fresh_every_round_and_sized_for_the_workloads():
    a, b = bench.make_plan(_args(), seed=100, vocab=8192), bench.make_plan(_args(), seed=101, vocab=8192)
    assert [len(p) for p in a["prefill"]] == [64, 512]
    assert [len(d["prompts"]) for d in a["decode"]] == [1, 4] and all(len(p) == 64 for p in a["decode"][1]["prompts"])
    assert len({tuple(p) for p in a["decode"][1]["prompts"]}) == 4  # four different streams
    assert a["prefill"][0] != b["prefill"][0]  # a new round never reuses a prompt (strata's prefix cache would)
    assert a["n_ctx_per_seq"] >= 512 and a["n_ctx"] == 4 * a["n_ctx_per_seq"] and a["n_seq"] == 4
    assert all(300 <= t < 8000 for p in a["prefill"] for t in p)
    small = bench.make_plan(_args(prefill=[16], prompt=16, tokens=4, streams=[1]), seed=1, vocab=8192)
    assert small["n_ctx_per_seq"] > len(small["warmup"])  # llama.cpp decodes the warm-up prompt in one sequence


def test_medians_and_ratios():
    def res(engine, pre, dec):
        return {"engine": engine, "prefill": [{"prompt": 64, "tok_s": x} for x in pre],
                "decode": [{"streams": 1, "decode_tok_s": x} for x in dec]}

    rounds = [res("llama.cpp", [100], [10]), res("strata", [50], [30]), res("llama.cpp", [300], [30]),
              res("strata", [150], [20]), res("llama.cpp", [200], [20]), res("strata", [100], [40])]
    med = bench.medians(rounds)
    assert med["llama.cpp"] == {"prefill_64": 200, "decode_x1": 20} and med["strata"] == {"prefill_64": 100,
                                                                                          "decode_x1": 30}
    assert med["ratio"] == {"prefill_64": 0.5, "decode_x1": 1.5} and med["paged"] == []
    # a round that read weights back from disk while timed is left out where the engine has clean rounds
    paged = {**res("llama.cpp", [1], [1]), "round": 3, "major_faults": bench.PAGED_FAULTS + 1}
    med = bench.medians(rounds + [paged])
    assert med["llama.cpp"] == {"prefill_64": 200, "decode_x1": 20} and med["paged"] == ["llama.cpp round 4"]
    only = bench.medians([paged, res("strata", [50], [30])])  # no clean round of that engine: kept
    assert only["llama.cpp"] == {"prefill_64": 1, "decode_x1": 1} and only["paged"] == []


@pytest.fixture(scope="module")
def mini_qwen3(tmp_path_factory):
    from strata.runtime.demo import configs as demo_configs
    from strata.runtime.demo import model as dm

    mp = pytest.MonkeyPatch()
    mp.setitem(demo_configs.BASE_CONFIGS, "bench", {**demo_configs.BASE_CONFIGS["bench"], **MINI})
    try:
        yield dm.write_demo_model(tmp_path_factory.mktemp("mini") / "mini", "bench", progress=False, engram=False,
                                  route_skew="uniform")
    finally:
        mp.undo()


def test_the_strata_side_measures_every_workload(mini_qwen3, tmp_path, capsys):
    plan = bench.make_plan(_args(prefill=[8, 40], prompt=8, tokens=5, streams=[1, 3]), seed=1, vocab=8192)
    plan.pop("logits")
    plan["warmup"] = plan["warmup"][:24]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert strata_cpu_side.main(["--model", str(mini_qwen3), "--threads", "2", "--plan", str(tmp_path / "plan.json")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["engine"] == "strata" and out["dtype"] == "bfloat16"  # the default on a bf16 checkpoint
    assert out["config"]["planner"]["max_batch"] == 3 and out["config"]["debug"]["cpu_threads"] == 2
    assert [p["prompt"] for p in out["prefill"]] == [8, 40] and all(p["tok_s"] > 0 for p in out["prefill"])
    assert [(d["streams"], d["tokens"]) for d in out["decode"]] == [(1, 5), (3, 5)]
    assert all(d["decode_tok_s"] > 0 and d["decode_s"] > 0 for d in out["decode"])


# rows of 256 values: K-quant blocks fit the experts (MINI's 128 / 32 do not)
MINI_K = {**MINI, "hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64}


def test_q4_k_m_models_are_one_gguf_that_both_engines_read(tmp_path, monkeypatch, capsys):
    gguf = pytest.importorskip("gguf")
    from strata.runtime.demo import configs as demo_configs
    from strata.tiers.store.format import read_index

    monkeypatch.setitem(demo_configs.BASE_CONFIGS, "bench", {**demo_configs.BASE_CONFIGS["bench"], **MINI_K})
    store, path = bench.ensure_models(tmp_path, 2, "plain", 1.0, keep_checkpoint=False, experts="q4_k_m")
    assert path.name == "bench-L2-plain-q4_k_m.gguf" and not (tmp_path / "models" / "bench-L2-plain").exists()
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    assert read_index(store).expert_format.ggml == (("Q4_K",), ("Q4_K",), ("Q4_K", "Q6_K"))  # the GGUF's blocks
    assert bench.ensure_models(tmp_path, 2, "plain", 1.0, keep_checkpoint=False, experts="q4_k_m") == (store, path)
    plan = bench.make_plan(_args(prefill=[], prompt=8, tokens=2, streams=[1]), seed=1, vocab=8192)
    plan["logits"]["ids"] = plan["logits"]["ids"][:8]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    ref = tmp_path / "ref.npy"  # the check's strata side: the float32 reference on the GGUF's experts
    assert strata_cpu_side.main(["--model", str(store), "--threads", "1", "--plan", str(tmp_path / "plan.json"),
                                 "--reference", str(ref)]) == 0
    import numpy as np

    logprobs = np.load(ref)
    assert logprobs.shape == (8, MINI_K["vocab_size"]) and np.allclose(np.exp(logprobs).sum(-1), 1, atol=1e-4)
    bench.remove_models(store, path)
    assert not store.exists() and not path.exists() and not path.with_suffix(".json").exists()
