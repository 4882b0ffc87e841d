"""The prefix cache: a request served from another slot's rows gives the tokens (and logits) computed without them.

For every attention strata runs (GQA: Qwen3 with q/k norms, Qwen2 with biases and a sliding window, Mixtral; MLA:
DeepSeek-V3's latent cache, and the demo model's MLA with Engram layers), greedy requests whose prompt shares a
prefix with a finished request, with a running one, with part of one, or lies inside one, are compared with the
same request computed whole (`prefix_cache=False`): same tokens, top log-probabilities within fp32 tolerance, and
bit-identical ones for reproducible requests. The prompts are chunked in 16-token passes, so a prefix also ends
inside a pass.
"""

from __future__ import annotations

import pytest
import torch

from reference_models import VOCAB, build_reference
from strata import Engine
from strata.runtime.generation.prefix_cache import common_prefix
from strata.runtime.generation.requests import GenRequest
from strata.runtime.generation.sampler import SamplingParams

CHUNK = 16
ATOL = 2e-4  # log-probabilities, fp32: another chunking rounds differently
MODELS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "demo_engram")


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_model_dir):
    """One engine per model, built on first use: fp32 on the CPU, 16-token prompt passes, two running slots."""
    made: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in made:
            if name == "demo_engram":
                directory = tiny_model_dir
            else:  # Qwen2 with its long-context variant: a 256-token sliding window
                _, directory = build_reference(name, tmp_path_factory.mktemp(name) / name, long=name == "qwen2_moe")
            engine = Engine.from_pretrained(
                directory, config={"runtime": {"max_context": 1024, "prefill_chunk": CHUNK, "dtype": "float32"}},
                device="cpu")
            engine.scheduler(max_batch=2, token_budget=CHUNK).start()
            made[name] = engine
        return made[name]

    yield get
    for engine in made.values():
        engine.close()


def ids(n: int, seed: int, vocab: int = VOCAB - 2) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, prompt: list[int], n: int = 8, cache: bool = True, reproducible: bool = False):
    """(tokens, top-5 log-probabilities per token, cached_tokens) of a greedy request."""
    h = engine.scheduler().submit(GenRequest(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                             logprobs=5, prefix_cache=cache, reproducible=reproducible))
    events = list(h.iter_events(timeout=300))
    assert events[-1].finish_reason == "length", events[-1].error
    toks = [e for e in events if e.token_id is not None]
    return [e.token_id for e in toks], [e.top_logprobs for e in toks], events[-1].cached_tokens


def assert_same(with_cache, without, exact: bool = False) -> None:
    tokens, tops, _ = with_cache
    ref_tokens, ref_tops, cached = without
    assert cached == 0
    assert tokens == ref_tokens
    for top, ref in zip(tops, ref_tops, strict=True):
        assert [i for i, _ in top] == [i for i, _ in ref]
        diff = max(abs(a - b) for (_, a), (_, b) in zip(top, ref, strict=True))
        assert diff == 0.0 if exact else diff < ATOL, f"top log-probabilities differ by {diff:.2e}"


def vocab_of(engine: Engine) -> int:
    return min(engine.checkpoint.config.vocab_size, VOCAB) - 2


def assert_reproducible_follow_up_exact(e: Engine) -> list[int]:
    """A reproducible request, then a follow-up resending it with its answer: the follow-up is served three whole
    16-token passes from the cache and its logits equal, bit for bit, those computed whole. Returns the first
    prompt."""
    v = vocab_of(e)
    first = ids(53, 7, v)
    answer, _, _ = run(e, first, reproducible=True)
    follow = first + answer + ids(6, 8, v)
    got = run(e, follow, reproducible=True)
    assert got[2] == 48  # three whole 16-token passes of the first prompt
    assert_same(got, run(e, follow, cache=False, reproducible=True), exact=True)
    return first


