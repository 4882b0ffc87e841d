"""Eviction policies: each victim is the one its ranking says, among what the manager allows."""

from __future__ import annotations

import random

import pytest

from strata.errors import ConfigError
from strata.tiers.policy import LFUPolicy, LRUPolicy, make_policy


def _traffic(policy, keys, steps, seed):
    """Random inserts, touches and removals; returns the resident set."""
    rng = random.Random(seed)
    resident = set()
    for _ in range(steps):
        k = rng.choice(keys)
        op = rng.random()
        if op < 0.25 and k not in resident:
            policy.insert(k)
            resident.add(k)
        elif op < 0.3 and k in resident:
            policy.remove(k)
            resident.discard(k)
        else:
            policy.touch(k)
    return resident


@pytest.mark.parametrize("seed", range(5))
def test_lfu_victim_is_the_lowest_decayed_count_among_eligible(seed):
    p = LFUPolicy(half_life=16.0)
    keys = [(layer, e) for layer in range(3) for e in range(20)]
    resident = _traffic(p, keys, 3000, seed)
    busy = set(random.Random(seed).sample(sorted(resident), k=min(5, len(resident))))
    eligible = resident - busy
    got = p.victim(lambda k: k in eligible)
    want = min(p.score(k) for k in eligible)
    assert got in eligible and p.score(got) == pytest.approx(want, rel=1e-9, abs=1e-12)
    p.remove(got)  # the next victim is the next lowest
    eligible.discard(got)
    got2 = p.victim(lambda k: k in eligible)
    assert p.score(got2) == pytest.approx(min(p.score(k) for k in eligible), rel=1e-9, abs=1e-12)


def test_lfu_never_touched_objects_go_first_and_none_when_nothing_is_eligible():
    p = LFUPolicy()
    for k in ("a", "b", "c"):
        p.insert(k)
    p.touch("a")
    p.touch("c")
    assert p.victim(lambda k: True) == "b"
    assert p.victim(lambda k: False) is None


def test_lru_order_and_eligibility():
    p = LRUPolicy()
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    assert p.victim(lambda k: True) == "b"
    assert p.victim(lambda k: k != "b") == "c"


def test_static_keeps_its_hot_set_and_cost_weighs_reload():
    s = make_policy("static", hot=["h"])
    for k in ("h", "x", "y"):
        s.insert(k)
    assert s.victim(lambda k: True) == "x"
    c = make_policy("cost", reload_cost=lambda k: 100.0 if k == "disk" else 1.0)
    for k in ("disk", "pinned"):
        c.insert(k)
        c.touch(k)
    assert c.victim(lambda k: True) == "pinned"  # equally used: losing the disk-backed one costs more
    with pytest.raises(ConfigError, match="eviction"):
        make_policy("fifo")
