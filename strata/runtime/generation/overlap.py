"""Overlapped decode: the next step is queued before the host reads the token it is fed.

A decode step's host work (reading the sampled token back, detokenizing, stop checks, streaming it
out, launching the next graph) sits between two GPU steps when they run in turn: 0.2 ms a token all in
VRAM, about 1 ms in one-graph split decode (`bench/tools/step_timeline.py` on the H200, code f760a63). With
`[debug] overlap_decode`, step t's token is sampled on the device and fed to step t+1 as a device
tensor; step t+1 is launched first, and the host reads step t's token while the GPU runs step t+1.
A token that ends its sequence (EOS, a stop string) costs one wasted step, never a wrong token: the
same logits are sampled in the same order with the same generators either way. A row with a grammar is
sampled later than the others: its mask needs step t-1's token on the host, so step t's forward pass is queued
first, then the host reads step t-1's tokens and advances the grammars while the GPU runs it, then queues the
grammar rows' masks and sampling, and step t+1 behind them. A wasted step writes its
sequence's KV (and Engram history) one position past its end, which nothing reads: a slot's next sequence
writes every position before it attends to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from strata.runtime.generation.grammar import GrammarBatch, GrammarMatcher
from strata.runtime.generation.sampler import SamplingParams, sample_rows
from strata.runtime.model.kv_cache import KVCache, StepBatch


class TokenReadback:
    """Sampled ids [B] int64 on their device, copied to page-locked memory behind an event at construction:
    `tolist()` waits for that copy only, not for the work queued on the stream after it."""

    def __init__(self, ids: torch.Tensor):
        self.event: torch.cuda.Event | None = None
        if ids.is_cuda:  # on ids' own card, which need not be the current one (a model split over cards)
            with torch.cuda.device(ids.device):
                self.host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                self.host.copy_(ids, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(torch.cuda.current_stream(ids.device))
        else:
            self.host = ids

    def tolist(self) -> list[int]:
        """The ids as Python ints (waits for their copy; releases the GIL while it waits)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def overlap_on(setting: bool | str, device: torch.device, cards: int = 1) -> bool:
    """[debug] overlap_decode resolved: "auto" means on CUDA (a device that computes synchronously gains nothing
    and would emit each token one step late), on one card: a model split over several has not been run
    overlapped on a two-GPU box yet, so there it is opt-in (true)."""
    return (device.type == "cuda" and cards <= 1) if setting == "auto" else bool(setting)


@dataclass
class QueuedStep:
    """A decode step queued on the device, with its tokens' sampling, that the host has not read back yet. Rows
    with a grammar wait for its mask, which needs the token the step before this one sampled: they are sampled by
    `sample_waiting` once the host has that token, and the read-back starts then (`read` is None until it has)."""

    tokens: torch.Tensor  # [B] int64 sampled, on the device: the input of a step queued behind this one
    read: TokenReadback | None
    queued: float  # perf_counter() when it was queued
    logits: torch.Tensor | None = None  # [B, V] fp32, kept while rows wait for their grammars' masks
    waiting: list[int] = field(default_factory=list)  # those rows
    samplers: list[tuple[SamplingParams, torch.Generator]] = field(default_factory=list)


def queue_decode(model, cache: KVCache, slots: list[int], starts: list[int], ids: torch.Tensor,
                 samplers: list[tuple[SamplingParams, torch.Generator]], waiting: list[int] = ()) -> QueuedStep:
    """Queue one decode step of B sequences (KV `slots`, input ids [B] on the device fed at `starts`), each
    row's sampling with its own (params, generator) but the `waiting` rows' (those with grammars:
    `sample_waiting`), and the tokens' read-back once no row waits; returns without waiting for the device."""
    with torch.inference_mode():
        logits = model.logits(model(ids, StepBatch(slots, starts, [1] * len(slots)), cache))  # [B, V] fp32
        if not waiting:
            out = sample_rows(logits, samplers)
            step = QueuedStep(out, TokenReadback(out), time.perf_counter())
        else:  # the waiting rows' places filled by `sample_waiting`
            out = torch.zeros(len(slots), dtype=torch.long, device=logits.device)
            free = [i for i in range(len(slots)) if i not in waiting]
            if free:
                _put(out, free, sample_rows(logits, [samplers[i] for i in free], free))
            step = QueuedStep(out, None, time.perf_counter(), logits, list(waiting), samplers)
    if (graphs := model.graphs) is not None:
        graphs.step_queued()  # all of the step is queued: what waits for that runs while the GPU works
    return step


def sample_waiting(step: QueuedStep, masks: GrammarBatch, matchers: list[GrammarMatcher | None]) -> None:
    """Sample `step`'s waiting rows under their grammars' masks (`matchers[i]` row i's, each advanced to the token
    the row was fed), into its tokens, and start the read-back; nothing to do for a step whose rows all sampled."""
    if step.read is not None:
        return
    with torch.inference_mode():
        masked = masks.mask(step.logits, [m if i in step.waiting else None for i, m in enumerate(matchers)],
                            in_place=True)  # the step's logits serve nothing after this
        _put(step.tokens, step.waiting, sample_rows(masked, [step.samplers[i] for i in step.waiting], step.waiting))
    step.read, step.logits = TokenReadback(step.tokens), None


def _put(tokens: torch.Tensor, rows: list[int], picked: torch.Tensor) -> None:
    """tokens[rows[j]] = picked[j] without an index tensor's copy to the device: one copy where the rows are all of
    them or a run, else one a row."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        tokens[rows[0] : rows[0] + len(rows)] = picked
    else:
        for j, i in enumerate(rows):
            tokens[i : i + 1] = picked[j : j + 1]
