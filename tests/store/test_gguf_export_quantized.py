"""GGUF export with quantized experts (`write_gguf(experts=...)`, `strata demo-model --gguf TYPE`): the file holds
llama.cpp's Q4_K_M mix of the checkpoint's experts, quantized as gguf_quantize gives them, and the bf16 export's
dense tensors; strata reads it back (the store's blobs dequantize to what `gguf` dequantizes from the file) and
runs it as transformers runs the dequantized weights (fp32, 1e-4, same greedy tokens), for Qwen3-MoE (qwen3moe) and
DeepSeek-V3 (deepseek2: MLA's split kv_b, sigmoid router, shared expert, a dense layer). Where llama-cpp-python is
installed, llama.cpp loads the files and its log-probabilities are close to strata's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from strata import Engine
from strata.cli import main
from strata.errors import StrataError, UnsupportedError
from strata.runtime.demo import configs as demo_configs
from strata.runtime.demo import model as dm
from strata.tiers.store import gguf_export
from strata.tiers.store.gguf_export import write_gguf
from strata.tiers.store.gguf_mix import use_more_bits
from strata.tiers.store.gguf_quantize import quantize_rows
from strata.tiers.store.safetensors_index import TensorIndex
from strata.tiers.store.store import ExpertStore

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from llamacpp_site import llamacpp_site  # noqa: E402

ATOL = 1e-4
FP32 = {"dtype": "float32", "cpu_numerics": "gpu", "max_context": 256}
# a shrunk `bench` model (Qwen3-MoE) whose experts' rows (256 values) hold K-quant blocks; of its 2 layers, Q4_K_M
# gives layer 1's down projections Q6_K (use_more_bits: the last eighth) and layer 0's Q4_K
MINI = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8448, "num_experts": 8,
        "num_experts_per_tok": 2, "max_window_layers": 2, "max_position_embeddings": 4096}
PROJS = (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps"))


@pytest.fixture(scope="module")
def mini_qwen3(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setitem(demo_configs.BASE_CONFIGS, "bench", {**demo_configs.BASE_CONFIGS["bench"], **MINI})
    try:
        root = tmp_path_factory.mktemp("gguf_q")
        ckpt = dm.write_demo_model(root / "mini", "bench", progress=False, engram=False)
        yield ckpt, write_gguf(ckpt, root / "mini-q4_k_m.gguf", experts="q4_k_m", threads=2)
    finally:
        mp.undo()


def _tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _dequantized(t) -> torch.Tensor:
    """A GGUF tensor as `gguf` dequantizes it, in numpy (transformers') order."""
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return torch.from_numpy(np.array(w, dtype=np.float32)).reshape(tuple(reversed([int(d) for d in t.shape])))


def _stacked(index: TensorIndex, layer: int, proj: str, experts: int) -> torch.Tensor:
    return torch.stack([index.load(f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight")
                        for e in range(experts)]).float()


def test_q4_k_m_is_llamacpps_expert_mix_over_the_bf16_exports_dense_tensors(mini_qwen3, tmp_path):
    ckpt, path = mini_qwen3
    tensors = _tensors(path)
    bf16 = _tensors(write_gguf(ckpt, tmp_path / "bf16.gguf"))
    assert tensors.keys() == bf16.keys()
    fields = gguf.GGUFReader(path).fields
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    index = TensorIndex.from_dir(ckpt)
    layers = MINI["num_hidden_layers"]
    for layer in range(layers):
        for proj, name in PROJS:
            t = tensors[f"blk.{layer}.{name}.weight"]
            want = "Q6_K" if proj == "down" and layer == 1 else "Q4_K"
            assert t.tensor_type.name == want == ("Q6_K" if proj == "down" and use_more_bits(layer, layers) else "Q4_K")
            # the blocks are the quantizer's on the checkpoint's bf16 weights, stacked [E, rows, row bytes]
            blocks = quantize_rows(_stacked(index, layer, proj, MINI["num_experts"]).numpy(), want)
            assert np.array_equal(np.asarray(t.data).reshape(blocks.shape), blocks), (layer, proj)
    for name, t in bf16.items():  # everything else byte for byte as the bf16 export writes it
        if "_exps" not in name:
            assert tensors[name].tensor_type == t.tensor_type and np.array_equal(tensors[name].data, t.data), name
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "BF16"
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"


def test_strata_keeps_the_written_blocks(mini_qwen3, tmp_path):
    _, path = mini_qwen3
    store = tmp_path / "store"
    assert main(["convert", str(path), str(store)]) == 0
    tensors = _tensors(path)
    with ExpertStore.open(store) as s:
        assert len(s.keys()) == MINI["num_hidden_layers"] * MINI["num_experts"]
        for layer, expert in [(0, 0), (0, 5), (1, 3), (1, 7)]:
            gate_up, down = s.layout.matrices(s.read_expert((layer, expert)))
            want = [_dequantized(tensors[f"blk.{layer}.{name}.weight"])[expert] for _, name in PROJS]
            assert torch.equal(gate_up.dequantize(), torch.cat(want[:2]))
            assert torch.equal(down.dequantize(), want[2])


def test_bf16_dense_tensors_stay_bf16_so_the_cpu_computes_in_bf16(mini_qwen3, tmp_path):
    """A file whose dense tensors are BF16 (as this export and llama.cpp's bf16 files write them) keeps them BF16 in
    its store, bit for bit, so `runtime.dtype = "auto"` computes it in bf16 on the CPU as it does the checkpoint."""
    from safetensors import safe_open

    from strata.runtime.plan.footprint import read_footprint

    _, path = mini_qwen3
    assert read_footprint(path).cpu_dtype == "bfloat16"
    store = tmp_path / "store"
    assert main(["convert", str(path), str(store)]) == 0
    assert read_footprint(store).cpu_dtype == "bfloat16"
    tensors = _tensors(path)
    (dense,) = store.glob("dense*.safetensors")
    with safe_open(str(dense), "pt") as f:
        head = f.get_tensor("lm_head.weight")
    assert head.dtype == torch.bfloat16 and torch.equal(head.float(), _dequantized(tensors["output.weight"]))


def _reference(ckpt, path):
    """transformers in fp32 on the checkpoint, its routed experts replaced by the GGUF's, dequantized by `gguf`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    tensors = _tensors(path)
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            if f"blk.{layer}.ffn_gate_exps.weight" not in tensors:
                continue
            gate, up, down = (_dequantized(tensors[f"blk.{layer}.{name}.weight"]) for _, name in PROJS)
            mod = model.model.layers[layer].mlp.experts
            mod.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            mod.down_proj.copy_(down)
    return model


@torch.no_grad()
def _check_against_transformers(ckpt, path, tmp_path, vocab: int) -> torch.Tensor:
    model = _reference(ckpt, path)
    prompt = torch.randint(300, vocab, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    disk = {"path": str(tmp_path / "cache"), "scrub": False}
    for runtime in ({**FP32, "experts": "memory"}, FP32):
        with Engine.from_pretrained(path, device="cpu", config={"tiers": {"disk": disk}, "runtime": runtime}) as eng:
            ours = eng.score(prompt)
            assert (ours - ref).abs().max().item() < ATOL
            assert eng.generate(prompt, max_tokens=6, temperature=0.0).token_ids == ids[len(prompt):]
    return ours


def test_strata_on_the_q4_k_m_file_matches_transformers(mini_qwen3, tmp_path):
    ckpt, path = mini_qwen3
    _check_against_transformers(ckpt, path, tmp_path, 8000)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_ds")
    # llama.cpp's spelling of the type: --gguf takes either case
    assert main(["demo-model", str(root / "tiny"), "--size", "tiny", "--no-engram", "--gguf", "Q8_0"]) == 0
    return root / "tiny", root / "tiny" / "model-q8_0.gguf"


def test_deepseek_v3_exports_as_deepseek2_and_matches_transformers(tiny_deepseek, tmp_path):
    ckpt, path = tiny_deepseek
    tensors = _tensors(path)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "blk.0.ffn_gate_exps.weight" not in tensors and "blk.0.ffn_gate.weight" in tensors  # the dense layer
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type.name == "Q8_0"
    assert {"blk.1.attn_k_b.weight", "blk.1.exp_probs_b.bias", "blk.1.ffn_up_shexp.weight"} <= tensors.keys()
    assert "blk.1.attn_kv_b.weight" not in tensors
    fields = gguf.GGUFReader(path).fields
    assert fields["deepseek2.attention.head_count_kv"].contents() == 1  # MLA as MQA, as llama.cpp's converter
    assert fields["deepseek2.expert_gating_func"].contents() == gguf.ExpertGatingFuncType.SIGMOID
    assert fields["deepseek2.attention.key_length_mla"].contents() == cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    _check_against_transformers(ckpt, path, tmp_path, cfg["vocab_size"])


def test_demo_model_gguf_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "a"), "--size", "tiny", "--no-engram", "--gguf", "q4_k"]) == 2
    assert main(["demo-model", str(tmp_path / "a"), "--size", "tiny", "--gguf", "q8_0"]) == 2
    assert main(["demo-model", str(tmp_path / "a"), "--size", "tiny", "--arch", "glm4_moe", "--no-engram",
                 "--gguf", "bf16"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    assert "rows of 64 values do not split into Q4_K's 256-value blocks; export this model as q8_0 or bf16" in err[0]
    assert "llama.cpp does not run Engram layers; add --no-engram" in err[1]
    assert "--gguf writes qwen3_moe, deepseek_v3, deepseek_v2 models, not glm4_moe" in err[2]
    assert not (tmp_path / "a").exists()


def test_a_disk_without_room_is_one_line_before_writing(tiny_deepseek, tmp_path, monkeypatch):
    ckpt, _ = tiny_deepseek
    monkeypatch.setattr(gguf_export.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
    with pytest.raises(StrataError, match=r"the GGUF needs about 0\.00 GB but 0\.00 GB are free; free space") as e:
        write_gguf(ckpt, tmp_path / "x.gguf", experts="q8_0")
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


def _llamacpp_logprobs(path, ids: list[int], site) -> torch.Tensor:
    """llama.cpp's log-probabilities at every position of `ids`, in a process of its own."""
    code = ("import sys, json, numpy as np, llama_cpp\n"
            "ids = json.loads(sys.argv[2])\n"
            "llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=128, logits_all=True, verbose=False, n_threads=1)\n"
            "llm.eval(ids)\n"
            "np.save(sys.argv[3], np.asarray(llm.scores[: len(ids)], dtype=np.float32))\n")
    out = path.parent / "llama_logits.npy"
    env = {**os.environ, "PYTHONPATH": str(site)}
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(ids), str(out)], env=env, check=True,
                   capture_output=True, timeout=600)
    return torch.log_softmax(torch.from_numpy(np.load(out)), dim=-1)


