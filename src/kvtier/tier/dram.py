"""DRAM tier: a pre-allocated arena of block slots in shared memory.

Where it runs: created by the process that owns the index (vLLM's scheduler
process for the embedded backend), attached by every worker process of the
same instance through the arena's path, which travels in the connector
metadata. All of them map the same file, so a block written by a worker is
read by another worker without a copy through the scheduler.

File layout (every offset 4 KiB aligned, so slots can feed O_DIRECT I/O
without a bounce buffer)::

    [superblock 4 KiB][slot headers, 128 B each][pad][slot 0][slot 1]...

A slot header holds the key of the block in the slot, a bit per rank that
has written its part, and one checksum per rank. Who writes what:

* the index owner calls :meth:`DramTier.clear` before it hands a slot to a
  writer and when it evicts; it never writes data;
* a writer (a worker rank) copies its part of the block into the slot, then
  calls :meth:`DramTier.seal`, which stores checksum, key and ready bit, in
  that order;
* a reader calls :meth:`DramTier.verify` after its copy: the key must match,
  every rank must be ready and each part's checksum must hold, else the copy
  is a miss.

The owner holds an exclusive ``flock`` on the file from creation until
:meth:`DramTier.close`, which unlinks the file under it; that lock, not a
process id, is what marks an arena alive to :func:`remove_stale_files` in
any process or container sharing the directory. Workers attach without it.
:func:`start_reaper` removes the file when the owner dies without closing
it (vLLM kills its engine core on SIGTERM without waiting).

The file is ``posix_fallocate``-d at creation: tmpfs would otherwise hand out
pages lazily and a full /dev/shm would kill the engine with SIGBUS on first
touch, long after start-up said all was well.

Huge pages: when the arena's directory is a hugetlbfs mount (``shm_dir``
pointed at, e.g., ``/dev/hugepages``), the arena is sized in whole huge
pages and lives on them (fewer TLB misses on 100+ GB pools). hugetlbfs
takes no ``write(2)``, so everything, superblock included, is written
through the mapping.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvtier.errors import ConfigError
from kvtier.hostmem import PageWarmer, hugetlbfs_page_size

_MAGIC = b"KVTDRAM2"
_SUPER = struct.Struct("<8sIIQQQQ16s")  # magic, version, ranks, num_slots, slot_bytes, slot_stride, data_off, ns
_PAGE = 4096
PART_ALIGN = _PAGE  # a rank's part of a slot is its bytes rounded up to this
MAX_RANKS = 8
# One ready byte per rank, not a shared bit mask: ranks seal the same slot
# from different processes at the same time, and a read-modify-write of a
# shared mask lost ranks' bits (a race reproduced with two processes sealing
# 4,096 slots; tests/unit/test_dram.py pins it). Each rank writes only its byte.
# ``gen`` counts the slot's clears (index owner): a load compares it before
# and after its copies, so a slot reused and refilled with the very header it
# had (the same block promoted back into it) is still seen as reused.
# Arenas of earlier versions had zeros there.
_HEADER = np.dtype(
    [("key", "V16"), ("ready", "u1", (MAX_RANKS,)), ("checksum", "<u8", (MAX_RANKS,)), ("published", "u1"),
     ("gen", "<u4"), ("pad", "V35")]
)
assert _HEADER.itemsize == 128


HEADER_BYTES = _HEADER.itemsize
# Offsets of the fields clear() writes, for struct-level writes to the map:
# through numpy's record fields a clear cost 5 us, most of a block's eviction.
_KEY_AT, _READY_AT, _PUBLISHED_AT, _GEN_AT = (_HEADER.fields[f][1] for f in ("key", "ready", "published", "gen"))
_GEN = struct.Struct("<I")
_NO_RANKS = bytes(MAX_RANKS)
HEADER_DTYPE = _HEADER  # a slot header as numpy reads a run of them (cluster values carry one each)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def page_size_of(directory: str) -> int:
    """The page size files in ``directory`` are made of: the huge page size
    on a hugetlbfs mount, else 4 KiB (the arena's own alignment)."""
    return hugetlbfs_page_size(directory) or _PAGE


def checksum(data: torch.Tensor, key: bytes) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes, seeded with the block's
    ``key`` (releases the GIL while hashing).

    Seeded, so a rank's part written and sealed for one key never verifies
    under another: a slot that two writers reached (a late writer of a
    session that ended, whose slot went to another key) fails its check
    even if the last seal named the other key.
    """
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()).cast("B"), seed=_seed(key))


def checksum_runs(runs: Iterable[Any], key: bytes) -> int:
    """:func:`checksum` of the bytes of ``runs`` (buffers: memoryviews,
    ctypes arrays) one after the other, the same digest as of one tensor
    holding them, without joining them."""
    h = xxhash.xxh3_64(seed=_seed(key))
    for run in runs:
        h.update(run)
    return h.intdigest()


def _seed(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE maps every page now, at start-up, instead of taking a page
    # fault per 4 KiB the first time a slot is written or read during serving.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)


def _mask(h: np.void) -> int:
    return sum(1 << r for r in range(MAX_RANKS) if h["ready"][r])


def create_owned(path: str) -> int:
    """Create ``path`` (must not exist, mode 0600) and take the owner's lock on it; the fd.

    The lock, held for the arena's lifetime, is how any process sharing
    the directory tells a live arena from a dead one's (see
    :func:`remove_stale_files`); process ids cannot, since another
    container's processes are invisible. A cleanup may lock the new file
    in the instant before we do and unlink it: then the path no longer
    names our file and we create it again.
    """
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a cleanup holds it
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(f"{path} was removed three times while being created")


def remove_stale_files(directory: str, prefix: str) -> list[str]:
    """Remove the arenas in ``directory`` whose owner is gone; return their names.

    An owner holds an exclusive ``flock`` on its arena for as long as it
    lives (:meth:`DramTier.create`), and the kernel drops it when the owner
    dies, however it dies. So a file named ``prefix...`` that can be locked
    here without waiting has no owner: it is unlinked while locked, so that
    no owner can have taken it in between. A file this process cannot open
    (another user's) is left alone. This replaced a ``kill(pid, 0)`` test
    that removed live arenas of other containers sharing /dev/shm
    (tests/unit/test_dram.py::test_stale_cleanup_keeps_a_locked_arena_of_an_invisible_pid).
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in sorted(names):
        if not name.startswith(prefix):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


# Run by start_reaper() as `python -I -S -c _REAPER path dev ino`: standard
# library only, so it starts in milliseconds and holds a few MiB.
_REAPER = """
import fcntl, os, sys
path, dev, ino = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if os.fork():
    os._exit(0)  # the parent returns at once; the child is nobody's child now
os.setsid()
try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
except OSError:
    sys.exit(0)
st = os.fstat(fd)
if (st.st_dev, st.st_ino) != (dev, ino):
    sys.exit(0)
fcntl.flock(fd, fcntl.LOCK_EX)  # granted once the owner closed the arena or died
try:
    if os.path.samestat(os.fstat(fd), os.lstat(path)):
        os.unlink(path)
except OSError:
    pass
"""


def start_reaper(tier: DramTier) -> None:
    """Start a small process that removes ``tier``'s file once its owner is gone.

    Why: vLLM's API server, on SIGTERM (``docker stop``), sends SIGTERM to
    the engine core and, with the default ``shutdown_timeout`` of 0,
    SIGKILL at once (vLLM 0.32: "Process manager: force killing remaining
    process EngineCore"), so neither the connector's ``shutdown`` nor an
    ``atexit`` hook gets to run, and the arena stayed in /dev/shm. The
    reaper waits for the owner's lock (:meth:`DramTier.create`), which the
    kernel releases however the owner ends, and unlinks the file under it
    if it is still the same file. It is double-forked into its own session,
    so vLLM's kill of the engine's process tree and a kill of the server's
    process group spare it; it holds no lock while it waits, so a cleanup
    by another engine is not delayed. Owner only. Raises ``OSError`` or
    ``subprocess.SubprocessError`` if the helper cannot be started.
    """
    assert tier.owner, "only the owner's arena is reaped"
    st = os.fstat(tier._fd)
    subprocess.run([sys.executable, "-I", "-S", "-c", _REAPER, tier.path, str(st.st_dev), str(st.st_ino)],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True, timeout=60)


@dataclass(frozen=True)
class SlotHeader:
    key: bytes
    ready_mask: int
    checksums: tuple[int, ...]


class DramTier:
    """Fixed-size slots in one shared-memory file.

    ``rank_bytes`` is what one rank writes per block; a slot holds
    ``ranks`` such parts, each 4 KiB aligned. Thread safety: distinct slots
    may be used from distinct threads; one slot is written by one writer at a
    time, which the index owner guarantees by handing it out once.
    """

    def __init__(self, path: str, fd: int, mm: mmap.mmap, ranks: int, num_slots: int,
                 rank_bytes: int, slot_stride: int, data_off: int, owner: bool) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.ranks = ranks
        self.num_slots = num_slots
        self.rank_bytes = rank_bytes
        self.rank_stride = _round_up(rank_bytes, _PAGE)
        self.slot_stride = slot_stride
        self.owner = owner
        self._headers = np.ndarray((num_slots,), dtype=_HEADER, buffer=mm, offset=_PAGE)
        self._data_off = data_off
        base = torch.frombuffer(mm, dtype=torch.uint8)
        self._slots = base[data_off : data_off + num_slots * slot_stride].view(num_slots, slot_stride)
        self._warmer: PageWarmer | None = None

    # --- life cycle -------------------------------------------------------

    @staticmethod
    def layout_for(capacity_bytes: int, rank_bytes: int, ranks: int) -> tuple[int, int, int]:
        """(num_slots, slot_stride, data_off) of an arena of at most ``capacity_bytes``."""
        slot_stride = _round_up(rank_bytes, _PAGE) * ranks
        num_slots = capacity_bytes // (slot_stride + _HEADER.itemsize)
        data_off = _round_up(_PAGE + num_slots * _HEADER.itemsize, _PAGE)
        while num_slots > 0 and data_off + num_slots * slot_stride > capacity_bytes:
            num_slots -= 1
            data_off = _round_up(_PAGE + num_slots * _HEADER.itemsize, _PAGE)
        return num_slots, slot_stride, data_off

    @classmethod
    def create(cls, path: str, capacity_bytes: int, rank_bytes: int, ranks: int = 1) -> DramTier:
        """Create a new arena file of at most ``capacity_bytes`` at ``path`` (must not exist).

        On a hugetlbfs mount the arena is a whole number of huge pages, at
        most ``capacity_bytes`` rounded down to one.
        """
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"ranks must be 1..{MAX_RANKS}, got {ranks}")
        page = page_size_of(os.path.dirname(os.path.abspath(path)))
        if page > _PAGE:
            capacity_bytes -= capacity_bytes % page
        num_slots, slot_stride, data_off = cls.layout_for(capacity_bytes, rank_bytes, ranks)
        if num_slots < 1:
            raise ConfigError("dram_size", capacity_bytes,
                              f"too small for one block of {rank_bytes * ranks} bytes")
        size = _round_up(data_off + num_slots * slot_stride, page)
        fd = create_owned(path)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                raise ConfigError("dram_size", capacity_bytes,
                                  f"cannot allocate {size} bytes in {os.path.dirname(path)}: {err.strerror}") \
                    from None
            mm = _map(fd, size)
            mm[: _SUPER.size] = _SUPER.pack(_MAGIC, 1, ranks, num_slots, rank_bytes, slot_stride, data_off, b"")
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, fd, mm, ranks, num_slots, rank_bytes, slot_stride, data_off, owner=True)

    @classmethod
    def adopt(cls, path: str) -> DramTier | None:
        """Become the owner of an arena whose owner is gone (a restarted
        meta service): take its lock, map it. None when another process
        still owns it (the lock is held) or the file is not an arena."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not os.path.samestat(os.fstat(fd), os.lstat(path)):
                raise OSError("replaced")
            tier = cls._map_existing(path, fd, owner=True)
        except (OSError, ValueError, struct.error):
            os.close(fd)
            return None
        return tier

    def sealed_blocks(self) -> list[tuple[bytes, int]]:
        """(key, slot) of every slot the index had published, sealed by all
        ranks, whose bytes match their checksums: what an adopted arena
        still holds intact."""
        out = []
        empty = bytes(16)
        for slot in range(self.num_slots):
            h = self._headers[slot]
            key = bytes(h["key"])
            if key == empty or not h["published"] or not h["ready"][: self.ranks].all():
                continue
            if all(checksum(self.rank_view(slot, r), key) == int(h["checksum"][r]) for r in range(self.ranks)):
                out.append((key, slot))
        return out

    def written_slots(self) -> list[int]:
        """Slots whose header names a key or has a rank's ready mark: what
        writers of a dead owner may have been filling."""
        h = self._headers[: self.num_slots]
        keyed = np.frombuffer(h["key"].tobytes(), dtype=np.uint8).reshape(-1, 16).any(axis=1)
        return np.flatnonzero(keyed | h["ready"].any(axis=1)).tolist()

    @classmethod
    def _map_existing(cls, path: str, fd: int, owner: bool) -> DramTier:
        raw = os.pread(fd, _SUPER.size, 0)
        magic, version, ranks, num_slots, rank_bytes, slot_stride, data_off, _ = _SUPER.unpack(raw)
        if magic != _MAGIC or version != 1:
            raise ValueError(f"{path} is not a kvtier DRAM arena")
        page = page_size_of(os.path.dirname(os.path.abspath(path)))
        size = _round_up(data_off + num_slots * slot_stride, page)
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{path} is shorter than its superblock says")
        mm = _map(fd, size)
        return cls(path, fd, mm, ranks, num_slots, rank_bytes, slot_stride, data_off, owner=owner)

    @classmethod
    def attach(cls, path: str) -> DramTier:
        """Map an existing arena (a worker). Takes no lock: the owner's lock
        alone says the arena is alive, and a worker that outlives its owner
        keeps its mapping even after a cleanup removed the path."""
        fd = os.open(path, os.O_RDWR)
        try:
            return cls._map_existing(path, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Drop this tier's mapping; the owner also removes the file.

        The memory is unmapped when the last view handed out (``rank_view``,
        slot matrices) is dropped, not before. Not ``mmap.close()``: a
        ``torch.frombuffer`` view keeps the mmap object alive but holds no
        buffer export, so ``close()`` would unmap under a live view and its
        next access would SIGSEGV (tests/unit/test_dram.py::
        test_view_outlives_close pins this).
        """
        if self._fd < 0:
            return
        if self._warmer is not None:
            self._warmer.close()
            self._warmer = None
        self._slots = None  # type: ignore[assignment]
        self._headers = None  # type: ignore[assignment]
        self._mm = None  # type: ignore[assignment]
        if self.owner:
            # Unlinked while the owner's lock is still held, then closed,
            # which releases it.
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1

    def keep_warm(self, interval_s: float) -> None:
        """Read a byte of every page of the arena every ``interval_s``
        seconds until :meth:`close` (:class:`kvtier.hostmem.PageWarmer`;
        0: never). For the owner: a load reads its slots at the speed the
        host gives memory left alone, which on a VM's host can be a
        fraction of memcpy's (a copy out of a shared-memory file idle for
        150 s ran at 5.4 GB/s here, out of one read a byte a page every
        second at 12.1 GB/s)."""
        if interval_s > 0 and self._warmer is None and self._fd >= 0:
            self._warmer = PageWarmer([self.mapped_range], interval_s, keep=self._mm,
                                      name="kvtier-warm-arena").start()

    @property
    def size_bytes(self) -> int:
        return self.num_slots * self.slot_stride

    # --- addresses (for a transfer engine that reads and writes the arena in place) ---

    @property
    def mapped_range(self) -> tuple[int, int]:
        """(address, bytes) of this process's mapping of the whole arena,
        headers and slots: what a transfer engine registers once."""
        return self._headers.ctypes.data - _PAGE, self._data_off + self.num_slots * self.slot_stride

    def header_address(self, slot: int) -> int:
        """Address of ``slot``'s header (``HEADER_BYTES``) in this process's mapping."""
        return self._headers.ctypes.data + slot * HEADER_BYTES

    def slot_address(self, slot: int) -> int:
        """Address of ``slot``'s data (``slot_stride`` bytes, 4 KiB aligned) in this process's mapping."""
        return self._headers.ctypes.data - _PAGE + self._data_off + slot * self.slot_stride

    # --- data -------------------------------------------------------------

    def rank_view(self, slot: int, rank: int = 0) -> torch.Tensor:
        """The bytes rank ``rank`` owns in ``slot`` (uint8, ``rank_bytes`` long, 4 KiB aligned)."""
        off = rank * self.rank_stride
        return self._slots[slot, off : off + self.rank_bytes]

    def slot_buffer(self, slot: int) -> memoryview:
        """All of ``slot`` (every rank, ``slot_stride`` bytes, 4 KiB aligned): an O_DIRECT buffer."""
        off = self._data_off + slot * self.slot_stride
        return memoryview(self._mm)[off : off + self.slot_stride]

    # --- headers ----------------------------------------------------------

    def seal_all(self, slot: int, key: bytes, ready_mask: int, checksums: tuple[int, ...]) -> None:
        """Restore a whole header, as saved with the block elsewhere (index owner, after a promotion)."""
        h = self._headers[slot]
        for rank, digest in enumerate(checksums[:MAX_RANKS]):
            h["checksum"][rank] = digest
        h["key"] = np.void(key)
        for rank in range(MAX_RANKS):
            h["ready"][rank] = (ready_mask >> rank) & 1

    def restore_header(self, slot: int, raw: bytes | memoryview) -> None:
        """Write a whole header copied out of an arena (``HEADER_BYTES``, its
        block verified against it by the caller), unpublished, keeping this
        slot's count of clears (index owner)."""
        h = np.frombuffer(raw, dtype=_HEADER, count=1).copy()
        h["published"] = 0
        h["gen"] = self._headers[slot]["gen"]
        self._headers[slot : slot + 1] = h  # one write: never published, nor another count, in between

    def clear(self, slot: int, key: bytes = bytes(16)) -> None:
        """Mark ``slot`` as holding nothing readable (index owner only),
        before anything rewrites its bytes; counts the clear in ``gen``."""
        if len(key) != 16:
            raise ValueError(f"a slot's key is 16 bytes, not {len(key)}")
        mm, at = self._mm, _PAGE + slot * HEADER_BYTES
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} of {self.num_slots}")
        mm[at + _PUBLISHED_AT] = 0
        mm[at + _READY_AT : at + _READY_AT + MAX_RANKS] = _NO_RANKS
        _GEN.pack_into(mm, at + _GEN_AT, (_GEN.unpack_from(mm, at + _GEN_AT)[0] + 1) & 0xFFFFFFFF)
        mm[at + _KEY_AT : at + _KEY_AT + 16] = key

    def publish(self, slot: int, published: bool = True) -> None:
        """Record that the index made ``slot`` readable (index owner only).

        Only an arena adopted after its owner died reads this: a slot every
        rank sealed but the index never published (a save whose step had
        not completed, or one it doomed: computed from KV that failed its
        check, or from weights since replaced) is not adopted.
        """
        self._headers[slot]["published"] = 1 if published else 0

    def seal(self, slot: int, key: bytes, rank: int, digest: int) -> None:
        """Publish rank ``rank``'s part of ``slot`` as written, after its data."""
        h = self._headers[slot]
        h["checksum"][rank] = digest
        h["key"] = np.void(key)
        h["ready"][rank] = 1

    def header(self, slot: int) -> SlotHeader:
        h = self._headers[slot]
        return SlotHeader(bytes(h["key"]), _mask(h), tuple(int(c) for c in h["checksum"]))

    def is_sealed(self, slot: int, key: bytes) -> bool:
        h = self._headers[slot]
        return bool(h["ready"][: self.ranks].all()) and bytes(h["key"]) == key

    def sealed_many(self, slots: Sequence[int], keys: Sequence[bytes], published: bool = False) -> list[bool]:
        """:meth:`is_sealed` of each ``(slot, key)``, in a few array passes
        (a load of 127 blocks read 127 headers one numpy scalar at a time:
        0.28 ms on the load's path). A slot out of range is not sealed.
        ``published``: the index must have published the slot too (a load:
        a slot sealed but never published holds a save the index doomed, or
        one whose step has not completed)."""
        n = len(slots)
        if n != len(keys):
            raise ValueError(f"{n} slots for {len(keys)} keys")
        joined = b"".join(keys)
        if not n or len(joined) != 16 * n:
            return [0 <= s < self.num_slots and len(k) == 16 and self.is_sealed(s, k)
                    and (not published or bool(self._headers[s]["published"])) for s, k in zip(slots, keys)]
        at = np.asarray(slots, dtype=np.int64)
        inside = (at >= 0) & (at < self.num_slots)
        return (inside & self._sealed(self._headers[np.where(inside, at, 0)], joined, published)).tolist()

    def _sealed(self, h: np.ndarray, joined: bytes, published: bool) -> np.ndarray:
        ok = h["ready"][:, : self.ranks].all(axis=1) & (h["key"] == np.frombuffer(joined, dtype="V16"))
        return ok & (h["published"] == 1) if published else ok

    def header_snapshot(self, slots: Sequence[int], keys: Sequence[bytes]) -> tuple[np.ndarray, list[bool]]:
        """A copy of the headers of ``slots`` (a row per slot; a slot out of
        range gets slot 0's), and whether each is sealed for its key by every
        rank and published: a load's check before its copy, and what the
        copy is checked against after it (:meth:`data_checks`,
        :meth:`headers_unchanged`)."""
        n = len(slots)
        if n != len(keys):
            raise ValueError(f"{n} slots for {len(keys)} keys")
        at = np.asarray(slots, dtype=np.int64).reshape(n)
        inside = (at >= 0) & (at < self.num_slots) & np.array([len(k) == 16 for k in keys], dtype=bool)
        headers = self._headers[np.where(inside, at, 0)].copy()
        joined = b"".join(k if len(k) == 16 else bytes(16) for k in keys)
        return headers, (inside & self._sealed(headers, joined, True)).tolist()

    def headers_unchanged(self, slots: Sequence[int], headers: np.ndarray) -> list[bool]:
        """Whether each slot's header is still the one in ``headers`` (a
        :meth:`header_snapshot` of ``slots``): key, ready marks, checksums,
        published mark and count of clears. The index owner clears a slot
        before anything rewrites its bytes, so a copy that read the slot
        before this returns True read the bytes the snapshot describes."""
        now = self._headers[np.asarray(slots, dtype=np.int64)]
        same = ((now["key"] == headers["key"]) & (now["ready"] == headers["ready"]).all(axis=1)
                & (now["checksum"] == headers["checksum"]).all(axis=1) & (now["published"] == headers["published"])
                & (now["gen"] == headers["gen"]))
        return same.tolist()

    def data_checks(self, slots: Sequence[int], keys: Sequence[bytes], rank: int,
                    headers: np.ndarray | None = None) -> Callable[[int], bool]:
        """For slots :meth:`sealed_many` found sealed for ``keys``: a check
        ``i -> bool``, whether rank ``rank``'s bytes of ``slots[i]`` match the
        checksum its header gives (``headers``: the one a snapshot gives).
        The headers are read once for the batch and each part is hashed
        straight from the mapping: :meth:`verify` per block cost ~5 us of
        header reads and tensor slicing besides the hash (0.65 ms for an
        8k-token hit of 127 blocks)."""
        if headers is None:
            expected = self._headers["checksum"][np.asarray(slots, dtype=np.int64), rank].tolist()
        else:
            expected = headers["checksum"][:, rank].tolist()
        mv = memoryview(self._mm)
        base = self._data_off + rank * self.rank_stride
        stride, n = self.slot_stride, self.rank_bytes
        seeds = [int.from_bytes(k[:8], "little") for k in keys]  # as checksum() seeds
        digest = xxhash.xxh3_64_intdigest

        def check(i: int) -> bool:
            off = base + slots[i] * stride
            return digest(mv[off : off + n], seed=seeds[i]) == expected[i]

        return check

    def verify_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[bool]:
        """:meth:`verify` of every rank of each ``(slot, key)``, the headers
        read for the batch at once (:meth:`sealed_many`, :meth:`data_checks`):
        a cluster put's check of 64 blocks spent as long on per-block header
        reads and tensor views as on the hashing."""
        sealed = self.sealed_many(slots, keys)
        checks = [self.data_checks(slots, keys, r) for r in range(self.ranks)] if any(sealed) else []
        return [ok and all(check(i) for check in checks) for i, ok in enumerate(sealed)]

    def verify(self, slot: int, key: bytes, rank: int, check_data: bool = True) -> bool:
        """True when ``slot`` holds ``key`` sealed by all ranks and, with
        ``check_data``, rank ``rank``'s bytes still match their checksum.

        Call it on a pinned slot before copying out of it: nothing rewrites a
        pinned slot, so what was verified is what gets copied.
        """
        h = self._headers[slot]
        if not h["ready"][: self.ranks].all() or bytes(h["key"]) != key:
            return False
        return not check_data or checksum(self.rank_view(slot, rank), key) == int(h["checksum"][rank])
