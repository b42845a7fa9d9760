"""SSD tier: block slots on files, partitions, loop or raw block devices, with direct I/O.

Runs in the process that owns the index (vLLM's scheduler process for the
embedded backend), on a small pool of I/O threads; ``os.preadv`` and
``os.pwritev`` release the GIL, so the I/O never holds up the engine's own
thread. Data moves only between a device and DRAM-tier slots: the DRAM
arena's slots are 4 KiB aligned, so they are the O_DIRECT buffers and no
bounce copy is made.

On-disk layout of each path (format 3; every region 4 KiB aligned)::

    [superblock 4 KiB][header table: 64 headers of 64 bytes per 4 KiB page][data 0 | data 1 | ...]

The superblock holds the format, the path's place in its tier, the slot
geometry, the format epoch and the layout fingerprint the caller gives (a
digest of the KV namespace and layout: a disk written for another model or
layout starts empty instead of serving its blocks). After it, the reset
floor (:data:`_FLOOR`): a reset (:meth:`SsdTier.set_floor`) writes a
sequence number there above every header written before it, and recovery
ignores every header numbered below it, so nothing from before a reset
comes back after a restart even where emptying its headers failed (a disk
error). Zeros (a superblock written before the floor existed) mean no
floor. Then a bound (:data:`_HIGH`) above every sequence number the tier
has written, reserved SEQ_RESERVE ahead at each start: after a start that
could not read every header page, a reset's floor is the bound, so it is
above the headers recovery never saw too.

A slot header (:data:`_HEADER`, 64 bytes) is self-describing: magic, the
format epoch, the block's key, a sequence number (recency at recovery), the
xxh3-64 checksum of the data, the data length, and a checksum of the header
itself. The headers *are* the index on disk; the in-memory index
(:mod:`kvtier.tier.ssd_index`) is rebuilt from them at start-up. At 64
bytes a header the table is 1/4096 of the data for 256 KiB slots, so
recovery reads a small fraction of the tier (format 2 used a 4 KiB page a
header). The DRAM header of a promoted block (per-rank checksums, ready
mask) is not stored: the store recomputes it from the data it just verified.

Headers share pages, and O_DIRECT writes whole pages, so a header write is a
read-modify-write of its pages under the path's header lock: two batches
writing neighbouring headers never undo each other. A page that reaches the
disk in part still leaves each header old or new: every header carries its
own checksum.

Write order for a batch of blocks (:meth:`SsdTier.write`):

1. slots being reused get an empty header, then ``fdatasync``: from here on
   nothing on disk points at their old contents;
2. data, then ``fdatasync``;
3. headers, then ``fdatasync``;
4. only then does the caller publish the blocks in its index.

A crash at any instant leaves every header either empty, torn (its own
checksum fails: empty), or pointing at data that is durable and whose
checksum is in the header. Reads verify the data checksum anyway, so a block
that went bad on the medium is a miss, never wrong KV.

What :meth:`SsdTier.open` formats (never anyone else's data): a path it
creates, one whose first and last MiB are zeros (``kvtier disk prepare``
leaves them so: :func:`sniff_ranges`), or one with kvtier's superblock (any
format); ``force_new`` starts kvtier's own tier afresh and claims nothing
more. Anything else, and a superblock that cannot be read, is a
:class:`ConfigError` naming the path. Before a file is created or grown the
free space of its file system is checked, and whatever a failed start
created is removed.

Slots are numbered globally ``0 .. num_slots-1``, interleaved across paths
(:meth:`SsdTier.location` and :meth:`SsdTier.slot_number` convert), so that
consecutive allocations spread over the paths.

Faults are injected in tests through :class:`IoOps`, the only place that
calls into the OS for I/O.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvtier.errors import ConfigError, TierIOError

log = logging.getLogger(__name__)

PAGE = 4096
# magic, version, path index, slot data bytes, num slots, epoch, uuid, layout fingerprint
_SUPER = struct.Struct("<8sIIQQQ16s16s")
SUPER_MAGIC = b"KVTSSD01"  # the same in every format: it says "kvtier's", the version says which
_FORMAT = 3  # 1: each header beside its data; 2: a table of 4 KiB headers; 3: 64-byte headers, fingerprint
_HDR_MAGIC = b"KVTBLK03"
_HEADER = struct.Struct("<8sQ16sQQQ")  # magic, epoch, key, seq, data checksum, data length
_HDR_SUM = struct.Struct("<Q")  # header_sums() of the 7 words before it
HEADER_BYTES = 64
HEADERS_PER_PAGE = PAGE // HEADER_BYTES
_HDR_DTYPE = np.dtype([("magic", "<u8"), ("epoch", "<u8"), ("key", "V16"), ("seq", "<u8"), ("checksum", "<u8"),
                       ("length", "<u8"), ("hsum", "<u8")])
_HDR_MAGIC_U64 = int.from_bytes(_HDR_MAGIC, "little")
FINGERPRINT_BYTES = 16
_FLOOR = struct.Struct("<8sQ")  # after _SUPER in the superblock page: magic, lowest sequence number recovered
_FLOOR_MAGIC = b"KVTFLOOR"
# After _FLOOR: magic, a number above the sequence number of every header
# this tier has written (see SsdTier.reset_floor).
_HIGH = struct.Struct("<8sQ")
_HIGH_MAGIC = b"KVTHIGH1"
# Sequence numbers a start (or a reset) reserves at once: one superblock
# write per start, and 2**40 blocks written before the bound runs out.
SEQ_RESERVE = 1 << 40
SNIFF_BYTES = 1 << 20  # how much of each end of a path must be zeros for it to count as unused (sniff_ranges)
_WRITE_RUN_PAGES = 64  # header pages per read-modify-write request: bounds the per-thread buffer
_RECOVER_PAGES = 256  # header pages per recovery read (1 MiB, 16,384 headers)
BLKGETSIZE64 = 0x80081272

assert _HEADER.size + _HDR_SUM.size == HEADER_BYTES == _HDR_DTYPE.itemsize


@dataclass(frozen=True)
class BlockRecord:
    """What a slot header says about the block it holds."""

    key: bytes
    seq: int
    checksum: int


@dataclass(frozen=True)
class SsdLocation:
    path_index: int
    slot: int


class IoOps:
    """The OS calls the SSD tier makes. Tests subclass it to inject faults."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags, 0o600)  # a file it creates is owner-only

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)


