"""Response log-probabilities: a prompt's, fed chunk by chunk, equal the whole prompt's at once."""

import pytest
import torch

from strata.runtime.generation.logprobs import PromptLogprobs, token_logprob, top_logprobs


@pytest.mark.parametrize("cuts", [[13], [1, 12], [5, 5, 3], [4, 1, 1, 7]])
def test_prompt_logprobs_do_not_depend_on_the_chunks(cuts):
    g = torch.Generator().manual_seed(7)
    n, vocab = sum(cuts), 50
    prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
    logits = torch.randn(n, vocab, generator=g)  # position i's logits predict token i + 1
    got, start = PromptLogprobs(k=3), 0
    for c in cuts:
        got.feed(prompt, logits[start : start + c], start, c)
        start += c
    want = torch.log_softmax(logits, dim=-1)
    assert got.values[0] is None and got.top[0] is None and len(got.values) == n
    for i in range(1, n):
        assert got.values[i] == pytest.approx(float(want[i - 1, prompt[i]]), abs=1e-6)
        best = want[i - 1].topk(3)
        assert [t for t, _ in got.top[i]] == best.indices.tolist()


def test_token_logprob_and_its_alternatives():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    lp, top = token_logprob(logits, 2, 2)
    want = torch.log_softmax(logits[0], dim=-1)
    assert lp == pytest.approx(float(want[2]))
    assert [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(float(want[1]))
    assert top_logprobs(want, 0) == []
