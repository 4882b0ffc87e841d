"""The embedded demo model: real HF layout (transformers loads it), determinism, sharding, atomicity, tokenizer."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import strata.runtime.demo.model as dm
from strata.errors import ConfigError, StrataError
from strata.runtime.demo.model import (
    DEMO_SIZES,
    demo_config,
    expected_bytes,
    write_demo_model,
)
from strata.runtime.demo.tokenizer import (
    SPECIAL_TOKENS,
    THINK_TOKENS,
    build_tokenizer,
    render_chat,
    tokenizer_json,
)
from strata.runtime.demo.weights import tensor_seed, tensor_specs
from strata.tiers.store.safetensors_index import TensorIndex


def _file_hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="module")
def tiny_sharded(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny", progress=False, max_shard_bytes=200_000)


# --- transformers loads the very same files --------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "tiny_sharded"])
def test_transformers_loads_without_missing_or_unexpected_keys(which, request):
    d = request.getfixturevalue(which)
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    # Engram tensors are strata's own (transformers has no Engram layers): the only keys it does not know
    assert info["missing_keys"] == set() and {k for k in info["unexpected_keys"] if "engram." not in k} == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    logits = model(torch.tensor([[1, 5, 42, 300, 2]])).logits
    assert logits.shape == (1, 5, 512) and torch.isfinite(logits).all()
    # a per-expert tensor on disk is exactly the slice transformers fused into gate_up_proj [E, 2I, H]
    on_disk = TensorIndex.from_dir(d).load("model.layers.1.mlp.experts.3.up_proj.weight")
    fused = model.model.layers[1].mlp.experts.gate_up_proj[3, 32:]
    assert torch.equal(fused.to(torch.bfloat16), on_disk)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def _hf_expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names/shapes of the transformers model, fused expert params split back per expert."""
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        prefix = name.rsplit("experts.", 1)[0] + "experts."
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows then up rows
            e, two_i, h = t.shape
            for k in range(e):
                out[f"{prefix}{k}.gate_proj.weight"] = out[f"{prefix}{k}.up_proj.weight"] = (two_i // 2, h)
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for k in range(t.shape[0]):
                out[f"{prefix}{k}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            out[name] = tuple(t.shape)
    return out


@pytest.mark.parametrize("size,layers", [("tiny", None), ("small", None), ("bench", 2)])
def test_tensor_names_and_shapes_match_transformers(size, layers):
    cfg = demo_config(size, layers)
    ours = {t.name: t.shape for t in tensor_specs(cfg)}
    assert len(ours) == len(tensor_specs(cfg))  # no duplicate names
    assert {k: v for k, v in ours.items() if "engram." not in k} == _hf_expected_shapes(cfg)  # Engram: strata's own
    assert any("engram." in k for k in ours) and "engram" in cfg
    # every tensor gets its own random stream
    seeds = [tensor_seed(0, t.name) for t in tensor_specs(cfg)]
    assert len(set(seeds)) == len(seeds)


def test_tokenizer_loads_in_transformers_and_chat_template_matches(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    gen = json.loads((tiny / "generation_config.json").read_text())
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert (eot, tok.convert_tokens_to_ids("<|im_start|>"), im_end) == (0, 1, 2)
    assert cfg["eos_token_id"] == im_end == tok.eos_token_id
    assert gen["eos_token_id"] == [im_end, eot] and cfg["bos_token_id"] == eot == tok.bos_token_id
    assert len(tok) <= cfg["vocab_size"]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime <think>two?</think> please."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another, in Français ✓"},
    ]
    for add in (False, True):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert text == render_chat(messages, add)
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add, return_dict=False)
        assert list(ids) == build_tokenizer(512).encode(text).ids
    assert tok("plain text").input_ids == build_tokenizer(512).encode("plain text").ids  # no BOS added
    # <think> tokens are regular: they survive skip_special_tokens, <|im_end|> does not
    ids = tok("a<think>b</think>c<|im_end|>").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>c"


# --- determinism ------------------------------------------------------------------------------------


def test_two_writes_are_byte_identical_and_seed_changes_weights(tiny, tmp_path):
    again = write_demo_model(tmp_path / "again", "tiny", progress=False, workers=1)  # other thread count too
    other = write_demo_model(tmp_path / "seed1", "tiny", seed=1, progress=False)
    a, b, c = _file_hashes(tiny), _file_hashes(again), _file_hashes(other)
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"] and a["config.json"] == c["config.json"]