def _aligned_page(n: int = 1) -> mmap.mmap:
    """Anonymous, page-aligned memory for O_DIRECT header I/O."""
    return mmap.mmap(-1, n * PAGE)


def device_size(fd: int) -> int:
    st = os.fstat(fd)
    if stat.S_ISBLK(st.st_mode):
        buf = fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8)
        return struct.unpack("<Q", buf)[0]
    return st.st_size


def mounted_devices() -> dict[int, str]:
    """st_rdev of every block device that has a mount point -> mount point."""
    out: dict[int, str] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                major, minor = (int(x) for x in parts[2].split(":"))
                out[os.makedev(major, minor)] = parts[4]
    except OSError:
        pass
    return out


def _whole_disk_of(rdev: int) -> int | None:
    """For a partition, the st_rdev of its disk (a partition of a mounted disk is refused too)."""
    try:
        sys_dir = os.path.realpath(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}")
        if os.path.exists(os.path.join(sys_dir, "partition")):
            with open(os.path.join(os.path.dirname(sys_dir), "dev")) as f:
                major, minor = (int(x) for x in f.read().split(":"))
            return os.makedev(major, minor)
    except OSError:
        pass
    return None


SYS_BLOCK = "/sys/block"


def loop_devices_backed_by(path: str) -> list[str]:
    """Loop devices (``/dev/loopN``) whose backing file is ``path``: by
    name, or by file (device and inode: a hard link or a bind mount of it)."""
    target = os.path.realpath(path)
    try:
        st = os.stat(target)
        ident: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        ident = None
    out = []
    try:
        names = sorted(n for n in os.listdir(SYS_BLOCK) if n.startswith("loop"))
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(SYS_BLOCK, name, "loop", "backing_file")) as f:
                backing = f.read().strip()
        except OSError:
            continue  # not attached
        if backing == target:  # "<path> (deleted)": the device holds a file since removed, not this one
            out.append(f"/dev/{name}")
            continue
        if ident is None:
            continue
        try:
            other = os.stat(backing)
            if (other.st_dev, other.st_ino) == ident:
                out.append(f"/dev/{name}")
                continue
        except OSError:
            pass  # "<name> (deleted)": the name is gone, the file may live on under another
        if _loop_backing_ident(f"/dev/{name}") == ident:
            out.append(f"/dev/{name}")
    return out


_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = struct.Struct("=QQQQQIIII64s64s32sQQ")  # struct loop_info64, 232 bytes


