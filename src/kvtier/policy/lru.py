"""Least-recently-used order over keys.

Called by the store, under its lock, in the process that owns the index.
Every operation costs in proportion to the keys it is given: ``victims``
walks the live order lazily, so a caller that needs ten victims of a million
keys looks at about ten.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
        """Keys from first to evict to last, lazily: the walk costs what the
        caller takes from it, not the number of keys held. The caller may
        remove keys while it walks (the store drops victims as it goes);
        keys removed before the walk reaches them are not yielded. The store
        skips the ones it cannot evict."""


class _Node:
    __slots__ = ("prev", "next", "key", "live")

    def __init__(self, key: bytes | None = None) -> None:
        self.prev: _Node = self
        self.next: _Node = self
        self.key = key
        self.live = True


class LruPolicy(EvictionPolicy):
    """A doubly linked list through a dict of nodes, oldest first.

    An OrderedDict (the earlier version) cannot be walked while it changes,
    so ``victims`` had to copy every key first: a million keys copied to
    evict ten. Here a removed key's node is unlinked but keeps its forward
    pointer, so a walk standing on it goes on with the node that followed
    it. A key moved while a walk is open gets a new node at the recent end
    (the walk meets it there); with no walk open, its node is moved.
    """

    def __init__(self) -> None:
        self._root = _Node()
        self._nodes: dict[bytes, _Node] = {}
        self._walks = 0  # victims() generators not finished

    def _unlink(self, node: _Node) -> None:
        node.prev.next = node.next
        node.next.prev = node.prev
        node.live = False  # node.next stays: a walk standing here continues from it

    def _append(self, key: bytes) -> None:
        root = self._root
        node = _Node(key)
        node.prev, node.next = root.prev, root
        root.prev.next = node
        root.prev = node
        self._nodes[key] = node

    def insert(self, key: bytes) -> None:
        old = self._nodes.get(key)
        if old is not None:
            self._unlink(old)
        self._append(key)

    def touch(self, keys: Iterable[bytes]) -> None:
        # A prefix is touched front to back, so its first block ends up most
        # recent: under pressure the tail of a prefix goes before its head,
        # which keeps the longest usable prefix alive. Inlined: a lookup
        # touches every block of a long prompt on vLLM's scheduler thread.
        nodes, root = self._nodes, self._root
        for key in reversed(keys if isinstance(keys, (list, tuple)) else list(keys)):
            node = nodes.get(key)
            if node is None:
                continue
            prev, nxt = node.prev, node.next
            prev.next = nxt
            nxt.prev = prev
            if self._walks:
                node.live = False
                node = _Node(key)
                nodes[key] = node
            last = root.prev
            node.prev = last
            node.next = root
            last.next = node
            root.prev = node

    def remove(self, key: bytes) -> None:
        node = self._nodes.pop(key, None)
        if node is not None:
            self._unlink(node)

    def victims(self) -> Iterator[bytes]:
        self._walks += 1
        try:
            root = self._root
            node = root.next
            while node is not root:
                if node.live:
                    yield node.key  # type: ignore[misc]
                node = node.next
        finally:
            self._walks -= 1

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)
