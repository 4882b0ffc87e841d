"""The benchmark suite's own logic (bench/suite): roofline arithmetic, case selection, the result schema,
the benchmark report's suite section generated from a JSON, and one tiny case end to end on CPU. No timing
assertions."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from bench.__main__ import main as bench_main
from bench.suite import report, results
from bench.suite.case_config import engine_config, prefill_chunk
from bench.suite.cases import VARIANTS, Case, Workload, full_suite, group_by_engine, quick_suite, select
from bench.suite.roofline import ModelFacts, Rates, cpu_stream_rate, fraction, measure_rates, roofline
from bench.suite.runner import run_suite
from bench.suite.strata_case import pinned_shortfall, warmup_for
from strata.config import load_config

ROOT = Path(__file__).resolve().parents[2]

FACTS = ModelFacts(expert_bytes=10, dense_bytes_per_step=100, num_experts=8, experts_per_token=2, moe_layers=2)
RATES = Rates(pcie=1.0, cpu=3.0, hbm=1000.0, disk=0.5)


# --- roofline -------------------------------------------------------------------------------------


def test_roofline_takes_the_slowest_of_gpu_cold_and_disk():
    # cold: 30 experts x 10 B over PCIe + CPU (4 B/s) = 75 s; GPU: (10 x 100 + 20 x 10) / 1000 = 1.2 s
    r = roofline(tokens=10, steps=10, gpu_experts=20, cold_experts=30, disk_experts=0, facts=FACTS, rates=RATES,
                 paths=("pcie", "cpu"))
    assert r["bound"] == "cold" and r["tok_s"] == pytest.approx(10 / 75)
    assert r["ms_per_token"]["gpu"] == pytest.approx(120.0) and r["cold_bytes_per_token"] == 30
    copy_only = roofline(tokens=10, steps=10, gpu_experts=20, cold_experts=30, disk_experts=0, facts=FACTS,
                         rates=RATES, paths=("pcie",))
    assert copy_only["tok_s"] == pytest.approx(10 / 300)  # one path: PCIe alone
    disk = roofline(tokens=10, steps=10, gpu_experts=20, cold_experts=0, disk_experts=100, facts=FACTS, rates=RATES,
                    paths=("pcie", "cpu"))
    assert disk["bound"] == "disk" and disk["tok_s"] == pytest.approx(10 / 2000)
    ceiling = roofline(tokens=10, steps=10, gpu_experts=40, cold_experts=0, disk_experts=0, facts=FACTS, rates=RATES,
                       paths=())
    assert ceiling["bound"] == "gpu" and ceiling["tok_s"] == pytest.approx(10 / 1.4)
    with pytest.raises(ValueError):  # cold traffic with no path to credit is a bug in the caller
        roofline(tokens=1, steps=1, gpu_experts=0, cold_experts=1, disk_experts=0, facts=FACTS, rates=RATES, paths=())
    with pytest.raises(ValueError):
        roofline(tokens=0, steps=1, gpu_experts=0, cold_experts=0, disk_experts=0, facts=FACTS, rates=RATES, paths=())
    assert fraction(5.0, {"tok_s": 20.0}) == 0.25 and fraction(None, {"tok_s": 1}) is None and fraction(1, None) is None


def test_expected_experts_per_step_and_rates():
    assert FACTS.expected_experts_per_step(1) == pytest.approx(2 * 2)  # k per layer
    assert FACTS.expected_experts_per_step(1000) == pytest.approx(2 * 8)  # every expert of every layer
    assert 4 < FACTS.expected_experts_per_step(4) < 16
    with pytest.raises(ValueError):
        Rates(pcie=0)
    assert Rates().source["pcie"] == "reference"


@pytest.mark.parametrize(("cores", "gpu_worker", "threads"), [(16, True, 12), (16, False, 16), (4, True, 3), (1, True, 1)])
def test_the_cpu_path_rate_is_the_pools_bytes_over_a_sweep_on_the_workers_threads(monkeypatch, cores, gpu_worker,
                                                                                   threads):
    """The roofline's CPU rate: every byte of the pool over the best timed sweep (the first, which faults the pages
    in, not counted), on the threads the one-graph decode's worker takes beside a GPU (4 cores left on 8+) or on
    every core without one."""
    from strata.kernels.cpu import library

    sweeps, seen = iter([0.1, 0.5, 0.25, 0.4]), []  # the first the fastest: it must not count
    monkeypatch.setattr(library, "default_threads", lambda: cores)
    monkeypatch.setattr(library, "read_sweep", lambda pieces, n: seen.append((len(pieces), n)) or next(sweeps))
    rate = cpu_stream_rate(gpu_worker, pool_bytes=64 << 20, piece_bytes=8 << 20)
    assert rate == (64 << 20) / 0.25
    assert seen == [(8, threads)] * 4


def test_measured_rates_take_the_cpu_paths_own_unless_there_is_no_kernel(monkeypatch):
    from strata.kernels.cpu import library

    if library.read_sweep([torch.ones(8)], 1) is None:
        pytest.skip("no compiled CPU kernel")
    rates = measure_rates("cpu", reps=1)
    assert rates.source["cpu"] == "measured" and rates.cpu != Rates().cpu and 1e8 < rates.cpu < 1e13
    monkeypatch.setattr(library, "read_sweep", lambda pieces, n: None)
    rates = measure_rates("cpu", reps=1)
    assert rates.source["cpu"] == "reference" and rates.cpu == Rates().cpu


# --- cases ----------------------------------------------------------------------------------------


def test_suites_are_named_uniquely_and_cover_every_variant():
    for cases in (quick_suite(), full_suite()):
        names = [c.name for c in cases]
        assert len(names) == len(set(names))
    full = full_suite()
    assert {c.variant for c in full} == set(VARIANTS)
    assert {c.gpu_fraction for c in full if c.variant == "split"} == {0.10, 0.25, 0.40, 0.50}
    assert {(c.workload.prompt, c.workload.streams) for c in full if c.variant == "split"} >= {
        (128, 1), (128, 4), (128, 8), (8192, 1)}
    assert all(c.workload.tokens == 128 for c in full)
    assert all(c.gpu_fraction == 0 for c in full if c.variant == "cpu-only")
    assert any(c.ram_fraction is not None and c.ram_fraction < 1 for c in full if c.variant == "disk")
    assert {c.routing for c in quick_suite()} == {"uniform", "skewed"}


def test_select_and_group():
    cases = quick_suite()
    picked = select(cases, ["split/b25/*"])
    assert {c.name for c in picked} == {"split/b25/uniform/p128x1", "split/b25/skewed/p128x1",
                                        "split/b25/uniform/p8192x1"}
    assert select(cases, None) == cases and len(select(cases, ["*/skewed/*", "hf/*"])) == 9
    with pytest.raises(SystemExit):
        select(cases, ["nothing/*"])
    groups = group_by_engine(picked)
    assert [len(g) for g in groups] == [2, 1]  # both uniform workloads share one engine
    assert [c.name for c in groups[0]] == ["split/b25/uniform/p128x1", "split/b25/uniform/p8192x1"]


def test_serve_config_is_valid_toml():
    import tomllib

    from strata.server.serve import format_toml as _toml  # what bench/suite/serve_case.py writes

    cfg = {"runtime": {"max_context": 1024}, "tiers": {"disk": {"path": "/x", "scrub": False}, "gpu": {"budget": "9"}},
           "planner": {"max_batch": 8}}
    assert tomllib.loads(_toml(cfg)) == cfg
    with pytest.raises(ValueError):
        Case("turbo", "uniform", 0.25, Workload(1, 1, 1))


def test_engine_configs_are_valid_strata_configs():
    summary = {"expert_bytes_total": 1000}
    settings = {"cache": "/tmp/c", "disk_cache": "/tmp/d", "token_budget": 512}
    w = [Workload(8192, 1, 128), Workload(128, 8, 128)]
    for variant in VARIANTS:
        if variant in ("hf",):
            continue
        cfg = engine_config(Case(variant, "uniform", None if variant == "ceiling" else 0.25, w[0],
                                 ram_fraction=0.5 if variant == "disk" else None), summary, settings, w)
        load_config(cfg)  # every key exists and every value validates
        assert cfg["runtime"]["max_context"] >= 8192 + 128 and cfg["planner"]["max_batch"] == 8
    naive = engine_config(Case("naive", "uniform", 0.25, w[0]), summary, settings, w)
    assert naive["policy"] == {"eviction": "lru", "budget_scope": "per_layer"} and naive["prefetch"]["lookahead"] == 0
    assert naive["runtime"]["cpu_numerics"] == "gpu" and naive["tiers"]["gpu"]["budget"] == "250"
    disk = engine_config(Case("disk", "uniform", 0.25, w[0], ram_fraction=0.5), summary, settings, w)
    assert disk["tiers"]["pinned"]["budget"] == "500" and disk["tiers"]["disk"]["path"] == "/tmp/d"
    assert "gpu" not in engine_config(Case("ceiling", "uniform", None, w[0]), summary, settings, w)["tiers"]
    assert VARIANTS["naive"]["policy"]["eviction"] == "lru"  # engine_config must not mutate the table


def test_the_ceiling_on_quantized_experts_holds_them_in_gpu_slots_in_their_format():
    """`runtime.experts = "memory"` would load quantized experts dequantized (bf16's bytes and kernels): the ceiling
    on a quantized model runs them tiered with the tiers' default budget, which holds them all, whatever budget --set
    gives the tiered cases; a plain model's ceiling stays in memory, and a split case keeps the --set budget."""
    w = [Workload(128, 1, 64)]
    settings = {"cache": "/tmp/c", "disk_cache": "/tmp/d", "token_budget": 512,
                "set": {"tiers": {"gpu": {"budget": "250"}}}}
    for fmt in ("fp8 128x128", "mxfp4", "gguf Q4_K/Q6_K"):
        summary = {"expert_bytes_total": 1000, "experts_format": fmt, "experts_quantized": True}
        ceiling = engine_config(Case("ceiling", "uniform", None, w[0]), summary, settings, w)
        load_config(ceiling)
        assert ceiling["runtime"]["experts"] == "tiered" and "budget" not in ceiling["tiers"].get("gpu", {})
        split = engine_config(Case("split", "uniform", 0.25, w[0]), summary, settings, w)
        assert split["runtime"].get("experts", "tiered") == "tiered" and split["tiers"]["gpu"]["budget"] == "250"
    plain = engine_config(Case("ceiling", "uniform", None, w[0]),
                          {"expert_bytes_total": 1000, "experts_format": "bf16", "experts_quantized": False}, settings, w)
    assert plain["runtime"]["experts"] == "memory"


# --- schema and report ----------------------------------------------------------------------------


def _ok(name: str, tok: float, hit: float | None = 0.5, frac: float | None = 0.5, **metrics) -> dict:
    variant, budget, routing, wl = name.split("/")
    m = dict.fromkeys(results.METRICS)
    m.update(decode_tok_s=tok, slowest_stream_tok_s=tok, gpu_hit_rate=hit, bytes_per_token={"pinned->gpu": 2e8},
             prefill_tok_s=1000.0, **metrics)
    return {"name": name, "variant": variant, "routing": routing, "group": "grid", "status": "ok", "reason": None,
            "budget": {"gpu_fraction": 0.25, "ram_fraction": None}, "workload": {"prompt": 128, "streams": 1, "tokens": 8},
            "metrics": m, "roofline": {"tok_s": tok / frac if frac else None, "bound": "cold"},
            "fraction_of_roofline": frac}


def _doc() -> dict:
    doc = results.new_document("quick", {"layers": 12}, {"gpu": "H200", "cpu": "Xeon", "git_commit": "abc"},
                               Rates().as_dict())
    doc["models"] = {"uniform": {"layers": 12, "route_skew": "uniform"}, "skewed": {"layers": 12, "route_skew": 1.0}}
    doc["cases"] = [
        _ok("split/b25/uniform/p128x1", 40.0, frac=0.85), _ok("split/b25/skewed/p128x1", 60.0, frac=0.5),
        _ok("hf/b25/uniform/p128x1", 0.2, hit=None, frac=None), _ok("naive/b25/uniform/p128x1", 25.0),
        _ok("ceiling/all/uniform/p128x1", 80.0, hit=None), _ok("split/b40/skewed/p128x1", 90.0, hit=0.93),
        {**_ok("serve/b25/uniform/startup", 1.0), "metrics": {"ready_s": 12.5}},
        {"name": "hf/b25/skewed/p128x1", "variant": "hf", "routing": "skewed", "group": "baseline",
         "budget": {"gpu_fraction": 0.25, "ram_fraction": None}, "workload": {"prompt": 128, "streams": 1, "tokens": 8},
         "status": "skipped", "reason": "prefill + first token took 400 s"},
    ]
    return doc


def test_a_prompt_prefills_in_one_chunk_up_to_8k_tokens():
    assert prefill_chunk([128], 2048) == 2048  # never below the scheduler's token budget
    assert prefill_chunk([128, 512, 8192], 2048) == 8192
    assert prefill_chunk([65536], 2048) == 8192
    cfg = engine_config(Case("split", "uniform", 0.25, Workload(512, 1, 16)), {"expert_bytes_total": 100},
                        {"token_budget": 256, "cache": "/tmp/c"}, [Workload(512, 1, 16)])
    assert cfg["runtime"]["prefill_chunk"] == 512


def test_a_pinned_tier_short_of_the_experts_skips_only_cases_that_read_from_it():
    def stats(pinned):
        return {"tiers": {"gpu": {"capacity": 384}, "pinned": {"capacity": pinned}, "disk": {"capacity": 1536}}}

    one = Workload(128, 1, 64)
    split, all_in_vram = Case("split", "uniform", 0.25, one), Case("split-q4_k_m", "uniform", None, one)
    disk = Case("disk", "uniform", 0.25, one, ram_fraction=0.5)
    assert "only 1488 of 1536 experts fit in pinned RAM" in pinned_shortfall(stats(1488), split)
    assert pinned_shortfall(stats(1536), split) is None
    assert pinned_shortfall(stats(16), all_in_vram) is None  # every expert in VRAM: pinned RAM only stages
    assert pinned_shortfall(stats(768), disk) is None  # short on purpose
    assert pinned_shortfall(None, split) is None


def test_validate_accepts_a_good_document_and_names_problems():
    doc = _doc()
    assert results.validate(doc) == []
    bad = copy.deepcopy(doc)
    bad["cases"][0]["status"] = "fine"
    del bad["cases"][1]["metrics"]["ttft_s"]
    bad["cases"][7]["reason"] = None
    bad["cases"][2]["metrics"]["decode_tok_s"] = 0
    del bad["rates"]
    problems = results.validate(bad)
    assert len(problems) == 5, problems
    assert any("missing key 'rates'" in p for p in problems) and any("ttft_s" in p for p in problems)


def test_report_tables_and_targets_from_json(tmp_path):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(_doc()))
    doc = results.load([path])
    t = {x["target"]: x for x in report.targets(doc)}
    assert t["25% GPU budget, uniform: >= 80% of the roofline"]["status"] == "met"
    assert t["25% GPU budget, skewed: >= 80% of the roofline"]["status"] == "NOT met"
    assert t["25%, uniform: >= 100x transformers + accelerate"]["measured"] == "200.0x"
    assert t["25%, uniform: >= 2x naive on-demand"]["status"] == "NOT met"  # 40 / 25 = 1.6x
    assert t["25%, skewed: >= 100x transformers + accelerate"]["status"] == "not measured"  # skipped case
    assert t["skewed, 40% of experts fit, adaptive policy: GPU hit rate >= 90%"]["status"] == "met"
    assert t["`strata serve` ready (store built) <= 30 s"]["measured"] == "12.5 s"
    ceiling = t["all in VRAM (uniform), 1 stream: >= 250 tok/s (48 layers)"]
    # 12 layers' rate x 12/48 bounds the 48-layer rate from below: below the target it decides nothing
    assert ceiling["measured"] == "80.0 tok/s on 12 layers: >= 20.0 at 48"
    assert ceiling["status"] == "not measured at 48 layers (the bound from 12 is below)"
    fast = copy.deepcopy(doc)
    long = _ok("split/b25/uniform/p8192x1", 20.0)
    long["metrics"]["prefill_tok_s"] = 16000.0
    fast["cases"].append(long)
    t = {x["target"]: x for x in report.targets(fast)}
    prefill = t["8K prompt, 25% (uniform): prefill >= 3,000 tok/s (48 layers)"]
    assert prefill["measured"] == "16,000 tok/s on 12 layers: >= 4,000 at 48" and prefill["status"] == "met"
    md = report.render(doc, "python -m bench run", "suite.png")
    assert "| uniform | transformers + accelerate offload | 0.20 | 40.00 | 200.00x |" in md
    assert "| split/b25/uniform/p128x1 | 40.00 |" in md and "pinned->gpu 200" in md
    assert "`hf/b25/skewed/p128x1`: skipped: prefill + first token took 400 s" in md
    assert "![tok/s and GPU hit rate" in md
    # a rate the run measured says so; the others are the machine's reference rates (recorded as their sheet's name)
    assert "pcie 55.0 GB/s (reference)" in md and "LIMITS.md" not in md
    measured = copy.deepcopy(doc)
    measured["rates"]["source"]["pcie"] = "measured"
    assert "pcie 55.0 GB/s (measured), cpu 70.0 GB/s (reference)" in report.render(measured)


