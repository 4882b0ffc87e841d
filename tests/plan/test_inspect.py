"""strata.runtime.plan.checkpoints.inspect: header-only checkpoint summaries.

Two kinds of checkpoint: tiny ones saved by transformers' own classes (every naming scheme and both
expert layouts), and full-size ones (Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3 with FP8 and MTP,
Mixtral-8x7B) written as sparse files: a real header, then `truncate` to hundreds of GB that are never
allocated on disk. The summary of those must come from the headers alone, which the test checks by
counting the bytes the process reads.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from strata.errors import CheckpointError
from strata.runtime.plan.checkpoints.inspect import ROLES, format_summary, summarize_checkpoint
from strata.tiers.store.safetensors_index import DTYPE_BITS, INDEX_NAME, TensorIndex

GiB = 1 << 30

# ------------------------------------------------------------------------- full-size sparse checkpoints

Spec = list[tuple[str, str, str, tuple[int, ...]]]  # (role, name, dtype, shape)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_BITS[dtype] // 8


def write_sparse_checkpoint(d: Path, spec: Spec, config: dict, shards: int) -> dict[str, int]:
    """Write `spec` as `shards` sparse safetensors files + index + config; return expected bytes by role."""
    d.mkdir(parents=True)
    per = -(-len(spec) // shards)
    weight_map, expected = {}, defaultdict(int)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, off = {}, 0
        for role, name, dtype, shape in spec[s * per : (s + 1) * per]:
            n = _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
            expected[role] += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # real writers pad the header to 8 bytes
        with open(d / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
        os.truncate(d / fname, 8 + len(raw) + off)  # a hole: no data blocks are allocated
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(config))
    return dict(expected)


def _attn_gqa(p: str, hidden: int, heads: int, kv: int, hd: int, qk_norm: bool) -> Spec:
    s = [
        ("attention", f"{p}.self_attn.q_proj.weight", "BF16", (heads * hd, hidden)),
        ("attention", f"{p}.self_attn.k_proj.weight", "BF16", (kv * hd, hidden)),
        ("attention", f"{p}.self_attn.v_proj.weight", "BF16", (kv * hd, hidden)),
        ("attention", f"{p}.self_attn.o_proj.weight", "BF16", (hidden, heads * hd)),
    ]
    if qk_norm:
        s += [
            ("attention", f"{p}.self_attn.q_norm.weight", "BF16", (hd,)),
            ("attention", f"{p}.self_attn.k_norm.weight", "BF16", (hd,)),
        ]
    return s + [
        ("norms", f"{p}.input_layernorm.weight", "BF16", (hidden,)),
        ("norms", f"{p}.post_attention_layernorm.weight", "BF16", (hidden,)),
    ]


def _embeddings(vocab: int, hidden: int) -> Spec:
    return [
        ("embeddings", "model.embed_tokens.weight", "BF16", (vocab, hidden)),
        ("norms", "model.norm.weight", "BF16", (hidden,)),
        ("embeddings", "lm_head.weight", "BF16", (vocab, hidden)),
    ]


def qwen3_moe(layers: int, hidden: int, heads: int, inter: int, experts: int, fused: bool = False) -> tuple[Spec, dict]:
    """Qwen3-MoE with real shapes; `fused` writes transformers 5's 3-D expert tensors."""
    spec = _embeddings(151936, hidden)
    for L in range(layers):
        p = f"model.layers.{L}"
        spec += _attn_gqa(p, hidden, heads, 4, 128, qk_norm=True)
        spec.append(("router", f"{p}.mlp.gate.weight", "BF16", (experts, hidden)))
        if fused:
            spec += [
                ("experts", f"{p}.mlp.experts.gate_up_proj", "BF16", (experts, 2 * inter, hidden)),
                ("experts", f"{p}.mlp.experts.down_proj", "BF16", (experts, hidden, inter)),
            ]
            continue
        for e in range(experts):
            spec += [
                ("experts", f"{p}.mlp.experts.{e}.gate_proj.weight", "BF16", (inter, hidden)),
                ("experts", f"{p}.mlp.experts.{e}.up_proj.weight", "BF16", (inter, hidden)),
                ("experts", f"{p}.mlp.experts.{e}.down_proj.weight", "BF16", (hidden, inter)),
            ]
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": inter,
    }
    return spec, config


