"""Least-recently-used order over keys.

Called by the store, under its lock, in the process that owns the index.
Every operation costs in proportion to the keys it is given: ``victims``
walks the live order lazily, so a caller that needs ten victims of a million
keys looks at about ten.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from itertools import islice


class EvictionPolicy(ABC):
    """Orders keys for eviction. Knows nothing of pins or slots."""

    @abstractmethod
    def insert(self, key: bytes) -> None: ...

    @abstractmethod
    def touch(self, keys: Iterable[bytes], *, all_held: bool = False) -> None:
        """Make ``keys`` the most recently used, the first most of all;
        keys not held are passed over. ``all_held``: the caller knows every
        key is held (a faster path; a key that is not still does no harm)."""

    @abstractmethod
    def remove(self, key: bytes) -> None: ...

    def in_order(self) -> Iterator[bytes]:
        """Every key held, first to evict first, read at once: the caller
        changes nothing until it has read them all. A policy may give a
        faster iterator than ``victims``, which allows changes as it goes."""
        return self.victims()

    @abstractmethod
    def victims(self) -> Iterator[bytes]:
        """Keys from first to evict to last, lazily: the walk costs what the
        caller takes from it, not the number of keys held. The caller may
        remove keys while it walks (the store drops victims as it goes);
        keys removed before the walk reaches them are not yielded. The store
        skips the ones it cannot evict."""


class LruPolicy(EvictionPolicy):
    """An OrderedDict of keys, oldest first.

    A touch is C calls only (``move_to_end`` mapped over the held keys): a
    lookup of a 64k-token prompt in 16-token blocks touches 4,096 keys, and
    a linked list of Python nodes cost twice as much (bench/pool.py lookup).

    An OrderedDict cannot be iterated while it changes, so ``victims``
    reads it in slices, each from the walk's place: the keys the walk has
    yielded that are still held and were not moved since form a prefix of
    the order, so the next slice starts after as many keys as that set
    holds. A key moved (touched or inserted) while a walk is open is taken
    out of that set and noted, so the walk skips it where its slice saw it
    and meets it at the recent end; a key removed ahead is not yielded.
    """

    _FIRST_SLICE = 32  # a walk's slices double from here: a short walk reads little, a long one linear

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()
        self._walks: list[_Walk] = []  # victims() generators not finished

    def insert(self, key: bytes) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None
        for walk in self._walks:
            walk.moved(key)

    def touch(self, keys: Iterable[bytes], *, all_held: bool = False) -> None:
        # A prefix is touched front to back, so its first block ends up most
        # recent: under pressure the tail of a prefix goes before its head,
        # which keeps the longest usable prefix alive. Unknown keys are
        # passed over (filter), in C like the moves.
        order = self._order
        seq = keys if isinstance(keys, (list, tuple)) else list(keys)
        if not self._walks:
            if all_held:
                try:
                    deque(map(order.move_to_end, reversed(seq)), 0)
                    return
                except KeyError:
                    pass  # one was not: moving them all again, filtered, gives the same order
            deque(map(order.move_to_end, filter(order.__contains__, reversed(seq))), 0)
            return
        for key in reversed(seq):
            if key in order:
                order.move_to_end(key)
                for walk in self._walks:
                    walk.moved(key)

    def remove(self, key: bytes) -> None:
        if self._order.pop(key, _ABSENT) is not _ABSENT:
            for walk in self._walks:
                walk.passed.discard(key)

    def in_order(self) -> Iterator[bytes]:
        return iter(self._order)  # C iteration: a walk's bookkeeping cost 1-2 us a key

    def reorder_as(self, order: Iterable[bytes]) -> None:
        """Put the keys held in the order they have in ``order`` (first to
        evict first); keys held that ``order`` lacks come before them, in
        their order. Not while a ``victims`` walk of this policy is open.
        C calls only (a move of each key held that ``order`` names: half the
        time of building a new order)."""
        if self._walks:
            raise RuntimeError("reorder_as with a victims() walk open")
        order_map = self._order
        deque(map(order_map.move_to_end, filter(order_map.__contains__, order)), 0)

    def victims(self) -> Iterator[bytes]:
        walk = _Walk()
        self._walks.append(walk)
        order = self._order
        size = self._FIRST_SLICE
        try:
            while True:
                walk.since_slice.clear()  # moves before the slice are where the slice saw them
                start = len(walk.passed)
                chunk = list(islice(order, start, start + size))
                if not chunk:
                    return
                for key in chunk:
                    if key not in order or key in walk.since_slice:
                        continue  # removed, or moved to the recent end: met there
                    walk.passed.add(key)
                    yield key
                # Each slice is read from the front (an OrderedDict cannot
                # seek), past the keys passed over: doubling without a cap
                # keeps a walk's cost linear in what it reads (a cap made a
                # walk past 200k kept keys read 25x more).
                size *= 2
        finally:
            self._walks.remove(walk)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


_ABSENT = object()


class _Walk:
    """An open ``victims`` walk: the keys it yielded that still stand where
    it met them (a prefix of the order), and the keys moved since its
    current slice was read."""

    __slots__ = ("passed", "since_slice")

    def __init__(self) -> None:
        self.passed: set[bytes] = set()
        self.since_slice: set[bytes] = set()

    def moved(self, key: bytes) -> None:
        self.passed.discard(key)
        self.since_slice.add(key)