def test_sharded_and_single_file_hold_identical_tensors(tiny, tiny_sharded):
    index = json.loads((tiny_sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tiny_sharded.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tiny_sharded / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # the real safetensors reader agrees with the index
        with safe_open(tiny_sharded / shard, "pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == shard}
    single, sharded = TensorIndex.from_dir(tiny), TensorIndex.from_dir(tiny_sharded)
    assert set(single.names()) == set(sharded.names()) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(single[n].nbytes for n in single.names()) == expected_bytes("tiny")
    for name in single.names():
        assert torch.equal(single.load(name), sharded.load(name)), name


def test_tokenizer_training_is_deterministic_across_processes():
    code = "import sys; from strata.runtime.demo.tokenizer import tokenizer_json; sys.stdout.write(tokenizer_json(512))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out == tokenizer_json(512) == tokenizer_json.__wrapped__(512)


# --- configs and sizes ------------------------------------------------------------------------------


def test_bench_config_is_qwen3_30b_a3b():
    cfg = demo_config("bench")
    want = {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_size": 2048,
        "moe_intermediate_size": 768, "intermediate_size": 6144, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1e6,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }  # fmt: skip
    assert {k: cfg[k] for k in want} == want
    assert 60e9 < expected_bytes("bench") < 62e9  # ~61 GB in bf16, like the real checkpoint


def test_layers_override_and_validation():
    for size in DEMO_SIZES:
        assert demo_config(size, layers=2)["num_hidden_layers"] == 2
    assert demo_config("bench", layers=3)["max_window_layers"] == 3
    assert demo_config("tiny")["num_hidden_layers"] == 3
    for bad in (0, 1, -2, True, "3"):  # deepseek sizes need >= 2 layers (layer 0 is dense)
        with pytest.raises(ConfigError):
            demo_config("tiny", layers=bad)
    with pytest.raises(ConfigError, match="unknown demo model size"):
        demo_config("huge")


def test_small_is_a_few_hundred_megabytes():
    cfg = demo_config("small")
    assert cfg["model_type"] == "deepseek_v3" and cfg["n_routed_experts"] >= 64 and cfg["n_shared_experts"] == 1
    assert 300e6 <= expected_bytes("small") <= 600e6
    assert expected_bytes("small", layers=2) < expected_bytes("small")


def test_every_weight_is_bf16_except_the_router_bias():
    for t in tensor_specs(demo_config("small")):
        f32 = t.name.endswith(("e_score_correction_bias", "engram.token_map"))  # token_map: integer ids, exact in F32
        assert t.dtype == ("F32" if f32 else "BF16"), t.name


# --- atomicity and existing directories ---------------------------------------------------------------


def test_crash_mid_write_leaves_no_directory(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = dm.make_tensor

    def flaky(spec, seed, std):
        calls["n"] += 1
        if calls["n"] == 20:
            raise RuntimeError("disk on fire")
        return real(spec, seed, std)

    monkeypatch.setattr(dm, "make_tensor", flaky)
    out = tmp_path / "model"
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_demo_model(out, "tiny", progress=False)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary sibling is gone too


def test_existing_directories(tiny, tmp_path):
    before = _file_hashes(tiny)
    assert write_demo_model(tiny, "tiny", progress=False) == tiny  # same model: returned as is
    assert _file_hashes(tiny) == before
    with pytest.raises(ConfigError, match="different demo model"):
        write_demo_model(tiny, "tiny", layers=2, progress=False)
    with pytest.raises(ConfigError, match="different demo model"):
        write_demo_model(tiny, "tiny", seed=5, progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(StrataError, match="not a strata demo model"):
        write_demo_model(busy, "tiny", progress=False)
    assert (busy / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (write_demo_model(empty, "tiny", progress=False) / "config.json").exists()


def test_stale_temporary_dirs_are_cleaned(tmp_path):
    stale = tmp_path / ".m.tmp-999999999-deadbeef"  # no such pid
    stale.mkdir()
    write_demo_model(tmp_path / "m", "tiny", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# --- tokenizer --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [512, 8192])
def test_tokenizer_round_trips_unicode_and_special_tokens_are_single_ids(vocab):
    tok = build_tokenizer(vocab)
    assert tok.get_vocab_size() == vocab
    texts = [
        "Hello, world!",
        "  leading spaces and\ttabs\nnewlines\r\n",
        "naïve café — “quotes” … ß ẞ",
        "日本語のテキスト、中文，한국어",
        "emoji 🙂🚀 family 👨‍👩‍👧 flags 🇫🇷",
        "combining e\u0301 and zero\u200bwidth, control \x00\x07\x1b",
        "math ∑ x² ≤ ∞, code: def f(x): return x**2",
        "<|im_start|>not a role",
    ]
    g = torch.Generator().manual_seed(0)  # plus random code points from all planes (no surrogates)
    for _ in range(20):
        cps = torch.randint(1, 0x10FFFF, (40,), generator=g).tolist()
        texts.append("".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF))
    for text in texts:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    for special in SPECIAL_TOKENS + THINK_TOKENS:
        assert len(tok.encode(special).ids) == 1
        assert len(tok.encode(f"x {special} y").ids) == len(tok.encode("x  y").ids) + 1
