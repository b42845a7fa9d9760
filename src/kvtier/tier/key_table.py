"""KeyTable: 16-byte block keys -> slot numbers, in flat arrays.

The hash table under both indexes that a lookup reads thousands of keys
from at once: the SSD tier's (:class:`~kvtier.tier.ssd_index.SsdIndex`) and
the DRAM blocks a probe counts without looking at their entries
(:class:`~kvtier.ready_index.ReadyIndex`). Every key lives in the slot it
names (16 bytes per slot, numpy views over one bytearray); the table is
open addressing with linear probing over int32 slot numbers, a power of two
at most ``max_load`` full, and deletes shift later members back so no
tombstones pile up. Not thread safe: its owner calls it under its lock.

Lookups come in two forms: :meth:`_find` key by key (memoryviews give
Python ints, several times faster than numpy scalars), and
:meth:`_find_array` for a batch, where every key looks at its home
position in one round of array passes, and the few that must walk on do
so in rounds of a window of positions each. Both agree on every key
(tested against a dict).
"""

from __future__ import annotations

import numpy as np

from kvtier.keys import KEY_BYTES

_EMPTY = -1
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: test keys (small integers) spread as well as digests
_M64 = (1 << 64) - 1
# Offsets a batch lookup looks at in one round once past the keys' homes
# (a window of 8 positions); a round moves on by the window's length.
_WINDOW = np.arange(1, 9)
NO_SLOTS = np.zeros(0, dtype=np.int64)


