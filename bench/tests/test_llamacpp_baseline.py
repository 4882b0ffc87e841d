"""The suite's `llamacpp` baseline (bench/suite/llamacpp_case.py, llamacpp_build.py): the expert placement arithmetic,
parsing of llama.cpp's real tool output (captured from llama-bench and llama-batched-bench of the vendored
llama.cpp on a tiny GGUF export: bench/tests/data/llamacpp/), the stripped source and its build key, and the report's
table "strata against llama.cpp". Nothing here builds or runs llama.cpp."""

from __future__ import annotations

import copy
import io
import json
import stat
import tarfile
from pathlib import Path

import pytest

from bench.suite import llamacpp_build as build
from bench.suite import report, results
from bench.suite.cases import (
    LLAMACPP_VARIANTS,
    Case,
    Workload,
    group_by_engine,
    llamacpp_suite,
    quick_suite,
    with_baselines,
)
from bench.suite.llamacpp_case import (
    Placement,
    _metrics,
    batched_bench_cmd,
    expert_placement,
    expert_tensor_bytes,
    gpu_buffer_bytes,
    layer_expert_bytes,
    llama_bench_cmd,
    parse_batched_bench,
    parse_buffers,
    parse_llama_bench,
    run_llamacpp_group,
)
from bench.suite.llamacpp_table import llamacpp_rows, llamacpp_table
from bench.suite.roofline import Rates

DATA = Path(__file__).parent / "data" / "llamacpp"


@pytest.fixture(scope="module")
def tiny_gguf_model(tmp_path_factory) -> Path:
    """The tiny demo model without Engram layers (what llama.cpp runs; DeepSeek-V3's shape, a dense first layer)."""
    from strata.runtime.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", progress=False, engram=False)


# --- the expert placement -------------------------------------------------------------------------------------


def _stacks(sizes: dict[int, tuple[int, int, int]]) -> dict[int, dict[str, int]]:
    """Layer -> its gate, up and down stacks' bytes, named as in a GGUF."""
    return {layer: {f"blk.{layer}.ffn_{k}_exps.weight": b for k, b in zip(("gate", "up", "down"), g, strict=True)}
            for layer, g in sizes.items()}


def test_the_gpu_takes_the_most_whole_layers_of_experts_that_fit_the_budget():
    third = 402_653_184  # one bench layer's gate (or up, or down) stack in bf16: 128 experts x 2048 x 768 x 2 bytes
    e = 3 * third
    layers = _stacks(dict.fromkeys(range(12), (third, third, third)))

    def placed(stacks, n, fraction):
        p = expert_placement(stacks, n, fraction)
        return p.n_cpu_moe, p.gpu_bytes, p.cpu_tensors

    assert placed(layers, 12, 0.25) == (9, 3 * e, ())  # 25% of 12 layers: exactly 3 (no rounding down to 2)
    assert placed(layers, 12, 0.50) == (6, 6 * e, ())
    assert placed(layers, 12, 0.0) == (12, 0, ())  # every layer's experts in RAM (--cpu-moe)
    assert placed(layers, 12, None) == (0, 12 * e, ())  # all in VRAM
    # 1.2 layers: layer 11 whole, and no stack of layer 10 fits the 0.2 layer left
    assert placed(layers, 12, 0.10) == (11, e, ())
    # 1.4 layers: layer 11, and one stack of layer 10 on the GPU (-ncmoe 10), its two others in RAM (-ot)
    n, gpu, cpu = placed(layers, 12, 0.12)
    assert (n, gpu) == (10, e + third) and len(cpu) == 2 and all(t.startswith("blk.10.") for t in cpu)
    # a dense first layer (DeepSeek's first_k_dense_replace) still counts in N: -ncmoe N names layer indices
    dense_first = _stacks({1: (30, 30, 40), 2: (30, 30, 40)})
    assert placed(dense_first, 3, 0.5) == (2, 100, ())
    assert placed(dense_first, 3, 1.0) == (0, 200, ())


