"""The scheduler's overlapped decode ([debug] overlap_decode): decode-only steps queued on the device before the
host has read the tokens they are fed, and the rules for chaining one behind another (rows with grammars too: theirs
are sampled once the host has advanced the grammars, `DecodeChain.finish`).

A step of decode tokens only is queued with its sampling (strata.runtime.generation.overlap.queue_decode); while
the running set stays the same and nobody waits for a free slot, the next step is queued behind it, fed its
sampled tokens on the device, before the host reads them. `DecodeChain` holds the step in flight and times the
steps as they land; the scheduler emits their tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from strata.runtime.generation.grammar import GrammarBatch
from strata.runtime.generation.overlap import QueuedStep, queue_decode, sample_waiting
from strata.runtime.generation.sequence import Sequence
from strata.runtime.model.kv_cache import KVCache


@dataclass
class InFlight:
    """A decode-only step of `seqs` queued on the device whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]
    starts: list[int]  # the position each sequence's input token was fed at
    step: QueuedStep


class DecodeChain:
    """The decode step in flight (`pending`), how many steps were queued behind an unread one, and when the last
    one's tokens were read."""

    def __init__(self) -> None:
        self.pending: InFlight | None = None
        self.chained_steps = 0  # steps queued behind one whose tokens were not read yet
        self._landed_at = 0.0  # perf_counter() when the last in-flight step's tokens were read

    @staticmethod
    def overlaps(seq: Sequence, ahead: int, max_context: int) -> bool:
        """Whether `seq` may decode in a step whose tokens are read later: not reproducible, no logprobs (those
        need the logits on the host), and still sampling `ahead` tokens from now before its limits. (A grammar's
        row is sampled once its last token was read: `finish`.)"""
        r = seq.req
        return not r.reproducible and r.logprobs is None and seq.may_sample(ahead, max_context)

    def chains(self, p: InFlight, running: list[Sequence], admitting: bool, max_context: int) -> bool:
        """Whether the next step may be queued behind `p` before its tokens are read: the `running` set is still
        `p`'s (none finished, cancelled, prefilling or admitted), nobody is `admitting` (waiting with a slot free),
        and every sequence samples at least two more tokens (p's and the next one's)."""
        if admitting:
            return False
        return (len(running) == len(p.seqs) and all(a is b for a, b in zip(running, p.seqs, strict=True))
                and all(self.overlaps(s, 2, max_context) for s in running))

    @staticmethod
    def launch(model, cache: KVCache, seqs: list[Sequence], starts: list[int], ids: torch.Tensor) -> InFlight:
        """Queue a decode step of `seqs` fed `ids` [B] on the device, the sampling of its tokens, and start reading
        them back; returns without waiting for the device."""
        waiting = [i for i, s in enumerate(seqs) if s.grammar is not None]
        step = queue_decode(model, cache, [s.slot for s in seqs], starts, ids, [(s.req.params, s.generator) for s in seqs],
                            waiting)
        return InFlight(seqs, starts, step)

    @staticmethod
    def finish(p: InFlight, masks: GrammarBatch) -> None:
        """Queue the sampling of `p`'s rows with grammars, each grammar having taken the token its row was fed
        (read back when the step before `p` landed), and start reading `p`'s tokens back. Before a step is
        chained behind `p` (fed its tokens) or `p` lands."""
        sample_waiting(p.step, masks, [s.grammar for s in p.seqs])

    def land(self, p: InFlight, running: list[Sequence]) -> tuple[list[tuple[Sequence, int]], float]:
        """Read `p`'s tokens (waiting for the device): (sequence, token) of those still `running` (the others
        finished or were cancelled meanwhile), and the seconds it took (since it was queued, or since the step
        before it landed, whichever is later)."""
        tokens = p.step.read.tolist()
        now = time.perf_counter()
        dt = now - max(p.step.queued, self._landed_at)
        self._landed_at = now
        live = []
        for seq, start, token in zip(p.seqs, p.starts, tokens, strict=True):
            if any(seq is s for s in running):
                seq.written, seq.ring_at = start + 1, -1  # a step queued behind this one has moved the rings on
                live.append((seq, token))
        return live, dt
