"""`strata demo-model --route-skew`: routing popularity written into the weights (strata.runtime.demo.skew).

Measured by counting router choices on real forward passes: S > 0 is Zipf-like and ranked by the
written profile at every depth, "uniform" is near uniform, S = 0 is byte-for-byte the plain model,
and transformers (reading the same files) routes exactly as strata does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import strata.runtime.demo.configs as demo_configs
import strata.runtime.demo.model as dm
from strata import Engine
from strata.cli import build_parser
from strata.errors import ConfigError
from strata.runtime.demo.skew import RouteSkew, check_skew, expert_ranks
from strata.runtime.model.routing_stats import (
    count_routing,
    lookahead_recall,
    popularity_summary,
    record_choices,
    record_lookahead,
    temporal_overlap,
)

# Qwen3-MoE as the `bench` size writes it, shrunk so a CPU test can run it (128 experts, top-8 kept).
MINI_QWEN3 = {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 16, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8448,
              "max_window_layers": 4, "max_position_embeddings": 4096}
TOKENS = 384


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _prompt(vocab: int, n: int = TOKENS) -> list[int]:
    return torch.randint(3, vocab - 1, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def mini_bench(tmp_path_factory):
    """write(route_skew) -> directory of a shrunk `bench` (Qwen3-MoE) demo model."""
    root = tmp_path_factory.mktemp("skew")
    mp = pytest.MonkeyPatch()
    mp.setitem(demo_configs.BASE_CONFIGS, "bench", {**demo_configs.BASE_CONFIGS["bench"], **MINI_QWEN3})

    def write(skew, locality=0.0):
        return dm.write_demo_model(root / f"bench-{skew}-{locality}", "bench", progress=False, engram=False,
                                   route_skew=skew, route_locality=locality)

    yield write
    mp.undo()


def _measure(directory: Path, num_experts: int, vocab: int) -> dict[int, torch.Tensor]:
    engine = Engine.from_pretrained(directory, config={"runtime": {"experts": "memory"}}, device="cpu")
    with count_routing(engine.model, num_experts) as counts:
        engine.score(_prompt(vocab))
    return counts


def test_zero_skew_is_the_plain_model_byte_for_byte(tmp_path):
    plain = dm.write_demo_model(tmp_path / "plain", "tiny", progress=False, engram=False)
    zero = dm.write_demo_model(tmp_path / "zero", "tiny", progress=False, engram=False, route_skew=0)
    skewed = dm.write_demo_model(tmp_path / "skewed", "tiny", progress=False, engram=False, route_skew=1)
    assert _hashes(plain) == _hashes(zero)
    assert "route_skew" not in (plain / dm.MARKER).read_text()  # directories written before still match
    a, b = _hashes(plain), _hashes(skewed)
    assert a["model.safetensors"] != b["model.safetensors"] and a["tokenizer.json"] == b["tokenizer.json"]
    assert _hashes(dm.write_demo_model(tmp_path / "again", "tiny", progress=False, engram=False, route_skew=1)) == b
    with pytest.raises(ConfigError, match="different demo model"):  # the marker tells skews apart
        dm.write_demo_model(skewed, "tiny", progress=False, engram=False, route_skew=2)


def test_skew_values_are_validated():
    assert check_skew(0) == 0.0 and check_skew("1.5") == 1.5 and check_skew("Uniform") == "uniform"
    for bad in (-0.5, 4.5, "lots", True, None, float("nan")):
        with pytest.raises(ConfigError, match="--route-skew"):
            check_skew(bad)
    args = build_parser().parse_args(["demo-model", "d", "--size", "bench", "--route-skew", "1.2"])
    assert check_skew(args.route_skew) == 1.2


def test_profile_is_a_per_layer_permutation():
    a, b = expert_ranks(0, 1, 128), expert_ranks(0, 2, 128)
    assert sorted(a.tolist()) == list(range(1, 129)) and not torch.equal(a, b)
    assert torch.equal(a, expert_ranks(0, 1, 128)) and not torch.equal(a, expert_ranks(1, 1, 128))
    cfg = dm.demo_config("tiny", engram=False)
    skew = RouteSkew.for_config(cfg, 1.0, 0)
    router = skew.apply("model.layers.1.mlp.gate.weight", torch.zeros(16, 64))
    col = router[:, skew.channel]
    assert col.argmax() == int((expert_ranks(0, 1, 16) == 1).nonzero()) and (col <= 0).all()
    assert router[:, [i for i in range(64) if i != skew.channel]].abs().sum() == 0
    with pytest.raises(ValueError):
        RouteSkew.for_config(cfg, 0, 0)


@pytest.mark.parametrize("skew", [1.0, 2.0])
def test_qwen3_skew_is_zipf_like_at_every_layer(mini_bench, skew):
    counts = _measure(mini_bench(skew), 128, MINI_QWEN3["vocab_size"])
    s = popularity_summary(counts)
    # uniform: the 40% most popular take 40%; S=1 calibrates to ~92% (top-8 of 128), S=2 to ~99%
    assert s["top40pct_share"] > (0.85 if skew == 1 else 0.95), s
    assert s["top10pct_share"] > (0.5 if skew == 1 else 0.75), s
    assert s["top1_vs_uniform"] > 8, s
    for layer, c in counts.items():
        per_layer = popularity_summary({layer: c})
        assert abs(per_layer["top40pct_share"] - s["top40pct_share"]) < 0.06, (layer, per_layer)  # same at all depths
        # ranked as written: the profile's favourites are the measured favourites
        ranks = expert_ranks(0, layer, 128)
        favourites = c.argsort(descending=True)[:12]  # the 10% most used
        assert (ranks[favourites] <= 24).all(), (layer, ranks[favourites].tolist())


def test_uniform_and_plain_routing(mini_bench):
    uniform = popularity_summary(_measure(mini_bench("uniform"), 128, MINI_QWEN3["vocab_size"]))
    assert uniform["top40pct_share"] < 0.55 and uniform["top1_vs_uniform"] < 2.5, uniform  # sampling noise only
    skewed = popularity_summary(_measure(mini_bench(1.0), 128, MINI_QWEN3["vocab_size"]))
    assert skewed["top40pct_share"] > uniform["top40pct_share"] + 0.3


def test_deepseek_skew(tmp_path):
    vocab = dm.demo_config("tiny", engram=False)["vocab_size"]
    skewed = popularity_summary(_measure(
        dm.write_demo_model(tmp_path / "s", "tiny", progress=False, engram=False, route_skew=2), 16, vocab))
    uniform = popularity_summary(_measure(
        dm.write_demo_model(tmp_path / "u", "tiny", progress=False, engram=False, route_skew="uniform"), 16, vocab))
    # top-4 of 16 experts: a layer's 4 favourites can take at most 100%, uniform gives them 25%
    assert uniform["top25pct_share"] < 0.35 < 0.6 < skewed["top25pct_share"], (uniform, skewed)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe+locality", "deepseek_v3"])
def test_transformers_routes_a_skewed_checkpoint_as_strata_does(arch, mini_bench, tmp_path):
    from transformers import AutoModelForCausalLM

    if arch.startswith("qwen3_moe"):
        directory = mini_bench(1.0, 1.0 if arch.endswith("locality") else 0.0)
        experts, vocab = 128, MINI_QWEN3["vocab_size"]
    else:
        directory = dm.write_demo_model(tmp_path / "t", "tiny", progress=False, engram=False, route_skew=1.0)
        experts, vocab = 16, dm.demo_config("tiny", engram=False)["vocab_size"]
    prompt = _prompt(vocab, 96)
    engine = Engine.from_pretrained(directory, config={"runtime": {"experts": "memory", "dtype": "float32"}},
                                    device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with count_routing(engine.model, experts) as ours, count_routing(hf, experts) as theirs:
        got = engine.score(prompt)
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert set(ours) == set(theirs) and len(ours) >= 2
    for layer in ours:
        assert torch.equal(ours[layer], theirs[layer]), layer
    assert (got - ref).abs().max() < 1e-4
    assert ref.std() > 0.05  # the final norm restored logits of the usual size (not all ~equal)
    ids = list(prompt[:16])
    for _ in range(8):  # greedy by definition: full forward at every step
        ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert engine.generate(prompt[:16], max_tokens=8).token_ids == ids[16:]


@pytest.mark.parametrize("skew", [1.0, "uniform"])
def test_next_layer_prediction_on_the_bench_checkpoints(mini_bench, skew):
    """The lookahead prefetcher's prediction (layer j's norm and router on the hidden state leaving layer j - 1)
    names nearly every expert the layer then picks on the skew-channel checkpoints the suite runs: their layers
    write small updates into a stream the skew channel normalises, so it changes little from layer to layer.
    The control, layer j - 1's own router standing in for layer j's, is near chance (8 of 128): the routers differ."""
    engine = Engine.from_pretrained(mini_bench(skew), config={"runtime": {"experts": "memory"}}, device="cpu")
    with record_lookahead(engine.model, (1, 2)) as rec:
        engine.score(_prompt(MINI_QWEN3["vocab_size"], 128))
    one, two = lookahead_recall(rec, 128, 1), lookahead_recall(rec, 128, 2)
    assert one["lookups"] == 3 * 128 * 8 and two["lookups"] == 2 * 128 * 8
    assert one["recall"] > 0.9 and one["cold_recall"] > 0.85 and two["recall"] > 0.85, (one, two)
    wrong = {"actual": rec["actual"], "predicted": {(j, 1): rec["actual"][j - 1] for j in range(1, 4)}}
    assert lookahead_recall(wrong, 128, 1)["recall"] < 0.2  # measured 0.07 on both


def _overlaps(directory: Path) -> tuple[list[dict], dict]:
    """Per layer `temporal_overlap` and the popularity summary over four 128-token prompts."""
    engine = Engine.from_pretrained(directory, config={"runtime": {"experts": "memory"}}, device="cpu")
    vocab = MINI_QWEN3["vocab_size"]
    with record_choices(engine.model) as choices:
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            engine.score(torch.randint(3, vocab - 1, (128,), generator=g).tolist())
    counts = {layer: torch.bincount(torch.cat(c).reshape(-1), minlength=128) for layer, c in choices.items()}
    return [temporal_overlap(c, 128) for c in choices.values()], popularity_summary(counts)


def test_route_locality_adds_temporal_locality_and_keeps_the_popularity(mini_bench):
    """--route-locality L: consecutive tokens share experts beyond what popularity explains (measured 0.49-0.52
    against 0.31-0.34 at L = 1 on this shape), at every depth, while the popularity profile keeps its calibration
    (the routers' profile column grows with the stream's token part). Without it reuse is popularity alone."""
    plain, plain_pop = _overlaps(mini_bench(1.0))
    local, local_pop = _overlaps(mini_bench(1.0, 1.0))
    for o in plain:
        assert abs(o["consecutive"] - o["independent"]) < 0.04, plain
    for o in local:
        assert o["consecutive"] > o["independent"] + 0.1, local
    assert abs(local_pop["top40pct_share"] - plain_pop["top40pct_share"]) < 0.03, (plain_pop, local_pop)


def test_route_locality_is_validated(tmp_path):
    from strata.runtime.demo.skew import check_locality

    assert check_locality("0.5") == 0.5 and check_locality(0) == 0.0
    for bad in (-1, 5, "much", True, None, float("nan")):
        with pytest.raises(ConfigError, match="--route-locality"):
            check_locality(bad)
    with pytest.raises(ConfigError, match="--route-skew too"):
        dm.write_demo_model(tmp_path / "a", "tiny", progress=False, engram=False, route_locality=1.0)
    with pytest.raises(ConfigError, match="Qwen3-MoE"):  # the tiny demo model is DeepSeek-V3-shaped
        dm.write_demo_model(tmp_path / "b", "tiny", progress=False, engram=False, route_skew=1.0, route_locality=1.0)
    cfg = dm.demo_config("bench", 4, engram=False)
    skew = RouteSkew.for_config(cfg, 1.0, 0, 1.0)
    assert 10 < skew.recency_window < 40 and len(skew.recency_pairs) >= 2  # 19 tokens at the bench shape, 33 here
    args = build_parser().parse_args(["demo-model", "d", "--size", "bench", "--route-skew", "1", "--route-locality", "1"])
    assert check_locality(args.route_locality) == 1.0
