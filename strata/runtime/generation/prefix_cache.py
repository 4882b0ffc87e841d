"""The prefix cache: KV-cache slots keep their sequence's rows after it ends, and later prompts that share a
prefix with any slot (finished or still running) start from those rows instead of recomputing them.

strata's KV cache is one contiguous slab per slot (`KVCache`), which the attention kernels and the decode step's
CUDA graphs read in place, so the cache works at the slot's granularity rather than with paged blocks: every slot
remembers the token ids whose rows it holds (a running sequence's prompt and fed tokens so far, a finished one's
at its end). A new request takes the slot whose ids share the longest prefix with its prompt:

- a finished sequence's slot whose ids the prompt extends (the next turn of a conversation), or any finished
  one when no slot is empty, is claimed in place: nothing moves;
- otherwise the request gets an empty slot (or the least recently used finished one, whose rows are evicted)
  and the shared rows are copied into it from the other slot (`KVCache.copy_prefix`: a device-to-device copy,
  197 MB for a thousand tokens of Qwen3-30B-A3B's bf16 cache, where recomputing them would run every layer
  and stream its cold experts again).

The shared prefix stops one token short of the prompt (its last position yields the first token's logits).
Rows are reused whatever the attention (GQA keys and values, MLA's latent and rotated key): they are the rows
the slot holds, position by position. Memory: `max_batch` slots that run sequences plus `runtime.prefix_cache_slots`
that only keep prefixes (each `runtime.max_context` tokens, counted by the planner); finished sequences stay in
whichever slots are idle, evicted least recently used first when a new sequence needs one.

Exactness. A shared prefix's rows are what the earlier pass computed; a request's own passes then start where the
prefix ends. For ordinary requests the tokens equal those computed without the cache up to the fp32 (or bf16)
rounding differences of another chunking, as the shared batch already has. Reproducible requests (bit-identical
whatever else runs) reuse only rows computed by full reproducible prompt chunks (`runtime.prefill_chunk` tokens,
from position 0), and only whole chunks of them, so every pass they run is the pass they would have run alone.

Engram layers keep a ring of the last values of their convolution per slot, valid only at the position it was
taken: the cache keeps a copy of the ring at the end of every prompt pass and of a finished sequence (when no
step ran ahead of the host), and a model with Engram layers reuses a prefix only up to such a position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from strata.runtime.model.kv_cache import KVCache


class HeldIds(Protocol):
    """A running sequence as the cache sees it: the ids whose rows its slot holds so far."""

    def cached_ids(self) -> list[int]: ...


@dataclass
class _Slot:
    """What one KV slot holds."""

    owner: HeldIds | None = None  # the running sequence in it; None: idle
    ids: list[int] = field(default_factory=list)  # an idle slot's ids, position by position ([]: empty)
    exact: int = 0  # its first `exact` positions came from full reproducible prompt chunks
    rings: dict[int, tuple[list[torch.Tensor], bool]] = field(default_factory=dict)  # Engram: position -> (rings, exact)
    used: int = 0  # when it last took or ended a sequence (a tick), for least-recently-used eviction

    def held(self) -> list[int]:
        return self.owner.cached_ids() if self.owner is not None else self.ids


@dataclass
class SlotGrant:
    """Where admission put a sequence: `slot`, whose first `hit` prompt positions hold the prefix's rows (copied
    from slot `source`, or None: they were there already)."""

    slot: int
    hit: int = 0
    source: int | None = None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists (slice comparisons: C speed, log n of them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """The slots of `cache`: which sequence runs in each, what each idle one still holds, and the prompt prefixes
    they offer (see the module docstring). `enabled=False` keeps nothing: every prompt runs whole.

    At most `max_running` of the cache's slots run sequences at once; `exact_chunk` is the reproducible requests'
    prompt chunk. With Engram layers, a prefix is reused only up to a position where the rings were kept."""

    def __init__(self, cache: KVCache, max_running: int, enabled: bool, exact_chunk: int):
        if not 1 <= max_running <= cache.num_slots:
            raise ValueError("a prefix cache needs 1 <= max_running <= the cache's slots")
        self.cache = cache
        self.enabled, self.exact_chunk, self.engram = enabled, max(1, exact_chunk), cache.engram is not None
        self.max_running = max_running
        self._slots = [_Slot() for _ in range(cache.num_slots)]
        self._tick = 0
        self.lookups = 0  # admissions that looked for a prefix
        self.hits = 0  # ... and found one
        self.prompt_tokens = 0  # prompt tokens of those admissions
        self.cached_tokens = 0  # prompt tokens served from the cache
        self.computed_tokens = 0  # prompt tokens run through the model (all requests)
        self.evictions = 0  # idle slots' prefixes dropped to make room

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def running(self) -> int:
        return sum(1 for s in self._slots if s.owner is not None)

    @property
    def free(self) -> int:
        """Sequences that may still be admitted now."""
        return self.max_running - self.running

    def admit(self, owner: HeldIds, prompt: list[int], reproducible: bool = False, reuse: bool = True) -> SlotGrant:
        """Give `owner` (whose `cached_ids()` is [] until it runs) a slot holding the longest prefix of `prompt` that
        any slot holds (copied there if need be; `reuse=False`, or a disabled cache: none). Needs `free > 0`."""
        if self.free <= 0:
            raise RuntimeError("no KV slot is free")
        self._tick += 1
        best, hit, rings, common = None, 0, None, 0
        if self.enabled and reuse:
            self.lookups += 1
            self.prompt_tokens += len(prompt)
            for i, s in enumerate(self._slots):
                held = s.held()
                if not held:
                    continue
                c = common_prefix(held, prompt)
                h, r = self._usable(s, c, len(prompt), reproducible)
                if h > hit or (h == hit and h and s.owner is None and self._slots[best].owner is not None):
                    best, hit, rings, common = i, h, r, c
        idle = [i for i, s in enumerate(self._slots) if s.owner is None]
        empty = [i for i in idle if not self._slots[i].ids]
        claim = best is not None and self._slots[best].owner is None and (
            common >= len(self._slots[best].ids) or not empty)
        if claim:
            target, source = best, None
        else:
            if empty:
                target = empty[0]
            else:
                target = min((i for i in idle if i != best), key=lambda i: self._slots[i].used)
                self.evictions += 1
            source = best if hit else None
        src = self._slots[best] if best is not None else None
        exact = min(hit, src.exact) if src is not None else 0
        kept = {p: r for p, r in src.rings.items() if p <= hit} if src is not None else {}
        slot = self._slots[target]
        slot.owner, slot.ids, slot.exact, slot.rings, slot.used = owner, [], exact, kept, self._tick
        if hit:
            self.hits += 1
            self.cached_tokens += hit
            if source is not None:
                self.cache.copy_prefix(source, target, hit)
            if rings is not None:
                self.cache.restore_engram_rings(target, rings)
        return SlotGrant(target, hit, source)

    def _usable(self, s: _Slot, common: int, prompt_len: int, reproducible: bool) -> tuple[int, list | None]:
        """How much of a common prefix of `common` ids with slot `s` a prompt of `prompt_len` may reuse, and the
        Engram rings to restore there."""
        limit = min(common, prompt_len - 1)
        if reproducible:  # whole reproducible chunks only, computed as such
            limit = min(limit, s.exact) // self.exact_chunk * self.exact_chunk
        if not self.engram:
            return limit, None
        at = max((p for p, (_, exact) in s.rings.items() if p <= limit and (exact or not reproducible)), default=0)
        return (at, s.rings[at][0]) if at else (0, None)

    def after_prompt_pass(self, slot: int, end: int, reproducible: bool) -> None:
        """A prompt chunk of `slot`'s sequence ended at position `end`: a reproducible one extends the exact rows to
        its last whole chunk; with Engram layers, the rings are kept as they are at `end`."""
        s = self._slots[slot]
        if reproducible:
            s.exact = max(s.exact, end // self.exact_chunk * self.exact_chunk)
        if self.engram and self.enabled:
            s.rings[end] = (self.cache.engram_rings(slot), end <= s.exact)

    def release(self, slot: int, ids: list[int] | None, rings_current: bool = False) -> None:
        """The sequence in `slot` ended. `ids`: those whose rows the slot holds, kept for later prompts (None, or a
        disabled cache: forgotten); `rings_current`: the Engram rings are those at their end (no step ran ahead)."""
        s = self._slots[slot]
        self._tick += 1
        s.owner, s.used = None, self._tick
        if not self.enabled or not ids:
            s.ids, s.exact, s.rings = [], 0, {}
            return
        s.ids = ids
        s.exact = min(s.exact, len(ids))
        s.rings = {p: r for p, r in s.rings.items() if p <= len(ids)}
        if self.engram and rings_current:
            s.rings[len(ids)] = (self.cache.engram_rings(slot), len(ids) <= s.exact)

    def count_computed(self, tokens: int) -> None:
        """Prompt tokens a forward pass ran through the model."""
        self.computed_tokens += tokens

    def clear(self) -> None:
        """Forget every idle slot's prefix (a running sequence keeps its slot)."""
        for s in self._slots:
            if s.owner is None:
                s.ids, s.exact, s.rings = [], 0, {}

    def stats(self) -> dict:
        """Counters since the cache was made, and what it holds now."""
        served = self.cached_tokens + self.computed_tokens
        return {"enabled": self.enabled, "slots": self.num_slots, "lookups": self.lookups, "hits": self.hits,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "computed_tokens": self.computed_tokens, "evictions": self.evictions,
                "hit_ratio": self.cached_tokens / served if served else 0.0,
                "held_tokens": sum(len(s.ids) for s in self._slots if s.owner is None),
                "idle_slots_holding": sum(1 for s in self._slots if s.owner is None and s.ids)}


def kv_slots(engine, max_batch: int, repro_chunk: int) -> tuple[KVCache, PrefixCache]:
    """`engine`'s KV cache for `max_batch` running sequences, with the slots beside them that only keep prefixes
    (`runtime.prefix_cache_slots`), and the prefix cache over it (`repro_chunk`: reproducible prompts' chunk)."""
    rt = engine.config.runtime
    # a model whose cache is a recurrent state, not rows per position (Qwen3.5-MoE), reuses no prefix
    reuse = rt.prefix_cache and getattr(engine.model, "reuses_prefixes", True)
    kept = rt.prefix_cache_slots if reuse else 0  # slots that only keep prefixes
    make = getattr(engine.model, "new_cache", None)  # an architecture with a cache of its own (DeepSeek-V4)
    cache = (make or partial(KVCache, engine.checkpoint.config))(max_batch + kept, engine.max_context, engine.dtype,
                                                                 engine.device)
    return cache, PrefixCache(cache, max_batch, reuse, repro_chunk)
