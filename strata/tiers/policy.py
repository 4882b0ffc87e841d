"""Placement and eviction policies: which resident object a full tier gives up.

A policy only ranks; the tier manager decides what may be evicted at all (nothing in use, nothing
in flight) through the `eligible` predicate of `victim`. Every policy sees the same events: `touch` on
each lookup (or `touch(key, n)` for n at once), `insert` when an object arrives in the tier, `remove` when it leaves. `victim` is on the
hot path (every miss into a full tier evicts), so it walks the policy's own order and stops at the
first eligible object instead of scoring every resident one: O(1) for LRU, O(log n) for LFU.

- `lru`: least recently used goes first (mixtral-offloading's per-layer LRU, when budgets are per layer).
- `lfu`: lowest use count with exponential decay (half-life in lookups), so the hot set migrates
  with traffic instead of freezing on what was popular an hour ago.
- `static`: the planner's hot set never leaves; other objects rotate LRU in the remaining slots.
- `cost`: decayed frequency times the cost of bringing the object back (its next tier down), so an
  object that would have to come back from disk is kept over one that sits in pinned RAM anyway.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from strata.errors import ConfigError

Key = Hashable
POLICIES = ("static", "lru", "lfu", "cost")


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key, uses: float = 1.0, advance: bool = True) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[Key]) -> None:
        """One lookup of each of `keys`, in order."""
        for key in keys:
            self.touch(key)

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, eligible: Callable[[Key], bool]) -> Key | None:
        return next((k for k in self._order if eligible(k)), None)


class LFUPolicy:
    """Lowest decayed use count first; counts halve every `half_life` lookups (of any object).

    Counts are kept for objects that left the tier too, so an object evicted under pressure comes
    back with its history (the frequency a cost model and a hot set need). With exponential decay the
    order of two objects only changes when one is touched: score(now) = count * exp(-decay * (now - t)),
    so log score + decay * now = log count + decay * t is a fixed priority per touch, kept in a heap.
    """

    def __init__(self, half_life: float = 256.0) -> None:
        if half_life <= 0:
            raise ConfigError(f"policy.lfu_half_life must be > 0, got {half_life}")
        self.decay = math.log(2) / half_life
        self.clock = 0
        self._score: dict[Key, tuple[float, int]] = {}  # key -> (count at time t, t)
        self._resident: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []  # (priority, sequence, key); stale entries skipped
        self._seq = 0

    def score(self, key: Key) -> float:
        count, t = self._score.get(key, (0.0, self.clock))
        return count * math.exp(-self.decay * (self.clock - t))

    def _priority(self, key: Key) -> float:
        count, t = self._score.get(key, (0.0, 0))
        return math.log(count) + self.decay * t if count > 0 else -math.inf

    def _push(self, key: Key) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self._priority(key), self._seq, key))
        self._compact()

    def _compact(self) -> None:
        """Drop the heap's stale entries now and then (each touch of a resident object pushes a new one)."""
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._heap = [(self._priority(k), i, k) for i, k in enumerate(self._resident)]
            heapq.heapify(self._heap)

    def touch(self, key: Key, uses: float = 1.0, advance: bool = True) -> None:
        """`uses` lookups of `key` at once; the clock advances by as many, unless not `advance`: a prompt's
        uses count at the moment the prompt is seen. (Advanced by every one, an 8K-token prompt moved the
        clock ~65K lookups per layer, ~8 half-lives, while its forward pass went from one layer to the
        next. The first layers' counts then looked ~2^-88 of the last layers', and the decode that
        followed promoted ~10 experts a token out of the early layers.)"""
        if advance:
            self.clock += uses
        self._score[key] = (self.score(key) + uses, self.clock)
        if key in self._resident:
            self._push(key)

    def touch_many(self, keys: Iterable[Key]) -> None:
        """One lookup of each of `keys`, in order: `touch(key)` for each, inlined (one-graph decode books ~100 a
        step on a thread beside the decoding one, whose GIL they hold)."""
        scores, resident, heap, decay, exp, log = self._score, self._resident, self._heap, self.decay, math.exp, math.log
        for key in keys:
            self.clock += 1
            now = self.clock
            count, t = scores.get(key, (0.0, now))
            count = count * exp(-decay * (now - t)) + 1.0
            scores[key] = (count, now)
            if key in resident:  # _push, its priority log(count) + decay * t at t = now
                self._seq += 1
                heapq.heappush(heap, (log(count) + decay * now, self._seq, key))
        self._compact()

    def insert(self, key: Key) -> None:
        self._resident.add(key)
        self._push(key)

    def remove(self, key: Key) -> None:
        self._resident.discard(key)

    def victim(self, eligible: Callable[[Key], bool]) -> Key | None:
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            priority, _, key = entry
            if key not in self._resident or priority != self._priority(key):
                continue  # stale: evicted, or touched since (a newer entry exists)
            skipped.append(entry)
            if eligible(key):
                found = key
                break
        for entry in skipped:  # the victim too: it stays ranked until the manager removes it
            heapq.heappush(self._heap, entry)
        return found


class StaticPolicy(LRUPolicy):
    """The hot set is pinned in the tier; everything else rotates LRU through the remaining slots."""

    def __init__(self, hot: Iterable[Key] = ()) -> None:
        super().__init__()
        self.hot = set(hot)

    def victim(self, eligible: Callable[[Key], bool]) -> Key | None:
        return super().victim(lambda k: k not in self.hot and eligible(k))


class CostPolicy(LFUPolicy):
    """Evict what is cheapest to lose: decayed frequency x cost of reloading it (seconds per byte)."""

    def __init__(self, reload_cost: Callable[[Key], float], half_life: float = 256.0) -> None:
        super().__init__(half_life)
        self.reload_cost = reload_cost

    def victim(self, eligible: Callable[[Key], bool]) -> Key | None:
        # the reload cost changes with other tiers' contents, so there is no fixed order: score them all
        candidates = (k for k in self._resident if eligible(k))
        return min(candidates, key=lambda k: (self.score(k) + 1e-3) * self.reload_cost(k), default=None)


def make_policy(name: str, *, half_life: float = 256.0, hot: Iterable[Key] = (),
                reload_cost: Callable[[Key], float] | None = None):
    """Build the policy named in `[policy] eviction`."""
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy(half_life)
    if name == "static":
        return StaticPolicy(hot)
    if name == "cost":
        return CostPolicy(reload_cost or (lambda key: 1.0), half_life)
    raise ConfigError(f"policy.eviction = {name!r} is invalid; use one of {', '.join(POLICIES)}")
