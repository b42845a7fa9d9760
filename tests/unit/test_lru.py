"""kvtier.policy.lru: the order keys are offered for eviction."""

from __future__ import annotations

from kvtier.policy import EvictionPolicy, LruPolicy

K = [bytes([i]) * 16 for i in range(8)]


def test_is_an_eviction_policy() -> None:
    assert isinstance(LruPolicy(), EvictionPolicy)


def test_insertion_order_is_eviction_order() -> None:
    p = LruPolicy()
    for k in K[:5]:
        p.insert(k)
    assert list(p.victims()) == K[:5]
    assert len(p) == 5


def test_reinsert_makes_most_recent() -> None:
    p = LruPolicy()
    for k in K[:3]:
        p.insert(k)
    p.insert(K[0])
    assert list(p.victims()) == [K[1], K[2], K[0]]
    assert len(p) == 3


def test_touch_prefix_evicts_tail_before_head() -> None:
    p = LruPolicy()
    for k in K[:5]:
        p.insert(k)
    p.touch([K[0], K[1], K[2]])
    # Untouched keys first, then the prefix from its tail to its head.
    assert list(p.victims()) == [K[3], K[4], K[2], K[1], K[0]]


def test_touch_accepts_any_iterable_and_ignores_unknown_keys() -> None:
    p = LruPolicy()
    for k in K[:3]:
        p.insert(k)
    p.touch(iter([K[7], K[0]]))
    assert list(p.victims()) == [K[1], K[2], K[0]]
    assert len(p) == 3  # touch never adds


def test_remove() -> None:
    p = LruPolicy()
    for k in K[:4]:
        p.insert(k)
    p.remove(K[1])
    assert list(p.victims()) == [K[0], K[2], K[3]]
    p.remove(K[1])  # removing an absent key is a no-op
    p.remove(K[7])
    assert len(p) == 3
    p.touch([K[1]])
    assert K[1] not in list(p.victims())


def test_victims_is_a_snapshot() -> None:
    p = LruPolicy()
    for k in K[:4]:
        p.insert(k)
    seen = []
    for key in p.victims():  # the store removes keys while it walks them
        seen.append(key)
        p.remove(key)
    assert seen == K[:4]
    assert len(p) == 0
