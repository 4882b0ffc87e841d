"""SamplingParams validation and sample()/log_probs() behaviour."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strata.errors import RequestError
from strata.runtime.generation.sampler import SamplingParams, log_probs, make_generator, sample


def _logits(b: int = 4, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_in_any_dtype():
    logits = _logits()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sample(logits.to(dtype), SamplingParams(), make_generator(0, "cpu"))
        assert out.dtype == torch.int64 and out.shape == (4,)
        assert torch.equal(out, logits.to(dtype).float().argmax(-1))
    tied = torch.tensor([[1.0, 5.0, 5.0, 0.0]])
    assert sample(tied, SamplingParams(), None).item() == 1  # first of the tied maxima, like torch.argmax


def test_seeded_sampling_reproducible_and_seeds_differ():
    flat = torch.zeros(2, 1000)
    p = SamplingParams(temperature=1.0, seed=1234)

    def draws(seed: int) -> list[list[int]]:
        g = make_generator(seed, "cpu")
        return [sample(flat, p, g).tolist() for _ in range(5)]

    assert draws(1234) == draws(1234) and draws(1234) != draws(4321)
    # seed=None gives a fresh random seed each time.
    draws = {tuple(sample(flat, p, make_generator(None, "cpu")).tolist()) for _ in range(5)}
    assert len(draws) > 1
    # Negative / huge seeds are accepted (wrapped to 64 bits) rather than crashing torch.
    make_generator(-1, "cpu")
    make_generator(2**70, "cpu")


def test_temperature_sampling_follows_the_softmax():
    """20,000 draws from softmax(logits / T): each token's frequency within 5 sigma of its probability, and a
    token masked by top-k never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4)):
        scaled = logits / params.temperature
        if params.top_k:
            scaled[0, scaled[0].argsort(descending=True)[params.top_k :]] = -math.inf
        want = scaled.softmax(-1)[0]
        g, n = make_generator(7, "cpu"), 20_000
        draws = sample(logits.expand(n, -1), params, g)
        freq = torch.bincount(draws, minlength=6).double() / n
        sigma = (want.double() * (1 - want.double()) / n).sqrt()
        assert ((freq - want.double()).abs() <= 5 * sigma + 1e-12).all(), (freq, want)
        assert (freq[want == 0] == 0).all()


@pytest.mark.gpu
def test_sampling_on_cuda_never_waits_for_the_device():
    """Overlapped decode queues the next step before it reads a token: sampling must not synchronise."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = _logits(3, 5000).cuda()
    g = make_generator(3, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for params in (SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=40),
                       SamplingParams(temperature=1.0, top_p=0.9)):
            out = sample(logits, params, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (3,) and out.is_cuda


def test_top_k_one_is_greedy():
    logits = _logits(8, 100, seed=3)
    p = SamplingParams(temperature=2.0, top_k=1)
    g = make_generator(0, "cpu")
    for _ in range(20):
        assert torch.equal(sample(logits, p, g), logits.argmax(-1))


def test_top_k_never_leaves_the_top_k():
    logits = _logits(4, 64, seed=5)
    k = 5
    allowed = logits.topk(k, dim=-1).indices
    p = SamplingParams(temperature=5.0, top_k=k)  # high temperature flattens, so outside tokens would show up
    g = make_generator(7, "cpu")
    seen = [set() for _ in range(4)]
    for _ in range(500):
        out = sample(logits, p, g)
        for row in range(4):
            assert out[row] in allowed[row]
            seen[row].add(out[row].item())
    assert all(len(s) > 1 for s in seen)  # it does sample, not just argmax
    # Ties at the k-th value still admit exactly k tokens.
    tied = torch.zeros(1, 10)
    outs = {sample(tied, SamplingParams(temperature=1.0, top_k=3), g).item() for _ in range(300)}
    assert len(outs) == 3


def test_top_p_small_keeps_only_the_max():
    logits = _logits(4, 64, seed=9)
    p = SamplingParams(temperature=1.0, top_p=1e-6)
    g = make_generator(0, "cpu")
    for _ in range(50):
        assert torch.equal(sample(logits, p, g), logits.argmax(-1))


def test_top_p_keeps_the_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps exactly the first two (0.5 + 0.3 >= 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    g = make_generator(0, "cpu")
    outs = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), g).item() for _ in range(400)}
    assert outs == {0, 1}
    outs = {sample(logits, SamplingParams(temperature=1.0, top_p=0.81), g).item() for _ in range(400)}
    assert outs == {0, 1, 2}


def test_log_probs_fp32():
    logits = _logits().to(torch.bfloat16)
    lp = log_probs(logits)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(4), atol=1e-5)


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert p.max_tokens == 64 and p.temperature == 0.0 and p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(temperature=1, top_p=1).temperature == 1.0
    q = SamplingParams()
    q.stop.append("x")
    assert SamplingParams().stop == []  # no shared mutable default


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 101}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_params_validation_names_the_parameter(kwargs, name):
    with pytest.raises(RequestError, match=name) as e:
        SamplingParams(**kwargs)
    assert "\n" not in str(e.value)


def _mixed_samplers(seed: int) -> list[tuple[SamplingParams, torch.Generator]]:
    """Seven rows: greedy, plain temperature (three), top-k, top-p, and top-k with top-p, each its own generator."""
    kinds = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=0.8),
             SamplingParams(temperature=1.2, top_k=5), SamplingParams(temperature=0.8),
             SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, top_k=8, top_p=0.7)]
    return [(p, make_generator(seed + i, "cpu")) for i, p in enumerate(kinds)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sample_rows_is_each_row_sampled_alone(device):
    """sample_rows over a batch (rows grouped by their filtering, each generator drawing its own row's noise) picks,
    for each row, the token `sample` picks for that row alone with an identical generator, over many steps (the
    generators advancing as they do in decode), for every row and for a subset of rows in any order."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from strata.runtime.generation.sampler import sample_rows

    def gens(seed):
        return [(p, make_generator(g.initial_seed(), device)) for p, g in _mixed_samplers(seed)]

    batched, alone = gens(11), gens(11)
    picks = set()
    for step in range(40):
        logits = (torch.randn(7, 300, generator=torch.Generator().manual_seed(step)) * 2).to(device)
        got = sample_rows(logits, batched)
        want = torch.cat([sample(logits[i : i + 1], p, g) for i, (p, g) in enumerate(alone)])
        assert torch.equal(got, want), step
        picks.update(got[1:].tolist())
        rows = [5, 0, 2]  # a subset, out of order: rows waiting for grammars
        sub_b, sub_a = [batched[r] for r in rows], [alone[r] for r in rows]
        got = sample_rows(logits, sub_b, rows)
        want = torch.cat([sample(logits[r : r + 1], p, g) for r, (p, g) in zip(rows, sub_a, strict=True)])
        assert torch.equal(got, want), step
    assert len(picks) > 20  # the sampled rows really draw (not argmax every time)


def test_greedy_picks_what_torch_argmax_picks_on_the_cpu():
    """`greedy` (numpy's argmax for float32 CPU logits) gives torch.argmax's ids: the first of equal maxima, a NaN
    above every number, -inf rows, one row or many, slices of a larger batch."""
    from strata.runtime.generation.sampler import greedy

    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-3, 4, (6, 1000), generator=g).float()  # many ties
    logits[1, 7] = float("nan")
    logits[1, 900] = float("nan")
    logits[2] = -math.inf
    logits[3, 999] = math.inf
    for rows in (logits, logits[:1], logits[2:5], logits[:, :513], logits.t().contiguous().t()):
        got = greedy(rows)
        assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1))
    assert torch.equal(greedy(logits.double()), logits.double().argmax(dim=-1))  # torch's own path


