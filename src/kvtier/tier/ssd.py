"""SSD tier: block slots on files, partitions, loop or raw block devices, with direct I/O.

Runs in the process that owns the index (vLLM's scheduler process for the
embedded backend), on a small pool of I/O threads; ``os.preadv`` and
``os.pwritev`` release the GIL, so the I/O never holds up the engine's own
thread. Data moves only between a device and DRAM-tier slots: the DRAM
arena's slots are 4 KiB aligned, so they are the O_DIRECT buffers and no
bounce copy is made.

On-disk layout of each path (every offset 4 KiB aligned)::

    [superblock 4 KiB][header 0 | header 1 | ... 4 KiB each][data 0 | data 1 | ...]

The headers form one table so that the headers of a batch of neighbouring
slots go to the device in one request (a header per request cost a quarter
of the write time), and recovery reads the table in large requests.

A slot header (:data:`_HEADER`) is self-describing: magic, the format epoch,
the block's key, a sequence number (recency at recovery), the xxh3-64
checksum of the data, the DRAM header fields to restore on promotion, and a
checksum of the header itself. The headers *are* the index on disk; the
in-memory index is rebuilt from them at start-up.

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

Faults are injected in tests through :class:`IoOps`, the only place that
calls into the OS for I/O.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.errors import ConfigError, TierIOError

log = logging.getLogger(__name__)

PAGE = 4096
_SUPER = struct.Struct("<8sIIQQQ16s")  # magic, version, path index, slot data bytes, num slots, epoch, uuid
_SUPER_MAGIC = b"KVTSSD01"
_FORMAT = 2  # 1: each header beside its data; 2: a header table
_HDR_MAGIC = b"KVTBLK01"
# magic, epoch, key, seq, data checksum, data length, dram ready mask, dram checksums x8
_HEADER = struct.Struct("<8sQ16sQQQI4x8Q")
_HDR_SUM = struct.Struct("<Q")
BLKGETSIZE64 = 0x80081272


@dataclass(frozen=True)
class BlockRecord:
    """What a slot header says about the block it holds."""

    key: bytes
    seq: int
    checksum: int
    dram_ready: int
    dram_checksums: tuple[int, ...]


@dataclass(frozen=True)
class SsdLocation:
    path_index: int
    slot: int


class IoOps:
    """The OS calls the SSD tier makes. Tests subclass it to inject faults."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)


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
    """Loop devices (``/dev/loopN``) whose backing file is ``path``."""
    target = os.path.realpath(path)
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
    return out


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


class _Path:
    """One file or device: its fd, lock, and slot geometry."""

    def __init__(self, index: int, path: str, fd: int, num_slots: int, slot_bytes: int) -> None:
        self.index = index
        self.path = path
        self.fd = fd
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes  # data bytes of one slot (4 KiB multiple)
        self.data_start = PAGE + num_slots * PAGE  # after the superblock and the header table
        self.sync_lock = threading.Lock()

    def header_offset(self, slot: int) -> int:
        return PAGE + slot * PAGE

    def data_offset(self, slot: int) -> int:
        return self.data_start + slot * self.slot_bytes