def _loop_backing_ident(dev_path: str) -> tuple[int, int] | None:
    """The (st_dev, st_ino) of the file loop device ``dev_path`` reads, from
    the kernel (LOOP_GET_STATUS64), whatever became of the file's name; None
    when the device cannot be asked (not attached, no permission)."""
    try:
        fd = os.open(dev_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        buf = bytearray(_LOOP_INFO64.size)
        fcntl.ioctl(fd, _LOOP_GET_STATUS64, buf)
    except OSError:
        return None
    finally:
        os.close(fd)
    lo_device, lo_inode = _LOOP_INFO64.unpack_from(buf)[:2]
    # The kernel's new_encode_dev(); os.makedev() gives the same number for
    # the same major and minor in the encoding st_dev uses.
    major = (lo_device & 0xFFF00) >> 8
    minor = (lo_device & 0xFF) | ((lo_device >> 12) & 0xFFF00)
    return os.makedev(major, minor), lo_inode


def check_exclusive(path: str, st: os.stat_result) -> None:
    """Refuse a block device with a mount point on it or on one of its
    partitions, and a regular file that backs a loop device (whoever uses
    the device writes the same bytes)."""
    if stat.S_ISREG(st.st_mode):
        loops = loop_devices_backed_by(path)
        if loops:
            raise ConfigError("ssd_path", path, f"backs loop device {', '.join(loops)}: use the device or detach it")
        return
    if not stat.S_ISBLK(st.st_mode):
        return
    mounts = mounted_devices()
    if st.st_rdev in mounts:
        raise ConfigError("ssd_path", path, f"device is mounted on {mounts[st.st_rdev]}")
    for rdev, where in mounts.items():
        if _whole_disk_of(rdev) == st.st_rdev:
            raise ConfigError("ssd_path", path, f"a partition of this device is mounted on {where}")


_SUM_SEED = np.uint64(0x243F6A8885A308D3)
_SUM_MUL1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser constants
_SUM_MUL2 = np.uint64(0x94D049BB133111EB)


def header_sums(words: np.ndarray) -> np.ndarray:
    """Checksums of slot headers: ``words`` (n, 7) uint64, the header before its checksum.

    Each word is folded in by XOR, then a bijective mix (splitmix64's
    finaliser), so headers that differ in one word always differ here, and
    headers that differ in more collide with odds of about 2**-64. Numpy
    computes it for a whole table at once: recovery of millions of headers
    costs a few array passes, where a hash call per header (xxh3, format 2)
    cost microseconds each.
    """
    h = np.full(words.shape[0], _SUM_SEED, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(words.shape[1]):
            h ^= words[:, i]
            h ^= h >> np.uint64(30)
            h *= _SUM_MUL1
            h ^= h >> np.uint64(27)
            h *= _SUM_MUL2
            h ^= h >> np.uint64(31)
    return h


def table_pages(num_slots: int) -> int:
    """Pages of the header table of a path of ``num_slots`` slots."""
    return -(-num_slots // HEADERS_PER_PAGE)


def _read_floor(head: bytes) -> int:
    """The reset floor a superblock page holds (0: none)."""
    if len(head) < _SUPER.size + _FLOOR.size:
        return 0
    magic, floor = _FLOOR.unpack_from(head, _SUPER.size)
    return floor if magic == _FLOOR_MAGIC else 0


def _read_high(head: bytes) -> int:
    """The bound on sequence numbers a superblock page holds (0: none)."""
    if len(head) < _SUPER.size + _FLOOR.size + _HIGH.size:
        return 0
    magic, high = _HIGH.unpack_from(head, _SUPER.size + _FLOOR.size)
    return high if magic == _HIGH_MAGIC else 0


def _is_file_or_disk(mode: int) -> bool:
    return stat.S_ISREG(mode) or stat.S_ISBLK(mode)


def recorded_layout(path: str) -> tuple[int, bytes] | None:
    """The slot size and layout fingerprint that ``path``'s kvtier
    superblock (this format) records, or None: no such path, not readable,
    not kvtier's, another format. Only a regular file or a block device
    is opened (a FIFO would block, a character device may act on open),
    read-only and non-blocking; no lock is taken and nothing written (a
    look before the tier is opened)."""
    try:
        if not _is_file_or_disk(os.stat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not _is_file_or_disk(os.fstat(fd).st_mode):  # replaced between the two looks
            return None
        head = os.pread(fd, _SUPER.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < _SUPER.size:
        return None
    magic, version, _, slot_bytes, _, _, _, fingerprint = _SUPER.unpack_from(head)
    if magic != SUPER_MAGIC or version != _FORMAT:
        return None
    return slot_bytes, fingerprint


def slots_for(size_bytes: int, slot_bytes: int) -> int:
    """Most slots of ``slot_bytes`` that a path of ``size_bytes`` holds with its superblock and header table."""
    n = max(0, (size_bytes - PAGE) // (slot_bytes + HEADER_BYTES))  # an upper bound: the table is whole pages
    while n > 0 and PAGE + table_pages(n) * PAGE + n * slot_bytes > size_bytes:
        n -= 1
    return n


@dataclass(frozen=True, eq=False)
class Recovered:
    """The blocks recovery found, as arrays, one row per valid header.

    ``slots``: global slot numbers (int64); ``key_bytes``: (n, 16) uint8;
    ``seqs`` and ``checksums``: uint64. A key may appear more than once
    (written again elsewhere before a crash): the index keeps the highest
    ``seq``. Iterating gives ``(SsdLocation, BlockRecord)`` pairs, for tests
    and small tiers; the store takes the arrays.
    """

    slots: np.ndarray
    key_bytes: np.ndarray  # not "keys": dict(recovered) would take it for a mapping
    seqs: np.ndarray
    checksums: np.ndarray
    locate: Callable[[int], SsdLocation] = field(repr=False)

    @classmethod
    def empty(cls, locate: Callable[[int], SsdLocation]) -> Recovered:
        return cls(np.zeros(0, np.int64), np.zeros((0, 16), np.uint8), np.zeros(0, np.uint64),
                   np.zeros(0, np.uint64), locate)

    def __len__(self) -> int:
        return int(self.slots.size)

    def __iter__(self) -> Iterator[tuple[SsdLocation, BlockRecord]]:
        for slot, key, seq, digest in zip(self.slots.tolist(), self.key_bytes, self.seqs.tolist(),
                                          self.checksums.tolist()):
            yield self.locate(slot), BlockRecord(bytes(key), seq, digest)


class _Path:
    """One file or device: its fd, locks, and slot geometry."""

    def __init__(self, index: int, path: str, fd: int, num_slots: int, slot_bytes: int) -> None:
        self.index = index
        self.path = path
        self.fd = fd
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes  # data bytes of one slot (4 KiB multiple)
        self.table_pages = table_pages(num_slots)
        self.data_start = PAGE + self.table_pages * PAGE  # after the superblock and the header table
        self.sync_lock = threading.Lock()
        # Held across the read and the write of header pages: two batches
        # with headers on one page would otherwise undo each other's.
        self.header_lock = threading.Lock()

    def page_offset(self, page: int) -> int:
        return PAGE + page * PAGE

    def data_offset(self, slot: int) -> int:
        return self.data_start + slot * self.slot_bytes


class _Interleave:
    """Global slot numbers <-> (path, slot), interleaved: g = 0, 1, ... is
    path 0 slot 0, path 1 slot 0, ..., path 0 slot 1, ...; where paths
    differ in size, the longer ones continue alone. One segment per distinct
    path size, so a conversion costs a bisect over at most ``len(paths)``."""

    def __init__(self, counts: list[int]) -> None:
        self.total = sum(counts)
        self.starts: list[int] = []  # first local slot of each segment
        self.bases: list[int] = []  # first global slot of each segment
        self.active: list[list[int]] = []  # paths still holding slots in each segment
        prev = base = 0
        for t in sorted(set(counts)):
            active = [p for p, n in enumerate(counts) if n >= t]
            self.starts.append(prev)
            self.bases.append(base)
            self.active.append(active)
            base += (t - prev) * len(active)
            prev = t
        self.rank = [{p: r for r, p in enumerate(a)} for a in self.active]

    def location(self, g: int) -> SsdLocation:
        if not 0 <= g < self.total:
            raise IndexError(f"slot {g} out of range 0..{self.total - 1}")
        j = bisect.bisect_right(self.bases, g) - 1
        off = g - self.bases[j]
        a = self.active[j]
        return SsdLocation(a[off % len(a)], self.starts[j] + off // len(a))

    def slot_number(self, loc: SsdLocation) -> int:
        j = bisect.bisect_right(self.starts, loc.slot) - 1
        return self.bases[j] + (loc.slot - self.starts[j]) * len(self.active[j]) + self.rank[j][loc.path_index]

    def global_slots(self, path_index: int, local: np.ndarray) -> np.ndarray:
        out = np.empty(local.size, dtype=np.int64)
        seg = np.searchsorted(np.asarray(self.starts), local, side="right") - 1
        for j in range(len(self.starts)):
            if path_index not in self.rank[j]:
                continue  # the path ended before this segment: none of its slots are here
            m = seg == j
            out[m] = self.bases[j] + (local[m] - self.starts[j]) * len(self.active[j]) + self.rank[j][path_index]
        return out

    def split(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(path index, local slot) arrays of global slot numbers ``g``."""
        paths = np.empty(g.size, dtype=np.int64)
        local = np.empty(g.size, dtype=np.int64)
        seg = np.searchsorted(np.asarray(self.bases), g, side="right") - 1
        for j in range(len(self.bases)):
            m = seg == j
            off = g[m] - self.bases[j]
            a = len(self.active[j])
            paths[m] = np.asarray(self.active[j])[off % a]
            local[m] = self.starts[j] + off // a
        return paths, local


@dataclass
class _Opened:
    """A path during :meth:`SsdTier.open`: what was found at its start."""

    path: str
    fd: int
    created: bool
    kind: str = ""  # "new", "zeros", "kvtier" or "foreign"
    head: bytes = b""
    num_slots: int = 0


class SsdTier:
    """Slots of ``slot_bytes`` (a multiple of 4 KiB) spread over one or more paths.

    Thread safety: :meth:`write`, :meth:`invalidate` and :meth:`read` may
    run concurrently from several threads on distinct slots; the caller (the
    store) never hands the same slot to two operations at once. Header
    pages shared by slots of concurrent batches are serialised by a lock
    per path.
    """

    def __init__(self, paths: list[_Path], epoch: int, io: IoOps, fingerprint: bytes = bytes(FINGERPRINT_BYTES)) \
            -> None:
        self._paths = paths
        self.epoch = epoch
        self.fingerprint = fingerprint
        self._io = io
        self.slot_bytes = paths[0].slot_bytes
        self._map = _Interleave([p.num_slots for p in paths])
        self._tls = threading.local()
        self.unreadable: set[SsdLocation] = set()  # slots whose header page recovery could not read
        self._seq_lock = threading.Lock()
        self._seq = 0
        self.floor = 0  # headers numbered below it are from before a reset: never recovered
        # Above every sequence number written on this tier, in every
        # superblock: the floor of a reset after a start that could not read
        # every header page (``_unseen``), so that their headers are below
        # it too. 0: not known (a superblock from before it, or used up).
        self.high = 0
        self._unseen = False  # header pages recovery could not read: numbers above _seq may be there
        self._floor_lock = threading.Lock()  # set_floor's superblock writes, one at a time
        self.created: list[str] = []  # paths open() created (discard() removes them)

    # --- life cycle -------------------------------------------------------

    @classmethod
    def open(cls, paths: Sequence[str], size_bytes: int | None, slot_bytes: int, force_new: bool = False,
             io: IoOps | None = None, fingerprint: bytes = b"") -> tuple[SsdTier, Recovered]:
        """Open (creating regular files of ``size_bytes`` split evenly) and recover.

        ``fingerprint``: up to 16 bytes naming what the blocks are (the
        connector passes a digest of the KV namespace and layout). A tier
        written with another fingerprint or slot geometry, or an older
        format, starts empty (one log line says why).

        Returns the tier and the blocks found on disk (none when ``force_new``
        or when the tier starts empty). Raises :class:`ConfigError` naming
        the path for anything an operator must fix: data that is not
        kvtier's, a superblock that cannot be read, not enough free space,
        a mounted device, a path held by another process, too small, no
        direct I/O. On any failure every path is closed and every file this
        call created is removed.
        """
        io = io or IoOps()
        if slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a multiple of {PAGE}, got {slot_bytes}")
        if len(fingerprint) > FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint is at most {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        fingerprint = fingerprint.ljust(FINGERPRINT_BYTES, b"\0")
        if not paths:
            raise ConfigError("ssd_path", "", "no path given")
        per_path = size_bytes // len(paths) if size_bytes else None
        want = per_path - per_path % PAGE if per_path else None
        found: list[_Opened] = []
        try:
            stats = [cls._stat(path, want) for path in paths]
            _check_space(list(paths), stats, want, size_bytes)
            for path, st in zip(paths, stats):
                fd = cls._open_path(path, st, io, found)
                o = found[-1]
                o.kind, o.head = ("new", b"") if o.created else cls._sniff(path, fd, io)
            for o in found:
                # Whatever force_new says: it starts kvtier's own tier afresh,
                # it never claims a path that holds someone's data.
                if o.kind == "foreign":
                    raise ConfigError("ssd_path", o.path, "holds data that is not kvtier's (its first and last "
                                      f"{SNIFF_BYTES >> 20} MiB are neither zeros nor a kvtier superblock): a "
                                      "mistyped path or a disk that moved? To give it to kvtier, overwriting "
                                      f"it: kvtier disk prepare --force {o.path}")
            for o in found:
                _grow(o, want, io)
                size = device_size(o.fd)
                o.num_slots = slots_for(size, slot_bytes)
                if o.num_slots < 1:
                    raise ConfigError("ssd_path", o.path, f"{size} bytes is too small for one slot of {slot_bytes}")
            opened = [_Path(i, o.path, o.fd, o.num_slots, slot_bytes) for i, o in enumerate(found)]
            why = "force_new_disk" if force_new else _why_not_recover(found, slot_bytes, fingerprint)
            if why is None:
                epoch = _SUPER.unpack_from(found[0].head)[5]
                tier = cls(opened, epoch, io, fingerprint)
                tier.floor = max(_read_floor(o.head) for o in found)
                tier.created = [o.path for o in found if o.created]
                recovered = tier._recover()
                tier._reserve(max(_read_high(o.head) for o in found))
                log.info("kvtier: SSD tier recovered %d blocks from %s", len(recovered), ":".join(paths))
                return tier, recovered
            # A random epoch, not the last one plus one: if a superblock was
            # lost, "last plus one" could revive headers of an old format.
            taken = {_SUPER.unpack_from(o.head)[5] for o in found if o.kind == "kvtier" and len(o.head) >= PAGE}
            epoch = _new_epoch(taken)
            for p in opened:
                cls._write_super(p, epoch, fingerprint, io, high=1 + SEQ_RESERVE)
            tier = cls(opened, epoch, io, fingerprint)
            tier.high = 1 + SEQ_RESERVE
            tier.created = [o.path for o in found if o.created]
            log.info("kvtier: SSD tier on %s starts empty (epoch %d): %s", ":".join(paths), epoch, why)
            return tier, Recovered.empty(tier.location)
        except BaseException:
            for o in found:
                os.close(o.fd)
            for o in found:
                if o.created:  # only what this call made; never a file that was there before
                    try:
                        os.unlink(o.path)
                    except OSError as err:
                        log.warning("kvtier: could not remove %s after a failed start: %s", o.path, err)
            raise

    @staticmethod
    def _stat(path: str, size_bytes: int | None) -> os.stat_result | None:
        """Refuse what can never be a tier path, before anything is opened; None: does not exist."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and (stat.S_ISBLK(st.st_mode) or stat.S_ISREG(st.st_mode)):
            check_exclusive(path, st)
        elif st is None:
            if not size_bytes:
                raise ConfigError("ssd_path", path, "does not exist and no ssd_size was given to create it")
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise ConfigError("ssd_path", path, f"directory {parent} does not exist")
        else:
            raise ConfigError("ssd_path", path, "not a regular file or block device")
        return st

    @staticmethod
    def _open_path(path: str, st: os.stat_result | None, io: IoOps, found: list[_Opened]) -> int:
        """Open and lock ``path``; appends it to ``found`` (with ``created``) once it is open."""
        if st is not None and stat.S_ISBLK(st.st_mode):
            flags = os.O_RDWR | os.O_DIRECT | os.O_EXCL  # O_EXCL: EBUSY if mounted or held
        elif st is not None:
            flags = os.O_RDWR | os.O_DIRECT
        else:
            # O_EXCL: "created" must mean created by this call, or a failed
            # start could remove a file someone made in the meantime.
            flags = os.O_RDWR | os.O_DIRECT | os.O_CREAT | os.O_EXCL
        try:
            fd = io.open(path, flags)
        except OSError as err:
            if st is None and err.errno != errno.EEXIST and os.path.exists(path):
                os.unlink(path)  # e.g. EINVAL for O_DIRECT on tmpfs comes after the file was made
            if err.errno == errno.EBUSY:
                raise ConfigError("ssd_path", path, "device is busy (mounted or opened exclusively elsewhere)") \
                    from None
            if err.errno == errno.EINVAL:
                raise ConfigError("ssd_path", path, "direct I/O (O_DIRECT) is not supported here") from None
            if err.errno == errno.EEXIST:
                raise ConfigError("ssd_path", path, "appeared while kvtier was starting; not touching it") \
                    from None
            raise ConfigError("ssd_path", path, f"cannot open: {err.strerror}") from None
        if st is not None:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino, stat.S_IFMT(now.st_mode)) != \
                    (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)):
                os.close(fd)  # not in found: nothing of it is removed
                raise ConfigError("ssd_path", path, "was replaced between its checks and its opening; "
                                  "not touching it")
        found.append(_Opened(path, fd, created=st is None))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError("ssd_path", path, "held by another process (locked)") from None
        return fd

    @staticmethod
    def _sniff(path: str, fd: int, io: IoOps) -> tuple[str, bytes]:
        """What an existing path holds: ("kvtier" | "zeros" | "foreign", its first bytes).

        Its superblock page first: a kvtier path needs no more (the rest of
        its start is header table, read at recovery). Else both ends
        (:func:`sniff_ranges`) must be zeros. A read error is a
        :class:`ConfigError`: formatting after a transient error would
        destroy a tier (or someone's data) that is there.
        """
        size = device_size(fd)
        ranges = sniff_ranges(size)
        if size % PAGE:
            # A file's last partial page, which the ranges leave out (all of
            # a file under a page: a few bytes of someone's notes).
            ranges.append((size - size % PAGE, size % PAGE))
        if not ranges:
            return "zeros", b""
        chunks = []
        for i, (off, n) in enumerate([(0, min(PAGE, ranges[0][1]))] + ranges):
            buf = _aligned_page(-(-n // PAGE))
            try:
                got = io.preadv(fd, [memoryview(buf)], off)
            except OSError as err:
                raise ConfigError("ssd_path", path, f"cannot read its superblock ({err.strerror}); not starting "
                                  "rather than format a disk that may hold data") from None
            if got < n:
                raise ConfigError("ssd_path", path, f"short read of its superblock ({got} of {n} bytes at "
                                  f"{off}); not starting rather than format a disk that may hold data")
            chunk = bytes(buf[:n])
            if i == 0 and chunk[: len(SUPER_MAGIC)] == SUPER_MAGIC:
                return "kvtier", chunk
            if chunk.count(0) != n:
                return "foreign", chunk
            chunks.append(chunk)
        return "zeros", chunks[1]

    @staticmethod
    def _write_super(p: _Path, epoch: int, fingerprint: bytes, io: IoOps, high: int) -> None:  # a new tier: no floor
        buf = _aligned_page()
        _SUPER.pack_into(buf, 0, SUPER_MAGIC, _FORMAT, p.index, p.slot_bytes, p.num_slots, epoch, uuid.uuid4().bytes,
                         fingerprint)
        _HIGH.pack_into(buf, _SUPER.size + _FLOOR.size, _HIGH_MAGIC, high)
        try:
            _write_all(io, p.fd, [memoryview(buf)], 0)
            io.fdatasync(p.fd)
        except OSError as err:
            raise ConfigError("ssd_path", p.path, f"cannot write its superblock: {err.strerror or err}") from None

    def close(self) -> None:
        for p in self._paths:
            if p.fd >= 0:
                os.close(p.fd)
                p.fd = -1

    def discard(self) -> None:
        """:meth:`close`, then remove the files :meth:`open` created (a start
        that failed after it: nothing it made is left; a path that was there
        before is kept)."""
        self.close()
        for path in self.created:
            try:
                os.unlink(path)
            except OSError as err:
                log.warning("kvtier: could not remove %s after a failed start: %s", path, err)
        self.created = []

    # --- geometry ---------------------------------------------------------

    def location(self, slot: int) -> SsdLocation:
        """Path and slot there of global slot number ``slot``."""
        return self._map.location(slot)

    def slot_number(self, loc: SsdLocation) -> int:
        """Global slot number of ``loc`` (inverse of :meth:`location`)."""
        return self._map.slot_number(loc)

    def locations(self) -> list[SsdLocation]:
        """Every slot in global order, interleaved across paths (small tiers and tests)."""
        return [self._map.location(g) for g in range(self.num_slots)]

    @property
    def num_slots(self) -> int:
        return self._map.total

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self._paths]

    def set_floor(self, floor: int) -> None:
        """Persist the reset floor ``floor`` (from :meth:`reset_floor`, under
        the store's lock at the reset: every header written before has a
        lower number) in every path's superblock, with the new bound, synced.
        Raises TierIOError (the caller still empties the old headers)."""
        with self._floor_lock:  # two resets close together: the later floor is the one left
            if floor <= self.floor:
                return
            self._write_marks(floor, self.high, "the reset floor")
            self.floor = floor

    def _write_marks(self, floor: int, high: int, what: str) -> None:
        """Write ``floor`` and ``high`` (0: none) into every path's superblock, synced."""
        for p in self._paths:
            buf = _aligned_page()
            try:
                n = self._io.preadv(p.fd, [memoryview(buf)], 0)
                if n != PAGE or bytes(buf[: len(SUPER_MAGIC)]) != SUPER_MAGIC:
                    raise OSError(errno.EIO, f"superblock read back {n} bytes")
                _FLOOR.pack_into(buf, _SUPER.size, _FLOOR_MAGIC if floor else bytes(8), floor)
                _HIGH.pack_into(buf, _SUPER.size + _FLOOR.size, _HIGH_MAGIC if high else bytes(8), high)
                _write_all(self._io, p.fd, [memoryview(buf)], 0)
                self._io.fdatasync(p.fd)
            except OSError as err:
                raise TierIOError(err.errno or errno.EIO,
                                  f"{p.path}: writing {what} failed: {err.strerror or err}") from None

    def _reserve(self, high_found: int) -> None:
        """At a recovering start, after :meth:`_recover`: reserve the next
        SEQ_RESERVE numbers, writing the bound into every superblock.

        When every header page was read, numbering goes on from the newest
        header. When some could not be, their numbers are unknown but below
        ``high_found`` (the bound on disk): numbering goes on from there, so
        that a reset's floor is above them however the write below ends.
        With no bound on disk either, nothing is known of those numbers: a
        reset takes the next number as its floor, as before the bound."""
        if self._unseen and not high_found:
            log.warning("kvtier: SSD header pages could not be read and the superblock holds no bound on "
                        "their sequence numbers: until a start reads them, a reset cannot rule out that their "
                        "blocks come back")
            return
        with self._seq_lock:
            if self._unseen:
                self._seq = max(self._seq, high_found - 1)
            high = self._seq + 1 + SEQ_RESERVE
        try:
            self._write_marks(self.floor, high, "the sequence bound")
        except TierIOError as err:
            log.warning("kvtier: %s; a reset takes the next sequence number as its floor", err)
            return
        with self._seq_lock:
            self.high = high

    def next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            if self.high and self._seq >= self.high:
                self.high = 0
                log.warning("kvtier: %d SSD blocks written since the start; the sequence bound is used up "
                            "until the next start", SEQ_RESERVE)
            return self._seq

    def reset_floor(self) -> int:
        """The floor for a reset, taken under the store's lock: every header
        written so far is numbered below it, every one written after at or
        above it. The next number, unless the start could not read every
        header page: then the bound (their numbers are below it, unknown
        otherwise), and the next bound is reserved above it
        (:meth:`set_floor` writes both). So only such a start's first reset
        skips numbers: resets every few seconds do not use the numbers up."""
        with self._seq_lock:
            if self._unseen and self.high:
                floor = self.high
                self.high = floor + SEQ_RESERVE
                self._unseen = False  # every header from before is below the floor now
            else:
                floor = self._seq + 1
            self._seq = floor - 1
            return floor

    # --- headers ----------------------------------------------------------

    def _header_pages(self, n: int) -> mmap.mmap:
        """A page-aligned buffer of ``n`` header pages, kept per thread and grown as needed."""
        buf = getattr(self._tls, "hdr", None)
        if buf is None or len(buf) < n * PAGE:
            buf = self._tls.hdr = _aligned_page(max(n, 16))
        return buf

    def _write_headers(self, path_index: int, slots: np.ndarray, recs: Sequence[BlockRecord | None] | None) -> None:
        """Write the headers of local ``slots`` of one path (``recs`` None: all
        empty), as a read-modify-write of each run of neighbouring pages."""
        p = self._paths[path_index]
        order = np.argsort(slots, kind="stable")
        slots = slots[order]
        recs = [recs[i] for i in order.tolist()] if recs is not None else None
        pages = np.unique(slots // HEADERS_PER_PAGE)
        cuts = np.flatnonzero(np.diff(pages) != 1) + 1
        runs: list[tuple[int, int]] = []
        for run in np.split(pages, cuts):
            for first in range(int(run[0]), int(run[-1]) + 1, _WRITE_RUN_PAGES):
                runs.append((first, min(_WRITE_RUN_PAGES, int(run[-1]) + 1 - first)))
        for first, count in runs:
            lo = int(np.searchsorted(slots, first * HEADERS_PER_PAGE))
            hi = int(np.searchsorted(slots, (first + count) * HEADERS_PER_PAGE))
            buf = self._header_pages(count)
            view = memoryview(buf)[: count * PAGE]
            rows = np.frombuffer(buf, dtype=np.uint8, count=count * PAGE).reshape(-1, HEADER_BYTES)
            words = rows.view("<u8")
            at = slots[lo:hi] - first * HEADERS_PER_PAGE
            with p.header_lock:
                n = self._io.preadv(p.fd, [view], p.page_offset(first))
                if n != len(view):
                    raise OSError(errno.EIO, f"short read of SSD header pages: {n} of {len(view)} bytes")
                rows[at] = 0
                if recs is not None:
                    filled = [row for i, row in zip(range(lo, hi), at.tolist()) if recs[i] is not None]
                    for i, row in zip(range(lo, hi), at.tolist()):
                        rec = recs[i]
                        if rec is not None:
                            _HEADER.pack_into(buf, row * HEADER_BYTES, _HDR_MAGIC, self.epoch, rec.key, rec.seq,
                                              rec.checksum, self.slot_bytes)
                    words[filled, 7] = header_sums(words[filled, :7])
                _write_all(self._io, p.fd, [view], p.page_offset(first))
            del rows, words  # release the buffer exports before the buffer may be replaced

    def _by_path(self, locs: Sequence[SsdLocation] | np.ndarray) -> dict[int, np.ndarray]:
        """Local slot arrays per path of SsdLocations or of an array of global slot numbers."""
        if isinstance(locs, np.ndarray):
            paths, local = self._map.split(locs.astype(np.int64))
        else:
            paths = np.fromiter((loc.path_index for loc in locs), dtype=np.int64, count=len(locs))
            local = np.fromiter((loc.slot for loc in locs), dtype=np.int64, count=len(locs))
        return {int(i): local[paths == i] for i in np.unique(paths)}

    def _recover(self) -> Recovered:
        """Read every path's header table in large requests and keep the valid headers.

        Magic, epoch and length are checked on the whole table at once; only
        headers that pass get their own checksum computed.
        """
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        buf = _aligned_page(_RECOVER_PAGES)
        mv = memoryview(buf)
        for p in self._paths:
            for first in range(0, p.table_pages, _RECOVER_PAGES):
                count = min(_RECOVER_PAGES, p.table_pages - first)
                try:
                    n = self._io.preadv(p.fd, [mv[: count * PAGE]], p.page_offset(first))
                except OSError:
                    n = -1
                if n != count * PAGE:
                    self._reread_pages(p, first, count, mv)
                first_slot = first * HEADERS_PER_PAGE
                nslots = min(count * HEADERS_PER_PAGE, p.num_slots - first_slot)
                hdr = np.frombuffer(buf, dtype=_HDR_DTYPE, count=nslots)
                cand = np.flatnonzero((hdr["magic"] == _HDR_MAGIC_U64) & (hdr["epoch"] == self.epoch)
                                      & (hdr["length"] == self.slot_bytes))
                if cand.size:
                    words = np.frombuffer(buf, dtype="<u8", count=nslots * 8).reshape(-1, 8)[cand]
                    ok = cand[header_sums(words[:, :7]) == words[:, 7]]
                    parts.append((self._map.global_slots(p.index, first_slot + ok), hdr[ok].copy()))
                del hdr
        del mv
        self._seq = max(self._seq, self.floor)
        if not parts:
            return Recovered.empty(self.location)
        slots = np.concatenate([s for s, _ in parts])
        hdrs = np.concatenate([h for _, h in parts])
        if self.floor:
            # From before a reset whose emptying of headers did not reach the
            # disk: not recovered, and their headers are emptied before the
            # slots take other data (as unreadable ones are).
            after = hdrs["seq"] >= self.floor
            self.unreadable.update(self.location(int(g)) for g in slots[~after].tolist())
            slots, hdrs = slots[after], hdrs[after]
            if not slots.size:
                return Recovered.empty(self.location)
        keys = np.ascontiguousarray(hdrs["key"]).view(np.uint8).reshape(-1, 16)
        self._seq = max(self.floor, int(hdrs["seq"].max()))
        return Recovered(slots, keys, hdrs["seq"].copy(), hdrs["checksum"].copy(), self.location)

    def _reread_pages(self, p: _Path, first: int, count: int, mv: memoryview) -> None:
        """Page by page where a large table read failed; a page that cannot be
        read is zeroed here (no block) and its slots are :attr:`unreadable`:
        their headers are rewritten before reuse."""
        for page in range(first, first + count):
            view = mv[(page - first) * PAGE : (page - first + 1) * PAGE]
            try:
                n = self._io.preadv(p.fd, [view], p.page_offset(page))
            except OSError as err:
                log.warning("kvtier: reading SSD header page %d of %s failed: %s", page, p.path, err)
                n = -1
            if n != PAGE:
                view[:] = bytes(PAGE)
                self._unseen = True
                lo = page * HEADERS_PER_PAGE
                self.unreadable.update(SsdLocation(p.index, s) for s in range(lo, min(lo + HEADERS_PER_PAGE,
                                                                                        p.num_slots)))

    # --- data -------------------------------------------------------------

    def write(self, items: Sequence[tuple[SsdLocation, BlockRecord, memoryview]], reused: Sequence[SsdLocation]) \
            -> None:
        """Write blocks durably, in the order the module docstring gives.

        ``items``: where, what header, and the data (``slot_bytes`` long,
        4 KiB aligned). ``reused``: locations among them that may still hold
        an older block on disk. Raises :class:`TierIOError` if anything
        fails; then none of ``items`` may be published (their headers may or
        may not be on disk, each self-consistent).
        """
        io = self._io
        touched = sorted({loc.path_index for loc, _, _ in items})
        try:
            if reused:
                for i, local in self._by_path(reused).items():
                    self._write_headers(i, local, None)
                self._sync({loc.path_index for loc in reused})
            for loc, _, data in items:
                p = self._paths[loc.path_index]
                _write_all(io, p.fd, [data], p.data_offset(loc.slot))
            self._sync(touched)
            for i in touched:
                mine = [(loc.slot, rec) for loc, rec, _ in items if loc.path_index == i]
                self._write_headers(i, np.array([s for s, _ in mine], dtype=np.int64), [r for _, r in mine])
            self._sync(touched)
        except OSError as err:
            raise TierIOError(err.errno, f"SSD write failed: {err.strerror or err}") from err

    def invalidate(self, locations: Sequence[SsdLocation] | np.ndarray) -> None:
        """Write empty headers at ``locations`` (SsdLocations, or an array of
        global slot numbers as the store's index keeps them) and make them
        durable: nothing on disk names their blocks any more (an operator's reset)."""
        try:
            by_path = self._by_path(locations)
            for i, local in by_path.items():
                self._write_headers(i, local, None)
            self._sync(by_path)
        except OSError as err:
            raise TierIOError(err.errno, f"SSD write failed: {err.strerror or err}") from err

    def read(self, loc: SsdLocation, rec: BlockRecord, out: memoryview) -> bool:
        """Read the block at ``loc`` into ``out`` (4 KiB aligned) and verify it.

        True only when the data matches ``rec.checksum`` (the index's record,
        recovered from or written with the header). The header is not read
        again: a slot that now holds anything else fails the checksum, and
        one data-only request is what the device serves fastest (a request
        of header and data was split in two and read at 0.67x of fio).
        I/O errors raise :class:`TierIOError`.
        """
        p = self._paths[loc.path_index]
        try:
            n = self._io.preadv(p.fd, [out], p.data_offset(loc.slot))
        except OSError as err:
            raise TierIOError(err.errno, f"SSD read failed: {err.strerror or err}") from err
        if n != len(out):
            return False
        return xxhash.xxh3_64_intdigest(out) == rec.checksum

    def _sync(self, path_indexes) -> None:
        for i in sorted(path_indexes):
            p = self._paths[i]
            with p.sync_lock:
                self._io.fdatasync(p.fd)


def sniff_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the ranges of a path of ``size`` bytes that must
    be zeros for it to count as unused, page-aligned: its first and its last
    :data:`SNIFF_BYTES` (the last partial page left out). File systems and
    volume managers mark both ends: btrfs at 64 KiB past the start (the
    64 KiB before it may be zeros), md's 0.90 and 1.0 superblocks, GPT's
    backup header and ZFS's last labels near the end."""
    end = size - size % PAGE
    head = min(SNIFF_BYTES, end)
    ranges = [(0, head)] if head else []
    tail = max(head, end - SNIFF_BYTES)
    if end > tail:
        ranges.append((tail, end - tail))
    return ranges


def _check_space(paths: list[str], stats: list[os.stat_result | None], want: int | None,
                 size_bytes: int | None) -> None:
    """Refuse, before anything is created or grown, files that their file systems have no room for."""
    if not want:
        return
    need: dict[int, list] = {}  # st_dev -> [bytes, directory, paths]
    for path, st in zip(paths, stats):
        if st is not None and (stat.S_ISBLK(st.st_mode) or st.st_size >= want):
            continue
        parent = os.path.dirname(os.path.abspath(path))
        dev = st.st_dev if st is not None else os.stat(parent).st_dev
        have = st.st_blocks * 512 if st is not None else 0  # posix_fallocate fills holes too
        entry = need.setdefault(dev, [0, parent, []])
        entry[0] += max(0, want - have)
        entry[2].append(path)
    for missing, parent, on in need.values():
        vfs = os.statvfs(parent)
        free = vfs.f_bavail * vfs.f_frsize  # what unprivileged writers may use: root's reserve stays free
        if missing > free:
            raise ConfigError("ssd_size", size_bytes, f"{', '.join(on)} need {missing} more bytes, but the file "
                              f"system of {parent} has {free} bytes free; give a smaller ssd_size")


def _grow(o: _Opened, want: int | None, io: IoOps) -> None:
    """Pre-allocate a regular file to ``want`` bytes, so a full disk is a start-up error, not a failed write later."""
    if not want or not stat.S_ISREG(os.fstat(o.fd).st_mode) or os.fstat(o.fd).st_size >= want:
        return
    try:
        io.fallocate(o.fd, 0, want)
    except OSError as err:
        raise ConfigError("ssd_path", o.path, f"cannot pre-allocate {want} bytes: {err.strerror}") from None


def _why_not_recover(found: list[_Opened], slot_bytes: int, fingerprint: bytes) -> str | None:
    """None when every path holds this tier's current superblock; else why the tier starts empty."""
    epochs = set()
    for i, o in enumerate(found):
        if o.kind != "kvtier":
            return f"{o.path} is new"  # created, or zeros (a path holding other data was refused)
        if len(o.head) < _SUPER.size:
            return f"{o.path}: superblock cut short"
        _, version, index, old_slot, old_n, epoch, _, old_fp = _SUPER.unpack_from(o.head)
        if version != _FORMAT:
            return f"{o.path} holds SSD tier format {version}, this is format {_FORMAT}"
        if old_fp != fingerprint:
            return (f"{o.path} was written for another KV layout (fingerprint {old_fp.hex()}, now "
                    f"{fingerprint.hex()})")
        if (old_slot, old_n) != (slot_bytes, o.num_slots):
            return (f"{o.path} has another slot geometry ({old_n} slots of {old_slot} bytes, now {o.num_slots} of "
                    f"{slot_bytes})")
        if index != i:
            return f"{o.path} was path {index} of its tier, now path {i}"
        epochs.add(epoch)
    if len(epochs) > 1:
        return "the paths belong to different tiers (epochs differ)"
    return None


def _new_epoch(taken: set[int]) -> int:
    while True:
        epoch = int.from_bytes(os.urandom(8), "little")
        if epoch and epoch not in taken:
            return epoch


def _write_all(io: IoOps, fd: int, buffers: list[memoryview], offset: int) -> None:
    want = sum(len(b) for b in buffers)
    n = io.pwritev(fd, buffers, offset)
    if n != want:
        # O_DIRECT writes are not resumable at an arbitrary byte; a short
        # write is a failure of this block, never silently accepted.
        raise OSError(errno.EIO, f"short write: {n} of {want} bytes")
