"""strata.tiers.store.gguf_export: a Qwen3-MoE checkpoint written as a bf16 GGUF holds the very same weights, under
llama.cpp's names and metadata keys, read back with llama.cpp's own reader (the `gguf` package)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from strata.errors import UnsupportedError
from strata.runtime.demo import configs as demo_configs
from strata.runtime.demo import model as dm
from strata.tiers.store.gguf_export import write_gguf
from strata.tiers.store.safetensors_index import TensorIndex

gguf = pytest.importorskip("gguf")

# a shrunk `bench` demo model (Qwen3-MoE); its vocab is larger than the tokenizer's, as Qwen's is
MINI = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8448, "num_experts": 8,
        "num_experts_per_tok": 2, "max_window_layers": 2, "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def mini_qwen3(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setitem(demo_configs.BASE_CONFIGS, "bench", {**demo_configs.BASE_CONFIGS["bench"], **MINI})
    try:
        root = tmp_path_factory.mktemp("gguf")
        yield dm.write_demo_model(root / "mini", "bench", progress=False, engram=False, route_skew=1.0)
    finally:
        mp.undo()


def _values(reader, key):
    field = reader.fields[key]
    return field.contents()


def test_the_gguf_holds_the_checkpoints_weights_under_llamacpp_names(mini_qwen3, tmp_path):
    out = write_gguf(mini_qwen3, tmp_path / "mini.gguf")
    reader = gguf.GGUFReader(out)
    arch = _values(reader, "general.architecture")
    assert arch == "qwen3moe"
    cfg = json.loads((mini_qwen3 / "config.json").read_text())
    assert _values(reader, "qwen3moe.block_count") == cfg["num_hidden_layers"]
    assert _values(reader, "qwen3moe.expert_count") == cfg["num_experts"]
    assert _values(reader, "qwen3moe.expert_used_count") == cfg["num_experts_per_tok"]
    assert _values(reader, "qwen3moe.expert_feed_forward_length") == cfg["moe_intermediate_size"]
    assert _values(reader, "qwen3moe.attention.key_length") == cfg["head_dim"]
    assert _values(reader, "qwen3moe.rope.freq_base") == cfg["rope_theta"]

    index = TensorIndex.from_dir(mini_qwen3)
    tensors = {t.name: t for t in reader.tensors}
    layers = cfg["num_hidden_layers"]
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    want = {"token_embd.weight", "output_norm.weight", "output.weight"}
    want |= {f"blk.{i}.{n}.weight" for i in range(layers) for n in per_layer}
    assert set(tensors) == want

    def values(name: str) -> torch.Tensor:
        t = tensors[name]
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            return torch.from_numpy(data.copy().view(np.int16)).view(torch.bfloat16).reshape(
                tuple(reversed([int(d) for d in t.shape])))
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        return torch.from_numpy(data.copy()).reshape(tuple(reversed([int(d) for d in t.shape])))

    assert torch.equal(values("token_embd.weight"), index.load("model.embed_tokens.weight"))
    assert torch.equal(values("output.weight"), index.load("lm_head.weight"))
    for i in range(layers):
        p = f"model.layers.{i}"
        assert torch.equal(values(f"blk.{i}.attn_q.weight"), index.load(f"{p}.self_attn.q_proj.weight"))
        assert torch.equal(values(f"blk.{i}.attn_output.weight"), index.load(f"{p}.self_attn.o_proj.weight"))
        # routers and norms in f32, as llama.cpp keeps them: bf16 widens exactly
        assert values(f"blk.{i}.ffn_gate_inp.weight").dtype == torch.float32
        assert torch.equal(values(f"blk.{i}.ffn_gate_inp.weight"), index.load(f"{p}.mlp.gate.weight").float())
        assert torch.equal(values(f"blk.{i}.attn_k_norm.weight"), index.load(f"{p}.self_attn.k_norm.weight").float())
        for proj, name in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            stacked = torch.stack([index.load(f"{p}.mlp.experts.{e}.{proj}_proj.weight")
                                   for e in range(cfg["num_experts"])])
            assert torch.equal(values(f"blk.{i}.{name}.weight"), stacked), (i, proj)


def test_the_vocabulary_is_padded_to_the_embedding(mini_qwen3, tmp_path):
    from tokenizers import Tokenizer

    reader = gguf.GGUFReader(write_gguf(mini_qwen3, tmp_path / "mini.gguf"))
    tokens = _values(reader, "tokenizer.ggml.tokens")
    types = _values(reader, "tokenizer.ggml.token_type")
    tok = Tokenizer.from_file(str(mini_qwen3 / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    assert len(tokens) == len(types) == MINI["vocab_size"] > size  # llama.cpp sizes the embedding by this list
    assert tokens[:size] == [tok.id_to_token(i) for i in range(size)]
    assert tokens[size:] == [f"[PAD{i}]" for i in range(size, MINI["vocab_size"])]
    assert types[0] == 3 and types[size - 1] == 4 and types[100] == 1 and set(types[size:]) == {5}  # control, user, ...
    assert _values(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(_values(reader, "tokenizer.ggml.merges")) > 1000
    config = json.loads((mini_qwen3 / "config.json").read_text())
    assert _values(reader, "tokenizer.ggml.eos_token_id") == config["eos_token_id"]


def test_refuses_what_llamacpp_would_not_run_the_same(tmp_path):
    glm = dm.write_demo_model(tmp_path / "glm", "tiny", progress=False, engram=False, arch="glm4_moe")
    with pytest.raises(UnsupportedError, match="handles Qwen3-MoE and DeepSeek-V3/V2 checkpoints"):
        write_gguf(glm, tmp_path / "x.gguf")
    engram = dm.write_demo_model(tmp_path / "tiny", "tiny", progress=False)
    with pytest.raises(UnsupportedError, match="Engram layers, which llama.cpp does not run"):
        write_gguf(engram, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
