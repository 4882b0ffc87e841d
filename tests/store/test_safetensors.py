"""strata.tiers.store.safetensors_index: hand-parsed headers, offset reads, and one-line errors for bad files.

Valid checkpoints are saved offline by transformers' own model classes (per-expert, fused 3-D and
sharded with an index); every tensor strata reads must equal what the safetensors library reads.
Corrupt files are written byte by byte.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from strata.errors import CheckpointError, UnsupportedError
from strata.tiers.store import safetensors_index as st
from strata.tiers.store.safetensors_index import TensorIndex, read_header, read_tensor

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
VARIANTS = ("per-expert", "fused-bf16", "sharded")


def _tiny_model(arch: str):
    """A random transformers model, big enough (~100 KB in fp32) to split into 50 KB shards."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, tie_word_embeddings=False)
    cfg = {
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **common,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "qwen2_moe": lambda: Qwen2MoeConfig(
            **common,
            num_key_value_heads=1,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "mixtral": lambda: MixtralConfig(
            **common, num_key_value_heads=1, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
        ),
        "deepseek_v3": lambda: DeepseekV3Config(
            **common,
            num_key_value_heads=2,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    }[arch]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(arch, variant) -> checkpoint dir, each saved by transformers' save_pretrained."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch in ARCHS:
        model = _tiny_model(arch)
        out[arch, "per-expert"] = root / f"{arch}-per-expert"
        model.save_pretrained(out[arch, "per-expert"])
        out[arch, "sharded"] = root / f"{arch}-sharded"
        model.save_pretrained(out[arch, "sharded"], max_shard_size="50KB")
        out[arch, "fused-bf16"] = root / f"{arch}-fused"
        model.to(torch.bfloat16).save_pretrained(out[arch, "fused-bf16"], save_original_format=False)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_load_matches_safetensors_library(hf_checkpoints, arch, variant):
    from safetensors.torch import load_file

    d = hf_checkpoints[arch, variant]
    reference: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        reference.update(load_file(f))
    index = TensorIndex.from_dir(d)
    assert sorted(index.names()) == sorted(reference)
    for name, want in reference.items():
        got = index.load(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
    if variant == "sharded":
        assert (d / st.INDEX_NAME).exists() and len(index.files()) > 1
    if variant == "fused-bf16":
        assert any(index[n].shape[0] == 4 and len(index[n].shape) == 3 for n in index.names())
        assert {info.dtype for info in index} == {"BF16"}
    # the data region of every file is exactly the tensors: nothing double-counted, nothing missed
    data = sum(f.stat().st_size - 8 - _header_len(f) for f in index.files())
    assert index.total_bytes() == data
    index.check_dtypes()  # all loadable


def test_load_converts_dtype_and_reads_in_chunks(hf_checkpoints, monkeypatch):
    index = TensorIndex.from_dir(hf_checkpoints["qwen3_moe", "per-expert"])
    name = "model.embed_tokens.weight"
    whole = index.load(name)
    monkeypatch.setattr(st, "_READ_CHUNK", 7)  # many short preadv calls, none aligned to elements
    assert torch.equal(index.load(name), whole)
    assert torch.equal(index.load(name, dtype=torch.bfloat16), whole.to(torch.bfloat16))
    out = torch.full((whole.numel(),), -1.0)
    got = read_tensor(index[name], out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, whole)
    with pytest.raises(ValueError):
        read_tensor(index[name], out=torch.empty(3))


def test_single_file_path_and_metadata(tmp_path):
    from safetensors.torch import save_file

    f = tmp_path / "one.safetensors"
    tensors = {
        "a": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "empty": torch.empty(0, 4),
        "s": torch.tensor(2.5),
    }
    save_file(tensors, f, metadata={"format": "pt"})
    index = TensorIndex.from_dir(f)
    assert len(index) == 3 and index.files() == [f]
    for name, want in tensors.items():
        assert torch.equal(index.load(name), want)
    assert index.total_bytes(["a"]) == 12


def _header_len(f: Path) -> int:
    with open(f, "rb") as fh:
        return struct.unpack("<Q", fh.read(8))[0]


# ---------------------------------------------------------------------------------------------- errors


def _st_bytes(header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _raises(exc_type, fn, filename: str) -> str:
    """Run fn; it must raise exc_type with a one-line message naming `filename`."""
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    assert filename in msg, msg
    assert "\n" not in msg and "\r" not in msg, msg
    return msg


GOOD = {"w": _entry("F32", [2, 2], 0, 16)}
BAD_FILES = {
    "empty": b"",
    "short": b"\x01\x02\x03",
    "header_past_eof": _st_bytes(GOOD, bytes(16), header_len=10_000),
    "header_over_limit": _st_bytes(b"{}", header_len=st.MAX_HEADER_BYTES + 1),
    "header_not_json": _st_bytes(b'{"w": {"dtype": "F32", '),
    "header_not_utf8": _st_bytes(b'{"\xff\xfe": 1}'),
    "header_is_list": _st_bytes(b"[1, 2]"),
    "duplicate_tensor": _st_bytes(
        b'{"w": ' + json.dumps(GOOD["w"]).encode() + b', "w": ' + json.dumps(GOOD["w"]).encode() + b"}", bytes(16)
    ),
    "duplicate_tensor_with_metadata": _st_bytes(
        b'{"__metadata__": {"format": "pt"}, "w": '
        + json.dumps(GOOD["w"]).encode()
        + b', "w": '
        + json.dumps(GOOD["w"]).encode()
        + b"}",
        bytes(16),
    ),
    "entry_not_object": _st_bytes({"w": "F32"}, bytes(16)),
    "entry_no_dtype": _st_bytes({"w": {"shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16)),
    "entry_dtype_list": _st_bytes({"w": _entry(["F32"], [2, 2], 0, 16)}, bytes(16)),  # type: ignore[arg-type]
    "entry_shape_str": _st_bytes({"w": _entry("F32", "2x2", 0, 16)}, bytes(16)),  # type: ignore[arg-type]
    "entry_shape_negative": _st_bytes({"w": _entry("F32", [-2, -2], 0, 16)}, bytes(16)),
    "entry_shape_float": _st_bytes({"w": _entry("F32", [2.0, 2], 0, 16)}, bytes(16)),
    "entry_offsets_three": _st_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8, 16]}}, bytes(16)),
    "entry_offsets_str": _st_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": ["0", "16"]}}, bytes(16)),
    "entry_offsets_bool": _st_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [False, True]}}, bytes(16)),
    "unknown_dtype": _st_bytes({"w": _entry("F7", [2, 2], 0, 16)}, bytes(16)),
    "offsets_reversed": _st_bytes({"w": _entry("F32", [0], 16, 0)}, bytes(16)),
    "offsets_negative": _st_bytes({"w": _entry("F32", [4], -16, 0)}, bytes(16)),
    "offsets_past_eof": _st_bytes(GOOD, bytes(10)),  # truncated: 10 of 16 data bytes
    "size_mismatch": _st_bytes({"w": _entry("F32", [2, 3], 0, 16)}, bytes(16)),
    "fp8_size_mismatch": _st_bytes({"w": _entry("F8_E4M3", [4, 4], 0, 32)}, bytes(32)),
    "overlap": _st_bytes({"a": _entry("F32", [2, 2], 0, 16), "b": _entry("F32", [2, 2], 8, 24)}, bytes(24)),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_corrupt_file_raises_one_line_checkpoint_error(tmp_path, case):
    f = tmp_path / f"{case}.safetensors"
    f.write_bytes(BAD_FILES[case])
    _raises(CheckpointError, lambda: read_header(f), f.name)
    _raises(CheckpointError, lambda: TensorIndex.from_dir(tmp_path), f.name)


def test_messages_say_what_is_wrong(tmp_path):
    def msg(case: str) -> str:
        f = tmp_path / f"{case}.safetensors"
        f.write_bytes(BAD_FILES[case])
        return _raises(CheckpointError, lambda: read_header(f), f.name)

    assert "truncated" in msg("short")
    assert "past the end of the file" in msg("header_past_eof")
    assert "not valid JSON" in msg("header_not_json")
    assert "lists 'w' twice" in msg("duplicate_tensor")
    assert "lists 'w' twice" in msg("duplicate_tensor_with_metadata")
    assert "no dtype" in msg("entry_no_dtype")
    assert "truncated" in msg("offsets_past_eof")
    assert "needs 24" in msg("size_mismatch")
    assert "overlap" in msg("overlap")
    assert "malformed" in msg("entry_offsets_str")


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path)


