"""A scheduler step's forward passes: which sequences each carries, and running one to its sampled tokens.

A step runs one pass shared by every sequence that may share one, its prompt chunks within the pacer's allowance,
and a pass of its own for each reproducible or score sequence (`plan_step`). `run_pass` runs a pass's tokens through
the model as one flat batch and samples every row that yields a token on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.runtime.generation.grammar import GrammarBatch
from strata.runtime.generation.logprobs import PromptLogprobs
from strata.runtime.generation.pacing import PrefillPacer
from strata.runtime.generation.sampler import sample_rows
from strata.runtime.generation.sequence import Sequence, plan_pass
from strata.runtime.model.kv_cache import KVCache, StepBatch

Pass = list[tuple[Sequence, list[int], int]]  # each row's sequence, input ids and start position (`plan_pass`)


@dataclass
class StepPlan:
    """The passes of one step, and what the pacer is told of it."""

    shared: Pass  # every decode token and the prompt chunks the allowance holds, of sequences that share a pass
    solo: list[tuple[Pass, bool]]  # a pass of its own per reproducible or score sequence, and whether reproducible
    n_decode: int  # decoding sequences (one token each)
    allow: int  # prompt tokens the pacer allowed the step


def plan_step(running: list[Sequence], pacer: PrefillPacer, repro_chunk: int, score_chunk: int) -> StepPlan:
    """The passes of a step over `running`: reproducible prompts advance by `repro_chunk` tokens and score prompts
    by `score_chunk`, each in a pass of its own; while sequences decode, those prompt tokens count against the
    pacer's allowance, which the shared pass's prompt chunks fill."""
    solo = [(plan_pass([s], score_chunk if s.req.score else repro_chunk), s.req.reproducible)
            for s in running if s.req.reproducible or s.req.score]
    n_decode = sum(1 for s in running if s.next_input is not None)
    solo_prompt = sum(len(inp) for plan, _ in solo for s, inp, _ in plan if s.next_input is None)
    allow = pacer.allowance(n_decode)
    if n_decode and pacer.enabled:  # solo chunks count against the step's allowance
        allow = max(allow - solo_prompt, min(pacer.min_chunk, allow))
    shared = plan_pass([s for s in running if not (s.req.reproducible or s.req.score)], allow)
    return StepPlan(shared, solo, n_decode, allow)


def run_pass(engine, cache: KVCache, grammars: GrammarBatch, plan: Pass,
             reproducible: bool) -> tuple[dict[int, int], torch.Tensor]:
    """Run `plan` through `engine`'s model as one flat batch (reproducible: the expert compute's exact path), keep
    what its prompt rows ask for (a score request's log-probabilities, prompt logprobs) and sample every row that
    yields a token. Returns {row: token} and each row's last-position logits [B, V] fp32."""
    model = engine.model
    ids = torch.tensor([t for _, inp, _ in plan for t in inp], dtype=torch.long, device=engine.device)
    batch = StepBatch([s.slot for s, _, _ in plan], [st for _, _, st in plan], [len(inp) for _, inp, _ in plan])
    with engine.numerics(reproducible), torch.inference_mode():
        hidden = model(ids, batch, cache)
        rows = batch.last_token_rows()
        logits = model.logits(hidden[rows])  # [B, V] fp32
        for i, (seq, inp, start) in enumerate(plan):
            off = batch.offsets[i]
            if seq.req.score:  # every position's next-token log-probabilities [len(inp), V], kept on the host
                seq.scores.append(torch.log_softmax(model.logits(hidden[off : off + len(inp)]), dim=-1).cpu())
            elif seq.next_input is None and seq.req.prompt_logprobs is not None:
                if seq.prompt_lp is None:
                    seq.prompt_lp = PromptLogprobs(seq.req.prompt_logprobs)
                seq.prompt_lp.feed(seq.req.prompt_ids, model.logits(hidden[off : off + len(inp)]), start, len(inp))
        # every row that yields a token is sampled on the device first, each with its own generator (so the
        # order is free), and read back once: one wait for the GPU a step, not one a sequence
        rows_out = [i for i, (seq, inp, _) in enumerate(plan) if seq.samples(inp)]
        masked = grammars.mask(logits, [seq.grammar if seq.samples(inp) else None for seq, inp, _ in plan])
        drawn = sample_rows(masked, [(plan[i][0].req.params, plan[i][0].generator) for i in rows_out], rows_out) \
            if rows_out else None
        if (graphs := model.graphs) is not None:
            graphs.step_queued()  # all of the step is queued (sampling too): its books run while the GPU works
        tokens = dict(zip(rows_out, drawn.tolist() if drawn is not None else [], strict=True))
    return tokens, logits