@pytest.mark.parametrize("draw", ["_draw_host", "_draw_race"])
def test_a_large_vocabulary_draws_from_the_softmax(draw):
    """Both ways of drawing (the host's inverse CDF over 1,024-token blocks, the exponential race) follow
    softmax(logits) over a vocabulary of 2,600 (two full blocks and a tail): Pearson's statistic over the tokens
    expected 20+ times within 6 sigma of its mean, masked tokens never drawn, the tail block drawn."""
    from strata.runtime.generation import sampler

    v, n = 2600, 40_000
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(2)) * 2
    logits[0, ::5] = -math.inf
    logits[0, 2050:] += 3  # the tail block holds much of the mass
    want = logits.softmax(-1)[0].double()
    draws = getattr(sampler, draw)(logits.expand(n, -1).contiguous(), make_generator(4, "cpu"))
    counts = torch.bincount(draws, minlength=v).double()
    expected = want * n
    big = expected >= 20
    chi2 = ((counts[big] - expected[big]) ** 2 / expected[big]).sum().item()
    dof = int(big.sum()) - 1
    assert abs(chi2 - dof) < 6 * math.sqrt(2 * dof), (chi2, dof)
    assert counts[::5].sum() == 0 and counts[2048:].sum() > 0


def test_inverse_cdf_at_the_ends_of_the_unit_interval():
    """u = 0 picks the first live token; u just under 1 (whose u * total may round onto the total) the last live
    one, past masked tokens and whole masked blocks at the end; every pick is a live token."""
    from strata.runtime.generation.sampler import BLOCK, inverse_cdf

    row = torch.randn(3 * BLOCK + 100, generator=torch.Generator().manual_seed(6)).numpy()
    row[:3] = -np.inf
    row[2 * BLOCK + 10 :] = -np.inf  # the last live token is 2 * BLOCK + 9; one block and the tail are empty
    top = float(row.max())
    assert inverse_cdf(row, top, 0.0) == 3
    assert inverse_cdf(row, top, float(np.nextafter(1.0, 0.0))) == 2 * BLOCK + 9
    rng = np.random.default_rng(0)
    assert all(np.isfinite(row[inverse_cdf(row, top, float(u))]) for u in rng.random(500))


def test_rows_without_a_finite_maximum_pick_as_greedy():
    """A row holding a NaN picks its first NaN, one at +inf its first +inf, one all -inf token 0 (what argmax picks,
    as the exponential race does), and the generator still advances one draw a row."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(8))
    logits[0, [70, 2100]] = math.nan
    logits[1, [1500, 2999]] = math.inf
    logits[2] = -math.inf
    g, h = make_generator(5, "cpu"), make_generator(5, "cpu")
    got = sample(logits, SamplingParams(temperature=1.0), g)
    assert got[:3].tolist() == [70, 1500, 0] and np.isfinite(logits[3, got[3]].item())
    torch.rand(4, dtype=torch.float64, generator=h)  # one uniform a row
    assert torch.equal(g.get_state(), h.get_state())