@pytest.mark.parametrize("name", MODELS)
def test_prefix_of_a_finished_request(engines, name):
    """The next turn of a conversation: the prompt extends a finished request's prompt and its answer."""
    e = engines(name)
    e.scheduler().prefix.clear()
    first = ids(37, 1, vocab_of(e))
    answer, _, _ = run(e, first)
    follow = first + answer + ids(9, 2, vocab_of(e))
    got = run(e, follow)
    assert_same(got, run(e, follow, cache=False))
    # everything the first request fed (its last answer token never was); with Engram layers too, since its rings
    # were kept where it ended
    assert got[2] == len(first) + len(answer) - 1


@pytest.mark.parametrize("name", MODELS)
def test_prefix_of_a_running_request(engines, name):
    """A prompt sharing a still decoding request's prompt is served from that slot (copied into its own)."""
    e = engines(name)
    e.scheduler().prefix.clear()
    sched = e.scheduler()
    base = ids(45, 3, vocab_of(e))
    long_run = sched.submit(GenRequest(base, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
    events = long_run.iter_events(timeout=300)
    first = next(events)  # its prompt is in its slot: it decodes from here on
    follow = base + [first.token_id] + ids(11, 4, vocab_of(e))
    got = run(e, follow)
    sched.cancel(long_run)
    assert list(events)[-1].finish_reason == "abort"  # still running when the follower had finished
    assert got[2] >= len(base)
    assert_same(got, run(e, follow, cache=False))


@pytest.mark.parametrize("name", MODELS)
def test_partial_and_longer_prefixes(engines, name):
    """A prompt sharing part of a cached one (ending inside a 16-token pass), and one lying inside a cached one."""
    e = engines(name)
    e.scheduler().prefix.clear()
    v = vocab_of(e)
    first = ids(50, 5, v)
    run(e, first, n=4)
    partial = first[:37] + ids(12, 6, v)
    got = run(e, partial)
    assert_same(got, run(e, partial, cache=False))
    # Engram: reusable up to the last pass end at or before the 37 shared tokens (passes end every 16 tokens)
    assert got[2] == (32 if name == "demo_engram" else 37)
    run(e, first, n=4)  # back into the cache
    inside = first[:29]  # all of it cached: all but its last token are reused
    got = run(e, inside)
    assert_same(got, run(e, inside, cache=False))
    assert got[2] == (16 if name == "demo_engram" else 28)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "demo_engram"])
def test_eviction_keeps_results_exact(engines, name):
    """More distinct prefixes than slots: idle slots are reused least recently used first, and every answer is
    still the one computed without the cache."""
    e = engines(name)
    sched = e.scheduler()
    sched.prefix.clear()
    evicted = sched.prefix.stats()["evictions"]
    v = vocab_of(e)
    convs = [ids(33, 10 + i, v) for i in range(3)]  # three conversations over two slots
    for turn in range(2):
        for i, conv in enumerate(convs):
            answer, _, _ = run(e, conv, n=4)
            got = run(e, conv + answer + ids(5, 20 + 3 * turn + i, v))
            assert_same(got, run(e, conv + answer + ids(5, 20 + 3 * turn + i, v), cache=False))
            convs[i] = conv + answer
    stats = sched.prefix.stats()
    assert stats["evictions"] > evicted and stats["hits"] > 0
    assert stats["idle_slots_holding"] <= 2


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "demo_engram"])
def test_reproducible_requests_are_bit_identical(engines, name):
    """Reproducible requests reuse only whole reproducible passes: the logits are bit-identical."""
    e = engines(name)
    sched = e.scheduler()
    sched.prefix.clear()
    first = assert_reproducible_follow_up_exact(e)
    v = vocab_of(e)
    # rows an ordinary request computed are never given to a reproducible one
    sched.prefix.clear()
    run(e, first)
    assert run(e, first + ids(4, 9, v), reproducible=True)[2] == 0


@pytest.mark.gpu
def test_reproducible_requests_are_bit_identical_on_a_tiered_gpu(tiny_model_dir):
    """On CUDA with most experts cold and the CPU split on: a reproducible request served from the prefix cache
    gives the logits of the same request computed whole, bit for bit."""
    slot = 12288  # one tiny-model expert in bf16
    cfg = {"tiers": {"gpu": {"budget": str(4 * slot)}}, "runtime": {"cpu_numerics": "fork", "max_context": 1024,
                                                                    "prefill_chunk": CHUNK}}
    with Engine.from_pretrained(tiny_model_dir, device="cuda", config=cfg) as e:
        e.scheduler(max_batch=2, token_budget=CHUNK).start()
        assert_reproducible_follow_up_exact(e)


