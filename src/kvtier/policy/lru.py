"""Least-recently-used order over keys.

Called by the store, under its lock, in the process that owns the index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator


class EvictionPolicy(ABC):
    """Orders keys for eviction. Knows nothing of pins or slots."""

    @abstractmethod
    def insert(self, key: bytes) -> None: ...

    @abstractmethod
    def touch(self, keys: Iterable[bytes]) -> None: ...

    @abstractmethod
    def remove(self, key: bytes) -> None: ...

    @abstractmethod
    def victims(self) -> Iterator[bytes]:
        """Keys from first to evict to last; the store skips the ones it cannot evict."""


class LruPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, keys: Iterable[bytes]) -> None:
        # A prefix is touched front to back, so its first block ends up most
        # recent: under pressure the tail of a prefix goes before its head,
        # which keeps the longest usable prefix alive.
        order = self._order
        for key in reversed(list(keys)):
            if key in order:
                order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[bytes]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)
