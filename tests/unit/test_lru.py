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


def test_victims_walk_survives_removing_the_key_just_yielded() -> None:
    p = LruPolicy()
    for k in K[:4]:
        p.insert(k)
    seen = []
    for key in p.victims():  # the store removes keys while it walks them
        seen.append(key)
        p.remove(key)
    assert seen == K[:4]
    assert len(p) == 0


def test_victims_walk_skips_keys_removed_ahead_and_sees_moved_ones_at_their_new_place() -> None:
    p = LruPolicy()
    for k in K[:6]:
        p.insert(k)
    walk = p.victims()
    assert next(walk) == K[0]
    p.remove(K[0])
    p.remove(K[1])  # ahead of the walk: never yielded
    p.remove(K[2])
    p.touch([K[3]])  # moved to the recent end: yielded there
    p.insert(K[6])
    assert list(walk) == [K[4], K[5], K[3], K[6]]
    assert list(p.victims()) == [K[4], K[5], K[3], K[6]]


def test_victims_is_lazy() -> None:
    # The walk costs what the caller takes: nothing is copied up front, so a
    # key inserted after the walk started is still reached.
    p = LruPolicy()
    p.insert(K[0])
    walk = p.victims()
    p.insert(K[1])
    assert list(walk) == [K[0], K[1]]


def test_contains() -> None:
    p = LruPolicy()
    p.insert(K[0])
    assert K[0] in p and K[1] not in p
    p.remove(K[0])
    assert K[0] not in p
