"""kvtier.policy.lru: the order keys are offered for eviction."""

from __future__ import annotations

import random

import pytest

from kvtier.policy import LruPolicy

K = [bytes([i]) * 16 for i in range(8)]


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


def test_reorder_as_follows_the_given_order_and_keeps_the_rest_before_it() -> None:
    p = LruPolicy()
    for k in K[:6]:
        p.insert(k)
    # K[6] is not held (passed over); K[1] and K[4] are not in the order (first, as they were).
    p.reorder_as([K[5], K[6], K[3], K[0], K[2]])
    assert list(p.victims()) == [K[1], K[4], K[5], K[3], K[0], K[2]]
    assert list(p.in_order()) == list(p.victims())
    assert len(p) == 6 and K[6] not in p
    p.touch([K[5]])
    assert list(p.victims())[-1] == K[5]


def test_reorder_as_refuses_while_a_walk_is_open() -> None:
    p = LruPolicy()
    for k in K[:3]:
        p.insert(k)
    walk = p.victims()
    assert next(walk) == K[0]
    with pytest.raises(RuntimeError, match="walk open"):
        p.reorder_as([K[2], K[1], K[0]])
    walk.close()
    p.reorder_as([K[2], K[1], K[0]])
    assert list(p.victims()) == [K[2], K[1], K[0]]


def test_contains() -> None:
    p = LruPolicy()
    p.insert(K[0])
    assert K[0] in p and K[1] not in p
    p.remove(K[0])
    assert K[0] not in p


class _LinkedReference:
    """The order a walk must follow, kept the plain way: a doubly linked
    list whose removed nodes keep their forward pointer, so a walk standing
    on one goes on; a key moved while a walk is open gets a new node at the
    recent end. Slow, obviously right; LruPolicy must yield the same."""

    class Node:
        def __init__(self, key: bytes | None = None) -> None:
            self.prev = self.next = self
            self.key, self.live = key, True

    def __init__(self) -> None:
        self.root = self.Node()
        self.nodes: dict[bytes, _LinkedReference.Node] = {}

    def _unlink(self, node: Node) -> None:
        node.prev.next, node.next.prev, node.live = node.next, node.prev, False

    def _append(self, key: bytes) -> None:
        node, last = self.Node(key), self.root.prev
        node.prev, node.next, last.next, self.root.prev = last, self.root, node, node
        self.nodes[key] = node

    def insert(self, key: bytes) -> None:
        if key in self.nodes:
            self._unlink(self.nodes[key])
        self._append(key)

    def touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            if key in self.nodes:
                self.insert(key)

    def remove(self, key: bytes) -> None:
        if key in self.nodes:
            self._unlink(self.nodes.pop(key))

    def victims(self):
        node = self.root.next
        while node is not self.root:
            if node.live:
                yield node.key
            node = node.next


@pytest.mark.parametrize("seed", range(40))
def test_walks_agree_with_a_linked_list_whatever_changes_during_them(seed: int) -> None:
    # The store walks victims while it removes, skips (pinned) and, between
    # walks, inserts and touches. Random interleavings of all of it, walks
    # longer than one slice, two walks open at once.
    rng = random.Random(seed)
    keys = [i.to_bytes(16, "little") for i in range(300)]
    got, ref = LruPolicy(), _LinkedReference()
    for k in rng.sample(keys, 200):
        got.insert(k)
        ref.insert(k)
    walks = [(got.victims(), ref.victims())]
    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            w_got, w_ref = rng.choice(walks)
            a, b = next(w_got, None), next(w_ref, None)
            assert a == b
            if a is not None and rng.random() < 0.7:  # the store frees most of what it is offered
                got.remove(a)
                ref.remove(a)
        elif op < 0.5:
            k = rng.choice(keys)
            got.remove(k)
            ref.remove(k)
        elif op < 0.65:
            k = rng.choice(keys)
            got.insert(k)
            ref.insert(k)
        elif op < 0.8:
            batch = rng.sample(keys, rng.randrange(1, 80))
            got.touch(batch)
            ref.touch(batch)
        elif op < 0.85 and len(walks) < 2:
            walks.append((got.victims(), ref.victims()))
        elif op < 0.9 and len(walks) > 1:
            walks.pop(0)
    for w_got, w_ref in walks:
        assert list(w_got) == list(w_ref)
    assert list(got.victims()) == list(ref.victims())
    assert len(got) == len(ref.nodes)


def test_a_walk_past_many_skipped_keys_reaches_the_rest() -> None:
    # Pinned blocks stay at the cold end while the walk goes on past them:
    # later slices start after the keys passed over, not at the front.
    p = LruPolicy()
    keys = [i.to_bytes(16, "little") for i in range(1000)]
    for k in keys:
        p.insert(k)
    seen = []
    for i, key in enumerate(p.victims()):
        seen.append(key)
        if i % 3 == 0:
            p.remove(key)
    assert seen == keys
    assert list(p.victims()) == [k for i, k in enumerate(keys) if i % 3]


def test_touch_told_all_held_orders_like_the_plain_touch_even_when_wrong() -> None:
    a, b = LruPolicy(), LruPolicy()
    for k in K[:6]:
        a.insert(k)
        b.insert(k)
    a.touch([K[1], K[3]], all_held=True)
    b.touch([K[1], K[3]])
    assert list(a.victims()) == list(b.victims()) == [K[0], K[2], K[4], K[5], K[3], K[1]]
    a.touch([K[4], K[7], K[0]], all_held=True)  # K7 is not held: the caller was wrong, no harm
    b.touch([K[4], K[7], K[0]])
    assert list(a.victims()) == list(b.victims())
    assert len(a) == 6 and K[7] not in a