def test_a_split_step_is_cut_into_cold_phases_gpu_work_between_layers_and_its_ends():
    """From the worker's decode window: 12 layers x 100 us of cold phases, 11 x 50 us between them, the rest of a
    2.5-ms step (400 tok/s) at its ends; 24 MB of cold bytes a token over 1.2 ms of cold phases is 20 GB/s. Cases
    without a window (the ceiling, CPU runs) are left out, and the section only appears when one has it."""
    doc = _doc()
    split = next(c for c in doc["cases"] if c["name"] == "split/b25/skewed/p128x1")
    split["metrics"].update(decode_tok_s=400.0, mailbox_window={"layers": 12 * 64, "serve_us": 100.0, "kernel_us": 99.0,
                                                                  "gpu_gap_us": 50.0, "kernel_GB_s": 80.0})
    split["roofline"].update(tok_s=800.0, cold_bytes_per_token=24_000_000)
    got = report.step_split(split, 12)
    assert got["step"] == pytest.approx(2.5) and got["cold"] == pytest.approx(1.2)
    assert got["between"] == pytest.approx(0.55) and got["rest"] == pytest.approx(0.75)
    assert got["cold_GB_s"] == pytest.approx(20.0)
    assert report.step_split(next(c for c in doc["cases"] if c["name"] == "ceiling/all/uniform/p128x1"), 12) is None
    table = report.step_table(doc)
    assert table.count("\n") == 2 and "| split/b25/skewed/p128x1 | 2.50 | 1.20 | 0.55 | 0.75 | 20.0 | 1.25 | 0.500 |" in table
    assert "### Where a split decode step goes" in report.render(doc)
    assert "### Where a split decode step goes" not in report.render(_doc())