def test_a_partial_layer_puts_the_stacks_with_the_most_bytes_that_fit_on_the_gpu():
    # the docstring's example: stacks gate 2u, up 2u, down 3u; the last two layers' down 4u (Q4_K_M's extra bits)
    u = 1000
    stacks = _stacks({layer: (2 * u, 2 * u, (4 if layer >= 10 else 3) * u) for layer in range(12)})
    p = expert_placement(stacks, 12, 0.25)  # B = 21.5u: layers 10, 11 (16u), then layer 9's down and gate (5u)
    assert (p.n_cpu_moe, p.gpu_bytes, p.cpu_tensors) == (9, 21 * u, ("blk.9.ffn_up_exps.weight",))
    assert p.gpu_bytes <= 0.25 * 86 * u  # never more than strata's budget
    assert p.args() == ["-ncmoe", "9", "-ot", r"^blk\.9\.ffn_up_exps\.weight$=CPU"]
    assert p.label == "9 + blk.9 up"
    # -ot is one regex: neither tool's list separators (',' and ';') in it
    two = Placement(4, ("blk.4.ffn_gate_exps.weight", "blk.4.ffn_up_exps.weight"), 0)
    assert "," not in two.args()[3] and ";" not in two.args()[3] and two.label == "4 + blk.4 gate/up"
    # unequal layers: the whole-layer tail first, never more than the budget
    uneven = _stacks({0: (3, 3, 4), 1: (3, 3, 4), 2: (3, 3, 4), 3: (10, 10, 10)})
    assert expert_placement(uneven, 4, 0.5).gpu_bytes == 30  # B = 30: layer 3 alone
    p = expert_placement(uneven, 4, 0.4)  # B = 24 < 30: no whole layer; two of layer 3's stacks (20)
    assert (p.n_cpu_moe, p.gpu_bytes, len(p.cpu_tensors)) == (3, 20, 1)


def test_the_expert_bytes_per_layer_come_from_the_gguf_export(tiny_gguf_model, tmp_path):
    pytest.importorskip("gguf")
    from strata.tiers.store.gguf_export import write_gguf

    cfg = json.loads((tiny_gguf_model / "config.json").read_text())
    gguf = write_gguf(tiny_gguf_model, tmp_path / "tiny-bf16.gguf")
    per_layer = layer_expert_bytes(gguf)
    experts, hidden, inter = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    moe = range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    assert per_layer == dict.fromkeys(moe, experts * 3 * hidden * inter * 2)  # gate, up, down in bf16; no shared ones
    stacks = expert_tensor_bytes(gguf)
    assert {layer: sorted(t) for layer, t in stacks.items()} == {
        layer: [f"blk.{layer}.ffn_{k}_exps.weight" for k in ("down", "gate", "up")] for layer in moe}


def test_the_tool_commands_carry_the_placement_threads_and_flash_attention():
    whole, part = Placement(9, (), 0), Placement(8, ("blk.8.ffn_up_exps.weight",), 0)
    cmd = batched_bench_cmd(Path("/b/llama-batched-bench"), Path("m.gguf"), whole, 16, [128], 64, [1, 4, 8], 2048)
    s = " ".join(cmd)
    assert "-ngl 99 -ncmoe 9 -t 16 -lm none" in s and "-fa on" in s and "--output-format" not in s and "-ot" not in s
    assert "-b 2048 -ub 2048 -npp 128 -ntg 64 -npl 1,4,8" in s
    assert int(cmd[cmd.index("-c") + 1]) >= 8 * (128 + 64)  # eight sequences, each its own prompt and tokens
    s = " ".join(llama_bench_cmd(Path("/b/llama-bench"), Path("m.gguf"), whole, 16, [512, 8192], 3, 8192))
    assert "-ncmoe 9" in s and "-lm none" in s and "-fa 1 -b 8192 -ub 8192 -p 512,8192 -n 0 -r 3 -o json" in s
    for cmd in (batched_bench_cmd(Path("b"), Path("m.gguf"), part, 16, [128], 64, [1], 2048),
                llama_bench_cmd(Path("b"), Path("m.gguf"), part, 16, [512], 3, 2048)):
        assert cmd[cmd.index("-ncmoe"):cmd.index("-ncmoe") + 4] == ["-ncmoe", "8", "-ot", part.args()[3]]


# --- parsing the tools' real output ----------------------------------------------------------------------------


