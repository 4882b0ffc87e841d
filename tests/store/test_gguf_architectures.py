"""GGUF files of qwen2moe, deepseek2 (DeepSeek-V3's MLA as llama.cpp writes it) and llama with experts (Mixtral),
and a split file, against transformers on the same weights dequantized by `gguf` (fp32, CPU): log-probabilities
within 1e-4 and identical greedy tokens, in memory and through the tiers; the Mixtral file's SentencePiece vocabulary
rebuilt into the engine's tokenizer encodes as the original."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.kernels.quant import ExpertFormat

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_arch_models import build_arch_gguf  # noqa: E402
from gguf_models import VOCAB  # noqa: E402

ATOL = 1e-4
FP32 = {"dtype": "float32", "cpu_numerics": "gpu", "max_context": 256}
QWEN2 = {0: ("Q4_K", "Q5_K", "Q6_K"), 1: ("Q2_K", "Q3_K", "Q8_0")}


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _check(model, path, tmp_path, want: ExpertFormat) -> Engine:
    """The checks above; the in-memory engine."""
    prompt = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = _greedy(model, prompt, 6)
    disk = {"path": str(tmp_path / "cache"), "scrub": False}
    memory = Engine.from_pretrained(path, device="cpu", config={"tiers": {"disk": disk},
                                                                 "runtime": {**FP32, "experts": "memory"}})
    assert (memory.score(prompt) - ref).abs().max().item() < ATOL
    assert memory.generate(prompt, max_tokens=6, temperature=0.0).token_ids == expected
    cfg = {"runtime": FP32, "tiers": {"pinned": {"budget": "300KiB"}, "disk": disk}}
    with Engine.from_pretrained(path, device="cpu", config=cfg) as tiered:
        assert tiered.tiers.store.expert_format == want
        assert (tiered.score(prompt) - ref).abs().max().item() < ATOL
        assert tiered.generate(prompt, max_tokens=6, temperature=0.0).token_ids == expected
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk
    return memory


def test_qwen2moe_with_its_shared_expert_and_gate(tmp_path):
    model, path = build_arch_gguf(tmp_path / "gguf", "qwen2moe", QWEN2)
    _check(model, path, tmp_path, ExpertFormat("gguf", ggml=(("Q4_K", "Q2_K"), ("Q5_K", "Q3_K"), ("Q6_K", "Q8_0"))))


def test_deepseek_v3_mla_split_kv_b_and_sigmoid_router(tmp_path):
    model, path = build_arch_gguf(tmp_path / "gguf", "deepseek2", {1: ("Q4_K", "Q2_K", "IQ4_XS"),
                                                                   2: ("Q6_K", "Q4_K", "Q4_K")}, seed=3)
    _check(model, path, tmp_path, ExpertFormat("gguf", ggml=(("Q4_K", "Q6_K"), ("Q2_K", "Q4_K"), ("IQ4_XS", "Q4_K"))))


def test_mixtral_as_llama_with_experts_and_its_sentencepiece_vocabulary(tmp_path):
    from tokenizers import Tokenizer

    model, path = build_arch_gguf(tmp_path / "gguf", "llama", {0: ("Q3_K", "Q3_K", "Q4_K"), 1: ("Q6_K", "Q5_K", "Q2_K")},
                                  seed=4, sentencepiece=True)
    engine = _check(model, path, tmp_path, ExpertFormat("gguf", ggml=(("Q3_K", "Q6_K"), ("Q3_K", "Q5_K"),
                                                                      ("Q4_K", "Q2_K"))))
    original = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    for text in ("Hello world", "  leading spaces,\nnewlines\n", "München 🙂 東京 unseen ☃", "<s>[INST] hi </s>"):
        ids = original.encode(text).ids
        assert engine.tokenizer.encode(text) == ids
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == original.decode(ids)
    assert engine.tokenizer.add_bos_token and engine.tokenizer.eos_token_ids == {2}


def test_a_split_file_from_any_of_its_parts(tmp_path):
    model, first = build_arch_gguf(tmp_path / "gguf", "qwen2moe", QWEN2, seed=5, split_max_tensors=20)
    parts = sorted(first.parent.glob("tiny-qwen2moe-*-of-*.gguf"))
    assert [p.name for p in parts] == ["tiny-qwen2moe-00001-of-00002.gguf", "tiny-qwen2moe-00002-of-00002.gguf"]
    _check(model, parts[1], tmp_path, ExpertFormat("gguf", ggml=(("Q4_K", "Q2_K"), ("Q5_K", "Q3_K"), ("Q6_K", "Q8_0"))))
