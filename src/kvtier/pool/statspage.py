"""The pool's counters in a page of shared memory, read without a call.

vLLM asks every instance for its connector's statistics once per engine
step, on the scheduler's thread, before the step's tokens go out. Through
the meta service's socket that was a round trip that, while the instance's
own forward pass held both cores of a small machine, waited 1.6 ms (median)
for the service to be scheduled: on the first token's path of a pool hit
(bench/pool.py ttft). The service now writes its counters into a small file
beside its arena a few times a second, and each instance maps it and reads
it as workers read the arena: no call at all.

One writer (the service), any number of readers. The page holds a sequence
number, the length of a MessagePack map of counter names to integers, and
the map. The writer makes the number odd, writes the map, then makes it even
again; a reader copies the map between two reads of the number and keeps it
only if both are the same even number (a seqlock), else tries again and,
after a few tries, answers None (the caller asks the service instead). The
counters are statistics: a torn read costs a stale figure, never a block.

The file is the service's own (pool/shmfile.py).
"""

from __future__ import annotations

import struct

import msgspec

from kvtier.pool.shmfile import SharedFile

PAGE_BYTES = 64 << 10
_HEAD = struct.Struct("<QI")  # sequence number, length of the map
_TRIES = 8
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict[str, int])


class StatsPage(SharedFile):
    """A counters page: :meth:`create` (the service) or :meth:`attach` (an instance)."""

    _seq = 0

    @classmethod
    def create(cls, path: str) -> StatsPage:
        return cls(path, *cls._create(path, PAGE_BYTES), owner=True)

    @classmethod
    def attach(cls, path: str) -> StatsPage:
        return cls(path, *cls._attach(path, PAGE_BYTES, "a counters page"), owner=False)

    def write(self, counters: dict[str, int]) -> bool:
        """Publish ``counters`` (the service); False when they do not fit."""
        body = _encoder.encode(counters)
        if _HEAD.size + len(body) > PAGE_BYTES:
            return False
        mm = self._mm
        self._seq += 1  # odd: being written
        mm[: _HEAD.size] = _HEAD.pack(self._seq, 0)
        mm[_HEAD.size : _HEAD.size + len(body)] = body
        self._seq += 1  # even: whole
        mm[: _HEAD.size] = _HEAD.pack(self._seq, len(body))
        return True

    def read(self) -> dict[str, int] | None:
        """The counters last published whole; None if none are (yet) or the
        writer kept changing them under every try."""
        mm = self._mm
        for _ in range(_TRIES):
            seq, n = _HEAD.unpack_from(mm, 0)
            if seq % 2 or not seq or n > PAGE_BYTES - _HEAD.size:
                continue
            body = mm[_HEAD.size : _HEAD.size + n]
            if _HEAD.unpack_from(mm, 0)[0] != seq:
                continue
            try:
                return _decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        return None
