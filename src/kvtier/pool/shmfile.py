"""Files of shared memory that the meta service writes and instances map.

The counters page (pool/statspage.py) and the ready index
(pool/readymap.py) are both the service's own: created 0600 with O_EXCL in
the pool's shared-memory folder, held under an exclusive ``flock`` for
their lifetime (so :func:`~kvtier.tier.dram.remove_stale_files` tells a
dead service's file from a live one's), and removed when the service
closes them. An instance maps them read-only; one it cannot map (another
user's, a size that is not the kind's) it does without, asking the service
instead.
"""

from __future__ import annotations

import mmap
import os

from kvtier.tier.dram import create_owned


class SharedFile:
    """A mapped file: made by :meth:`_create` (the service) or :meth:`_attach` (an instance)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.owner = owner

    @staticmethod
    def _create(path: str, nbytes: int) -> tuple[int, mmap.mmap]:
        fd = create_owned(path)  # O_EXCL, 0600, the owner's flock
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return fd, mm

    @staticmethod
    def _attach(path: str, min_bytes: int, what: str) -> tuple[int, mmap.mmap]:
        """Map ``path`` read-only, whole; ValueError if it has fewer than ``min_bytes``."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < min_bytes:
                raise ValueError(f"{path} is not {what}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return fd, mm

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._mm.close()
        except BufferError:
            pass  # arrays over it live on (a store being closed elsewhere): unmapped once they go
        if self.owner:
            try:
                os.unlink(self.path)  # while the lock is still held, as the arena does
            except OSError:
                pass
        os.close(self._fd)
        self._fd = -1