def _write_index(d: Path, weight_map: dict[str, str] | str) -> Path:
    f = d / st.INDEX_NAME
    f.write_text(weight_map if isinstance(weight_map, str) else json.dumps({"metadata": {}, "weight_map": weight_map}))
    return f


def test_index_errors(tmp_path):
    _save(tmp_path / "a.safetensors", {"x": torch.ones(2), "y": torch.zeros(3)})
    _write_index(tmp_path, {"x": "a.safetensors", "y": "a.safetensors"})
    assert sorted(TensorIndex.from_dir(tmp_path).names()) == ["x", "y"]

    _write_index(tmp_path, {"x": "a.safetensors", "z": "a.safetensors"})
    msg = _raises(CheckpointError, lambda: TensorIndex.from_dir(tmp_path), "a.safetensors")
    assert "'z'" in msg and "missing" in msg

    _write_index(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})
    msg = _raises(CheckpointError, lambda: TensorIndex.from_dir(tmp_path), "b.safetensors")
    assert "missing" in msg

    for broken in (
        '{"weight_map": {"x": ',
        '{"metadata": {}}',
        '{"weight_map": ["a.safetensors"]}',
        '{"weight_map": {"x": 3}}',
        "[]",
        "\xff",
    ):
        _write_index(tmp_path, broken)
        _raises(CheckpointError, lambda: TensorIndex.from_dir(tmp_path), st.INDEX_NAME)