@pytest.mark.parametrize("which", ["qwen3moe q4_k_m", "deepseek2 q8_0"])
def test_llamacpp_runs_the_exported_files(which, mini_qwen3, tiny_deepseek, tmp_path):
    site = llamacpp_site()
    if site is None:
        pytest.skip("llama-cpp-python is not installed (optional; bench/cpu/cpu_vs_llamacpp.py builds it)")
    path = mini_qwen3[1] if which.startswith("qwen3moe") else tiny_deepseek[1]
    ids = torch.randint(300, 500, (32,), generator=torch.Generator().manual_seed(2)).tolist()
    disk = {"path": str(tmp_path / "cache"), "scrub": False}
    with Engine.from_pretrained(path, device="cpu", config={"tiers": {"disk": disk}, "runtime": FP32}) as eng:
        ours = eng.score(ids)
    theirs = _llamacpp_logprobs(path, ids, site)
    diff = (theirs - ours).abs()
    # llama.cpp multiplies K-quant and Q8_0 blocks with activations rounded to 8 bits (its q8_K / q8_0 dot products)
    # and keeps an f16 KV cache: measured median 0.0010 / 0.0003, p99 0.004 / 0.010 nats, top-1 agreement 0.97 / 1;
    # a swapped or misplaced tensor moves the median past 0.05 (bench/cpu/cpu_vs_llamacpp.py's check)
    assert diff.median().item() < 0.005 and diff.quantile(0.99).item() < 0.03
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item() >= 0.9


