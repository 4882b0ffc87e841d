"""`strata convert`, `inspect` and `plan` on a GGUF file, and a GGUF store's blobs checked for their block types."""

from __future__ import annotations

import pytest

from strata.cli import main
from strata.kernels.quant import ExpertFormat
from strata.tiers.store.format import read_index
from strata.tiers.store.store import ExpertStore, format_problem

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_models import build_qwen3_gguf  # noqa: E402

TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q3_K", "Q6_K")]
FORMAT = ExpertFormat("gguf", ggml=(("Q4_K", "Q2_K"), ("Q4_K", "Q3_K"), ("Q6_K",)))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen3_gguf(tmp_path_factory.mktemp("gguf_cmd"), TYPES, seed=2)[1]


def test_convert_writes_the_store_once_and_refuses_a_quantizing_option(qwen3, tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["convert", str(qwen3), str(store)]) == 0
    assert f"wrote the store {store}" in capsys.readouterr().out
    idx = read_index(store)
    assert idx.expert_format == FORMAT and idx.moe_layers == [0, 1] and idx.num_experts == 4
    assert main(["convert", str(qwen3), str(store)]) == 0
    assert "is already the store of" in capsys.readouterr().out
    assert main(["convert", str(qwen3), str(tmp_path / "fp8"), "--experts", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "keep their ggml blocks; drop --experts fp8" in err and err.count("\n") == 1
    assert not (tmp_path / "fp8").exists()


def test_inspect_shows_the_ggml_types_of_the_file_and_of_its_store(qwen3, tmp_path, capsys):
    assert main(["inspect", str(qwen3)]) == 0
    out = capsys.readouterr().out
    assert "GGUF qwen3moe (qwen3_moe)" in out
    assert "experts gguf Q4_K/Q2_K/Q3_K/Q6_K: " in out and "dense f32: " in out
    assert "2 (2 MoE, 0 dense)" in out and "4 per layer, 2 active per token" in out
    assert "mxfp4" not in out
    store = tmp_path / "store"
    assert main(["convert", str(qwen3), str(store)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    assert "experts gguf Q4_K/Q2_K/Q3_K/Q6_K: " in out and "store layout" in out and "mxfp4" not in out


def test_plan_reads_a_gguf_file_from_its_headers(qwen3, tmp_path, capsys):
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[tiers.disk]\npath = "{tmp_path / "cache"}"\n')
    assert main(["plan", str(qwen3), "--config", str(cfg), "--gpu-mem", "0", "--ram", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "2 MoE layers x 4 = 8 of" in out and "(gguf Q4_K/Q2_K/Q3_K/Q6_K)" in out
    assert "packed: a GGUF file is converted into a packed store" in out
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("store.msgpack"))  # headers only


def test_format_problem_checks_the_block_type_ids_of_a_gguf_blob(qwen3, tmp_path):
    store = tmp_path / "store"
    assert main(["convert", str(qwen3), str(store)]) == 0
    with ExpertStore.open(store) as s:
        buf = s.read_expert(s.keys()[0]).clone()
        layout = s.layout
    assert format_problem(layout, buf) is None
    assert buf[:3].tolist() == [12, 12, 14]  # Q4_K gate and up, Q6_K down
    bad = buf.clone()
    bad[2] = 99  # no ggml type
    assert format_problem(layout, bad) == "down has ggml type id 99, not one of the store's Q6_K"
    bad = buf.clone()
    bad[0] = 8  # Q8_0: a type, but none of this store's gate tensors has it
    assert format_problem(layout, bad) == "gate has ggml type id 8, not one of the store's Q4_K/Q2_K"
