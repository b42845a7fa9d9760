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

The file is the service's own: created 0600 with O_EXCL in the pool's
shared-memory folder, held under an exclusive ``flock`` for its lifetime
(so :func:`~kvtier.tier.dram.remove_stale_files` tells a dead service's
page from a live one's), and removed when the service closes it.
"""

from __future__ import annotations

import mmap
import os
import struct

import msgspec

from kvtier.tier.dram import create_owned

PAGE_BYTES = 64 << 10
_HEAD = struct.Struct("<QI")  # sequence number, length of the map
_TRIES = 8
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict[str, int])


class StatsPage:
    """A counters page: :meth:`create` (the service) or :meth:`attach` (an instance)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.owner = owner
        self._seq = 0

    @classmethod
    def create(cls, path: str) -> StatsPage:
        fd = create_owned(path)  # O_EXCL, 0600, the owner's flock
        try:
            os.ftruncate(fd, PAGE_BYTES)
            mm = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, fd, mm, owner=True)

    @classmethod
    def attach(cls, path: str) -> StatsPage:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size < PAGE_BYTES:
                raise ValueError(f"{path} is not a counters page")
            mm = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, owner=False)

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

    def close(self) -> None:
        if self._fd < 0:
            return
        self._mm.close()
        if self.owner:
            try:
                os.unlink(self.path)  # while the lock is still held, as the arena does
            except OSError:
                pass
        os.close(self._fd)
        self._fd = -1