def _fp8(role: str, name: str, shape: tuple[int, int]) -> Spec:
    """An FP8 weight and its 128x128-block F32 scales, as in DeepSeek-V3's release."""
    blocks = (-(-shape[0] // 128), -(-shape[1] // 128))
    return [(role, name, "F8_E4M3", shape), (role, name + "_scale_inv", "F32", blocks)]


def _deepseek_layer(p: str, role_of: dict[str, str], dense: bool) -> Spec:
    h, r = 7168, role_of
    s = [
        *_fp8(r["attention"], f"{p}.self_attn.q_a_proj.weight", (1536, h)),
        (r["attention"], f"{p}.self_attn.q_a_layernorm.weight", "BF16", (1536,)),
        *_fp8(r["attention"], f"{p}.self_attn.q_b_proj.weight", (128 * 192, 1536)),
        *_fp8(r["attention"], f"{p}.self_attn.kv_a_proj_with_mqa.weight", (576, h)),
        (r["attention"], f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (512,)),
        *_fp8(r["attention"], f"{p}.self_attn.kv_b_proj.weight", (128 * 256, 512)),
        *_fp8(r["attention"], f"{p}.self_attn.o_proj.weight", (h, 128 * 128)),
        (r["norms"], f"{p}.input_layernorm.weight", "BF16", (h,)),
        (r["norms"], f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
    ]
    if dense:
        for proj, shape in (("gate_proj", (18432, h)), ("up_proj", (18432, h)), ("down_proj", (h, 18432))):
            s += _fp8(r["dense_mlp"], f"{p}.mlp.{proj}.weight", shape)
        return s
    s += [
        (r["router"], f"{p}.mlp.gate.weight", "BF16", (256, h)),
        (r["router"], f"{p}.mlp.gate.e_score_correction_bias", "F32", (256,)),
    ]
    for who, role in [(f"experts.{e}", r["experts"]) for e in range(256)] + [("shared_experts", r["shared_experts"])]:
        for proj, shape in (("gate_proj", (2048, h)), ("up_proj", (2048, h)), ("down_proj", (h, 2048))):
            s += _fp8(role, f"{p}.mlp.{who}.{proj}.weight", shape)
    return s


def deepseek_v3() -> tuple[Spec, dict]:
    """DeepSeek-V3 (671B) as released: FP8 weights, 3 dense layers, 58 MoE layers, MTP layer 61."""
    same = {r: r for r in ROLES}
    spec = _embeddings(129280, 7168)
    for L in range(61):
        spec += _deepseek_layer(f"model.layers.{L}", same, dense=L < 3)
    mtp = dict.fromkeys(ROLES, "mtp")  # everything of layer 61 is MTP, whatever it looks like
    spec += _deepseek_layer("model.layers.61", mtp, dense=False)
    spec += [
        ("mtp", "model.layers.61.embed_tokens.weight", "BF16", (129280, 7168)),
        ("mtp", "model.layers.61.enorm.weight", "BF16", (7168,)),
        ("mtp", "model.layers.61.hnorm.weight", "BF16", (7168,)),
        ("mtp", "model.layers.61.eh_proj.weight", "BF16", (7168, 2 * 7168)),
        ("mtp", "model.layers.61.shared_head.norm.weight", "BF16", (7168,)),
        ("mtp", "model.layers.61.shared_head.head.weight", "BF16", (129280, 7168)),
    ]
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1,
        "quantization_config": {"quant_method": "fp8"},
    }
    return spec, config


def mixtral_8x7b() -> tuple[Spec, dict]:
    spec = _embeddings(32000, 4096)
    for L in range(32):
        p = f"model.layers.{L}"
        spec += _attn_gqa(p, 4096, 32, 8, 128, qk_norm=False)
        spec.append(("router", f"{p}.block_sparse_moe.gate.weight", "BF16", (8, 4096)))
        for e in range(8):
            spec += [
                ("experts", f"{p}.block_sparse_moe.experts.{e}.w1.weight", "BF16", (14336, 4096)),
                ("experts", f"{p}.block_sparse_moe.experts.{e}.w2.weight", "BF16", (4096, 14336)),
                ("experts", f"{p}.block_sparse_moe.experts.{e}.w3.weight", "BF16", (14336, 4096)),
            ]
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    return spec, config


BIG = {
    # name: (builder, shards, layers, experts/layer, experts/token, shared, one expert's bytes, dtype, layout)
    "qwen3-30b-a3b": (
        lambda: qwen3_moe(48, 2048, 32, 768, 128),
        16,
        48,
        128,
        8,
        0,
        3 * 768 * 2048 * 2,
        "BF16",
        "per-expert",
    ),
    "qwen3-30b-a3b-fused": (
        lambda: qwen3_moe(48, 2048, 32, 768, 128, fused=True),
        16,
        48,
        128,
        8,
        0,
        3 * 768 * 2048 * 2,
        "BF16",
        "fused",
    ),
    "qwen3-235b-a22b": (
        lambda: qwen3_moe(94, 4096, 64, 1536, 128),
        24,
        94,
        128,
        8,
        0,
        3 * 1536 * 4096 * 2,
        "BF16",
        "per-expert",
    ),
    "deepseek-v3": (deepseek_v3, 32, 61, 256, 8, 1, 3 * (2048 * 7168 + 16 * 56 * 4), "F8_E4M3", "per-expert"),
    "mixtral-8x7b": (mixtral_8x7b, 4, 32, 8, 2, 0, 3 * 14336 * 4096 * 2, "BF16", "per-expert"),
}


def _header_len(f: Path) -> int:
    with open(f, "rb") as fh:  # never f.read_bytes(): the sparse files are hundreds of GB
        return struct.unpack("<Q", fh.read(8))[0]


def _bytes_read() -> int | None:
    """Bytes this process has read through read()/pread() so far (Linux), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@pytest.mark.parametrize("model", sorted(BIG))
def test_full_size_sparse_checkpoint_from_headers_only(tmp_path, model):
    build, shards, layers, experts, per_token, shared, expert_bytes, dtype, layout = BIG[model]
    spec, config = build()
    d = tmp_path / model
    try:
        expected = write_sparse_checkpoint(d, spec, config, shards)
    except OSError as e:  # a filesystem without sparse files or large-file support
        pytest.skip(f"cannot create sparse files here: {e}")
    total = sum(expected.values())
    assert total > 50 * GiB  # the point of the test: far more than could ever be read in time

    before, t0 = _bytes_read(), time.perf_counter()
    s = summarize_checkpoint(d)
    elapsed, after = time.perf_counter() - t0, _bytes_read()

    # headers only: the JSON (headers, index, config) is read, never the hundreds of GB of (sparse) data
    if before is not None and after is not None:
        headers = sum(8 + _header_len(f) for f in d.glob("*.safetensors"))
        json_files = (d / INDEX_NAME).stat().st_size + (d / "config.json").stat().st_size
        assert after - before < headers + json_files + 1024 * 1024, (after - before, headers, json_files)
    assert elapsed < 5.0  # ~0.1-0.7 s; a loose bound, timing is not what this test is for

    assert s.total_bytes == total
    assert s.bytes_by_role == {role: expected.get(role, 0) for role in ROLES}
    assert (s.num_layers, s.experts_per_layer, s.experts_per_token) == (layers, experts, per_token)
    assert (s.shared_experts, s.expert_bytes, s.dtype, s.expert_layout) == (shared, expert_bytes, dtype, layout)
    assert s.num_files == shards and s.notes == []
    assert s.architecture == config["architectures"][0] and s.model_type == config["model_type"]
    if model == "deepseek-v3":
        assert (s.moe_layers, s.mtp_layers) == (58, 1)
        assert s.bytes_by_dtype["F8_E4M3"] > 600 * GiB
    else:
        assert (s.moe_layers, s.mtp_layers) == (layers, 0)
    text = format_summary(s)
    assert config["architectures"][0] in text and "GiB" in text


def test_fp8_checkpoint_without_scales_is_summarised_but_not_loadable(tmp_path):
    spec, config = qwen3_moe(2, 256, 4, 128, 4)
    spec = [(r, n, "F8_E4M3" if n.endswith("proj.weight") else dt, sh) for r, n, dt, sh in spec]
    write_sparse_checkpoint(tmp_path / "m", spec, config, 1)
    assert summarize_checkpoint(tmp_path / "m").expert_bytes == 3 * 128 * 256
    from strata.errors import CheckpointError

    with pytest.raises(CheckpointError, match="has no '.*weight_scale_inv' \\(its block scales\\)"):
        TensorIndex.from_dir(tmp_path / "m").check_dtypes()


# ------------------------------------------------------------------ tiny checkpoints from transformers


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """(model_type, fused) -> a tiny random checkpoint saved by transformers."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, tie_word_embeddings=False)
    configs = {
        "qwen3_moe": Qwen3MoeConfig(
            **common,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "qwen2_moe": Qwen2MoeConfig(
            **common,
            num_key_value_heads=1,
            intermediate_size=32,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "mixtral": MixtralConfig(
            **common, num_key_value_heads=1, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2
        ),
        "deepseek_v3": DeepseekV3Config(
            **common,
            num_key_value_heads=2,
            intermediate_size=32,
            moe_intermediate_size=8,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
        ),
    }
    root, out = tmp_path_factory.mktemp("hf"), {}
    for model_type, cfg in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        for fused in (False, True):
            out[model_type, fused] = root / f"{model_type}-{fused}"
            model.save_pretrained(out[model_type, fused], save_original_format=not fused, max_shard_size="8KB")
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_transformers_checkpoints(hf_checkpoints, model_type, fused):
    d = hf_checkpoints[model_type, fused]
    s = summarize_checkpoint(d)
    index = TensorIndex.from_dir(d)
    assert s.model_type == model_type and s.notes == []
    assert s.expert_layout == ("fused" if fused else "per-expert")
    assert (s.num_layers, s.experts_per_layer, s.experts_per_token) == (3, 4, 2)
    assert s.moe_layers == (2 if model_type == "deepseek_v3" else 3)  # first_k_dense_replace=1
    assert s.shared_experts == (1 if model_type in ("qwen2_moe", "deepseek_v3") else 0)
    assert s.expert_bytes == 3 * 16 * 8 * 4  # gate + up + down, [8, 16] each, fp32
    assert s.num_files == len(index.files()) > 1 and s.mtp_layers == 0
    assert s.total_bytes == index.total_bytes() == sum(s.bytes_by_role.values())
    assert s.bytes_by_role["experts"] == s.moe_layers * 4 * s.expert_bytes
    assert s.bytes_by_role["embeddings"] == 2 * 64 * 16 * 4
    assert s.bytes_by_role["router"] >= s.moe_layers * 4 * 16 * 4
    assert s.bytes_by_role["attention"] > 0 and s.bytes_by_role["norms"] > 0
    assert (s.bytes_by_role["dense_mlp"] > 0) == (model_type == "deepseek_v3")
    assert (s.bytes_by_role["shared_experts"] > 0) == (s.shared_experts > 0)
    assert s.bytes_by_role["other"] == s.bytes_by_role["mtp"] == 0
    assert s.dtype == "F32"


def test_unknown_model_type_and_mismatches_are_noted(hf_checkpoints, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(hf_checkpoints["qwen3_moe", False], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="my_moe", num_local_experts=8)  # and the tensors hold 4 experts per layer
    (d / "config.json").write_text(json.dumps(cfg))
    s = summarize_checkpoint(d)
    assert s.model_type == "my_moe" and s.bytes_by_role["experts"] > 0
    assert any("'my_moe'" in n for n in s.notes) and any("8 experts" in n and "4" in n for n in s.notes)
    assert all("\n" not in n for n in s.notes)
    assert "note: model_type 'my_moe'" in format_summary(s)


def test_dense_model(tmp_path):
    spec = _embeddings(1000, 64)
    for L in range(2):
        spec += _attn_gqa(f"model.layers.{L}", 64, 2, 1, 32, qk_norm=False)
        spec += [("dense_mlp", f"model.layers.{L}.mlp.{p}.weight", "BF16", (128, 64)) for p in ("gate_proj", "up_proj")]
        spec.append(("dense_mlp", f"model.layers.{L}.mlp.down_proj.weight", "BF16", (64, 128)))
    spec.append(("other", "model.rotary_emb.inv_freq", "F32", (16,)))
    expected = write_sparse_checkpoint(tmp_path / "m", spec, {"model_type": "llama", "num_hidden_layers": 2}, 1)
    s = summarize_checkpoint(tmp_path / "m")
    assert (s.moe_layers, s.experts_per_layer, s.expert_bytes, s.expert_layout) == (0, 0, 0, "none")
    assert s.bytes_by_role == {role: expected.get(role, 0) for role in ROLES}
    assert any("inv_freq" in n for n in s.notes)
    assert "experts" not in format_summary(s).split("bytes by role")[0]


def test_config_errors(tmp_path, hf_checkpoints):
    with pytest.raises(CheckpointError, match="nope"):
        summarize_checkpoint(tmp_path / "nope")
    d = tmp_path / "m"
    shutil.copytree(hf_checkpoints["mixtral", False], d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError) as e:
        summarize_checkpoint(d)
    assert str(d) in str(e.value) and "config.json" in str(e.value) and "\n" not in str(e.value)
    for bad in ('{"model_type": "mixtral",', "[1, 2]", "\xff"):
        (d / "config.json").write_text(bad, encoding="latin-1")
        with pytest.raises(CheckpointError) as e:
            summarize_checkpoint(d)
        assert "config.json" in str(e.value) and "\n" not in str(e.value)
    (d / "config.json").write_text("{}")
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        summarize_checkpoint(d)


def test_a_store_is_summarised_like_its_checkpoint(tiny_model_dir, tmp_path):
    """`strata inspect STORE`: its experts and Engram tables come from the index (dense.safetensors holds only the
    rest), so layers, experts and every role's bytes equal the checkpoint's."""
    from strata.runtime.plan.checkpoints.convert import convert_checkpoint

    store = tmp_path / "store"
    convert_checkpoint(tiny_model_dir, store, progress=False)
    src, got = summarize_checkpoint(tiny_model_dir), summarize_checkpoint(store)
    assert got.moe_layers == src.moe_layers == 2 and got.num_layers == src.num_layers
    assert (got.experts_per_layer, got.expert_bytes) == (src.experts_per_layer, src.expert_bytes)
    assert got.bytes_by_role == src.bytes_by_role and got.total_bytes == src.total_bytes
    assert got.expert_layout == "store" and not got.notes
    assert "2 MoE, 1 dense" in format_summary(got)