def test_batched_bench_table_and_jsonl_parse_to_rows():
    table = parse_batched_bench((DATA / "batched-bench.table.txt").read_text())
    jsonl = parse_batched_bench((DATA / "batched-bench.jsonl.txt").read_text())
    assert [(r["pp"], r["tg"], r["pl"]) for r in table] == [(128, 16, 1), (128, 16, 4), (128, 16, 8)]
    # -npl 1,4,8 with --output-format jsonl: this llama.cpp prints the rows of 1 and 4 streams, not the last one
    # (captured as it came), which is why the suite's command asks for the table
    assert [(r["pp"], r["tg"], r["pl"]) for r in jsonl] == [(128, 16, 1), (128, 16, 4)]
    assert table[0]["speed_tg"] == 777.23 and table[2]["t_pp"] == 0.258  # the printed figures, not recomputed
    for r in jsonl + table:
        # the tool's own definitions: S_TG = pl * tg / T_TG, S_PP = pl * pp / T_PP (prompts not shared); the table
        # prints the times to the millisecond
        assert r["speed_tg"] == pytest.approx(r["pl"] * r["tg"] / r["t_tg"], rel=0.01 + 5e-4 / r["t_tg"])
        assert r["speed_pp"] == pytest.approx(r["pl"] * r["pp"] / r["t_pp"], rel=0.01 + 5e-4 / r["t_pp"])


def test_the_buffer_sizes_say_what_llama_cpp_put_in_vram():
    cpu = parse_buffers((DATA / "batched-bench.lv4.stderr.txt").read_text())  # -lv 4 of the CPU build, as captured
    assert cpu == {"CPU_Mapped": {"model": round(0.67 * 2**20)}, "CPU": {
        "output": 0, "KV": round(0.18 * 2**20), "compute": round(2.06 * 2**20)}}
    assert gpu_buffer_bytes(cpu) is None
    # a CUDA build's lines (llama-model.cpp / llama-kv-cache.cpp / llama-context.cpp formats): pinned host buffers
    # (CUDA_Host) are RAM, not VRAM
    cuda = ("I load_tensors:        CUDA0 model buffer size =  4096.00 MiB\n"
            "I load_tensors:    CUDA_Host model buffer size =   512.00 MiB\n"
            "I load_tensors:   CPU_Mapped model buffer size = 12288.00 MiB\n"
            "I llama_kv_cache:      CUDA0 KV buffer size =   144.00 MiB\n"
            "I sched_reserve:      CUDA0 compute buffer size =   300.50 MiB\n"
            "I sched_reserve:  CUDA_Host compute buffer size =    20.00 MiB\n")
    assert gpu_buffer_bytes(parse_buffers(cuda)) == round((4096 + 144 + 300.5) * 2**20)
    row = {"pl": 1, "speed_tg": 50.0, "speed_pp": 400.0, "t_pp": 0.32, "tg": 64, "buffers": parse_buffers(cuda)}
    m = _metrics(row, None, 128)
    assert (m["peak_vram_bytes"], m["kv_reserved_bytes"]) == (round((4096 + 144 + 300.5) * 2**20), 144 * 2**20)


def test_llama_bench_json_parses_to_its_prefill_tests():
    tests = parse_llama_bench((DATA / "llama-bench.json.txt").read_text())
    assert [(t["n_prompt"], t["n_gen"]) for t in tests] == [(512, 0), (8192, 0)]
    for t in tests:
        assert t["n_cpu_moe"] == 1 and t["flash_attn"] in (1, True)
        assert len(t["samples_ts"]) == 2  # -r 2
        assert t["avg_ts"] == pytest.approx(sum(t["samples_ts"]) / 2, rel=1e-3)
    with pytest.raises(ValueError, match="no JSON array"):
        parse_llama_bench("| model | size |\n")


# --- the source and its build directory -------------------------------------------------------------------------


