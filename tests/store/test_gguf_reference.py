"""GGUF files read by strata against transformers running the same weights dequantized by `gguf` (fp32, CPU):
log-probabilities within 1e-4 and identical greedy tokens, experts kept in their ggml blocks (mixed per tensor and
per layer) in memory and through the tiers; the tokenizer rebuilt from the file's metadata encodes as the original."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.errors import CheckpointError, UnsupportedError
from strata.kernels.quant import ExpertFormat

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_models import VOCAB, build_qwen3_gguf  # noqa: E402

ATOL = 1e-4
FP32 = {"dtype": "float32", "cpu_numerics": "gpu", "max_context": 256}
TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q3_K", "IQ4_XS")]  # Q5_K and Q8_0: the next file


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen3_gguf(tmp_path_factory.mktemp("gguf"), TYPES)


@pytest.fixture(scope="module")
def qwen3_q5(tmp_path_factory):
    return build_qwen3_gguf(tmp_path_factory.mktemp("gguf5"), [("Q5_K", "Q5_K", "Q8_0"), ("Q8_0", "Q8_0", "Q5_K")], 1)


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _check(model, path, tmp_path, want: ExpertFormat) -> None:
    prompt = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = _greedy(model, prompt, 6)
    disk = {"path": str(tmp_path / "cache"), "scrub": False}
    memory = Engine.from_pretrained(path, device="cpu", config={"tiers": {"disk": disk},
                                                                 "runtime": {**FP32, "experts": "memory"}})
    ours = memory.score(prompt)
    assert (ours - ref).abs().max().item() < ATOL
    assert memory.generate(prompt, max_tokens=6, temperature=0.0).token_ids == expected
    cfg = {"runtime": FP32, "tiers": {"pinned": {"budget": "600KiB"}, "disk": disk}}
    with Engine.from_pretrained(path, device="cpu", config=cfg) as tiered:
        assert tiered.tiers.store.expert_format == want
        assert (tiered.score(prompt) - ref).abs().max().item() < ATOL
        assert tiered.generate(prompt, max_tokens=6, temperature=0.0).token_ids == expected
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk


def test_k_quant_experts_match_transformers_through_the_tiers(qwen3, tmp_path):
    model, path = qwen3
    _check(model, path, tmp_path, ExpertFormat("gguf", ggml=(("Q4_K", "Q2_K"), ("Q4_K", "Q3_K"), ("Q6_K", "IQ4_XS"))))


def test_q5_k_and_q8_0_experts(qwen3_q5, tmp_path):
    model, path = qwen3_q5
    _check(model, path, tmp_path, ExpertFormat("gguf", ggml=(("Q5_K", "Q8_0"), ("Q5_K", "Q8_0"), ("Q8_0", "Q5_K"))))


def test_the_tokenizer_from_the_metadata_encodes_as_the_original(qwen3):
    from tokenizers import Tokenizer

    from strata.tiers.store.gguf_reader import GGUFFile
    from strata.tiers.store.gguf_tokenizer import tokenizer_json

    _, path = qwen3
    original = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    rebuilt = Tokenizer.from_str(tokenizer_json(GGUFFile.open(path).fields, str(path)))
    text = ("<|im_start|>user\nHello there, how's the weather  today?\n\t 12345 <think>ok</think><|im_end|>"
            " Ünïcödé, emoji 🙂 and   spaces")
    assert rebuilt.encode(text).ids == original.encode(text).ids
    assert rebuilt.decode(original.encode(text).ids, skip_special_tokens=False) == text


def test_bad_files_are_one_line_errors(qwen3, tmp_path):
    from strata.tiers.store.gguf_reader import GGUFFile

    _, path = qwen3
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cut.gguf: not a complete GGUF file") as e:
        GGUFFile.open(cut)
    assert "\n" not in str(e.value)
    w = gguf.GGUFWriter(tmp_path / "other.gguf", "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedError, match="GGUF architecture 'mamba' is not one strata runs"):
        GGUFFile.open(tmp_path / "other.gguf")
    f = GGUFFile.open(path)
    f.hf_config["moe_intermediate_size"] = 512  # the metadata disagrees with the tensors
    with pytest.raises(CheckpointError, match="'blk.0.ffn_gate_exps.weight' has shape"):
        f.experts(0)
