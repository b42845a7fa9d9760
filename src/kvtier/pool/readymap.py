"""The meta service's ready index in shared memory: lookups without a call.

A lookup of a 64k-token prompt (4,096 keys) through the meta service was a
round trip: the keys sent, the service woken, the count sent back, the
scheduler woken. On a 2-core machine each wake waited for a core, and that
wait, not the count (~0.3 ms of array passes), made the tail: p99 over
1 ms. The count the service makes first is read from its ready index
(ready_index.py), the DRAM blocks that are plain READY; the service keeps
that index in a file of shared memory beside its arena, and each instance
maps it read-only and counts the leading keys there itself.

A run that covers the whole request is answered that way, and the
instance tells the service what it counted without waiting for an answer
(wire.Touch, the run's slots, sent with the instance's next call: see
pool/client.py): the service counts the lookup for its hit
counters and stamps the blocks for their recency, as it does for a run it
counts itself (one array call, where counting the run again cost it as
much as the instance's count). A run that stops early leaves the rest of
the keys (blocks on SSD, moving, in the cluster) to the service, asked by
call with the head's slots (wire.Probe.ahead). A request whose last key
the index does not hold is asked by call at once: its run stops before the
end, and the service would count it again (a conversation's next turn
extends a prefix held: counted here first, the lookup cost 10-25 % more).

The index changes under the reader: the service makes its sequence number
odd while it changes the table and even after (a seqlock, ready_index.py).
A count made between two reads of the same even number stands; else it is
made again, and after a few tries the instance asks the service. Nothing
here hands out a slot: the pin that follows a count is the service's, and
it finds no block that left since (the load is then recomputed). A count
can be wrong only in being stale: the service applies a block's leaving
once the call that made it has been answered (the store's settle), and a
reader between the two counts that block; its pin then fails, as it would
for a block evicted between a lookup by call and its pin.
"""

from __future__ import annotations

import numpy as np

from kvtier.pool.shmfile import SharedFile
from kvtier.ready_index import HEADER, HEADER_BYTES, MAGIC, MAX_LOAD, memory_bytes
from kvtier.tier.key_table import KeyTable

_TRIES = 3


class ReadyMap(SharedFile):
    """The file: :meth:`create` (the service, whose store writes the index
    in :attr:`memory`) or :meth:`attach` (an instance, which reads it with
    :meth:`leading`)."""

    memory: memoryview | None = None
    _table: KeyTable | None = None
    _seq: np.ndarray | None = None

    @classmethod
    def create(cls, path: str, num_slots: int) -> ReadyMap:
        """A file for the ready index of ``num_slots`` DRAM slots; the store
        lays it out (``TieredStore.share_ready(map.memory)``)."""
        fd, mm = cls._create(path, memory_bytes(num_slots))
        self = cls(path, fd, mm, owner=True)
        self.memory = memoryview(mm)
        return self

    @classmethod
    def attach(cls, path: str) -> ReadyMap:
        fd, mm = cls._attach(path, HEADER_BYTES, "a ready index")
        self = cls(path, fd, mm, owner=False)
        try:
            magic, _, num_slots, size = HEADER.unpack_from(mm, 0)
            if magic != MAGIC or len(mm) != memory_bytes(num_slots) or \
                    size != KeyTable.sizes(num_slots, MAX_LOAD)[1]:
                raise ValueError(f"{path} is not a ready index (or not one laid out by this kvtier version)")
            view = memoryview(mm)
            self._table = KeyTable(num_slots, MAX_LOAD, memory=view[HEADER_BYTES:], table_size=size)
            self._seq = np.frombuffer(view, dtype="<u8", count=1, offset=8)
        except BaseException:
            self.close()
            raise
        return self

    def holds(self, key: bytes) -> bool:
        """Whether the index holds ``key`` now, looked at once (a read torn
        by a change can only send a lookup the slower way)."""
        table = self._table  # None once closed (by another thread, maybe)
        try:
            return table is not None and table._find(key)[1] >= 0
        except IndexError:
            return False

    def leading(self, want: np.ndarray) -> tuple[int, np.ndarray] | None:
        """How many of the leading keys (an (n, 2) "<u8" array of their
        halves) the service's ready index holds, and their slots, counted
        while the index did not change; None if it changed under every try
        (ask the service)."""
        seq, table = self._seq, self._table  # None once closed (by another thread, maybe)
        if seq is None or table is None:
            return None
        for _ in range(_TRIES):
            before = int(seq[0])
            if before & 1:
                continue
            try:
                run = table.run_of(want)
            except IndexError:  # a slot read mid-change past the keys (it cannot be: each is whole)
                continue
            if int(seq[0]) == before:
                return run
        return None

    def close(self) -> None:
        """Unmap and, the service's, remove. The views go first; while a
        reader (or the store) still holds one the mapping stays (mmap
        refuses to close), and goes with the last of them."""
        memory, self.memory, self._table, self._seq = self.memory, None, None, None
        if memory is not None:
            try:
                memory.release()
            except BufferError:
                pass  # the store's arrays still use it: unmapped once they go
        super().close()
