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


def test_a_long_prompt_counts_every_layer_at_one_moment():
    """An 8K-token prompt's forward pass reports each layer's uses in turn (12 layers x 128 experts, ~512 uses
    each). Advancing the decay clock by every use (half-life 8192 lookups) would make layer 0's counts look
    ~2^-88 of layer 11's, and the decode after it would promote experts out of the early layers. Counted at
    one moment, equal uses score equal in every layer, and one decode token (8 touches) cannot make an
    expert look twice as used as another."""
    p = LFUPolicy(half_life=8192)
    rng = random.Random(0)
    for layer in range(12):
        for e in range(128):
            p.insert((layer, e))
            p.touch((layer, e), 512 + rng.randint(-20, 20), advance=False)
    first, last = p.score((0, 5)), p.score((11, 5))
    assert 0.9 < first / last < 1.1
    for e in range(8):  # a decode token: ordinary touches advance the clock
        p.touch((3, e))
    victim = p.victim(lambda k: True)
    assert max(p.score((11, e)) for e in range(128)) < 2 * p.score(victim)

    old = LFUPolicy(half_life=8192)  # the clock moved by every use: the first layers fade during the prompt
    for layer in range(12):
        for e in range(128):
            old.touch((layer, e), 512)
    assert old.score((0, 5)) < 1e-6 * old.score((11, 5))


@pytest.mark.parametrize("name", ["lfu", "lru", "static"])
def test_touch_many_is_touch_for_each_key(name):
    """The bulk form one-graph decode's books use ranks exactly as one `touch` per key."""
    keys = [(layer, e) for layer in range(2) for e in range(16)]
    one, bulk = make_policy(name, half_life=8.0, hot=keys[:3]), make_policy(name, half_life=8.0, hot=keys[:3])
    rng = random.Random(7)
    resident = set(rng.sample(keys, 20))
    for p in (one, bulk):
        for k in sorted(resident):
            p.insert(k)
    for _ in range(200):  # batches of lookups, resident or not, as a decode step's layers report them
        batch = [rng.choice(keys) for _ in range(rng.randint(0, 9))]
        for k in batch:
            one.touch(k)
        bulk.touch_many(batch)
    if name == "lfu":
        assert one.clock == bulk.clock and one._score == bulk._score
    eligible = set(resident)
    for _ in range(len(resident)):  # the whole eviction order agrees
        v = one.victim(lambda k: k in eligible)
        assert bulk.victim(lambda k: k in eligible) == v
        one.remove(v), bulk.remove(v), eligible.discard(v)