class SsdTier:
    """Slots of ``slot_bytes`` (a multiple of 4 KiB) spread over one or more paths.

    Thread safety: :meth:`write` and :meth:`read` may run concurrently from
    several threads on distinct slots; the caller (the store) never hands the
    same slot to two operations at once.
    """

    def __init__(self, paths: list[_Path], epoch: int, io: IoOps) -> None:
        self._paths = paths
        self.epoch = epoch
        self._io = io
        self.slot_bytes = paths[0].slot_bytes
        self._tls = threading.local()
        self.unreadable: set[SsdLocation] = set()  # headers recovery could not read
        self._seq_lock = threading.Lock()
        self._seq = 0

    # --- life cycle -------------------------------------------------------

    @classmethod
    def open(cls, paths: Sequence[str], size_bytes: int | None, slot_bytes: int, force_new: bool = False,
             io: IoOps | None = None) -> tuple[SsdTier, list[tuple[SsdLocation, BlockRecord]]]:
        """Open (creating regular files of ``size_bytes`` split evenly) and recover.

        Returns the tier and the blocks found on disk (none when ``force_new``
        or when the geometry changed). Raises :class:`ConfigError` naming the
        path for anything an operator must fix (mounted device, held by
        another process, too small, no direct I/O).
        """
        io = io or IoOps()
        if slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a multiple of {PAGE}, got {slot_bytes}")
        if not paths:
            raise ConfigError("ssd_path", "", "no path given")
        per_path = size_bytes // len(paths) if size_bytes else None
        opened: list[_Path] = []
        epoch = 0
        recovered: list[tuple[SsdLocation, BlockRecord]] = []
        try:
            for i, path in enumerate(paths):
                fd = cls._open_path(path, per_path, io)
                size = device_size(fd)
                num_slots = (size - PAGE) // (PAGE + slot_bytes)
                if num_slots < 1:
                    os.close(fd)
                    raise ConfigError("ssd_path", path, f"{size} bytes is too small for one slot of {slot_bytes}")
                p = _Path(i, path, fd, num_slots, slot_bytes)
                opened.append(p)
            supers = [cls._read_super(p, io) for p in opened]
            same = all(s is not None and s[0] == i and s[1] == slot_bytes and s[2] == p.num_slots
                       for i, (s, p) in enumerate(zip(supers, opened)))
            if same and not force_new:
                epoch = supers[0][3]  # type: ignore[index]
                if any(s[3] != epoch for s in supers):  # type: ignore[index]
                    same = False
            if not same or force_new:
                # A random epoch, not the last one plus one: if a superblock
                # was lost, "last plus one" could revive headers of an old format.
                epoch = _new_epoch({s[3] for s in supers if s is not None})
                for p in opened:
                    cls._write_super(p, epoch, io)
                tier = cls(opened, epoch, io)
                log.info("kvtier: SSD tier formatted (epoch %d) on %s", epoch, ":".join(paths))
                return tier, []
            tier = cls(opened, epoch, io)
            recovered = tier._recover()
            log.info("kvtier: SSD tier recovered %d blocks from %s", len(recovered), ":".join(paths))
            return tier, recovered
        except BaseException:
            for p in opened:
                os.close(p.fd)
            raise

    @staticmethod
    def _open_path(path: str, size_bytes: int | None, io: IoOps) -> int:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISBLK(st.st_mode):
            check_exclusive(path, st)
            flags = os.O_RDWR | os.O_DIRECT | os.O_EXCL  # O_EXCL: EBUSY if mounted or held
        elif st is None or stat.S_ISREG(st.st_mode):
            if st is not None:
                check_exclusive(path, st)
            if st is None:
                if not size_bytes:
                    raise ConfigError("ssd_path", path, "does not exist and no ssd_size was given to create it")
                parent = os.path.dirname(os.path.abspath(path))
                if not os.path.isdir(parent):
                    raise ConfigError("ssd_path", path, f"directory {parent} does not exist")
            flags = os.O_RDWR | os.O_DIRECT | os.O_CREAT
        else:
            raise ConfigError("ssd_path", path, "not a regular file or block device")
        try:
            fd = io.open(path, flags)
        except OSError as err:
            if err.errno == errno.EBUSY:
                raise ConfigError("ssd_path", path, "device is busy (mounted or opened exclusively elsewhere)") \
                    from None
            if err.errno == errno.EINVAL:
                raise ConfigError("ssd_path", path, "direct I/O (O_DIRECT) is not supported here") from None
            raise ConfigError("ssd_path", path, f"cannot open: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError("ssd_path", path, "held by another process (locked)") from None
        if stat.S_ISREG(os.fstat(fd).st_mode) and size_bytes:
            size = size_bytes - size_bytes % PAGE
            if os.fstat(fd).st_size < size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as err:
                    os.close(fd)
                    raise ConfigError("ssd_path", path, f"cannot pre-allocate {size} bytes: {err.strerror}") \
                        from None
        return fd

    @staticmethod
    def _read_super(p: _Path, io: IoOps) -> tuple[int, int, int, int] | None:
        buf = _aligned_page()
        try:
            n = io.preadv(p.fd, [memoryview(buf)], 0)
        except OSError:
            return None
        if n < _SUPER.size:
            return None
        magic, version, index, slot_bytes, num_slots, epoch, _ = _SUPER.unpack_from(buf, 0)
        if magic != _SUPER_MAGIC or version != _FORMAT:
            if magic == _SUPER_MAGIC:
                log.warning("kvtier: %s holds SSD tier format %d, this is format %d: starting it empty",
                            p.path, version, _FORMAT)
            return None
        return index, slot_bytes, num_slots, epoch

    @staticmethod
    def _write_super(p: _Path, epoch: int, io: IoOps) -> None:
        buf = _aligned_page()
        _SUPER.pack_into(buf, 0, _SUPER_MAGIC, _FORMAT, p.index, p.slot_bytes, p.num_slots, epoch, uuid.uuid4().bytes)
        _write_all(io, p.fd, [memoryview(buf)], 0)
        io.fdatasync(p.fd)

    def close(self) -> None:
        for p in self._paths:
            if p.fd >= 0:
                os.close(p.fd)
                p.fd = -1

    # --- geometry ---------------------------------------------------------

    def locations(self) -> list[SsdLocation]:
        """Every slot, interleaved across paths so consecutive allocations spread out."""
        out = []
        longest = max(p.num_slots for p in self._paths)
        for s in range(longest):
            for p in self._paths:
                if s < p.num_slots:
                    out.append(SsdLocation(p.index, s))
        return out

    @property
    def num_slots(self) -> int:
        return sum(p.num_slots for p in self._paths)

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self._paths]

    def next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

    # --- headers ----------------------------------------------------------

    def _header_pages(self, n: int) -> mmap.mmap:
        """A page-aligned buffer of ``n`` header pages, kept per thread and grown as needed."""
        buf = getattr(self._tls, "hdr", None)
        if buf is None or len(buf) < n * PAGE:
            buf = self._tls.hdr = _aligned_page(max(n, 16))
        return buf

    def _write_headers(self, entries: Sequence[tuple[SsdLocation, BlockRecord | None]]) -> None:
        """Write the headers of ``entries`` (None: empty), one request per run
        of neighbouring slots of a path (at most 256 headers a request)."""
        ordered = sorted(entries, key=lambda e: (e[0].path_index, e[0].slot))
        most = 256  # headers per request: bounds the per-thread buffer
        for c in range(0, len(ordered), most):
            part = ordered[c : c + most]
            buf = self._header_pages(len(part))
            view = memoryview(buf)
            for page, (_, rec) in enumerate(part):
                self._pack_header(buf, rec, page * PAGE)
            start = 0
            for end in range(1, len(part) + 1):
                if end < len(part):
                    a, b = part[end - 1][0], part[end][0]
                    if b.path_index == a.path_index and b.slot == a.slot + 1:
                        continue
                first = part[start][0]
                p = self._paths[first.path_index]
                _write_all(self._io, p.fd, [view[start * PAGE : end * PAGE]], p.header_offset(first.slot))
                start = end

    def _pack_header(self, buf: mmap.mmap, rec: BlockRecord | None, at: int = 0) -> None:
        buf[at : at + PAGE] = bytes(PAGE)
        if rec is None:
            return
        checks = list(rec.dram_checksums) + [0] * (8 - len(rec.dram_checksums))
        _HEADER.pack_into(buf, at, _HDR_MAGIC, self.epoch, rec.key, rec.seq, rec.checksum, self.slot_bytes,
                          rec.dram_ready, *checks)
        _HDR_SUM.pack_into(buf, at + _HEADER.size, xxhash.xxh3_64_intdigest(buf[at : at + _HEADER.size]))

    def _unpack_header(self, buf: bytes) -> BlockRecord | None:
        if buf[:8] != _HDR_MAGIC:
            return None
        (want,) = _HDR_SUM.unpack_from(buf, _HEADER.size)
        if xxhash.xxh3_64_intdigest(buf[: _HEADER.size]) != want:
            return None
        magic, epoch, key, seq, checksum, length, ready, *checks = _HEADER.unpack_from(buf, 0)
        if epoch != self.epoch or length != self.slot_bytes:
            return None
        return BlockRecord(key, seq, checksum, ready, tuple(checks))

    def _recover(self) -> list[tuple[SsdLocation, BlockRecord]]:
        found: list[tuple[SsdLocation, BlockRecord]] = []
        batch = 64
        buf = _aligned_page(batch)
        for p in self._paths:
            for first in range(0, p.num_slots, batch):
                count = min(batch, p.num_slots - first)
                # The table is contiguous: one request per 64 headers, and page
                # by page only where that request fails.
                try:
                    whole = self._io.preadv(p.fd, [memoryview(buf)[: count * PAGE]], p.header_offset(first))
                except OSError:
                    whole = -1
                for s in range(first, first + count):
                    view = memoryview(buf)[(s - first) * PAGE : (s - first + 1) * PAGE]
                    if whole != count * PAGE:
                        try:
                            n = self._io.preadv(p.fd, [view], p.header_offset(s))
                        except OSError as err:
                            log.warning("kvtier: reading SSD header %s slot %d failed: %s", p.path, s, err)
                            n = -1
                        if n != PAGE:
                            # Unknown contents: its header is rewritten empty before reuse.
                            self.unreadable.add(SsdLocation(p.index, s))
                            continue
                    rec = self._unpack_header(bytes(view[: _HEADER.size + _HDR_SUM.size]))
                    if rec is not None:
                        found.append((SsdLocation(p.index, s), rec))
        self._seq = max((r.seq for _, r in found), default=0)
        return found

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
                self._write_headers([(loc, None) for loc in reused])
                self._sync({loc.path_index for loc in reused})
            for loc, _, data in items:
                p = self._paths[loc.path_index]
                _write_all(io, p.fd, [data], p.data_offset(loc.slot))
            self._sync(touched)
            self._write_headers([(loc, rec) for loc, rec, _ in items])
            self._sync(touched)
        except OSError as err:
            raise TierIOError(err.errno, f"SSD write failed: {err.strerror or err}") from err

    def invalidate(self, locations: Sequence[SsdLocation]) -> None:
        """Write empty headers at ``locations`` and make them durable: nothing
        on disk names their blocks any more (an operator's reset)."""
        try:
            self._write_headers([(loc, None) for loc in locations])
            self._sync({loc.path_index for loc in locations})
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