def _tree(root: Path) -> Path:
    for rel, text in {"CMakeLists.txt": "project(llama)\n", "ggml/CMakeLists.txt": "x\n", "src/llama.cpp": "int x;\n",
                      "tools/llama-bench/llama-bench.cpp": "int main(){}\n", "docs/build.md": "doc\n",
                      "models/ggml-vocab-llama.gguf": "vocab\n", "tests/test-x.cpp": "t\n",
                      "ggml/src/ggml-vulkan/vk.cpp": "v\n", "ggml/src/ggml-cuda/cu.cu": "c\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_source_is_stripped_packed_and_keyed_by_its_hash(tmp_path):
    tree = _tree(tmp_path / "llama.cpp")
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:  # an sdist's layout: <name>-<version>/vendor/llama.cpp/...
        for p in sorted(tree.rglob("*")):
            if p.is_file():
                tar.add(p, arcname="llama_cpp_python-0.3.36/vendor/llama.cpp/" + p.relative_to(tree).as_posix())
        info = tarfile.TarInfo("llama_cpp_python-0.3.36/pyproject.toml")  # outside vendor/: not taken
        info.size = 3
        tar.addfile(info, io.BytesIO(b"x=1"))
    from_sdist = build.prepare_source(sdist, tmp_path / "a")
    from_tree = build.prepare_source(tree, tmp_path / "b")
    kept = sorted(p.relative_to(from_sdist).as_posix() for p in from_sdist.rglob("*") if p.is_file())
    assert kept == [build.HASH_FILE, "CMakeLists.txt", "ggml/CMakeLists.txt", "ggml/src/ggml-cuda/cu.cu",
                    "src/llama.cpp", "tools/llama-bench/llama-bench.cpp"]
    assert (from_sdist / build.HASH_FILE).read_text() == (from_tree / build.HASH_FILE).read_text()
    packed = build.pack_source(from_sdist, tmp_path / "llama.cpp-src.tar.gz")
    again = build.prepare_source(packed, tmp_path / "c")  # what the GPU machine unpacks
    assert (again / build.HASH_FILE).read_text() == (from_sdist / build.HASH_FILE).read_text()
    assert build.build_dir_for(again, tmp_path / "build", cuda=True).name.endswith("-cuda")
    assert build.build_dir_for(again, tmp_path / "build", cuda=False) == build.build_dir_for(
        from_tree, tmp_path / "build", cuda=False)
    (tree / "src" / "llama.cpp").write_text("int y;\n")  # another source: another build directory
    changed = build.prepare_source(tree, tmp_path / "d")
    assert build.build_dir_for(changed, tmp_path / "build", False) != build.build_dir_for(again, tmp_path / "build", False)
    with pytest.raises(build.LlamaCppBuildError, match="neither a llama.cpp tree"):
        build.prepare_source(tmp_path / "a" / "src", tmp_path / "e")


def test_the_configure_flags_are_the_suites():
    cuda = build.cmake_args(True)
    assert {"-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"} <= set(cuda)
    assert "-DGGML_CUDA=OFF" in build.cmake_args(False) and "-DCMAKE_CUDA_ARCHITECTURES=90" not in build.cmake_args(False)


def test_cublas_from_pips_nvidia_wheels_where_the_toolkit_has_none(tmp_path):
    site = tmp_path / "site"
    assert build.pip_cublas_args([site]) == []
    cu13 = site / "nvidia" / "cu13"  # nvidia-cublas 13's layout
    (cu13 / "include").mkdir(parents=True)
    (cu13 / "lib").mkdir()
    for f in ("include/cublas_v2.h", "lib/libcublas.so.13", "lib/libcublasLt.so.13"):
        (cu13 / f).write_text("")
    args = build.pip_cublas_args([tmp_path / "elsewhere", site])
    assert args == [f"-DCUDA_cublas_LIBRARY={cu13}/lib/libcublas.so.13",
                    f"-DCUDA_cublasLt_LIBRARY={cu13}/lib/libcublasLt.so.13",
                    f"-DCMAKE_CUDA_FLAGS=-I{cu13}/include", f"-DCMAKE_CXX_FLAGS=-I{cu13}/include"]
    assert build.cmake_args(True, args)[-4:] == args and not set(args) & set(build.cmake_args(False, args))


def test_no_tools_and_no_source_skips_with_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_LLAMACPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.LlamaCppBuildError, match="--llamacpp-src"):
        build.ensure_tools(None, None, str(tmp_path))
    with pytest.raises(build.LlamaCppBuildError, match="lacks llama-bench"):
        build.ensure_tools(str(tmp_path), None, str(tmp_path))


