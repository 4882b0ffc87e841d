"""The trained demo model shipped in the package: its files, strata against its trainable reference and
transformers, English out of it, a trained router's skew and locality, and the copies `demo-model` writes."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from strata import Engine
from strata.cli import main
from strata.errors import ConfigError
from strata.runtime.demo.model import MARKER, TRAINED_DIR, ensure_default_model, write_demo_model
from strata.runtime.demo.weights import tensor_specs
from strata.tiers.store.safetensors_index import TensorIndex

WORDS = Path(__file__).parents[1] / "data" / "demo_words.txt"  # the corpus's words (demo_train --words)
SHIPPED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "chat_template.jinja", MARKER, "training.json"}
SAMPLE = Path(__file__).parents[1] / "data" / "demo_sample.txt"  # Genesis 1 and twelve fortunes: the corpus's two styles


@pytest.fixture(scope="module")
def engine():
    """strata on the shipped model, every expert in memory, fp32 (the reference path)."""
    eng = Engine.from_pretrained(TRAINED_DIR, config={"runtime": {"experts": "memory", "dtype": "float32"}},
                                 device="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def words() -> set[str]:
    return set(WORDS.read_text().split())


def _english(text: str, words: set[str]) -> tuple[float, float, int]:
    """(share of printable ASCII characters, share of its words that are corpus words, distinct words)."""
    found = re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)*", text)
    ascii_share = sum(c.isascii() and (c.isprintable() or c in "\n") for c in text) / max(1, len(text))
    known = sum(w.lower() in words for w in found) / max(1, len(found))
    return ascii_share, known, len({w.lower() for w in found})


def test_shipped_files_are_complete_small_and_in_deepseek_names():
    files = {p.name: p.stat().st_size for p in TRAINED_DIR.iterdir()}
    assert set(files) == SHIPPED
    assert sum(files.values()) <= 20e6
    cfg = json.loads((TRAINED_DIR / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["n_routed_experts"] >= 16 and "engram" in cfg
    assert cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] >= 3  # several MoE layers
    index = TensorIndex.from_dir(TRAINED_DIR)
    specs = {t.name: t for t in tensor_specs(cfg)}  # the names and shapes of every demo checkpoint
    assert set(index.names()) == set(specs)
    for name, spec in specs.items():
        assert (index[name].dtype, tuple(index[name].shape)) == (spec.dtype, spec.shape), name
    assert json.loads((TRAINED_DIR / MARKER).read_text())["size"] == "demo"


def test_strata_matches_the_trainable_reference(engine):
    """strata's fp32 reference path against the model as it was trained (transformers' DeepSeek-V3 + Engram)."""
    from strata.runtime.demo.lm import load_checkpoint

    reference = load_checkpoint(TRAINED_DIR)
    ids = engine.tokenizer.encode("And the LORD said unto Moses, Speak unto the children of Israel",
                                  add_special_tokens=False)
    with torch.no_grad():
        want = torch.log_softmax(reference(torch.tensor([ids]))[0], dim=-1)
        greedy = list(ids)
        for _ in range(12):  # greedy by the definition: the whole sequence again at every step
            greedy.append(int(reference(torch.tensor([greedy]))[0, -1].argmax()))
    assert (engine.score(ids) - want).abs().max().item() < 1e-4
    assert engine.generate(ids, max_tokens=12, temperature=0.0).token_ids == greedy[len(ids):]


def test_transformers_loads_everything_but_the_engram_layers():
    from transformers import AutoModelForCausalLM

    from strata.runtime.demo.lm import load_checkpoint

    model, info = AutoModelForCausalLM.from_pretrained(TRAINED_DIR, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and not info["mismatched_keys"]
    assert {k for k in info["unexpected_keys"] if "engram" not in k} == set()  # Engram is strata's own
    trained = load_checkpoint(TRAINED_DIR).lm.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, trained[name]), name


def test_greedy_and_sampled_text_is_english(engine, words):
    """Corpus words, printable ASCII, not one word over and over: a random-weight model writes none of it."""
    for prompt, kwargs in (("The experts of a mixture", {"temperature": 0.0}),
                           ("And the LORD said unto Moses,", {"temperature": 0.0}),
                           ("And the LORD said unto Moses,", {"temperature": 0.8, "seed": 3})):
        text = engine.generate(prompt, max_tokens=48, **kwargs).text
        ascii_share, known, distinct = _english(text, words)
        assert ascii_share >= 0.98 and known >= 0.9 and distinct >= 12, (prompt, kwargs, text)


def test_chat_answers_and_stops(engine, words):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Who made the heaven and the earth?"}])
    out = engine.generate(engine.tokenizer.encode(prompt, add_special_tokens=False), max_tokens=96, temperature=0.0)
    assert out.finish_reason == "stop" and len(out.token_ids) < 96  # at <|im_end|>, before the token limit
    ascii_share, known, distinct = _english(out.text, words)
    assert ascii_share >= 0.98 and known >= 0.9 and distinct >= 4, out.text


def test_routing_is_skewed_local_and_uses_every_expert(engine):
    """On a text sample, against what a random-weight router of this shape gives (top eighth ~18%, consecutive
    tokens sharing ~k*k/E experts, as independent picks would): in every MoE layer the top eighth of the experts
    take over 22.5% of the routings and no expert is idle, and consecutive tokens share 1.4x chance or more."""
    routers = {i: layer.mlp.gate for i, layer in enumerate(engine.model.layers) if hasattr(layer.mlp, "gate")}
    picks: dict[int, list[torch.Tensor]] = {i: [] for i in routers}
    hooks = [r.register_forward_hook(lambda m, args, out, i=i: picks[i].append(out[1].cpu())) for i, r in routers.items()]
    try:
        engine.score(engine.tokenizer.encode(SAMPLE.read_text(), add_special_tokens=False))
    finally:
        for h in hooks:
            h.remove()
    cfg = engine.model.cfg
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    shared_per_layer = []
    for layer, chosen in picks.items():
        ids = torch.cat(chosen)  # [tokens, k]
        counts = Counter(ids.flatten().tolist())
        assert len(counts) == e, f"layer {layer}: experts {sorted(set(range(e)) - set(counts))} never chosen"
        top = sum(sorted(counts.values(), reverse=True)[: e // 8]) / ids.numel()
        assert top > 1.8 / 8, f"layer {layer}: the top eighth of the experts take only {top:.1%}"
        pairs = zip(ids[:-1].tolist(), ids[1:].tolist(), strict=True)
        shared_per_layer.append(sum(len(set(a) & set(b)) for a, b in pairs) / (len(ids) - 1))
    chance = k * k / e  # expected overlap of two independent k-of-E picks
    assert sum(shared_per_layer) / len(shared_per_layer) > 1.4 * chance, shared_per_layer


def test_default_model_is_the_shipped_one():
    assert ensure_default_model(progress=False) == TRAINED_DIR


def test_demo_model_writes_a_copy(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo-model", str(out)]) == 0  # --size demo is the default
    assert "trained demo model" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in TRAINED_DIR.iterdir()}
    assert write_demo_model(out, "demo", progress=False) == out  # the same model: kept as is
    with pytest.raises(ConfigError, match="different demo model"):
        write_demo_model(out, "tiny", progress=False)
    for option in ({"layers": 3}, {"seed": 1}, {"engram": False}, {"route_skew": "1"}):
        with pytest.raises(ConfigError, match="the demo model is trained"):
            write_demo_model(tmp_path / "other", "demo", progress=False, **option)
    assert main(["demo-model", str(tmp_path / "other"), "--layers", "3"]) == 2
    assert "--layers: the demo model is trained" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