def test_usage_counts_and_stats(engines):
    """`cached_tokens` of the request's events, and the cache's token counters."""
    e = engines("qwen3_moe")
    sched = e.scheduler()
    sched.prefix.clear()
    before = sched.stats()["prefix_cache"]
    prompt = ids(40, 30)
    answer, _, _ = run(e, prompt)
    again = run(e, prompt + answer + ids(3, 31))
    after = sched.stats()["prefix_cache"]
    assert again[2] == 40 + 8 - 1
    assert after["cached_tokens"] - before["cached_tokens"] == again[2]
    assert after["computed_tokens"] - before["computed_tokens"] == 40 + 4  # the first prompt, then 4 of 51
    assert 0 < after["hit_ratio"] < 1


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([], [1]) == 0
    a = list(range(1000))
    for k in (0, 1, 511, 512, 999):
        b = a[:k] + [-1] + a[k + 1:]
        assert common_prefix(a, b) == k


def test_planner_counts_the_prefix_only_slots(tiny_model_dir):
    """`runtime.prefix_cache_slots` adds that many contexts of KV to the plan, and an engine's cache has them."""
    from strata.runtime.model.kv_cache import KVCache
    from strata.runtime.plan.host import GpuInfo, HostInfo
    from strata.runtime.plan.planner import plan

    gib = 1 << 30
    host = HostInfo(gpus=[GpuInfo(0, "sim", 80 * gib, 80 * gib)], ram_total=128 * gib, ram_available=128 * gib,
                    tmpfs_path="/dev/shm/strata", tmpfs_free=0, disk_path="/tmp", disk_free=1 << 40, cpu_count=16)
    runtime = {"max_context": 2048}
    base = plan(tiny_model_dir, host, {"runtime": runtime, "planner": {"max_batch": 3}})
    more = plan(tiny_model_dir, host, {"runtime": {**runtime, "prefix_cache_slots": 2}, "planner": {"max_batch": 3}})
    off = plan(tiny_model_dir, host, {"runtime": {**runtime, "prefix_cache_slots": 2, "prefix_cache": False},
                                      "planner": {"max_batch": 3}})
    engine = Engine.from_pretrained(tiny_model_dir, config={"runtime": {"max_context": 64, "prefix_cache_slots": 2}},
                                    device="cpu")
    per_token = KVCache.bytes_per_token(engine.checkpoint.config, torch.bfloat16)
    assert more.kv_bytes - base.kv_bytes == 2 * 2048 * per_token and off.kv_bytes == base.kv_bytes
    assert more.gpus[0].expert_room_bytes == base.gpus[0].expert_room_bytes - 2 * 2048 * per_token
    sched = engine.scheduler(max_batch=1)
    assert sched.cache.num_slots == 3 and sched.stats()["kv_slots_free"] == 1
    sched.start()
    firsts = [ids(12, 40 + i, 500) for i in range(3)]
    answers = [run(engine, f, n=3)[0] for f in firsts]  # one at a time: three prefixes kept in three slots
    for f, a in zip(firsts, answers, strict=True):
        assert run(engine, f + a + [7], n=2)[2] == len(f) + len(a) - 1
    engine.close()


def test_prefix_cache_off(tiny_model_dir):
    """`runtime.prefix_cache = false`: nothing is kept, every prompt is computed whole."""
    engine = Engine.from_pretrained(tiny_model_dir, config={"runtime": {"max_context": 128, "prefix_cache": False}},
                                    device="cpu")
    engine.scheduler().start()
    prompt = ids(30, 50, 500)
    answer, _, _ = run(engine, prompt, n=3)
    assert run(engine, prompt + answer + [9], n=2)[2] == 0
    stats = engine.scheduler().stats()["prefix_cache"]
    assert not stats["enabled"] and stats["cached_tokens"] == 0 and stats["held_tokens"] == 0
    assert stats["computed_tokens"] == 30 + 34
    engine.close()