# --- a group's records from the tools' output -------------------------------------------------------------------


def _fake_tools(tmp_path: Path) -> dict[str, Path]:
    """Stand-ins printing the captured output (what the real tools print for these arguments)."""
    out = {}
    for name, fixture in (("llama-batched-bench", "batched-bench.table.txt"), ("llama-bench", "llama-bench.json.txt")):
        p = tmp_path / name
        p.write_text(f"#!/bin/sh\necho \"$*\" >> '{tmp_path / 'calls.txt'}'\ncat '{DATA / fixture}'\n")
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
        out[name] = p
    return out


def test_a_group_turns_the_tools_output_into_records(tiny_gguf_model, tmp_path):
    pytest.importorskip("gguf")
    cases = [Case("llamacpp", "uniform", 0.5, Workload(128, s, 16)) for s in (1, 4, 8)]
    settings = {"llamacpp_root": str(tmp_path / "root"), "llamacpp_threads": 2}
    recs = run_llamacpp_group(cases, tiny_gguf_model, _fake_tools(tmp_path), settings, 60.0, log=lambda s: None)
    rows = {r["pl"]: r for r in parse_batched_bench((DATA / "batched-bench.table.txt").read_text())}
    for rec, streams in zip(recs, (1, 4, 8), strict=True):
        assert rec["status"] == "ok", rec
        m = rec["metrics"]
        assert m["decode_tok_s"] == pytest.approx(rows[streams]["speed_tg"], rel=1e-3)
        assert m["slowest_stream_tok_s"] == pytest.approx(rows[streams]["speed_tg"] / streams, rel=1e-3)
        assert m["ttft_s"] == pytest.approx(rows[streams]["t_pp"], rel=1e-3)
        # the tiny model: dense layer 0, 2 MoE layers, half of them on the GPU: layer 2 whole
        assert (rec["config"]["n_cpu_moe"], rec["config"]["cpu_tensors"], rec["config"]["placement"]) == (2, [], "2")
    doc = {**_doc(), "cases": recs}
    assert results.validate(doc) == []
    assert Path(recs[0]["config"]["gguf"]).is_file()  # exported once, under the llama.cpp root
    # one batched-bench run for the three stream counts, batching prompts as strata chunks them, weights read
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 1 and "-npl 1,4,8" in calls[0] and "-b 2048 -ub 2048" in calls[0] and "-lm none" in calls[0]


# --- the report -----------------------------------------------------------------------------------------------


def _ok(name: str, decode: float, prefill: float = 1000.0, vram: float | None = None, kv: float | None = None,
        **config) -> dict:
    variant, budget, routing, wl = name.split("/")
    prompt, streams = (int(x) for x in wl[1:].split("x"))
    m = dict.fromkeys(results.METRICS)
    m.update(decode_tok_s=decode, slowest_stream_tok_s=decode / streams, prefill_tok_s=prefill, bytes_per_token={},
             peak_vram_bytes=vram, kv_reserved_bytes=kv)
    return {"name": name, "variant": variant, "routing": routing, "group": "grid", "status": "ok", "reason": None,
            "budget": {"gpu_fraction": 0.25, "ram_fraction": None},
            "workload": {"prompt": prompt, "streams": streams, "tokens": 64}, "metrics": m, "roofline": None,
            "fraction_of_roofline": None, "config": config}


def _doc() -> dict:
    doc = results.new_document("llamacpp", {"layers": 12}, {"gpu": "H200", "cpu": "Xeon", "git_commit": "abc"},
                               Rates().as_dict())
    doc["models"] = {"uniform": {"layers": 12, "route_skew": "uniform"}}
    doc["cases"] = [
        _ok("split/b25/uniform/p128x1", 30.0, vram=5 * 2**30),
        _ok("llamacpp/b25/uniform/p128x1", 20.0, vram=4.5 * 2**30, n_cpu_moe=9),
        _ok("llamacpp-q4_k_m/b25/uniform/p128x1", 40.0, n_cpu_moe=9),
        _ok("split/b25/uniform/p128x8", 120.0), _ok("llamacpp/b25/uniform/p128x8", 60.0, n_cpu_moe=9),
        _ok("split/b25/uniform/p8192x1", 25.0, prefill=4000.0),
        _ok("llamacpp/b25/uniform/p8192x1", 20.0, prefill=1000.0, n_cpu_moe=9),
        _ok("split/b25/uniform/p512x1", 25.0),  # no llama.cpp twin: no row
    ]
    return doc