def test_results_md_section_is_replaced_between_markers(tmp_path):
    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\nearlier text\n")
    report.update_report(md, "first run\n")
    report.update_report(md, "second run\n")
    text = md.read_text()
    assert text.count(report.BEGIN) == 1 and "second run" in text and "first run" not in text
    assert text.startswith("# Benchmarks\n\nearlier text\n")
    md.write_text(text + "\n## Later section\n")
    report.update_report(md, "third run\n")
    assert md.read_text().endswith("## Later section\n") and "third run" in md.read_text()


def test_the_reports_suite_section_is_the_report_command_on_the_files_it_lists(monkeypatch):
    """`python -m bench report` writes docs/benchmarks.md by default, and that report's suite section is exactly what
    the command makes of the run files it lists (all in the repository, in order), so it was not edited by hand and
    cites no file that is gone."""
    from bench.__main__ import REPORT, _parser

    assert Path(_parser().parse_args(["report", "x.json"]).results) == REPORT == ROOT / "docs" / "benchmarks.md"
    monkeypatch.chdir(ROOT)  # the section names its files from the repository's root
    files, command = report.section_sources(REPORT)
    assert files and all(Path(f).is_file() for f in files)
    text = REPORT.read_text()
    section = text[text.index(report.BEGIN) + len(report.BEGIN):text.index(report.END)].strip()
    assert section == report.render(results.load(files), command, "suite.png").strip()
    assert (REPORT.parent / "suite.png").is_file()