def test_a_tensor_type_override_picks_any_tensors_type(tiny_deepseek, tmp_path):
    from strata.tiers.store.gguf_mix import tensor_types
    from strata.tiers.store.gguf_reader import GGUFFile

    ckpt, _ = tiny_deepseek
    mix = tensor_types("q8_0", 3)
    attention_q8 = lambda name, shape: "Q8_0" if name.endswith("attn_output.weight") else mix(name, shape)  # noqa: E731
    path = write_gguf(ckpt, tmp_path / "x.gguf", experts="q8_0", tensor_type=attention_q8)
    tensors = _tensors(path)
    assert tensors["blk.0.attn_output.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.attn_q_b.weight"].tensor_type.name == "BF16"
    want = TensorIndex.from_dir(ckpt).load("model.layers.0.self_attn.o_proj.weight").float()
    got = GGUFFile.open(path).read("blk.0.attn_output.weight")  # strata's reading, dequantized by gguf
    assert torch.equal(got, _dequantized(tensors["blk.0.attn_output.weight"]))
    assert 0 < (got - want).abs().max().item() < 0.01 * want.abs().max().item()
    with pytest.raises(UnsupportedError, match="blk.0.attn_output.weight: rows of 64 values do not split into Q4_K"):
        write_gguf(ckpt, tmp_path / "y.gguf", tensor_type=lambda n, s: "Q4_K" if "attn_output" in n else mix(n, s))
    assert not (tmp_path / "y.gguf").exists()