def test_the_table_strata_against_llamacpp_from_a_results_file(tmp_path):
    path = results.write(_doc(), tmp_path)
    doc = results.load([path])
    table = llamacpp_table(doc)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 + 2  # header, rule, one row per split case with a llama.cpp twin; the note
    # no strata Q4_K_M case here: the Q4_K_M ratio is strata's bf16 run over llama.cpp's Q4_K_M, and says so
    assert ("| uniform | b25 | p128x1 | decode | 30.00 | 20.00 | 1.50x |  | 40.00 | 0.75x (strata bf16) | 9 / 9 | "
            "5.0 / 4.5 |  |") in lines
    assert "| uniform | b25 | p128x8 | decode | 120.00 | 60.00 | 2.00x |  |  |  | 9 / - |  |  |" in lines
    assert "| uniform | b25 | p8192x1 | prefill | 4,000.00 | 1,000.00 | 4.00x |  |  |  | 9 / - |  |  |" in lines  # prefill tok/s
    assert lines[-1].startswith("Q4_K_M ratios marked `(strata bf16)`: no strata case on the Q4_K_M file")
    md = report.render(doc, "python -m bench run --suite llamacpp", "suite.png", "suite-llamacpp.png")
    assert "### strata against llama.cpp" in md and "![strata / llama.cpp per case](suite-llamacpp.png)" in md
    no_llama = {**_doc(), "cases": [c for c in doc["cases"] if c["variant"] == "split"]}
    assert llamacpp_table(no_llama) == "" and "strata against llama.cpp" not in report.render(no_llama)


def test_all_in_vram_pairs_llamacpp_with_strata_s_ceiling(tmp_path):
    """At budget "all" strata's bf16 twin is the `ceiling` variant (every expert in VRAM), not `split`."""
    doc = _doc()
    doc["cases"] += [_ok("ceiling/all/uniform/p128x1", 90.0), _ok("llamacpp/all/uniform/p128x1", 45.0, n_cpu_moe=0),
                     _ok("split-q4_k_m/all/uniform/p128x1", 100.0),
                     _ok("llamacpp-q4_k_m/all/uniform/p128x1", 80.0, n_cpu_moe=0)]
    doc = results.load([results.write(doc, tmp_path)])
    row = next(r for r in llamacpp_rows(doc) if r["budget"] == "all")
    assert row["strata"] == 90.0 and row["llamacpp"]["bf16"]["ratio"] == pytest.approx(2.0)
    assert row["strata_q4_k_m"] == 100.0 and row["llamacpp"]["Q4_K_M"]["ratio"] == pytest.approx(1.25)
    assert "| uniform | all | p128x1 | decode | 90.00 | 45.00 | 2.00x | 100.00 | 80.00 | 1.25x | 0 / 0 |" in \
        llamacpp_table(doc)


def test_the_table_names_the_stacks_ot_kept_in_ram_and_the_kv_caches_in_vram(tmp_path):
    doc = _doc()
    doc["cases"] = [_ok("split/b25/uniform/p128x1", 30.0, vram=6.6 * 2**30, kv=1.5 * 2**30),
                    _ok("split-q4_k_m/b25/uniform/p128x1", 50.0),
                    _ok("llamacpp/b25/uniform/p128x1", 20.0, vram=4.9 * 2**30, kv=0.05 * 2**30, n_cpu_moe=9,
                        placement="9"),
                    _ok("llamacpp-q4_k_m/b25/uniform/p128x1", 40.0, n_cpu_moe=9, placement="9 + blk.9 up")]
    doc = results.load([results.write(doc, tmp_path)])
    table = llamacpp_table(doc)
    # the placement column, and each VRAM side with its KV cache where the run recorded it
    assert "| 1.25x | 9 / 9 + blk.9 up | 6.6 (1.5) / 4.9 (0.1) |  |" in table


