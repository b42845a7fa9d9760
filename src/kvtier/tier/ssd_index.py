"""SsdIndex: the in-memory index of an SSD tier, a few flat arrays per slot.

Runs in the process that owns the store (vLLM's scheduler process for the
embedded backend); every method is called under the store's lock and is not
thread safe on its own.

A multi-TB SSD tier holds tens of millions of slots, so the index keeps no
Python object per slot (a dict entry, an entry object and an LRU node cost
~137 bytes per block). Everything is indexed by the *global slot number*
``0 .. num_slots-1`` (:meth:`SsdTier.location` maps it to a path and a slot
there):

- ``keys``      16 bytes per slot (a bytearray, numpy views over it);
- ``checksums`` and ``seqs``, uint64: what the slot's header on disk says;
- ``recency``   int64: a counter, bumped on insert and on every touch; the
  least recently used READY slots have the smallest values;
- ``state``     one byte: FREE, DIRTY (free, but its header on disk may
  still name an older block, so it is emptied before reuse), WRITING (taken
  by a write in flight, not readable) and READY;
- a free stack of int32 slot numbers;
- an open-addressing hash table (linear probing, int32 slot numbers, a
  power of two at most 3/4 full) from key to slot, deletes by backward
  shift so no tombstones pile up (:class:`~kvtier.tier.key_table.KeyTable`,
  shared with the DRAM blocks' ready index);
- pins in a dict, slot -> count: few slots are pinned (being promoted) at
  once.

That is 45 bytes per slot plus 5.3 to 10.7 bytes of hash table (measured in
``bench/ssd_index.py`` and recorded in docs/benchmarks.md). The capacity is
fixed (the number of slots), so the table never grows.

Eviction picks its victims in one batch (``np.argpartition`` over the
recency of READY, unpinned slots) and removes them together; a large batch
rebuilds the hash table with vectorised probing instead of deleting key by
key, and a smaller one deletes its keys in place, also vectorised
(:meth:`_delete_many`), so its cost is a few array passes amortised over
the blocks it frees. The caller holds its lock for the whole batch, so a batch is at most
:func:`eviction_batch` slots: the store frees the room between its
watermarks over several calls instead of in one pause of seconds.

Order of calls: :meth:`adopt` once at start-up (what recovery found), then
:meth:`take` -> :meth:`begin_write` -> :meth:`publish` (or :meth:`remove`
on failure) for each write; :meth:`get` / :meth:`touch` for lookups;
:meth:`victims` -> :meth:`remove_many` for eviction; :meth:`release` returns
slots whose headers an invalidation emptied (or failed to).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvtier.tier.key_table import _EMPTY, KEY_BYTES, KeyTable
from kvtier.tier.ssd import BlockRecord, SsdLocation

# Above this share of the held keys, removing a batch rebuilds the table
# (a few vectorised passes) instead of deleting key by key in Python.
_REBUILD_SHARE = 1 / 16
# Most slots one eviction batch frees. The store runs a batch under its lock,
# which the scheduler thread waits on: at 10M slots, evicting from the high
# to the low watermark in one batch (1M blocks) held it for 2-4 s. A batch of
# 1 % of the slots, at least 64 and at most this, keeps the pause bounded
# (docs/benchmarks.md); the rest of the room is freed by the next calls.
EVICT_BATCH_MAX = 65_536
# Below this many keys, a lookup or touch goes key by key: a few numpy calls
# cost more than a short loop.
_VECTOR_MIN = 48


def eviction_batch(num_slots: int) -> int:
    """Most slots one eviction call of an index of ``num_slots`` slots frees."""
    return min(EVICT_BATCH_MAX, max(64, num_slots // 100))


class SlotState(enum.IntEnum):
    FREE = 0
    DIRTY = 1  # free; its header on disk may still name a block: emptied before the slot is reused
    WRITING = 2
    READY = 3


# Plain ints for the per-key paths: comparing a memoryview's int with an IntEnum member is slower.
_FREE, _DIRTY, _WRITING, _READY = (int(s) for s in SlotState)


class SsdEntry:
    """A view of one slot of an :class:`SsdIndex`, made on access and never kept.

    Has the attributes the store used on its per-block objects: ``ready``,
    ``pins`` (settable), ``loc`` and ``rec`` (None unless READY).
    """

    __slots__ = ("_index", "slot")

    def __init__(self, index: SsdIndex, slot: int) -> None:
        self._index = index
        self.slot = slot

    @property
    def ready(self) -> bool:
        return self._index._st[self.slot] == _READY

    @property
    def pins(self) -> int:
        return self._index._pins.get(self.slot, 0)

    @pins.setter
    def pins(self, n: int) -> None:
        if n > 0:
            self._index._pins[self.slot] = n
        else:
            self._index._pins.pop(self.slot, None)

    @property
    def loc(self) -> SsdLocation:
        return self._index.locate(self.slot)

    @property
    def rec(self) -> BlockRecord | None:
        if not self.ready:
            return None
        return self._index.record(self.slot)


class SsdIndex(KeyTable):
    """Key -> slot, slot state, recency and the free stack of ``num_slots`` SSD slots.

    ``locate`` maps a global slot number to its :class:`SsdLocation` (the
    tier's :meth:`SsdTier.location`); only :attr:`SsdEntry.loc` uses it.
    """

    def __init__(self, num_slots: int, locate: Callable[[int], SsdLocation] | None = None) -> None:
        super().__init__(num_slots)
        self.locate = locate if locate is not None else (lambda slot: SsdLocation(0, slot))
        n = max(1, num_slots)
        self._checksums = np.zeros(n, dtype=np.uint64)
        self._seqs = np.zeros(n, dtype=np.uint64)
        self._recency = np.zeros(n, dtype=np.int64)
        self._state = np.zeros(n, dtype=np.uint8)
        self._free = np.zeros(n, dtype=np.int32)
        self._free[:num_slots] = np.arange(num_slots - 1, -1, -1)  # popped from the end: slot 0 first
        self._free_top = num_slots
        # Slots whose write failed, taken only once the stack is empty (a bad
        # sector taken again by every next batch would fail them all).
        self._last: collections.deque[int] = collections.deque()
        # memoryviews give Python ints on scalar access, several times faster than numpy scalars.
        self._st = memoryview(self._state)
        self._rec = memoryview(self._recency)
        self._fr = memoryview(self._free)
        self._pins: dict[int, int] = {}
        self._count = 0  # keys held (WRITING or READY)
        self._clock = 0

    def _rebuild(self, dedup: bool = False) -> list[int]:
        """Refill the hash table from the WRITING and READY slots, vectorised.

        Linear probing in rounds: every pending key tries its current
        position; where several land on one empty position one wins (the
        last write of a fancy assignment) and the others, like those that
        met an occupied position, move one on. A position once filled stays
        filled, so every key ends after an unbroken run from its home: the
        probing invariant lookups rely on.

        With ``dedup`` (recovery: a key may be on disk twice), copies of one
        key share a home and move in step, so a copy that meets its key at
        an occupied position is a duplicate: the higher sequence number
        keeps the position. Returns the slots of the copies that lost.
        """
        table, keys, mask = self._table, self._keys, self._mask
        table.fill(_EMPTY)
        pending = np.flatnonzero(self._state >= SlotState.WRITING).astype(np.int32)
        pos = self._buckets(pending)
        stale: list[int] = []
        while pending.size:
            empty = table[pos] == _EMPTY
            table[pos[empty]] = pending[empty]
            rest = table[pos] != pending
            pending, pos = pending[rest], pos[rest]
            if dedup and pending.size:
                same = (keys[table[pos]] == keys[pending]).all(axis=1)
                if same.any():  # rare: blocks written twice before a crash
                    for slot, at in zip(pending[same].tolist(), pos[same].tolist()):
                        held = int(table[at])
                        if self._seqs[slot] > self._seqs[held]:
                            table[at] = slot
                            stale.append(held)
                        else:
                            stale.append(slot)
                    pending, pos = pending[~same], pos[~same]
            pos = (pos + 1) & mask
        return stale

    # --- lookups ------------------------------------------------------------

    def __len__(self) -> int:
        """Keys held: being written or READY."""
        return self._count

    def __contains__(self, key: bytes) -> bool:
        return self._find(key)[1] >= 0

    def get(self, key: bytes) -> SsdEntry | None:
        slot = self._find(key)[1]
        return SsdEntry(self, slot) if slot >= 0 else None

    def __getitem__(self, key: bytes) -> SsdEntry:
        slot = self._find(key)[1]
        if slot < 0:
            raise KeyError(key)
        return SsdEntry(self, slot)

    def key(self, slot: int) -> bytes:
        return bytes(self._key_bytes[slot * KEY_BYTES : (slot + 1) * KEY_BYTES])

    def record(self, slot: int) -> BlockRecord:
        return BlockRecord(self.key(slot), int(self._seqs[slot]), int(self._checksums[slot]))

    def state(self, slot: int) -> SlotState:
        return SlotState(self._st[slot])

    def find_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """Slots of ``keys`` (int64, -1 where not held), vectorised.

        The lookup of a long prompt asks for thousands of keys at once; one
        :meth:`_find` per key costs ~0.3 us each in Python. Here the keys
        are looked up together (:meth:`KeyTable._find_array`: a round of
        array passes at their homes, then windows for the few that walk
        on). A key that is not 16 bytes is never held.
        """
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if not n or not self._count:
            return out
        if n < _VECTOR_MIN:
            for i, key in enumerate(keys):
                out[i] = self._find(key)[1]
            return out
        joined = b"".join(keys)
        if len(joined) != n * KEY_BYTES or any(len(k) != KEY_BYTES for k in keys):
            for i, key in enumerate(keys):
                out[i] = self._find(key)[1] if len(key) == KEY_BYTES else -1
            return out
        return self._find_array(np.frombuffer(joined, dtype="<u8").reshape(n, 2))

    def ready_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is READY (readable), vectorised."""
        slots = self.find_many(keys)
        held = slots >= 0
        ok = np.zeros(len(slots), dtype=bool)
        ok[held] = self._state[slots[held]] == _READY
        return ok.tolist()

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make ``keys`` the most recently used, the first one most of all.

        A prefix is touched front to back, so under pressure its tail goes
        before its head, which keeps the longest usable prefix alive.
        """
        if len(keys) < _VECTOR_MIN:
            rec = self._rec
            clock = self._clock
            for key in reversed(keys):
                slot = self._find(key)[1]
                if slot >= 0:
                    clock += 1
                    rec[slot] = clock
            self._clock = clock
            return
        slots = self.find_many(keys)
        held = slots[slots >= 0]
        if held.size:
            # The first key ends most recent: stamps fall with the position.
            # A key given twice keeps the stamp of its first place, as the
            # loop above does (np.unique: one assignment per slot, no reliance
            # on the order numpy applies repeated indices in).
            uniq, first = np.unique(held, return_index=True)
            self._recency[uniq] = self._clock + held.size - first
            self._clock += int(held.size)

    # --- writes ---------------------------------------------------------------

    def take(self) -> tuple[int, bool] | None:
        """Pop a free slot: (slot, whether its old header must be emptied first), or None when full.

        The slot belongs to the caller until :meth:`begin_write` or :meth:`release`.
        """
        if self._free_top:
            self._free_top -= 1
            slot = self._fr[self._free_top]
        elif self._last:
            slot = self._last.popleft()  # the one that failed longest ago
        else:
            return None
        dirty = self._st[slot] == _DIRTY
        self._st[slot] = _FREE
        return slot, dirty

    def begin_write(self, key: bytes, slot: int) -> int | None:
        """Point ``key`` at ``slot`` (from :meth:`take`), WRITING: held, not readable.

        A slot the key pointed at before is freed (DIRTY: its header still
        names the key); returns it, else None.
        """
        pos, old = self._find(key)
        if old >= 0:
            self._t[pos] = slot
            self._free_slot(old, dirty=True)
        else:
            self._t[pos] = slot
            self._count += 1
        self._key_bytes[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] = key
        self._st[slot] = _WRITING
        return old if old >= 0 else None

    def publish(self, slot: int, checksum: int, seq: int) -> None:
        """The write into ``slot`` is durable: READY, and the most recently used."""
        assert self._st[slot] == _WRITING
        self._checksums[slot] = checksum
        self._seqs[slot] = seq
        self._clock += 1
        self._rec[slot] = self._clock
        self._st[slot] = _READY

    def remove(self, key: bytes, dirty: bool = True, free: bool = True) -> int | None:
        """Forget ``key``; its slot goes back to the free stack (DIRTY unless told
        its header is known empty), or with ``free`` False stays out of it
        until :meth:`release` (its header is being emptied). Returns the
        slot, or None if not held."""
        pos, slot = self._find(key)
        if slot < 0:
            return None
        self._delete_at(pos)
        self._count -= 1
        self._free_slot(slot, dirty, free)
        return slot

    def remove_slot(self, slot: int, dirty: bool = True, free: bool = True, last: bool = False) -> None:
        """:meth:`remove` of whatever key ``slot`` holds (WRITING or READY).
        ``last``: the slot goes to the bottom of the free stack, taken after
        every other free slot (its write failed: a bad sector taken again by
        every next batch would fail them all and stop SSD writes)."""
        assert self._st[slot] >= _WRITING, f"slot {slot} holds no key"
        got = self.remove(self.key(slot), dirty, free=free and not last)
        assert got == slot
        if free and last:
            self._last.append(slot)

    @property
    def free_count(self) -> int:
        """Slots free to take (with those taken last)."""
        return self._free_top + len(self._last)

    def release(self, slots: Iterable[int] | np.ndarray, dirty: bool) -> None:
        """Return slots that hold no key (taken and not used, or emptied by an
        invalidation) to the free stack."""
        arr = np.asarray(slots, dtype=np.int32).reshape(-1)
        if not arr.size:
            return
        assert (self._state[arr] < SlotState.WRITING).all(), "a released slot still holds a key"
        self._state[arr] = SlotState.DIRTY if dirty else SlotState.FREE
        self._push(arr)

    def _free_slot(self, slot: int, dirty: bool, free: bool = True) -> None:
        self._st[slot] = _DIRTY if dirty else _FREE
        self._pins.pop(slot, None)  # a late unpin finds the key gone, not a stranger in its slot
        if free:
            self._fr[self._free_top] = slot
            self._free_top += 1

    def take_dirty(self) -> np.ndarray:
        """Take every DIRTY slot off the free stack (freed, its header still
        on disk naming its old block), for the caller to empty those headers
        and :meth:`release` the slots: a reset must not leave old blocks that
        a restart would recover."""
        if self._last:  # back on the stack, bottom first, as the stack would have held them
            last = np.fromiter(self._last, dtype=np.int32, count=len(self._last))[::-1]
            self._last.clear()
            top = self._free_top
            self._free[last.size : top + last.size] = self._free[:top].copy()
            self._free[: last.size] = last
            self._free_top = top + last.size
        top = self._free_top
        stack = self._free[:top]
        dirty = self._state[stack] == _DIRTY
        if not dirty.any():
            return np.zeros(0, dtype=np.int32)
        taken = stack[dirty].astype(np.int32)
        keep = stack[~dirty].copy()
        self._free[: keep.size] = keep
        self._free_top = int(keep.size)
        return taken

    def _push(self, arr: np.ndarray) -> None:
        top = self._free_top
        self._free[top : top + arr.size] = arr
        self._free_top = top + arr.size

    # --- eviction and bulk removal --------------------------------------------------------

    def victims(self, n: int) -> np.ndarray:
        """Up to ``n`` READY, unpinned slots, least recently used first (one
        ``argpartition`` for the whole batch, then a sort of the batch only)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        cand = self.ready_unpinned()
        if n < cand.size:
            cand = cand[np.argpartition(self._recency[cand], n - 1)[:n]]
        return cand[np.argsort(self._recency[cand], kind="stable")]

    def ready_unpinned(self) -> np.ndarray:
        """Every READY slot nobody pins, in slot order (an operator's reset drops them all)."""
        cand = np.flatnonzero(self._state == _READY).astype(np.int32)
        if self._pins:
            cand = cand[~np.isin(cand, np.fromiter(self._pins, dtype=np.int32, count=len(self._pins)))]
        return cand

    def remove_many(self, slots: np.ndarray, dirty: bool = True, free: bool = True) -> None:
        """:meth:`remove_slot` of each of ``slots`` (distinct, each WRITING or READY)."""
        if not slots.size:
            return
        if slots.size < 16:  # a few: key by key is cheaper than setting up the arrays
            for s in slots.tolist():
                self.remove_slot(s, dirty, free)
            return
        assert (self._state[slots] >= SlotState.WRITING).all()
        if slots.size > self._count * _REBUILD_SHARE:
            self._state[slots] = SlotState.DIRTY if dirty else SlotState.FREE
            self._rebuild()
        else:
            self._delete_many(slots)
            self._state[slots] = SlotState.DIRTY if dirty else SlotState.FREE
        self._count -= int(slots.size)
        if self._pins:
            for s in slots.tolist():
                self._pins.pop(s, None)
        if free:
            self._push(slots.astype(np.int32))

    def pin_count(self) -> int:
        return sum(self._pins.values())

    # --- start-up -------------------------------------------------------------

    def adopt(self, slots: np.ndarray, keys: np.ndarray, seqs: np.ndarray, checksums: np.ndarray,
              unreadable: Iterable[int] = ()) -> int:
        """Load what recovery found: for a key found in several slots the copy
        with the highest sequence number wins; the other copies' slots and the
        slots whose headers could not be read are DIRTY. Recency follows the
        sequence numbers. Returns how many keys are held. Call once, on an
        empty index.

        ``keys``: (n, 16) uint8; ``slots``, ``seqs``, ``checksums``: (n,).
        """
        assert self._count == 0 and self._free_top == self.num_slots
        slots = np.asarray(slots, dtype=np.int64)
        seqs = np.asarray(seqs, dtype=np.uint64)
        self._keys[slots] = np.ascontiguousarray(keys, dtype=np.uint8).reshape(-1, KEY_BYTES).view("<u8")
        self._seqs[slots] = seqs
        self._checksums[slots] = np.asarray(checksums, dtype=np.uint64)
        self._recency[slots] = seqs.astype(np.int64)
        self._state[slots] = SlotState.READY
        # Duplicates are found while the hash table is built (no sort of all the keys).
        stale = np.asarray(self._rebuild(dedup=True), dtype=np.int64)
        self._state[stale] = SlotState.DIRTY
        self._count = int(slots.size - stale.size)
        self._clock = int(seqs.max()) if seqs.size else 0
        bad = np.asarray(list(unreadable), dtype=np.int64)
        if bad.size:
            bad = bad[self._state[bad] == SlotState.FREE]
            self._state[bad] = SlotState.DIRTY
        free = np.flatnonzero(self._state[: self.num_slots] < SlotState.WRITING)[::-1].astype(np.int32)
        self._free[: free.size] = free
        self._free_top = int(free.size)
        return self._count

    # --- accounting ---------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes of the arrays behind the index (pins not counted: a handful)."""
        return (len(self._key_bytes) + self._checksums.nbytes + self._seqs.nbytes + self._recency.nbytes
                + self._state.nbytes + self._free.nbytes + self._table.nbytes)