def test_load_merges_runs_later_cases_win(tmp_path):
    a, b = _doc(), _doc()
    b["cases"] = [_ok("split/b25/uniform/p128x1", 50.0), _ok("split/b10/uniform/p128x1", 20.0)]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    doc = results.load([tmp_path / "a.json", tmp_path / "b.json"])
    by = {c["name"]: c for c in doc["cases"]}
    assert len(by) == len(a["cases"]) + 1 and by["split/b25/uniform/p128x1"]["metrics"]["decode_tok_s"] == 50.0
    # ratios come from one run: run A measured split (40) and naive (25); run B's split (50) has no naive beside it
    t = {x["target"]: x for x in report.targets(doc)}
    assert t["25%, uniform: >= 2x naive on-demand"]["measured"] == "1.6x"
    md = report.render(doc)
    assert "| uniform | naive on-demand (per-layer LRU, no prefetch, no CPU) | 25.00 | 40.00 | 1.60x | A |" in md
    assert "| split/b25/uniform/p128x1 | 50.00 |" in md and "- run B:" in md  # the table shows the latest
    c = {**_doc(), "cases": [_ok("copy-only/b25/uniform/p128x1", 10.0)]}
    (tmp_path / "c.json").write_text(json.dumps(c))
    doc = results.load([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"])
    beats = {x["target"]: x for x in report.targets(doc)}["25%, uniform: the split beats copy-only"]
    assert beats["measured"] == "5.00x (across runs)"  # no run measured both: said so
    # a later run that skipped a case leaves the earlier measurement in place; a later measurement still wins
    skipped = dict(_ok("split/b25/uniform/p128x1", 0.0), status="skipped", reason="no fastapi here")
    (tmp_path / "d.json").write_text(json.dumps({**_doc(), "cases": [skipped, _ok("split/b10/uniform/p128x1", 30.0)]}))
    doc = results.load([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "d.json"])
    by = {c["name"]: c for c in doc["cases"]}
    assert by["split/b25/uniform/p128x1"]["status"] == "ok" and by["split/b25/uniform/p128x1"]["run"] == "B"
    assert by["split/b10/uniform/p128x1"]["metrics"]["decode_tok_s"] == 30.0
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="not a valid suite result"):
        results.load([tmp_path / "bad.json"])


def test_a_run_on_the_full_depth_model_stays_apart_and_decides_the_48_layer_target(tmp_path):
    deep = {**_doc(), "cases": [_ok("ceiling/all/uniform/p128x1", 297.7, hit=None)]}
    deep["models"] = {"uniform": {"layers": 48, "route_skew": "uniform"}}
    (tmp_path / "a.json").write_text(json.dumps(_doc()))
    (tmp_path / "deep.json").write_text(json.dumps(deep))
    doc = results.load([tmp_path / "a.json", tmp_path / "deep.json"])
    by = {c["name"]: c for c in doc["cases"]}
    assert by["ceiling/all/uniform/p128x1"]["metrics"]["decode_tok_s"] == 80.0  # the 12-layer case is not replaced
    assert by["ceiling/all/uniform/p128x1@48L"]["run"] == "B"
    assert doc["models"]["uniform"]["layers"] == 12 and doc["models_at"][48]["uniform"]["layers"] == 48
    t = {x["target"]: x for x in report.targets(doc)}
    ceiling = t["all in VRAM (uniform), 1 stream: >= 250 tok/s (48 layers)"]
    assert ceiling == {"target": ceiling["target"], "measured": "297.7 tok/s on 48 layers", "status": "met"}
    md = report.render(doc)
    assert "- run B:" in md and "(48-layer checkpoints: its cases are marked @48L)" in md
    assert "- uniform checkpoint (the @48L cases): 48 layers" in md and "| ceiling/all/uniform/p128x1@48L | 297.70 |" in md
    # the same figure below the target is a miss, not "not measured"
    deep["cases"] = [_ok("ceiling/all/uniform/p128x1", 200.0, hit=None)]
    (tmp_path / "deep.json").write_text(json.dumps(deep))
    t = {x["target"]: x for x in report.targets(results.load([tmp_path / "a.json", tmp_path / "deep.json"]))}
    assert t["all in VRAM (uniform), 1 stream: >= 250 tok/s (48 layers)"]["status"] == "NOT met"


def test_the_plot_draws_the_budget_sweep_and_says_when_there_is_nothing_to_draw(tmp_path):
    pytest.importorskip("matplotlib")  # a dev and bench extra
    from bench.suite.plot import available, plot

    assert available()
    doc = _doc()
    png = plot(doc, tmp_path / "suite.png")
    assert png == tmp_path / "suite.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    only_hf = {**doc, "cases": [c for c in doc["cases"] if c["variant"] == "hf"]}  # no split, static or naive case
    assert plot(only_hf, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_report_append_merges_new_runs_after_the_ones_the_section_lists(tmp_path, monkeypatch, capsys):
    """`python -m bench report --append NEW.json`: the section's own file list and command are kept, the new run
    comes last (its cases the latest), and appending a listed file again changes nothing."""
    from bench.__main__ import main as bench_main

    monkeypatch.chdir(tmp_path)  # the section names its files as given, relative to where the command ran
    first, second, third = _doc(), _doc(), _doc()
    second["cases"] = [_ok("split/b25/skewed/p128x1", 70.0, frac=0.6)]
    third["cases"] = [_ok("split/b25/skewed/p128x1", 80.0, frac=0.7)]
    for name, doc in (("a.json", first), ("b.json", second), ("c.json", third)):
        (tmp_path / name).write_text(json.dumps(doc))
    md = tmp_path / "benchmarks.md"
    assert bench_main(["report", "a.json", "b.json", "--results", str(md), "--command", "run one"]) == 0
    assert report.section_sources(md) == (["a.json", "b.json"], "run one")
    assert bench_main(["report", "--append", "c.json", "--results", str(md), "--command", "run three"]) == 0
    assert report.section_sources(md) == (["a.json", "b.json", "c.json"], "run one; run three")
    text = md.read_text()
    assert "| 25% GPU budget, skewed: >= 80% of the roofline | 0.700 | NOT met |" in text  # run C's, the latest
    assert bench_main(["report", "--append", "c.json", "--results", str(md)]) == 0
    assert md.read_text() == text
    (tmp_path / "b.json").unlink()
    assert bench_main(["report", "--append", "c.json", "--results", str(md)]) == 2
    assert "lists b.json, which is not there" in capsys.readouterr().err
    assert bench_main(["report", "--append", "c.json", "--results", str(tmp_path / "none.md")]) == 2


def test_runs_past_the_26th_get_two_letter_labels():
    assert [results.run_label(i) for i in (0, 25, 26, 27, 51, 52, 701, 702)] == [
        "A", "Z", "AA", "AB", "AZ", "BA", "ZZ", "AAA"]


def test_the_roofline_targets_list_every_depth_measured_and_need_all_of_them(tmp_path):
    """A run on the 24-layer cut (the bench model's depth where the whole model does not fit) joins the 12-layer figure in
    the roofline rows; one depth below 0.8 makes the row a miss."""
    deep = {**_doc(), "cases": [_ok("split/b25/uniform/p128x1", 20.0, frac=0.91),
                                _ok("split/b25/skewed/p128x1", 30.0, frac=0.52)]}
    deep["models"] = {"uniform": {"layers": 24, "route_skew": "uniform"}, "skewed": {"layers": 24, "route_skew": 1.0}}
    (tmp_path / "a.json").write_text(json.dumps(_doc()))
    (tmp_path / "deep.json").write_text(json.dumps(deep))
    t = {x["target"]: x for x in report.targets(results.load([tmp_path / "a.json", tmp_path / "deep.json"]))}
    assert t["25% GPU budget, uniform: >= 80% of the roofline"] == {
        "target": "25% GPU budget, uniform: >= 80% of the roofline", "measured": "0.850 on 12 layers; 0.910 on 24 layers",
        "status": "met"}
    assert t["25% GPU budget, skewed: >= 80% of the roofline"]["measured"] == "0.500 on 12 layers; 0.520 on 24 layers"
    deep["cases"][0]["fraction_of_roofline"] = 0.7  # the deeper cut misses: the row does too
    (tmp_path / "deep.json").write_text(json.dumps(deep))
    t = {x["target"]: x for x in report.targets(results.load([tmp_path / "a.json", tmp_path / "deep.json"]))}
    assert t["25% GPU budget, uniform: >= 80% of the roofline"]["status"] == "NOT met"


# --- end to end -----------------------------------------------------------------------------------


def test_one_tiny_case_end_to_end_on_cpu(tmp_path, capsys):
    short_ram = {"tiers": {"pinned": {"budget": str(4 * 12288)}}}  # 4 of the tiny model's 32 expert slots
    cases = [Case("split", "skewed", 0.25, Workload(24, 2, 4)), Case("hf", "skewed", 0.25, Workload(24, 1, 4)),
             Case("naive", "skewed", 0.25, Workload(24, 1, 4), extra=short_ram),
             Case("repro", "skewed", 0.25, Workload(24, 1, 4), group="ablation")]
    settings = {"suite": "test", "device": "cpu", "cache": str(tmp_path / "cache"), "disk_cache": str(tmp_path / "d"),
                "models_dir": str(tmp_path / "models"), "size": "tiny", "layers": None, "skew": 1.0, "model": None,
                "token_budget": 256, "placement_timeout": 10.0, "hf_limit_s": 60.0, "deadline_s": 300.0,
                "progress": False}
    doc = run_suite(cases, settings, tmp_path / "out", log=lambda s: None, rates=Rates())
    assert results.validate(doc) == []
    split, hf, short, repro = doc["cases"]
    assert repro["status"] == "ok" and repro["roofline"]["bound"] in ("gpu", "cold")  # its cold experts cross PCIe
    assert short["status"] == "skipped" and "pinned RAM" in short["reason"]  # not a case of what it says
    assert split["status"] == "ok", split.get("reason")
    m = split["metrics"]
    assert m["tokens"] == 8 and m["decode_tok_s"] > 0 and m["lookups_per_token"] > 0
    assert m["warmup"] == {"prompt": 24, "streams": 2, "tokens": 4}  # a new batch shape is warmed before timing
    state = m["decode_state"]  # CPU: no graphs; the prefetcher's state and counters are recorded
    assert state["graph_mode"] is None and state["prefetch"]["issued"] >= 0
    assert state["prefetcher"] is None or set(state["prefetcher"]) == {"idle", "pauses", "target"}
    assert state["cost_model"]["cpu_bytes_per_s"] > 0 and state["cost_model"]["stage_fixed_s"] >= 0
    assert m["mailbox_window"] is None  # CPU: no one-graph worker (on the GPU: its trip over the decode window)
    assert m["graph_captures_in_decode"] == 0  # (CPU: no graphs; on the GPU the warm-up should leave none either)
    assert split["roofline"]["bound"] in ("gpu", "cold", "disk") and split["config"]["tiers"]["gpu"]["budget"]
    assert hf["status"] == "skipped" and hf["reason"]  # CPU: the offload baseline needs CUDA
    assert doc["models"]["skewed"]["route_skew"] == 1.0 and doc["machine"]["torch"]
    pop = doc["models"]["skewed"]["popularity"]  # how the checkpoint routes, temporal locality included
    assert 0 < pop["independent_overlap"] <= 1 and 0 <= pop["consecutive_overlap"] <= 1 and pop["top40pct_share"] > 0.4
    on_disk = json.loads((tmp_path / "out" / results.RESULT_FILE).read_text())
    assert [c["name"] for c in on_disk["cases"]] == [c.name for c in cases]
    assert "split/b25/skewed/p24x2" in report.render(on_disk)
    assert bench_main(["list", "--suite", "quick", "--cases", "hf/*"]) == 0
    assert capsys.readouterr().out.split() == ["hf/b25/uniform/p128x1"]


def test_the_serve_case_times_start_up_then_first_requests_on_cpu(tmp_path):
    """`strata serve` for real on the tiny model: ready, then one request and four at once, each timed twice; the
    warm-up (forced on: "auto" is CUDA only) is recorded from the server's own line."""
    pytest.importorskip("fastapi")
    settings = {"suite": "test", "device": "cpu", "cache": str(tmp_path / "cache"), "disk_cache": str(tmp_path / "d"),
                "models_dir": str(tmp_path / "models"), "size": "tiny", "layers": None, "skew": 1.0, "model": None,
                "token_budget": 256, "placement_timeout": 10.0, "hf_limit_s": 60.0, "deadline_s": 300.0,
                "progress": False, "set": {"runtime": {"warmup": True}}}
    doc = run_suite([Case("serve", "uniform", 0.25, Workload(128, 1, 128), group="serve")], settings,
                    tmp_path / "out", log=lambda s: None, rates=Rates())
    assert results.validate(doc) == []
    serve = doc["cases"][0]
    assert serve["status"] == "ok", serve.get("reason")
    m = serve["metrics"]
    assert 0 < m["ready_s"] and all(m[f"{w}_{n}_s"] > 0 for w in ("first", "again") for n in ("request", "batch4"))
    assert serve["warmup"].startswith("warmed up in") and "decode batch sizes 1-8" in serve["warmup"]
    t = {x["target"]: x for x in report.targets(doc)}
    assert "then its first request" in t["`strata serve` ready (store built) <= 30 s"]["measured"]


def test_a_case_whose_graphs_were_captured_in_the_timed_decode_says_so(tmp_path, monkeypatch):
    """A capture inside the timed decode (a shape the warm-up missed) makes the case's decode figures low: its record
    carries a note, which the report lists under "Skipped, failed or cut short". (CPU runs capture nothing: the count
    is forced here, on a real run's metrics.)"""
    import bench.suite.strata_case as sc

    real = sc.run_workload

    def captured_twice(*args, **kwargs):
        res = real(*args, **kwargs)
        res["metrics"]["graph_captures_in_decode"] = 2
        return res

    monkeypatch.setattr(sc, "run_workload", captured_twice)
    settings = {"suite": "test", "device": "cpu", "cache": str(tmp_path / "cache"), "disk_cache": str(tmp_path / "d"),
                "models_dir": str(tmp_path / "models"), "size": "tiny", "layers": None, "skew": 1.0, "model": None,
                "token_budget": 256, "placement_timeout": 10.0, "hf_limit_s": 60.0, "deadline_s": 300.0,
                "progress": False}
    doc = run_suite([Case("split", "skewed", 0.25, Workload(24, 1, 4))], settings, tmp_path / "out", log=lambda s: None,
                    rates=Rates())
    (case,) = doc["cases"]
    assert case["status"] == "ok" and "2 decode graph(s) captured inside the timed decode" in case["note"]
    assert "`split/b25/skewed/p24x1`: ok: 2 decode graph(s)" in report.render(doc)


def test_each_workload_shape_is_warmed_once():
    warmed = {(64, 1)}
    assert warmup_for(Workload(64, 1, 128), warmed) is None
    w = warmup_for(Workload(128, 4, 128), warmed)
    # several streams: the whole run, whose last steps decode fewer streams (their graphs are captured untimed)
    assert (w.prompt, w.streams, w.tokens) == (128, 4, 128)
    assert warmup_for(Workload(128, 4, 64), warmed) is None  # the same shape: its graphs exist
    assert warmup_for(Workload(8192, 4, 64), warmed) is not None  # another KV bucket
    one = warmup_for(Workload(256, 1, 128), warmed)
    assert (one.prompt, one.streams) == (256, 1) and one.tokens < 128  # one stream: one batch size, a short run


def test_routing_popularity_is_measured_with_graphs_paused(monkeypatch):
    """The routing-count hooks copy ids to the host, which no CUDA graph can contain: while they run the
    engine's decode graphs are off (a capture then would fail, and that decode mode would stay eager),
    and the engine's own mode is back afterwards."""
    from types import SimpleNamespace

    from bench.suite import strata_case

    def own_mode():
        return "full"

    model = torch.nn.Module()
    model.graphs = SimpleNamespace(mode=own_mode, failed={})
    engine = SimpleNamespace(model=model)
    seen = []
    monkeypatch.setattr(strata_case, "run_workload", lambda eng, *a, **k: seen.append(eng.model.graphs.mode()))
    strata_case.measure_popularity(engine, None, 100, {"experts_per_layer": 4})
    assert seen == [None]
    assert engine.model.graphs.mode is own_mode


def test_machine_info_takes_the_commit_it_is_told(monkeypatch):
    """A copied tree whose git metadata is stale (the GPU box's) records the commit the caller names."""
    monkeypatch.delenv("STRATA_BENCH_COMMIT", raising=False)
    own = results.machine_info()
    monkeypatch.setenv("STRATA_BENCH_COMMIT", "0123abcd" * 5)
    told = results.machine_info()
    assert told["git_commit"] == "0123abcd" * 5 and told["git_dirty"] is False
    assert told["git_commit_from"] == "STRATA_BENCH_COMMIT" and "git_commit_from" not in own


def test_snapshot_counts_the_tiers_path_bytes_and_none_for_warm_ahead():
    """The suite's counters per case: the bytes of each tier path; warm-ahead's reads (one-graph decode's
    `warm_ahead` stats) stay in host RAM, so they add no path and change none."""
    from bench.suite.strata_case import _snapshot

    class FakeEngine:  # the one-graph decode stats need a GPU's mailbox worker: their shape, as WarmAhead.stats gives it
        def __init__(self, ahead):
            self.ahead = ahead

        def stats(self):
            return {"tiers": {"paths": {"pinned->gpu": {"bytes": 7}, "disk->pinned": {"bytes": 5}}},
                    "one_graph_decode": {"warm_ahead": self.ahead}}

    warm = {"warm_bytes": 8 << 20, "plans_used": 5, "plans_late": 1, "read_bytes": 123, "read_s": 0.01,
            "computed_bytes": 100, "pieces_stolen": 0, "held_s": 0.0, "held_us_max": 0.0}
    assert _snapshot(FakeEngine(warm))["paths"] == {"pinned->gpu": 7, "disk->pinned": 5}
    assert _snapshot(FakeEngine(None))["paths"] == {"pinned->gpu": 7, "disk->pinned": 5}


def test_one_tiny_fp8_case_on_cpu(tmp_path):
    """`--experts fp8`: the suite writes its demo model as an FP8 release and runs strata's cases on it (its store
    keeps the experts in fp8); the transformers baseline is skipped, naming the format."""
    cases = [Case("split", "skewed", 0.25, Workload(24, 1, 4)), Case("hf", "skewed", 0.25, Workload(24, 1, 4))]
    settings = {"suite": "test", "device": "cpu", "cache": str(tmp_path / "cache"), "disk_cache": str(tmp_path / "d"),
                "models_dir": str(tmp_path / "models"), "size": "tiny", "layers": None, "skew": 1.0, "model": None,
                "token_budget": 256, "placement_timeout": 10.0, "hf_limit_s": 60.0, "deadline_s": 300.0,
                "progress": False, "experts": "fp8"}
    doc = run_suite(cases, settings, tmp_path / "out", log=lambda s: None, rates=Rates())
    split, hf = doc["cases"]
    assert split["status"] == "ok", split.get("reason")
    assert split["metrics"]["tokens"] == 4 and split["metrics"]["decode_tok_s"] > 0
    assert hf["status"] == "skipped" and "fp8" in hf["reason"]
    model = doc["models"]["skewed"]
    assert model["path"].endswith("-fp8") and model["experts_format"] == "fp8 32x32" and model["demo"]["experts"] == "fp8"


def test_one_tiny_gguf_case_on_cpu(tmp_path):
    """`--experts q8_0` (a GGUF export type): the suite writes the bf16 demo model, exports it as a GGUF file with
    its routed experts in that type, and runs strata's cases on the file; the routing marker is the source's."""
    cases = [Case("split", "skewed", 0.25, Workload(24, 1, 4))]
    settings = {"suite": "test", "device": "cpu", "cache": str(tmp_path / "cache"), "disk_cache": str(tmp_path / "d"),
                "models_dir": str(tmp_path / "models"), "size": "tiny", "layers": None, "skew": 1.0, "model": None,
                "token_budget": 256, "placement_timeout": 10.0, "hf_limit_s": 60.0, "deadline_s": 300.0,
                "progress": False, "experts": "q8_0"}
    doc = run_suite(cases, settings, tmp_path / "out", log=lambda s: None, rates=Rates())
    (split,) = doc["cases"]
    assert split["status"] == "ok", split.get("reason")
    assert split["metrics"]["tokens"] == 4 and split["metrics"]["decode_tok_s"] > 0
    model = doc["models"]["skewed"]
    assert model["path"].endswith("-q8_0.gguf") and model["experts_format"].startswith("gguf")
    assert "Q8_0" in model["experts_format"] and model["demo"]["route_skew"] == 1.0 and model["vocab_size"] > 0
    assert (tmp_path / "models" / Path(model["path"]).name.removesuffix("-q8_0.gguf")).is_dir()  # its bf16 source


def test_a_case_reports_its_median_timed_run():
    """Each strata case's workload is timed several times (`--repeats`); its record is the median decode run's, with
    every run's rates kept, so one slow window (a host hiccup) does not become the case's figure."""
    from bench.suite.strata_case import median_run

    runs = [{"metrics": {"decode_tok_s": r, "prefill_tok_s": 10.0 * r}} for r in (311.5, 531.7, 498.0)]
    chosen = median_run(runs)
    assert chosen["metrics"]["decode_tok_s"] == 498.0
    assert chosen["metrics"]["decode_tok_s_runs"] == [311.5, 531.7, 498.0]
    assert chosen["metrics"]["prefill_tok_s_runs"] == [3115.0, 5317.0, 4980.0]
    alone = median_run([{"metrics": {"decode_tok_s": 5.0, "prefill_tok_s": 1.0}}])
    assert alone["metrics"] == {"decode_tok_s": 5.0, "prefill_tok_s": 1.0}  # one run: as measured, nothing added


def test_the_suite_times_each_case_as_often_as_told(tmp_path, monkeypatch):
    import bench.suite.strata_case as sc

    real, timed = sc.run_workload, []

    def counted(engine, sched, w, *args, **kwargs):
        timed.append(w)
        return real(engine, sched, w, *args, **kwargs)

    monkeypatch.setattr(sc, "run_workload", counted)
    settings = {"suite": "test", "device": "cpu", "cache": str(tmp_path / "cache"), "disk_cache": str(tmp_path / "d"),
                "models_dir": str(tmp_path / "models"), "size": "tiny", "layers": None, "skew": 1.0, "model": None,
                "token_budget": 256, "placement_timeout": 10.0, "hf_limit_s": 60.0, "deadline_s": 300.0,
                "progress": False, "repeats": 3}
    w = Workload(24, 1, 4)
    doc = run_suite([Case("split", "skewed", 0.25, w)], settings, tmp_path / "out", log=lambda s: None, rates=Rates())
    (case,) = doc["cases"]
    assert case["status"] == "ok", case.get("reason")
    assert timed[-3:] == [w, w, w]  # after the warm-ups
    assert len(case["metrics"]["decode_tok_s_runs"]) == 3
    assert case["metrics"]["decode_tok_s"] == sorted(case["metrics"]["decode_tok_s_runs"])[1]


def test_the_transformers_baseline_runs_without_hub_kernels(monkeypatch):
    """transformers 5.x with the `kernels` package fetches Hub kernels, which an offline GPU machine cannot verify
    (the model then fails to load): the baseline runs with USE_HUB_KERNELS=NO, and the caller's setting comes back."""
    from bench.suite import hf_case

    seen = []
    monkeypatch.setattr(hf_case, "_run_hf", lambda *a, **k: seen.append(os.environ.get("USE_HUB_KERNELS")) or {})
    monkeypatch.setenv("USE_HUB_KERNELS", "YES")
    hf_case.run_hf(None, None, {}, {}, 100.0)
    assert seen == ["NO"] and os.environ["USE_HUB_KERNELS"] == "YES"
    monkeypatch.delenv("USE_HUB_KERNELS")
    hf_case.run_hf(None, None, {}, {}, 100.0)
    assert seen == ["NO", "NO"] and "USE_HUB_KERNELS" not in os.environ