def test_a_ratio_comes_from_one_run(tmp_path):
    first, second = _doc(), copy.deepcopy(_doc())
    second["cases"] = [_ok("split/b25/uniform/p128x1", 60.0)]  # a later run measured strata alone
    a, b = tmp_path / "a", tmp_path / "b"
    doc = results.load([results.write(first, a), results.write(second, b)])
    row = next(r for r in llamacpp_rows(doc) if r["workload"] == "p128x1")
    assert row["llamacpp"]["bf16"]["ratio"] == pytest.approx(1.5) and row["llamacpp"]["bf16"]["same_run"]


def test_the_plot_of_ratios(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.suite.plot import plot_llamacpp

    png = plot_llamacpp(_doc(), tmp_path / "suite-llamacpp.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_llamacpp({**_doc(), "cases": _doc()["cases"][:1]}, tmp_path / "none.png") is None


# --- the cases ------------------------------------------------------------------------------------------------


def test_the_llamacpp_suite_pairs_every_strata_case_with_both_exports():
    cases = llamacpp_suite()
    names = {c.name for c in cases}
    assert len(names) == len(cases) == 44
    for c in cases:
        if c.variant == "split":
            assert {f"{v}/b25/{c.routing}/{c.workload.name}" for v in (*LLAMACPP_VARIANTS, "split-q4_k_m")} <= names
    assert {(c.workload.prompt, c.workload.streams) for c in cases} == {(128, 1), (128, 4), (128, 8), (512, 1), (8192, 1)}
    # all in VRAM: strata's ceiling and its Q4_K_M file without a budget, llama.cpp with --n-cpu-moe 0 (None)
    assert {c.name for c in cases if c.gpu_fraction is None} == {
        f"{v}/all/uniform/p128x1" for v in ("ceiling", "split-q4_k_m", *LLAMACPP_VARIANTS)}
    assert len(group_by_engine(cases)) == 12  # one engine (or one llama.cpp placement) per variant, routing, budget
    added = with_baselines(quick_suite(), ["llamacpp"])
    twins = [c for c in added if c.variant == "llamacpp"]
    assert {(c.routing, c.gpu_fraction, c.workload) for c in twins} == {
        (c.routing, c.gpu_fraction, c.workload) for c in quick_suite() if c.variant == "split"}
    with pytest.raises(SystemExit, match="unknown baseline"):
        with_baselines(quick_suite(), ["vllm"])


def test_bench_run_with_the_llamacpp_baseline_on_cpu(tmp_path):
    """`python -m bench run --baselines llamacpp` end to end on the tiny model: strata's case, then llama.cpp's (the
    captured output standing in for the tools), the table and the plot in the section."""
    pytest.importorskip("gguf")
    from bench.__main__ import main as bench_main

    out = tmp_path / "out"
    _fake_tools(tmp_path)
    rc = bench_main(["run", "--suite", "llamacpp", "--size", "tiny", "--device", "cpu", "--tokens", "16", "--rates",
                     "limits", "--cases", "split/b25/uniform/p128x1", "--baselines", "llamacpp",
                     "--llamacpp-bin", str(tmp_path), "--llamacpp-root", str(tmp_path / "root"),
                     "--llamacpp-threads", "2", "--models-dir", str(tmp_path / "models"), "--cache",
                     str(tmp_path / "cache"), "--disk-cache", str(tmp_path / "disk"), "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / results.RESULT_FILE).read_text())
    assert [c["name"] for c in doc["cases"]] == ["split/b25/uniform/p128x1", "llamacpp/b25/uniform/p128x1"]
    strata, llama = doc["cases"]
    assert strata["status"] == "ok" and llama["status"] == "ok", (strata.get("reason"), llama.get("reason"))
    assert llama["metrics"]["decode_tok_s"] == 777.23  # the table's one-stream row
    # 25% of the tiny model's two MoE layers: no whole layer fits, one of layer 2's three equal stacks does
    assert llama["config"]["n_cpu_moe"] == 2 and len(llama["config"]["cpu_tensors"]) == 2
    ratio = strata["metrics"]["decode_tok_s"] / 777.23
    md = (out / "suite.md").read_text()
    assert f"| uniform | b25 | p128x1 | decode | {strata['metrics']['decode_tok_s']:,.2f} | 777.23 | {ratio:,.2f}x |" in md