class KeyTable:
    """Key of each of ``num_slots`` slots and the hash table that finds them."""

    def __init__(self, num_slots: int, max_load: float = 0.75, memory: memoryview | None = None,
                 table_size: int | None = None) -> None:
        """``memory``: the key array and then the hash table live there (the
        meta service's shared ready index, pool/readymap.py) instead of in
        memory of the table's own, laid out as :meth:`sizes` says; it is
        taken as it is (a reader's, filled by its writer) when
        ``table_size`` is given, and emptied otherwise."""
        if not 0 <= num_slots < 2**31 - 1:
            raise ValueError(f"num_slots must be in [0, 2**31 - 1), got {num_slots}")
        self.num_slots = num_slots
        n = max(1, num_slots)
        size = table_size if table_size is not None else self.sizes(num_slots, max_load)[1]
        if size < 8 or size & (size - 1):
            raise ValueError(f"a key table's size is a power of two of at least 8, got {size}")
        self._mask = size - 1
        self._shift = 64 - size.bit_length() + 1
        if memory is None:
            # Sliced per lookup: a 16-byte copy compares fastest.
            self._key_bytes: bytearray | memoryview = bytearray(n * KEY_BYTES)
            self._table = np.full(size, _EMPTY, dtype=np.int32)
        else:
            if len(memory) < n * KEY_BYTES + size * 4:
                raise ValueError(f"{len(memory)} bytes hold no key table of {num_slots} slots and {size} positions")
            self._key_bytes = memory[: n * KEY_BYTES]
            self._table = np.frombuffer(memory, dtype=np.int32, count=size, offset=n * KEY_BYTES)
            if table_size is None:
                self._table.fill(_EMPTY)
        self._keys = np.frombuffer(self._key_bytes, dtype="<u8").reshape(n, 2)
        self._t = memoryview(self._table)

    @staticmethod
    def sizes(num_slots: int, max_load: float = 0.75) -> tuple[int, int]:
        """(bytes of the key array, positions of the hash table) of a table of
        ``num_slots`` slots at most ``max_load`` full; the table's memory is
        the first and then 4 bytes a position."""
        n = max(1, num_slots)
        size = 8
        while size * max_load < n:
            size *= 2
        return n * KEY_BYTES, size

    def bucket(self, key: bytes) -> int:
        """Home position of ``key`` in the hash table (tests use it to make collisions)."""
        h = int.from_bytes(key, "little")  # the two halves as the vectorised path reads them ("<u8")
        return ((((h ^ (h >> 64)) & _M64) * _MIX) & _M64) >> self._shift

    def _homes(self, k: np.ndarray) -> np.ndarray:
        """Home positions of keys given as (n, 2) little-endian uint64 halves."""
        h = k[:, 0] ^ k[:, 1]
        h *= np.uint64(_MIX)  # arrays wrap without a warning (scalars would warn)
        h >>= np.uint64(self._shift)  # at least one bit: a position fits an int64 as it is
        return h.view(np.int64)

    def _buckets(self, slots: np.ndarray) -> np.ndarray:
        return self._homes(self._keys[slots])

    def _find(self, key: bytes) -> tuple[int, int]:
        """(table position, slot) of ``key``; slot -1 and the empty position where it would go."""
        t, kb, mask = self._t, self._key_bytes, self._mask
        pos = self.bucket(key)
        while True:
            s = t[pos]
            if s < 0:
                return pos, -1
            if kb[s * KEY_BYTES : s * KEY_BYTES + KEY_BYTES] == key:
                return pos, s
            pos = (pos + 1) & mask

    def _find_array(self, want: np.ndarray) -> np.ndarray:
        """Slots (-1 where absent) of keys given as (n, 2) "<u8" halves, vectorised.

        First every key looks at its home position, each half compared on
        its own (the ``all(axis=1)`` of an (n, 2) comparison cost ten times
        as much). Most keys end there, found or at an empty position; the few
        whose home holds another key walk on in windows (:meth:`_walk`).
        An empty position (-1) reads the last slot's key: should that be
        the key asked for, it is reported at slot -1, absent, which it is
        (a key in the table lies before the first empty position of its
        probe run)."""
        pos = self._homes(want)
        # take() with native ints: a fancy index of int32 slots into a strided
        # half cost four times as much (~37 against ~8 us for 4,096 keys),
        # and the rows come whole: both halves in one gather.
        s = self._table.take(pos).astype(np.intp)
        got = self._keys.take(s, axis=0)
        match = (got[:, 0] == want[:, 0]) & (got[:, 1] == want[:, 1])
        out = np.where(match, s, -1)
        walking = np.flatnonzero(s > out)  # another key there: the walk goes on
        if walking.size:
            self._walk(want[walking], pos[walking], walking, out)
        return out

    def run_of(self, want: np.ndarray) -> tuple[int, np.ndarray]:
        """How many of the leading keys ``want`` ((n, 2) "<u8" halves) are
        in the table, a run that ends at the first key that is not, and the
        slots of that run. A cold prompt costs one key's lookup."""
        if not len(want) or self._find(want[0].tobytes())[1] < 0:
            return 0, NO_SLOTS
        slots = self._find_array(want)
        miss = np.flatnonzero(slots < 0)
        n = int(miss[0]) if miss.size else len(want)
        return n, slots[:n]

    def _walk(self, want: np.ndarray, at: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
        """Go on with the walks of keys ``want`` (rows ``idx`` of ``out``)
        from table positions ``at``, the positions of ``_WINDOW`` a round: a
        round costs its array calls whatever its size, and at the loads used a
        window ends nearly every walk (a found key, or an empty position)."""
        table, mask = self._table, self._mask
        k0, k1 = self._keys[:, 0], self._keys[:, 1]
        while True:
            near = table[(at[:, None] + _WINDOW) & mask]
            match = (k0[near] == want[:, :1]) & (k1[near] == want[:, 1:])
            # One position at most holds the key; a match at an empty one reads -1.
            found = np.where(match, near, -1).max(axis=1)
            out[idx] = found
            on = (found < 0) & (near.min(axis=1) >= 0)  # neither the key nor an empty position yet
            if not on.any():
                return
            idx, want, at = idx[on], want[on], at[on] + len(_WINDOW)

    def _delete_at(self, pos: int) -> None:
        """Empty table position ``pos``, shifting later members of its probe run back (no tombstones)."""
        t, mask, kb = self._t, self._mask, self._key_bytes
        hole = j = pos
        while True:
            j = (j + 1) & mask
            s = t[j]
            if s < 0:
                break
            home = self.bucket(bytes(kb[s * KEY_BYTES : s * KEY_BYTES + KEY_BYTES]))
            # The member at j may move to the hole unless its home lies
            # cyclically in (hole, j]: then a lookup would start past the hole.
            if (home <= hole < j) or (hole < j < home) or (j < home <= hole):
                t[hole] = s
                hole = j
        t[hole] = _EMPTY

    def _delete_many(self, slots: np.ndarray) -> None:
        """Take the keys of ``slots`` (distinct, all in the table) out of the
        hash table, vectorised: the batch form of :meth:`_delete_at`.

        Their positions are found by probing all of them at once; they are
        emptied; then every key between a new hole and the next empty
        position (the only keys whose probe runs may cross a hole) is lifted
        out and inserted again, by the rounds :meth:`_insert_many` uses. The
        cost follows the batch and its probe runs, not the table: key by key
        in Python, a batch of 65,536 took 0.5 to 2 s.
        """
        table, mask = self._table, self._mask
        pos = self._buckets(slots)
        want = slots.astype(np.int32)
        found: list[np.ndarray] = []
        while want.size:
            hit = table[pos] == want
            found.append(pos[hit])
            want, pos = want[~hit], (pos[~hit] + 1) & mask
        holes = np.concatenate(found)
        table[holes] = _EMPTY
        lifted: list[np.ndarray] = []
        cur = (holes + 1) & mask
        while cur.size:
            cur = cur[table[cur] != _EMPTY]
            lifted.append(cur)
            cur = (cur + 1) & mask
        at = np.concatenate(lifted)
        if at.size:
            self._insert_many(table[at].copy(), at)

    def _insert_many(self, slots: np.ndarray, clear: np.ndarray | None = None) -> None:
        """Insert the keys of ``slots`` (not in the table) by linear probing in
        parallel rounds (as :meth:`SsdIndex._rebuild` does); ``clear``: table
        positions to empty first (they held them)."""
        table, mask = self._table, self._mask
        if clear is not None:
            table[clear] = _EMPTY
        pending = slots.astype(np.int32)
        pos = self._buckets(pending)
        while pending.size:
            empty = table[pos] == _EMPTY
            table[pos[empty]] = pending[empty]
            rest = table[pos] != pending
            pending, pos = pending[rest], (pos[rest] + 1) & mask

    def table_bytes(self) -> int:
        """Bytes of the key array and the hash table."""
        return len(self._key_bytes) + self._table.nbytes
