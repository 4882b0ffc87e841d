"""strata on llama.cpp's Q4_K_M GGUF (`split-q4_k_m`, bench/suite/strata_gguf_case.py): the suite's cases and their
order, the GPU budget as a fraction of the file's routed-expert bytes, one export shared with llama.cpp's cases, the
report's Q4_K_M ratio, and the log lines for models not on disk yet. No GPU and no llama.cpp binary: the captured
output of llama.cpp's tools stands in for them."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bench.suite import report, results
from bench.suite.case_config import engine_config
from bench.suite.cases import Case, Workload, group_by_engine, llamacpp_suite, select, with_baselines
from bench.suite.llamacpp_case import gguf_path, layer_expert_bytes
from bench.suite.llamacpp_table import llamacpp_rows, llamacpp_table
from bench.suite.models import ensure_model, gguf_source, model_facts
from bench.suite.roofline import Rates
from bench.suite.runner import run_suite
from bench.suite.strata_gguf_case import gguf_model, gpu_budget_bytes

DATA = Path(__file__).parent / "data" / "llamacpp"
# a 2-layer Qwen3-MoE of the bench size's shape with rows of 256 values, so that K-quant blocks fit its experts (the
# tiny size's rows of 64 and 32 take bf16 and q8_0 only)
MINI_K = {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8448, "num_experts": 8,
          "num_experts_per_tok": 2, "max_window_layers": 2, "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def mini_checkpoint(tmp_path_factory) -> Path:
    """A bf16 demo checkpoint with uniform routing that exports to Q4_K_M, in a models directory of its own."""
    from strata.runtime.demo import configs as demo_configs
    from strata.runtime.demo import model as dm

    mp = pytest.MonkeyPatch()
    mp.setitem(demo_configs.BASE_CONFIGS, "bench", {**demo_configs.BASE_CONFIGS["bench"], **MINI_K})
    try:
        return dm.write_demo_model(tmp_path_factory.mktemp("models") / "bench-L2-uniform", "bench", progress=False,
                                   engram=False, route_skew="uniform")
    finally:
        mp.undo()


def _fake_tools(where: Path) -> Path:
    """llama-bench and llama-batched-bench stand-ins printing their captured output; the directory holding them."""
    where.mkdir(parents=True, exist_ok=True)
    for name, fixture in (("llama-batched-bench", "batched-bench.table.txt"), ("llama-bench", "llama-bench.json.txt")):
        p = where / name
        p.write_text(f"#!/bin/sh\ncat '{DATA / fixture}'\n")
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return where


# --- the cases ------------------------------------------------------------------------------------------------


def test_the_llamacpp_suite_runs_strata_on_q4_k_m_between_its_bf16_run_and_llamacpp():
    cases = llamacpp_suite()
    q4 = [c for c in cases if c.variant == "split-q4_k_m" and c.gpu_fraction is not None]
    work = {(128, 1), (128, 4), (128, 8), (512, 1), (8192, 1)}
    for routing in ("uniform", "skewed"):
        mine = [c for c in q4 if c.routing == routing]
        assert {(c.workload.prompt, c.workload.streams) for c in mine} == work
        assert all(c.gpu_fraction == 0.25 and c.budget_label == "b25" and c.ram_fraction is None for c in mine)
        # the same workloads, tokens and budget as llama.cpp's Q4_K_M cases: one twin each
        assert {c.name.split("/", 1)[1] for c in mine} == {
            c.name.split("/", 1)[1] for c in cases if c.variant == "llamacpp-q4_k_m" and c.routing == routing
            and c.gpu_fraction is not None}
    assert len(cases) == 44
    # the order the runner measures in: per routing strata bf16, strata Q4_K_M; llama.cpp's groups after all of them
    groups = [(g[0].variant, g[0].routing, g[0].budget_label) for g in group_by_engine(cases)]
    assert groups == [(v, r, "b25") for r in ("uniform", "skewed")
                      for v in ("split", "split-q4_k_m", "llamacpp", "llamacpp-q4_k_m")] + [
        (v, "uniform", "all") for v in ("ceiling", "split-q4_k_m", "llamacpp", "llamacpp-q4_k_m")]
    added = with_baselines(select(llamacpp_suite(), ["split/*"]), ["llamacpp-q4_k_m"])
    assert [c.variant for c in added].count("split-q4_k_m") == 10 and [c.variant for c in added].count("llamacpp") == 0
    assert with_baselines(select(llamacpp_suite(), ["split/*"]), ["llamacpp"]) == select(
        llamacpp_suite(), ["split/*"]) + [c for c in llamacpp_suite() if c.variant == "llamacpp" and c.gpu_fraction]


# --- the file and its budget ----------------------------------------------------------------------------------


def test_strata_runs_llamacpps_q4_k_m_file_at_25_percent_of_its_expert_bytes(mini_checkpoint, tmp_path):
    pytest.importorskip("gguf")
    settings = {"llamacpp_root": str(tmp_path / "root"), "cache": str(tmp_path / "cache"), "token_budget": 256,
                "disk_cache": str(tmp_path / "disk")}
    case = Case("split-q4_k_m", "uniform", 0.25, Workload(128, 1, 4))
    said: list[str] = []
    gguf, facts, summary = gguf_model(case, mini_checkpoint, settings, log=said.append)
    assert gguf == gguf_path(mini_checkpoint, "q4_k_m", settings)  # the file llamacpp-q4_k_m reads
    assert gguf.name == "bench-L2-uniform-q4_k_m.gguf" and gguf.parent == tmp_path / "root" / "gguf"
    assert len(said) == 1 and str(gguf) in said[0] and "not on disk yet" in said[0]
    experts = sum(layer_expert_bytes(gguf).values())
    cfg = engine_config(case, summary, settings, [case.workload])
    assert int(cfg["tiers"]["gpu"]["budget"]) == gpu_budget_bytes(case, summary) == int(0.25 * experts)
    bf16 = model_facts(mini_checkpoint)[1]["expert_bytes_total"]
    assert experts < bf16 / 3  # Q4_K_M's bytes, not the bf16 checkpoint's (which a 25% budget of would be > 3x)
    assert summary["experts_format"].startswith("gguf Q4_K")
    # all in VRAM: the bf16 checkpoint's ceiling loads its experts into the model, the GGUF's keeps them in GPU slots in
    # their format (loaded into the model they would be dequantized to bf16)
    plain = model_facts(mini_checkpoint)[1]
    assert summary["experts_quantized"] and not plain["experts_quantized"] and plain["experts_format"] == "bf16"
    ceiling = Case("ceiling", "uniform", None, case.workload)
    assert engine_config(ceiling, plain, settings, [case.workload])["runtime"]["experts"] == "memory"
    assert engine_config(ceiling, summary, settings, [case.workload])["runtime"]["experts"] == "tiered"
    # the file lies outside the checkpoint's directory: its routing marker and vocabulary come from the source given
    assert gguf_source(gguf) == gguf
    assert summary["source"] == str(mini_checkpoint) and summary["demo"]["route_skew"] == "uniform"
    assert summary["vocab_size"] == MINI_K["vocab_size"] and facts.num_experts == MINI_K["num_experts"]
    written = gguf.stat().st_mtime_ns
    assert gguf_model(case, mini_checkpoint, settings, log=said.append)[0] == gguf  # found on disk: not written again
    assert gguf.stat().st_mtime_ns == written and len(said) == 1


def test_models_not_on_disk_say_where_they_are_written(tmp_path):
    pytest.importorskip("gguf")
    said: list[str] = []
    args = (tmp_path / "models", "tiny", None, "uniform", 1.0)
    path = ensure_model(*args, progress=False, experts="q8_0", log=said.append)
    assert [s.split(" ")[0] for s in said] == ["writing", "exporting"]
    assert str(path.parent / "tiny-Lall-uniform") in said[0] and str(path) in said[1]
    assert all("not on disk yet" in s for s in said)
    ensure_model(*args, progress=False, experts="q8_0", log=said.append)
    ensure_model(*args, progress=False, log=said.append)
    assert len(said) == 2  # both on disk now: nothing said


# --- a run, end to end on the CPU -----------------------------------------------------------------------------


def test_a_run_measures_strata_and_llamacpp_on_one_q4_k_m_file_and_reports_their_ratio(mini_checkpoint, tmp_path):
    pytest.importorskip("gguf")
    cases = select(llamacpp_suite(4), ["*/b25/uniform/p128x1"])
    settings = {"suite": "llamacpp", "device": "cpu", "cache": str(tmp_path / "cache"),
                "disk_cache": str(tmp_path / "disk"), "models_dir": str(tmp_path / "models"), "size": "bench",
                "layers": None, "skew": 1.0, "model": str(mini_checkpoint), "token_budget": 256,
                "placement_timeout": 10.0, "hf_limit_s": 60.0, "deadline_s": 300.0, "progress": False,
                "experts": "bf16", "llamacpp_bin": str(_fake_tools(tmp_path / "bin")), "llamacpp_src": None,
                "llamacpp_root": str(tmp_path / "root"), "llamacpp_threads": 2}
    said: list[str] = []
    doc = run_suite(cases, settings, tmp_path / "out", log=said.append, rates=Rates())
    names = [c["name"] for c in doc["cases"]]
    assert names == ["split/b25/uniform/p128x1", "split-q4_k_m/b25/uniform/p128x1", "llamacpp/b25/uniform/p128x1",
                     "llamacpp-q4_k_m/b25/uniform/p128x1"]
    assert all(c["status"] == "ok" for c in doc["cases"]), [(c["name"], c.get("reason")) for c in doc["cases"]]
    split, strata_q4, _, llama_q4 = doc["cases"]
    gguf = Path(strata_q4["gguf"]["path"])
    # one export, written by strata's case and read by llama.cpp's
    assert llama_q4["config"]["gguf"] == str(gguf) and gguf.parent == tmp_path / "root" / "gguf"
    exports = [s for s in said if s.startswith("exporting") and "q4_k_m" in s]
    assert len(exports) == 1  # before strata's first result on the file: the log shows where that time went
    assert said.index(exports[0]) < next(i for i, s in enumerate(said) if s.startswith(strata_q4["name"] + ":"))
    # the same budget: 25% of the file's routed-expert bytes, the bytes llama.cpp's --n-cpu-moe takes its 25% of
    experts = sum(layer_expert_bytes(gguf).values())
    assert strata_q4["gguf"]["expert_bytes_total"] == llama_q4["config"]["expert_bytes_total"] == experts
    assert int(strata_q4["config"]["tiers"]["gpu"]["budget"]) == strata_q4["gguf"]["gpu_budget_bytes"] == int(
        0.25 * experts)
    assert int(split["config"]["tiers"]["gpu"]["budget"]) > 3 * int(0.25 * experts)  # bf16: its own expert bytes
    ours = strata_q4["metrics"]["decode_tok_s"]
    assert ours > 0 and ours != split["metrics"]["decode_tok_s"]
    assert results.validate(doc) == []
    table = llamacpp_table(doc)
    row = next(r for r in llamacpp_rows(doc) if r["workload"] == "p128x1")
    assert row["llamacpp"]["Q4_K_M"]["strata_weights"] == "Q4_K_M"
    assert row["llamacpp"]["Q4_K_M"]["ratio"] == pytest.approx(ours / 777.23)  # the captured one-stream row
    assert f"| {ours:,.2f} | 777.23 | {ours / 777.23:,.2f}x |" in table and "(strata bf16)" not in table


# --- the report -----------------------------------------------------------------------------------------------


def _ok(name: str, decode: float, prefill: float = 1000.0, **config) -> dict:
    variant, budget, routing, wl = name.split("/")
    prompt, streams = (int(x) for x in wl[1:].split("x"))
    m = dict.fromkeys(results.METRICS)
    m.update(decode_tok_s=decode, slowest_stream_tok_s=decode / streams, prefill_tok_s=prefill, bytes_per_token={})
    return {"name": name, "variant": variant, "routing": routing, "group": "grid", "status": "ok", "reason": None,
            "budget": {"gpu_fraction": 0.25, "ram_fraction": None},
            "workload": {"prompt": prompt, "streams": streams, "tokens": 64}, "metrics": m, "roofline": None,
            "fraction_of_roofline": None, "config": config}


def _doc(cases: list[dict]) -> dict:
    doc = results.new_document("llamacpp", {"layers": 12}, {"gpu": "H100", "cpu": "Xeon", "git_commit": "abc"},
                               Rates().as_dict())
    doc["models"] = {"uniform": {"layers": 12, "route_skew": "uniform"}}
    doc["cases"] = cases
    return doc


def test_the_q4_k_m_ratio_takes_strata_on_q4_k_m_and_says_when_it_falls_back_to_bf16(tmp_path):
    doc = results.load([results.write(_doc([
        _ok("split/b25/uniform/p128x1", 30.0), _ok("split-q4_k_m/b25/uniform/p128x1", 50.0),
        _ok("llamacpp/b25/uniform/p128x1", 20.0, n_cpu_moe=9), _ok("llamacpp-q4_k_m/b25/uniform/p128x1", 40.0, n_cpu_moe=9),
        _ok("split/b25/uniform/p128x4", 100.0), _ok("llamacpp-q4_k_m/b25/uniform/p128x4", 80.0, n_cpu_moe=9),
        _ok("split/b25/uniform/p128x8", 120.0), _ok("split-q4_k_m/b25/uniform/p128x8", 90.0),
        _ok("llamacpp-q4_k_m/b25/uniform/p128x8", 60.0, n_cpu_moe=9),  # no llama.cpp bf16 twin: strata's bf16 shown
        _ok("split-q4_k_m/b25/uniform/p8192x1", 20.0, prefill=3000.0),  # strata's Q4_K_M run alone still has its row
        _ok("llamacpp-q4_k_m/b25/uniform/p8192x1", 10.0, prefill=1000.0, n_cpu_moe=9),
    ]), tmp_path)])
    lines = llamacpp_table(doc).splitlines()
    # strata bf16 | llama.cpp bf16 | ratio | strata Q4_K_M | llama.cpp Q4_K_M | ratio | -ncmoe bf16 / Q4_K_M | VRAM bf16 |
    # VRAM Q4_K_M
    assert "| uniform | b25 | p128x1 | decode | 30.00 | 20.00 | 1.50x | 50.00 | 40.00 | 1.25x | 9 / 9 |  |  |" in lines
    assert "| uniform | b25 | p128x8 | decode | 120.00 |  |  | 90.00 | 60.00 | 1.50x | - / 9 |  |  |" in lines
    assert "| uniform | b25 | p8192x1 | prefill |  |  |  | 3,000.00 | 1,000.00 | 3.00x | - / 9 |  |  |" in lines
    # no strata Q4_K_M case for 4 streams: strata's bf16 run, marked, and the note under the table says so
    assert "| uniform | b25 | p128x4 | decode | 100.00 |  |  |  | 80.00 | 1.25x (strata bf16) | - / 9 |  |  |" in lines
    assert any(line.startswith("Q4_K_M ratios marked `(strata bf16)`") for line in lines)
    rows = {r["workload"]: r for r in llamacpp_rows(doc)}
    assert rows["p128x1"]["strata"] == 30.0 and rows["p128x1"]["strata_q4_k_m"] == 50.0
    assert rows["p128x4"]["llamacpp"]["Q4_K_M"]["strata_weights"] == "bf16" and rows["p128x4"]["strata_q4_k_m"] is None
    whole = {**doc, "cases": [c for c in doc["cases"] if "p128x4" not in c["name"]]}
    assert "(strata bf16)" not in llamacpp_table(whole) and "Q4_K_M ratios marked" not in report.render(whole)
