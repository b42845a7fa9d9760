"""ReadyIndex: the DRAM blocks a probe may count without looking at them.

A probe of a 64k-token prompt asks for 4,096 keys, on vLLM's scheduler
thread or, for every instance of a node, in the meta service. Its first
part is the run of leading keys whose DRAM entry is plain READY (held, not
in the store's odd set: not PENDING, PROMOTING, doomed or to be freed).
Found key by key, that run cost a dict lookup per key, each a cache miss on
an entry and a key object: 0.6-1 ms for 4,096 keys on the 2-core test
machine. Here the same set lives in a :class:`KeyTable` over the DRAM
slots (the key of each slot in it, the hash table), and the run is found
with a few array passes over the request's keys as one buffer: the keys
need not even become bytes objects (the meta service hands over the
blob it received).

The store tells the index of every change (:meth:`set` when an entry
becomes plain READY, :meth:`unset` when it stops being so or leaves DRAM)
on its per-key paths, which pay one dict store for it; the changes are
applied in one vectorised batch (:meth:`flush`) before a lookup reads the
table, and by the store after a step's saves complete. Only the last
change of a key counts.

What it answers is a count: loads pin and read through the store's
entries, never through this index, so a wrong answer here could only make
a hit a miss (or a miss that the pin then finds), never hand out the
wrong slot. The store checks the index against its entries in the tests
(:meth:`TieredStore.odd_keys_consistent`). Not thread safe: called under
the store's lock.

The meta service keeps it in a file of shared memory that instances map
(pool/readymap.py): :data:`HEADER` first, with a sequence number that
:meth:`flush` makes odd while it changes the table and even again after (a
seqlock), then the key table. An instance counts a run there without a
call; the count is as good as the service's own, since either is checked
by the pin.
"""

from __future__ import annotations

import struct
import time

import numpy as np

from kvtier.keys import KEY_BYTES, KEY_DTYPE
from kvtier.tier.key_table import NO_SLOTS, KeyTable

# A quarter full at most: a lookup's rounds end when its longest probe run
# does, and the table is 16 bytes a DRAM slot (a 2 GiB pool of 64 KiB
# blocks: 512 KiB).
MAX_LOAD = 0.25
# The shared form's memory: this header (magic, sequence number, slots,
# hash table positions) in its first HEADER_BYTES, then the key table.
HEADER = struct.Struct("<8sQQQ")
MAGIC = b"kvtready"
HEADER_BYTES = 64


def memory_bytes(num_slots: int) -> int:
    """Bytes of the shared form's memory for ``num_slots`` DRAM slots."""
    key_bytes, size = KeyTable.sizes(num_slots, MAX_LOAD)
    return HEADER_BYTES + key_bytes + size * 4


class ReadyIndex(KeyTable):
    """Key -> DRAM slot of the plain READY blocks, changes applied in batches."""

    def __init__(self, num_slots: int, memory: memoryview | None = None) -> None:
        """``memory``: :func:`memory_bytes` of shared memory to keep the
        table in, header first (the meta service's); its own otherwise."""
        self.shared = memory is not None
        if memory is None:
            super().__init__(num_slots, max_load=MAX_LOAD)
            self._seq = np.zeros(1, dtype="<u8")
        else:
            if len(memory) < memory_bytes(num_slots):
                raise ValueError(f"{len(memory)} bytes hold no ready index of {num_slots} slots")
            super().__init__(num_slots, max_load=MAX_LOAD, memory=memory[HEADER_BYTES:])
            HEADER.pack_into(memory, 0, MAGIC, 0, num_slots, len(self._table))
            self._seq = np.frombuffer(memory, dtype="<u8", count=1, offset=8)
        self._in = np.zeros(max(1, num_slots), dtype=bool)  # the slot's key is in the table
        self._count = 0
        self.flushed_at = time.monotonic()  # of the last flush (or of the making)
        self.leaving = 0  # keys noted since the last flush that its table holds (the store counts them)
        self.changes: dict[bytes, int] = {}  # key -> its slot, or -1: out (written by set, unset, and the store)

    def count(self) -> int:
        """Keys in the table, once the changes noted are applied (applies them)."""
        self.flush()
        return self._count

    def set(self, key: bytes, slot: int) -> None:
        """``key``'s block in DRAM ``slot`` is plain READY (from the next lookup on)."""
        self.changes[key] = slot

    def unset(self, key: bytes) -> None:
        """``key`` is not plain READY, or not in DRAM (a key never set is passed over)."""
        self.changes[key] = -1

    def flush(self) -> None:
        """Apply the changes noted, vectorised: the keys changed leave the
        table, then those set go in at their slots. A slot given to a key
        while the table still holds another key there (which the store
        never does: the other key is unset first) is taken from that key."""
        changes = self.changes  # the same dict for the index's life: the store holds it too
        if not changes:
            return
        self.flushed_at = time.monotonic()
        n = len(changes)
        joined = b"".join(changes)
        if len(joined) != n * KEY_BYTES:  # the store admits 16-byte keys only: none other is ever set
            for key in [k for k in changes if len(k) != KEY_BYTES]:
                del changes[key]
            n = len(changes)
            joined = b"".join(changes)
        want = np.frombuffer(joined, dtype="<u8").reshape(n, 2)
        slots = np.fromiter(changes.values(), dtype=np.int64, count=n)
        changes.clear()
        self.leaving = 0
        found = self._find_array(want) if self._count else np.full(n, -1, dtype=np.int64)
        new = slots >= 0
        seq = int(self._seq[0]) | 1
        self._seq[0] = seq  # odd: readers of the shared form look again, or ask the service
        gone = np.concatenate([found[found >= 0], slots[new][self._in[slots[new]]]])
        if gone.size:
            gone = np.unique(gone)
            self._delete_many(gone)
            self._in[gone] = False
            self._count -= int(gone.size)
        if new.any():
            add, first = np.unique(slots[new], return_index=True)  # one key a slot (see the docstring)
            self._keys[add] = want[new][first]
            self._insert_many(add)
            self._in[add] = True
            self._count += int(add.size)
        self._seq[0] = seq + 1  # even: whole again (left odd by a failure on the way, until the next flush)

    def leading(self, want: np.ndarray) -> tuple[int, np.ndarray]:
        """How many of the leading keys, given as an (n, 2) "<u8" array of
        their halves, are in the index (a run that ends at the first key
        that is not), and the slots of that run."""
        self.flush()
        if not self._count:
            return 0, NO_SLOTS
        return self.run_of(want)

    def holds_at(self, key: bytes, slot: int) -> bool:
        """Whether the table holds ``key`` at ``slot`` (as of the last flush)."""
        return bool(self._in[slot]) and self._key_bytes[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] == key

    def held_slots(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` (valid slot numbers) hold a key in the table, as
        of the last :meth:`flush`: a mask."""
        return self._in[slots]

    def keys_of(self, slots: np.ndarray) -> list[bytes]:
        """The keys the table has for ``slots`` (each set, and not given
        to another key since), as bytes."""
        return np.frombuffer(self._key_bytes, dtype=KEY_DTYPE)[slots].tolist()

    def held(self) -> dict[bytes, int]:
        """Every key in the table with its slot, each found again by lookup (tests)."""
        self.flush()
        out = {}
        for slot in np.flatnonzero(self._in).tolist():
            key = bytes(self._key_bytes[slot * KEY_BYTES : (slot + 1) * KEY_BYTES])
            if self._find(key)[1] == slot:
                out[key] = slot
        return out

