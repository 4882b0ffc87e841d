"""Log-probabilities for responses: the sampled token's and its top alternatives (`logprobs`), and each prompt
token's given its prefix (`prompt_logprobs`), accumulated over a prompt's prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.runtime.generation.sampler import log_probs


def top_logprobs(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token, log-probability) of one position's log-probabilities row [V], most likely first."""
    if k <= 0:
        return []
    values, ids = row.topk(k)
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def token_logprob(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, the k most likely alternatives) under logits [1, V] or [V]."""
    row = log_probs(logits.reshape(-1)).cpu()
    return float(row[token]), top_logprobs(row, k)


@dataclass
class PromptLogprobs:
    """Each prompt token's log-probability given its prefix, fed chunk by chunk as the prompt prefills. The first
    token has none (None in both lists)."""

    k: int  # alternatives per position
    values: list = field(default_factory=list)  # [float | None] per prompt token
    top: list = field(default_factory=list)  # [list[(token, logprob)] | None] per prompt token
    last_row: torch.Tensor | None = None  # logits [1, V] of the previous chunk's last position

    def feed(self, prompt: list[int], chunk_logits: torch.Tensor, start: int, n: int) -> None:
        """Prompt positions start .. start + n - 1 prefilled, with logits [n, V]: each position's logits predict
        the next token, so a chunk scores its own tokens after the first from its rows, and its first from the
        previous chunk's last row."""
        prev = torch.cat([self.last_row, chunk_logits[:-1]]) if self.last_row is not None else chunk_logits[:-1]
        lp = log_probs(prev).cpu()
        targets = prompt[start + 1 - (1 if self.last_row is not None else 0) : start + n]
        if start == 0:
            self.values.append(None)
            self.top.append(None)
        for row, tok in zip(lp, targets, strict=True):
            self.values.append(float(row[tok]))
            self.top.append(top_logprobs(row, self.k))
        self.last_row = chunk_logits[-1:].detach()