def test_directory_errors(tmp_path):
    _raises(CheckpointError, lambda: TensorIndex.from_dir(tmp_path / "nope"), "nope")
    (tmp_path / "empty").mkdir()
    _raises(CheckpointError, lambda: TensorIndex.from_dir(tmp_path / "empty"), "empty")
    # without an index, the same tensor in two files is ambiguous
    _save(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    _save(tmp_path / "b.safetensors", {"x": torch.ones(2)})
    msg = _raises(CheckpointError, lambda: TensorIndex.from_dir(tmp_path), "b.safetensors")
    assert "a.safetensors" in msg
    index = TensorIndex.from_dir(tmp_path / "a.safetensors")
    _raises(CheckpointError, lambda: index["missing"], "missing")


def test_file_truncated_after_indexing(tmp_path):
    f = tmp_path / "model.safetensors"
    _save(f, {"x": torch.arange(64, dtype=torch.float32)})
    index = TensorIndex.from_dir(tmp_path)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 8)
    _raises(CheckpointError, lambda: index.load("x"), f.name)
    f.unlink()
    _raises(CheckpointError, lambda: index.load("x"), f.name)


@pytest.mark.parametrize("dtype", ["F8_E5M2", "F8_E8M0"])
def test_other_fp8_dtypes_are_unsupported_on_load_and_check(tmp_path, dtype):
    # hand-written like DeepSeek-V3's files: FP8 weights with F32 block scales, BF16 norms
    f = tmp_path / "model-00001-of-00001.safetensors"
    header = {
        "layer.weight": _entry(dtype, [4, 8], 0, 32),
        "layer.weight_scale_inv": _entry("F32", [1, 1], 32, 36),
        "norm.weight": _entry("BF16", [8], 36, 52),
    }
    f.write_bytes(_st_bytes(header, bytes(52)))
    index = TensorIndex.from_dir(tmp_path)  # indexing (and `strata inspect`) still works
    assert index["layer.weight"].nbytes == 32 and not index["layer.weight"].supported
    assert torch.equal(index.load("norm.weight"), torch.zeros(8, dtype=torch.bfloat16))
    msg = _raises(UnsupportedError, lambda: index.load("layer.weight"), f.name)
    assert "e4m3" in msg and dtype in msg
    msg = _raises(UnsupportedError, index.check_dtypes, f.name)
    assert "e4m3" in msg and "'layer.weight'" in msg
    index.check_dtypes(["norm.weight", "layer.weight_scale_inv"])  # loadable subset passes


def test_block_scaled_fp8_passes_the_check_and_reads_raw(tmp_path):
    """F8_E4M3 beside its `_scale_inv` is loadable (read raw, dequantized by its reader); without it, a one-line
    CheckpointError names the tensor and its missing scales."""
    f = tmp_path / "model.safetensors"
    values = torch.tensor([[1.0, -2.0, 0.5, 448.0]]).to(torch.float8_e4m3fn)
    header = {"layer.weight": _entry("F8_E4M3", [1, 4], 0, 4), "layer.weight_scale_inv": _entry("F32", [1, 1], 4, 8),
              "lone.weight": _entry("F8_E4M3", [1, 4], 8, 12)}
    data = values.view(torch.uint8).numpy().tobytes() + torch.tensor([0.5]).numpy().tobytes() + bytes(4)
    f.write_bytes(_st_bytes(header, data))
    index = TensorIndex.from_dir(tmp_path)
    index.check_dtypes(["layer.weight", "layer.weight_scale_inv"])
    raw = read_tensor(index["layer.weight"], raw=True)
    assert raw.dtype == torch.float8_e4m3fn and raw.float().tolist() == [[1.0, -2.0, 0.5, 448.0]]
    msg = _raises(UnsupportedError, lambda: index.load("layer.weight"), f.name)  # never converted without its scales
    assert "weight_scale_inv" in msg
    msg = _raises(CheckpointError, index.check_dtypes, f.name)
    assert "'lone.weight'" in msg and "'lone.weight_scale_inv'" in msg


def test_other_unloadable_dtypes(tmp_path):
    f = tmp_path / "x.safetensors"
    header = {"ids": _entry("I64", [3], 0, 24), "mx": _entry("F4", [2, 4], 24, 28), "b": _entry("BOOL", [2], 28, 30)}
    f.write_bytes(_st_bytes(header, bytes(30)))
    index = TensorIndex.from_dir(f)
    for name in ("ids", "mx", "b"):
        _raises(UnsupportedError, lambda name=name: index.load(name), f.name)
    assert "MXFP4" in _raises(UnsupportedError, lambda: index.load("mx"), f.name)
