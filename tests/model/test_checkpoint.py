"""Checkpoint-level bad input: each is a strata error with a one-line message naming file and problem,
and the CLI turns it into exit status 2 with no traceback."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest

from strata import CheckpointError, Engine, UnsupportedError
from strata.runtime.model.checkpoint import Checkpoint


@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(model_copy)
    assert "config.json" in one_line(e) and str(model_copy) in one_line(e)


def test_config_not_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(model_copy)
    assert "config.json" in one_line(e)


def test_unknown_architecture_names_supported_ones(model_copy):
    edit_config(model_copy, model_type="llama")
    with pytest.raises(UnsupportedError) as e:
        Checkpoint.open(model_copy)
    msg = one_line(e)
    assert "llama" in msg and all(a in msg for a in ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral"))


@pytest.mark.parametrize("quantization, match", [
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size None is not two positive integers"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
])
def test_unsupported_quantization_configs_are_refused(model_copy, quantization, match):
    edit_config(model_copy, quantization_config=quantization)
    with pytest.raises(UnsupportedError, match=match) as e:
        Checkpoint.open(model_copy)
    assert "config.json" in one_line(e)


def test_fp8_tensor_without_scales_is_refused(model_copy):
    """Relabel one bf16 tensor as F8_E4M3 (twice the elements, same bytes) with no `_scale_inv` beside it: open
    refuses it, naming the tensor and its missing scales."""
    path = model_copy / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "BF16" and len(v["shape"]) == 2)
    header[name]["dtype"] = "F8_E4M3"
    header[name]["shape"] = [header[name]["shape"][0] * 2, header[name]["shape"][1]]
    new = json.dumps(header).encode()  # data offsets are relative to the data start: only N changes
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(model_copy)
    assert "FP8" in one_line(e) and name in one_line(e) and f"{name}_scale_inv" in one_line(e)


def test_tensor_missing(model_copy):
    edit_config(model_copy, num_hidden_layers=4)  # the files hold 3 layers
    with pytest.raises(CheckpointError) as e:
        Engine.from_pretrained(model_copy, device="cpu")
    assert "model.layers.3" in one_line(e) and "missing" in one_line(e)


def test_shape_disagrees_with_config(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    edit_config(model_copy, vocab_size=cfg["vocab_size"] + 8)
    with pytest.raises(CheckpointError) as e:
        Engine.from_pretrained(model_copy, device="cpu")
    assert "embed_tokens" in one_line(e) and "shape" in one_line(e)


def test_truncated_shard(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(model_copy)
    assert "model.safetensors" in one_line(e) and "truncated" in one_line(e)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata", *args], capture_output=True, text=True, timeout=300)


def test_cli_errors_exit_2_without_traceback(model_copy, tmp_path):
    (model_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json!!!}")
    for args in (["generate", str(tmp_path / "absent"), "--prompt", "x"],
                 ["inspect", str(model_copy)],
                 ["generate", str(model_copy), "--prompt", "x"]):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        lines = [line for line in r.stderr.splitlines() if line.startswith("strata: error:")]
        assert len(lines) == 1, r.stderr


def test_cli_generate_on_a_damaged_store_ends_its_text_then_names_the_damage(tiny_model_dir, tmp_path):
    """Damage is found when an expert is first read; the text streamed so far keeps a line of its own."""
    store = tmp_path / "store"
    assert run_cli("convert", str(tiny_model_dir), str(store)).returncode == 0
    for blob in sorted((store / "experts").glob("*.bin")):  # every expert of every layer: the first one routed fails
        blob.write_bytes(bytes(255 - b for b in blob.read_bytes()))
    r = run_cli("generate", str(store), "--prompt", "Hello", "--max-tokens", "4", "--device", "cpu")
    assert r.returncode == 2 and r.stdout == "Hello\n", (r.stdout, r.stderr[-2000:])
    lines = [line for line in r.stderr.splitlines() if line.startswith("strata: error:")]
    assert len(lines) == 1 and "checksum mismatch" in lines[0] and "strata verify" in lines[0], r.stderr[-2000:]


def test_cli_demo_model_generate_and_inspect(tmp_path):
    d = tmp_path / "tiny"
    r = run_cli("demo-model", str(d), "--size", "tiny")
    assert r.returncode == 0, r.stderr
    r = run_cli("generate", str(d), "--prompt", "Hello", "--max-tokens", "5", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello")
    r = run_cli("inspect", str(d))
    assert r.returncode == 0 and "deepseek_v3" in r.stdout and "experts" in r.stdout
