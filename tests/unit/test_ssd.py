"""kvtier.tier.ssd: direct-I/O slots on real files, recovery from headers,
faults at the OS boundary, exclusivity, and crash consistency.

Files live in pytest's ``tmp_path`` (ext4: O_DIRECT works). Faults are
injected through :class:`IoOps` subclasses only; crashes are real process
deaths (``os._exit``) in a child process.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvtier.errors import ConfigError, TierIOError
from kvtier.tier import ssd as ssd_module
from kvtier.tier.ssd import BlockRecord, IoOps, SsdLocation, SsdTier
from kvtier.tools.disk import prepare
from tests.unit.conftest import HEADERS_PER_PAGE, PAGE, ssd_offsets, ssd_path_bytes

SNIFF = 1 << 20  # each end of a path that must be zeros (or kvtier's) for it to be formatted

SLOT = 2 * PAGE
PER_PATH = 4  # slots per path


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block_data(key: bytes, seq: int) -> bytes:
    """The bytes written for version ``seq`` of ``key`` (the crash child computes the same)."""
    return hashlib.shake_256(key + seq.to_bytes(8, "little")).digest(SLOT)


def aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned anonymous memory: an O_DIRECT buffer."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return memoryview(buf)


def record(key: bytes, seq: int) -> BlockRecord:
    return BlockRecord(key, seq, xxhash.xxh3_64_intdigest(block_data(key, seq)))


def put(tier: SsdTier, blocks: dict[SsdLocation, tuple[bytes, int]],
        reused: Sequence[SsdLocation] = ()) -> dict[SsdLocation, BlockRecord]:
    """Write version ``seq`` of ``key`` at each location in one batch."""
    recs = {loc: record(key, seq) for loc, (key, seq) in blocks.items()}
    tier.write([(loc, rec, aligned(block_data(rec.key, rec.seq))) for loc, rec in recs.items()], reused)
    return recs


def read_back(tier: SsdTier, loc: SsdLocation, rec: BlockRecord) -> bytes | None:
    buf = mmap.mmap(-1, tier.slot_bytes)
    return bytes(buf) if tier.read(loc, rec, memoryview(buf)) else None


def flip_byte(path: str, offset: int) -> None:
    """Flip one byte on disk through the page cache (not O_DIRECT), as a medium fault would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


# --- open and format -----------------------------------------------------


def test_open_creates_and_preallocates_files_split_over_paths(make_ssd, tmp_path: Path) -> None:
    tier, recovered = make_ssd(PER_PATH, SLOT, num_paths=2)
    assert list(recovered) == []
    assert tier.paths == [str(tmp_path / "ssd0.bin"), str(tmp_path / "ssd1.bin")]
    assert (tier.num_slots, tier.slot_bytes) == (2 * PER_PATH, SLOT)
    for path in tier.paths:
        st = os.stat(path)
        assert stat.S_ISREG(st.st_mode)
        assert st.st_size == ssd_path_bytes(PER_PATH, SLOT)  # half of ssd_size each
        assert st.st_blocks * 512 >= st.st_size  # posix_fallocate: no holes
        with open(path, "rb") as f:
            assert f.read(8) == b"KVTSSD01"  # formatted


def test_size_is_split_evenly_and_rounded_down_to_pages(make_ssd) -> None:
    # 3 slots' worth per path plus change that is not a page: the change is dropped.
    size = 2 * (ssd_path_bytes(3, SLOT) + 1000)
    tier, _ = make_ssd(0, SLOT, num_paths=2, size_bytes=size)
    assert tier.num_slots == 6
    assert [os.stat(p).st_size for p in tier.paths] == [ssd_path_bytes(3, SLOT)] * 2


def test_locations_interleave_paths(make_ssd) -> None:
    tier, _ = make_ssd(3, SLOT, num_paths=2)
    assert tier.locations() == [SsdLocation(p, s) for s in range(3) for p in range(2)]


def test_write_then_read_is_bit_exact_and_lands_where_documented(make_ssd) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT, num_paths=2)
    blocks = {loc: (K(i), tier.next_seq()) for i, loc in enumerate(tier.locations())}
    recs = put(tier, blocks)
    for loc, rec in recs.items():
        assert read_back(tier, loc, rec) == block_data(rec.key, rec.seq)
    # Every block is on the path and at the offset its location names.
    for loc, rec in recs.items():
        with open(tier.paths[loc.path_index], "rb") as f:
            f.seek(ssd_offsets(SLOT, loc.slot, PER_PATH)[1])
            assert f.read(SLOT) == block_data(rec.key, rec.seq)


def test_read_verifies_the_data_against_the_record(make_ssd) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT)
    loc = tier.locations()[0]
    rec = put(tier, {loc: (K(1), 1)})[loc]
    assert read_back(tier, loc, rec) is not None
    assert read_back(tier, loc, replace(rec, checksum=rec.checksum ^ 1)) is None
    assert read_back(tier, tier.locations()[1], rec) is None  # never written: other bytes


# --- recovery ------------------------------------------------------------------


def test_reopen_recovers_blocks(make_ssd) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT, num_paths=2)
    locs = tier.locations()
    recs = put(tier, {locs[i]: (K(i), 10 + i) for i in range(5)})
    tier.close()
    tier, recovered = make_ssd(PER_PATH, SLOT, num_paths=2)
    assert sorted(recovered, key=lambda lr: lr[1].seq) == list(recs.items())
    for loc, rec in recovered:
        assert read_back(tier, loc, rec) == block_data(rec.key, rec.seq)
    assert tier.next_seq() > 14  # sequence numbers go on from the newest block on disk


def test_force_new_forgets_everything(make_ssd) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT)
    recs = put(tier, {loc: (K(i), i + 1) for i, loc in enumerate(tier.locations())})
    tier.close()
    assert len(recs) == tier.num_slots
    tier, recovered = make_ssd(PER_PATH, SLOT, force_new=True)
    # Recovery is the only way an index learns of a block: none is left to read.
    assert list(recovered) == []
    tier.close()
    # The new format is what is on disk now: a plain reopen recovers nothing either.
    assert list(make_ssd(PER_PATH, SLOT)[1]) == []


def test_other_slot_size_reformats(make_ssd, caplog: pytest.LogCaptureFixture) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT)
    put(tier, {loc: (K(i), i + 1) for i, loc in enumerate(tier.locations())})
    tier.close()
    # Same files, half the slot size: slot 0's header is at the same offset.
    caplog.set_level("INFO", logger="kvtier.tier.ssd")
    tier, recovered = make_ssd(PER_PATH, PAGE, size_bytes=ssd_path_bytes(PER_PATH, SLOT))
    assert list(recovered) == []
    assert tier.slot_bytes == PAGE
    [line] = [r.getMessage() for r in caplog.records if "starts empty" in r.getMessage()]
    assert f"another slot geometry ({PER_PATH} slots of {SLOT} bytes, now 8 of {PAGE})" in line
    tier.close()
    # Back to the first size: reformatted again, the first blocks stay forgotten.
    assert list(make_ssd(PER_PATH, SLOT)[1]) == []


def test_flipped_data_byte_fails_read(make_ssd) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT, num_paths=2)
    locs = tier.locations()
    recs = put(tier, {locs[0]: (K(0), 1), locs[3]: (K(3), 2)})
    bad = locs[3]
    offset = ssd_offsets(SLOT, bad.slot, PER_PATH)[1] + SLOT - 1  # the last byte: the checksum covers all of it
    flip_byte(tier.paths[bad.path_index], offset)
    assert read_back(tier, bad, recs[bad]) is None
    assert read_back(tier, locs[0], recs[locs[0]]) is not None
    flip_byte(tier.paths[bad.path_index], offset)
    assert read_back(tier, bad, recs[bad]) == block_data(K(3), 2)


def test_flipped_header_byte_drops_the_block(make_ssd) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT, num_paths=2)
    locs = tier.locations()
    recs = put(tier, {locs[i]: (K(i), i + 1) for i in range(4)})
    bad = locs[1]
    flip_byte(tier.paths[bad.path_index], ssd_offsets(SLOT, bad.slot, PER_PATH)[0] + 20)  # inside the key
    tier.close()
    tier, recovered = make_ssd(PER_PATH, SLOT, num_paths=2)
    assert {loc for loc, _ in recovered} == set(recs) - {bad}
    for loc, rec in recovered:
        assert rec == recs[loc]


# --- reuse of slots ---------------------------------------------------------------


def test_reused_slot_forgets_the_old_key(make_ssd) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT)
    locs = tier.locations()
    old = put(tier, {locs[0]: (K(1), 1), locs[1]: (K(2), 2)})
    # K(1)'s slot is evicted and reused for K(9); K(2) gets a newer copy in another slot.
    new = put(tier, {locs[0]: (K(9), 3), locs[2]: (K(2), 4)}, reused=[locs[0]])
    assert read_back(tier, locs[0], old[locs[0]]) is None
    assert read_back(tier, locs[0], new[locs[0]]) == block_data(K(9), 3)
    tier.close()
    tier, recovered = make_ssd(PER_PATH, SLOT)
    assert {loc: (rec.key, rec.seq) for loc, rec in recovered} == {
        locs[0]: (K(9), 3), locs[1]: (K(2), 2), locs[2]: (K(2), 4)}  # both copies of K(2): the caller picks


def test_failed_write_into_reused_slot_leaves_no_old_header(make_ssd) -> None:
    io = FaultIo()
    tier, _ = make_ssd(PER_PATH, SLOT, io=io)
    loc = tier.locations()[0]
    put(tier, {loc: (K(1), 1)})
    io.arm("pwritev", errno.EIO, nth=1)  # the empty header goes out, the data write fails
    with pytest.raises(TierIOError):
        put(tier, {loc: (K(9), 2)}, reused=[loc])
    tier.close()
    _, recovered = make_ssd(PER_PATH, SLOT)
    assert list(recovered) == []


# --- faults at the OS boundary -----------------------------------------------------


class FaultIo(IoOps):
    """Fails one OS call after :meth:`arm`: the ``nth`` call (from 0) of
    ``op`` raises ``OSError(err)``, or, with ``err=None``, comes up one page
    short (a header read or write: nothing at all)."""

    def __init__(self) -> None:
        self.op: str | None = None
        self.err: int | None = None
        self.left = 0
        self.fired = False

    def arm(self, op: str, err: int | None, nth: int = 0) -> None:
        self.op, self.err, self.left, self.fired = op, err, nth, False

    def _fire(self, op: str) -> bool:
        if self.op != op:
            return False
        if self.left:
            self.left -= 1
            return False
        self.op, self.fired = None, True
        if self.err is not None:
            raise OSError(self.err, os.strerror(self.err))
        return True

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self._fire("pwritev"):
            [buf] = buffers
            return os.pwritev(fd, [memoryview(buf)[: len(buf) - PAGE]], offset) if len(buf) > PAGE else 0
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self._fire("preadv"):
            [buf] = buffers
            return os.preadv(fd, [memoryview(buf)[: len(buf) - PAGE]], offset) if len(buf) > PAGE else 0
        return super().preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        if self._fire("fdatasync"):
            return
        super().fdatasync(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        self._fire("fallocate")
        super().fallocate(fd, offset, length)


# One batch of 2 blocks in neighbouring slots, one of them reused, on one
# path: pwritev 0 is the empty header, 1-2 the data, 3 both headers (one
# request: they share a page); fdatasync 0-2 one per phase; preadv 0 and 1
# read the header page before each header write (O_DIRECT writes whole pages).
@pytest.mark.parametrize(("op", "nth", "err"), [
    ("preadv", 0, errno.EIO),
    ("preadv", 1, None),  # short read of the header page: nothing is written over it
    ("pwritev", 0, errno.ENOSPC),
    ("pwritev", 1, errno.ENOSPC),
    ("pwritev", 2, errno.EIO),
    ("pwritev", 3, errno.EIO),
    ("pwritev", 1, None),  # short data write
    ("pwritev", 3, None),  # short header write
    ("fdatasync", 0, errno.EIO),
    ("fdatasync", 2, errno.EIO),
])
def test_write_fault_raises_tier_io_error(make_ssd, op: str, nth: int, err: int | None) -> None:
    io = FaultIo()
    tier, _ = make_ssd(PER_PATH, SLOT, io=io)
    locs = tier.locations()
    put(tier, {locs[0]: (K(0), 1)})
    io.arm(op, err, nth)
    with pytest.raises(TierIOError) as info:
        put(tier, {locs[0]: (K(1), 2), locs[1]: (K(2), 3)}, reused=[locs[0]])
    assert io.fired
    assert info.value.errno == (err if err is not None else errno.EIO)
    # Whatever reached the disk is self-consistent ...
    tier.close()
    tier, recovered = make_ssd(PER_PATH, SLOT, io=io)
    for loc, rec in recovered:
        assert read_back(tier, loc, rec) == block_data(rec.key, rec.seq)
    # ... and the tier goes on working (the caller treats the batch's slots as reused).
    again = put(tier, {locs[0]: (K(3), 4), locs[1]: (K(4), 5)}, reused=locs[:2])
    for loc, rec in again.items():
        assert read_back(tier, loc, rec) == block_data(rec.key, rec.seq)


def test_read_eio_raises_tier_io_error(make_ssd) -> None:
    io = FaultIo()
    tier, _ = make_ssd(PER_PATH, SLOT, io=io)
    loc = tier.locations()[0]
    rec = put(tier, {loc: (K(0), 1)})[loc]
    io.arm("preadv", errno.EIO)
    with pytest.raises(TierIOError) as info:
        read_back(tier, loc, rec)
    assert info.value.errno == errno.EIO
    assert read_back(tier, loc, rec) == block_data(K(0), 1)


def test_short_read_is_a_miss(make_ssd) -> None:
    io = FaultIo()
    tier, _ = make_ssd(PER_PATH, SLOT, io=io)
    loc = tier.locations()[0]
    rec = put(tier, {loc: (K(0), 1)})[loc]
    io.arm("preadv", None)
    # The buffer already holds the block (a slot read into before): only the
    # count can tell that this read came up short.
    out = aligned(block_data(K(0), 1))
    assert not tier.read(loc, rec, out)
    assert io.fired
    assert read_back(tier, loc, rec) == block_data(K(0), 1)


# --- what may be opened ------------------------------------------------------------


def test_same_file_twice_is_refused(make_ssd, tmp_path: Path) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT, num_paths=2)
    loc = tier.locations()[0]
    rec = put(tier, {loc: (K(0), 1)})[loc]
    with pytest.raises(ConfigError) as info:
        make_ssd(PER_PATH, SLOT, num_paths=2)
    assert info.value.key == "ssd_path"
    assert info.value.value == str(tmp_path / "ssd0.bin")
    assert "held by another process" in str(info.value)
    assert read_back(tier, loc, rec) is not None  # the holder is undisturbed


def test_refused_second_path_releases_the_first(make_ssd, tmp_path: Path) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT, num_paths=2)
    tier.close()
    holder, _ = SsdTier.open([str(tmp_path / "ssd1.bin")], None, SLOT)
    try:
        with pytest.raises(ConfigError) as info:
            make_ssd(PER_PATH, SLOT, num_paths=2)
        assert info.value.value == str(tmp_path / "ssd1.bin")
        # ssd0.bin was opened and locked on the way: it must have been let go.
        assert _unlocked(str(tmp_path / "ssd0.bin"))
    finally:
        holder.close()


@pytest.mark.parametrize("kind", ["directory", "char device"])
def test_not_a_file_or_block_device_is_refused(tmp_path: Path, kind: str) -> None:
    path = str(tmp_path) if kind == "directory" else "/dev/null"
    with pytest.raises(ConfigError) as info:
        SsdTier.open([path], 1 << 20, SLOT)
    assert (info.value.key, info.value.value) == ("ssd_path", path)
    assert "not a regular file or block device" in str(info.value)


def test_missing_file_without_size_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.bin")
    with pytest.raises(ConfigError) as info:
        SsdTier.open([path], None, SLOT)
    assert (info.value.key, info.value.value) == ("ssd_path", path)
    assert not os.path.exists(path)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "nowhere" / "ssd.bin")
    with pytest.raises(ConfigError) as info:
        SsdTier.open([path], 1 << 20, SLOT)
    assert info.value.value == path


def test_file_too_small_for_one_slot_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "small.bin")
    with pytest.raises(ConfigError) as info:
        SsdTier.open([path], PAGE + SLOT, SLOT)  # room for the superblock and the data, not the header
    assert info.value.value == path
    assert "too small" in str(info.value)
    assert not os.path.exists(path)  # made by this start: removed on the way out
    with open(path, "wb") as f:
        f.write(bytes(PAGE + SLOT))
    with pytest.raises(ConfigError, match="too small"):
        SsdTier.open([path], None, SLOT)
    assert _unlocked(path)  # closed on the way out
    assert os.path.getsize(path) == PAGE + SLOT  # not made by this start: left alone


def _unlocked(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        SsdTier.open([str(tmp_path / "a")], 1 << 20, SLOT + 512)
    with pytest.raises(ConfigError):
        SsdTier.open([], 1 << 20, SLOT)


class NoOpenIo(IoOps):
    """Fails the test if the tier tries to open anything."""

    def open(self, path: str, flags: int) -> int:
        raise AssertionError(f"opened {path}")


class SwapBeforeOpen(IoOps):
    """Puts another file at the path between the tier's checks and its open
    (someone else's file, moved there meanwhile)."""

    def __init__(self, other: Path) -> None:
        self.other = other

    def open(self, path: str, flags: int) -> int:
        os.replace(self.other, path)
        return super().open(path, flags)


def test_a_path_replaced_between_its_checks_and_its_opening_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "ssd.bin"
    path.write_bytes(b"\0" * (1 << 20))  # checked: zeros, a tier could start here
    other = tmp_path / "theirs.bin"
    theirs = b"\0" * (1 << 20)  # e.g. an image being made: all zeros, which a tier would format
    other.write_bytes(theirs)
    with pytest.raises(ConfigError, match="replaced between its checks and its opening") as info:
        SsdTier.open([str(path)], None, SLOT, io=SwapBeforeOpen(other))
    assert info.value.key == "ssd_path"
    assert path.read_bytes() == theirs  # not formatted, not removed


def _block_node(rdev: int) -> str | None:
    for name in sorted(os.listdir("/dev")):
        path = os.path.join("/dev", name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISBLK(st.st_mode) and st.st_rdev == rdev:
            return path
    return None


def test_mounted_block_device_is_refused_before_open() -> None:
    # SsdTier._open_path runs check_exclusive on the stat result before any
    # open; NoOpenIo makes sure of it, so nothing can touch the device.
    node = _block_node(os.stat("/").st_dev)
    if node is None:
        pytest.skip("no block device node in /dev holds /")
    with pytest.raises(ConfigError) as info:
        SsdTier.open([node], None, SLOT, io=NoOpenIo())
    assert (info.value.key, info.value.value) == ("ssd_path", node)
    assert "mounted" in str(info.value)


def _fake_loop(sys_block: Path, name: str, backing: str | None) -> None:
    (sys_block / name).mkdir(parents=True)
    if backing is not None:
        (sys_block / name / "loop").mkdir()
        (sys_block / name / "loop" / "backing_file").write_text(backing + "\n")


def test_a_hard_link_to_a_loop_devices_backing_file_is_refused(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    backing = tmp_path / "fs.img"
    backing.write_bytes(b"\0" * (1 << 20))
    alias = tmp_path / "alias.img"
    os.link(backing, alias)  # the same file under another name
    sys_block = tmp_path / "sys-block"
    _fake_loop(sys_block, "loop2", str(backing))
    monkeypatch.setattr(ssd_module, "SYS_BLOCK", str(sys_block))
    assert ssd_module.loop_devices_backed_by(str(alias)) == ["/dev/loop2"]
    with pytest.raises(ConfigError, match="backs loop device /dev/loop2"):
        SsdTier.open([str(alias)], None, SLOT, io=NoOpenIo())


def test_a_loop_devices_file_whose_first_name_was_deleted_is_refused_under_its_other(tmp_path: Path) -> None:
    """A real loop device on a file, a second name (hard link) made, the
    first name removed: the kernel shows "<first> (deleted)" as the backing
    file, and only the device itself (LOOP_GET_STATUS64) says which file it
    reads. kvtier must not format that file under its other name."""
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup")
    first, other = tmp_path / "fs.img", tmp_path / "other-name.img"
    first.write_bytes(b"\0" * (1 << 20))
    os.link(first, other)
    made = subprocess.run(["losetup", "-f", "--show", str(first)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"no loop device: {made.stderr.strip()}")
    dev = made.stdout.strip()
    try:
        first.unlink()
        with open(f"/sys/block/{os.path.basename(dev)}/loop/backing_file") as f:
            assert f.read().strip() == f"{first} (deleted)"
        assert dev in ssd_module.loop_devices_backed_by(str(other))
        with pytest.raises(ConfigError, match=f"backs loop device .*{dev}"):
            SsdTier.open([str(other)], None, SLOT, io=NoOpenIo())
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
    assert other.read_bytes() == b"\0" * (1 << 20)  # untouched


def test_a_file_backing_a_loop_device_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # /sys/block as the kernel shows it: loop0 detached, loop3 on our file,
    # loop5 on a file that had this path before it was deleted.
    path = tmp_path / "ssd.bin"
    path.write_bytes(b"\0" * (1 << 20))
    sys_block = tmp_path / "sys-block"
    _fake_loop(sys_block, "loop0", None)
    _fake_loop(sys_block, "loop3", str(path))
    _fake_loop(sys_block, "loop5", f"{path} (deleted)")  # an earlier file at this path, since removed
    _fake_loop(sys_block, "sda", None)
    monkeypatch.setattr(ssd_module, "SYS_BLOCK", str(sys_block))
    assert ssd_module.loop_devices_backed_by(str(path)) == ["/dev/loop3"]
    with pytest.raises(ConfigError) as info:
        SsdTier.open([str(path)], None, SLOT, io=NoOpenIo())
    assert (info.value.key, info.value.value) == ("ssd_path", str(path))
    assert "backs loop device /dev/loop3" in str(info.value)
    (sys_block / "loop3" / "loop" / "backing_file").write_text(str(tmp_path / "other.bin") + "\n")
    tier, _ = SsdTier.open([str(path)], None, SLOT)
    tier.close()


def test_disk_with_a_mounted_partition_is_refused_before_open() -> None:
    dev = os.stat("/").st_dev
    disk = ssd_module._whole_disk_of(dev)
    node = _block_node(disk) if disk is not None else None
    if node is None:
        pytest.skip("/ is not on a partition of a disk with a node in /dev")
    with pytest.raises(ConfigError) as info:
        SsdTier.open([node], None, SLOT, io=NoOpenIo())
    assert "partition of this device is mounted" in str(info.value)


# --- crash consistency ------------------------------------------------------------

# The child loads tier/ssd.py on its own rather than through kvtier.tier,
# whose __init__ imports the DRAM tier and with it torch: 2 s per child,
# times ~150 crash points. ssd.py itself needs only kvtier.errors and xxhash.
_CRASH_CHILD = textwrap.dedent("""
    import hashlib, importlib.util, json, mmap, os, sys
    import xxhash

    plan = json.loads(sys.argv[1])
    spec = importlib.util.spec_from_file_location("kvtier_ssd_under_test", plan["module"])
    ssd = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ssd
    spec.loader.exec_module(ssd)
    crash_at, mode, slot_bytes = plan["crash_at"], plan["mode"], plan["slot_bytes"]

    def aligned(data):
        buf = mmap.mmap(-1, len(data))
        buf[:] = data
        return memoryview(buf)

    class CrashIo(ssd.IoOps):
        # Writes wait in a volatile cache until fdatasync of their file, as
        # on a disk with a write cache. The process dies before I/O call
        # number crash_at; the cache then reaches the disk in part, per mode.
        def __init__(self):
            self.calls = 0
            self.cache = {}
            self.armed = False  # the start's own writes (its sequence bound) are not among the calls

        def _tick(self):
            if not self.armed:
                return
            if self.calls == crash_at:
                for fd, writes in self.cache.items():
                    kept = {"kept": writes, "lost": [], "odd": writes[1::2]}[mode]
                    for offset, data in kept:
                        os.pwritev(fd, [aligned(data)], offset)
                os._exit(9)
            self.calls += 1

        def pwritev(self, fd, buffers, offset):
            self._tick()
            data = b"".join(bytes(b) for b in buffers)
            # Page by page: a request of several pages can reach the disk in part.
            for at in range(0, len(data), 4096):
                self.cache.setdefault(fd, []).append((offset + at, data[at : at + 4096]))
            return len(data)

        def preadv(self, fd, buffers, offset):
            # A read sees what this process wrote, synced or not (the page
            # cache): the header writes read their pages before writing them.
            n = os.preadv(fd, buffers, offset)
            [buf] = buffers
            for at, data in self.cache.get(fd, []):
                if offset <= at < offset + len(buf):
                    buf[at - offset : at - offset + len(data)] = data
            return n

        def fdatasync(self, fd):
            self._tick()
            for offset, data in self.cache.pop(fd, []):
                os.pwritev(fd, [aligned(data)], offset)
            os.fdatasync(fd)

    io = CrashIo()
    tier, _ = ssd.SsdTier.open(plan["paths"], None, slot_bytes, io=io)
    assert not io.cache  # the files were formatted by the parent; the start's writes are synced
    io.armed = True
    for i, batch in enumerate(plan["batches"]):
        print("begin", i, flush=True)
        if batch["invalidate"]:
            tier.invalidate([ssd.SsdLocation(p, s) for p, s in batch["invalidate"]])
            print("done", i, flush=True)
            continue
        items = []
        for p, s, key_hex, seq in batch["items"]:
            key = bytes.fromhex(key_hex)
            data = hashlib.shake_256(key + seq.to_bytes(8, "little")).digest(slot_bytes)  # block_data()
            rec = ssd.BlockRecord(key, seq, xxhash.xxh3_64_intdigest(data))
            items.append((ssd.SsdLocation(p, s), rec, aligned(data)))
        tier.write(items, [ssd.SsdLocation(p, s) for p, s in batch["reused"]])
        print("done", i, flush=True)
    print("calls", io.calls, flush=True)
""")

Loc = tuple[int, int]
# (location -> (key, seq)), reused; or ({}, locations) with RESET last: an invalidation.
Batch = tuple[dict[Loc, tuple[bytes, int]], list[Loc]] | tuple[dict[Loc, tuple[bytes, int]], list[Loc], str]
RESET = "invalidate"

CRASH_PER_PATH = 130  # a header table of 3 pages per path
# The slots used, on header pages 0, 0, 0, 1, 1, 2: a batch's header request
# spans two pages, so the crash can tear it between them.
S = (0, 1, 63, 64, 65, 128)
# Written by the parent before each child: K(0..7) over both paths, seq 1..8.
_SETUP: dict[Loc, tuple[bytes, int]] = {(i % 2, S[i // 2]): (K(i), i + 1) for i in range(8)}
_N = [K(100 + i) for i in range(5)]
# One batch after an earlier write: two slots evicted and reused by new keys,
# a newer copy of K(2) in a fresh slot, a newer copy of K(3) into its own slot.
_ONE_BATCH: list[Batch] = [
    ({(0, S[0]): (_N[0], 9), (1, S[0]): (_N[1], 10), (0, S[4]): (K(2), 11), (1, S[1]): (K(3), 12),
      (1, S[4]): (_N[2], 13)},
     [(0, S[0]), (1, S[0]), (1, S[1])]),
]
# Evict then reuse, twice: batch 1 reuses a slot batch 0 filled, K(0) comes
# back into another key's slot, K(2)'s slot goes to a new key.
_SEQUENCE: list[Batch] = [
    ({(0, S[0]): (_N[0], 9), (1, S[0]): (_N[1], 10), (0, S[4]): (_N[2], 11)}, [(0, S[0]), (1, S[0])]),
    ({(1, S[0]): (K(0), 12), (0, S[1]): (_N[3], 13), (1, S[4]): (_N[0], 14)}, [(1, S[0]), (0, S[1])]),
]


def _is_reset(batch: Batch) -> bool:
    return len(batch) == 3 and batch[2] == RESET


# An operator's reset in the middle: three blocks' headers emptied, then a
# write that reuses one of those slots.
_WITH_RESET: list[Batch] = [
    ({}, [(0, S[1]), (1, S[1]), (0, S[3])], RESET),
    ({(1, S[1]): (_N[4], 9), (0, S[5]): (_N[0], 10)}, [(1, S[1])]),
]


def _runs(locs) -> int:
    """Header requests for ``locs``: one per run of neighbouring header pages of a path."""
    s = sorted({(p, slot // HEADERS_PER_PAGE) for p, slot in locs})
    return sum(1 for i, (p, page) in enumerate(s) if i == 0 or s[i - 1] != (p, page - 1))


def _io_calls(batch: Batch) -> int:
    """pwritev and fdatasync calls of one batch in the documented order."""
    if _is_reset(batch):
        return _runs(batch[1]) + len({p for p, _ in batch[1]})
    blocks, reused = batch[0], batch[1]
    paths = {p for p, _ in blocks}
    # empty headers + sync, data + sync, headers + sync
    return (_runs(reused) + len({p for p, _ in reused}) + len(blocks) + len(paths)
            + _runs(blocks) + len(paths))


def _run_crash_child(paths: list[str], batches: list[Batch], crash_at: int,
                     mode: str) -> tuple[int, list[str]]:
    plan = {
        "module": ssd_module.__file__, "paths": paths, "slot_bytes": SLOT,
        "crash_at": crash_at, "mode": mode,
        "batches": [{"items": [[p, s, key.hex(), seq] for (p, s), (key, seq) in b[0].items()],
                     "reused": [] if _is_reset(b) else [list(loc) for loc in b[1]],
                     "invalidate": [list(loc) for loc in b[1]] if _is_reset(b) else []} for b in batches],
    }
    out = subprocess.run([sys.executable, "-c", _CRASH_CHILD, json.dumps(plan)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode in (0, 9), out.stderr
    return out.returncode, out.stdout.splitlines()


def _check_after_crash(paths: list[str], batches: list[Batch],
                       log: list[str]) -> dict[Loc, tuple[bytes, int]]:
    """Reopen after the child died and check what recovery finds; returns it by location."""
    every = [_SETUP] + [b[0] for b in batches]
    written = {(key, seq): loc for blocks in every for loc, (key, seq) in blocks.items()}
    begun = {int(line.split()[1]) for line in log if line.startswith("begin")}
    done = {int(line.split()[1]) for line in log if line.startswith("done")}
    tier, recovered = SsdTier.open(paths, None, SLOT)
    try:
        found: dict[Loc, tuple[bytes, int]] = {}
        for loc, rec in recovered:
            where = (loc.path_index, loc.slot)
            # A header only ever names a block that was written, where it was written ...
            assert written.get((rec.key, rec.seq)) == where, (where, rec)
            assert rec.checksum == xxhash.xxh3_64_intdigest(block_data(rec.key, rec.seq))
            # ... and its data is all there.
            assert read_back(tier, loc, rec) == block_data(rec.key, rec.seq), (where, rec)
            found[where] = (rec.key, rec.seq)
    finally:
        tier.close()
    # Durability: a block whose batch returned is there unless a batch that
    # has begun since then writes to its slot (or empties it) ...
    def touched_later(loc: Loc, i: int) -> bool:
        return any(j > i and (loc in batches[j][0] or loc in batches[j][1]) for j in begun)

    finished = [(-1, _SETUP)] + [(i, batches[i][0]) for i in sorted(done)]
    for i, blocks in finished:
        for loc, block in blocks.items():
            if not touched_later(loc, i):
                assert found.get(loc) == block, (loc, block, log)
    # ... and a slot whose invalidation returned stays empty until written again.
    for i in sorted(done):
        if _is_reset(batches[i]):
            for loc in batches[i][1]:
                if not touched_later(loc, i):
                    assert loc not in found, (loc, log)
    return found


@pytest.mark.parametrize("mode", ["kept", "lost", "odd"])
@pytest.mark.parametrize("batches", [_ONE_BATCH, _SEQUENCE, _WITH_RESET],
                         ids=["one-batch", "evict-reuse-sequence", "reset-then-reuse"])
def test_crash_at_every_io_call_leaves_only_verified_blocks(tmp_path: Path, batches: list[Batch],
                                                             mode: str) -> None:
    total = sum(_io_calls(b) for b in batches)
    crash_at = 0
    while True:
        run = tmp_path / str(crash_at)
        run.mkdir()
        paths = [str(run / "ssd0.bin"), str(run / "ssd1.bin")]
        tier, _ = SsdTier.open(paths, 2 * ssd_path_bytes(CRASH_PER_PATH, SLOT), SLOT)
        put(tier, {SsdLocation(*loc): block for loc, block in _SETUP.items()})
        tier.close()
        rc, log = _run_crash_child(paths, batches, crash_at, mode)
        found = _check_after_crash(paths, batches, log)
        if rc == 0:
            break
        assert crash_at < total, log  # it should have finished by now
        crash_at += 1
    assert crash_at == total and log[-1] == f"calls {total}"
    # With no crash, each slot holds the last block written to it.
    final = dict(_SETUP)
    for b in batches:
        if _is_reset(b):
            for loc in b[1]:
                final.pop(loc, None)
        final.update(b[0])
    assert found == final


class BadSector(IoOps):
    """Every read that touches the second header page fails, as on a bad sector."""

    def __init__(self) -> None:
        self.bad = PAGE + PAGE
        self.failed = 0

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if offset <= self.bad < offset + sum(len(b) for b in buffers):
            self.failed += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().preadv(fd, buffers, offset)


def test_a_header_page_recovery_cannot_read_is_marked_for_rewrite(make_ssd) -> None:
    per_path = HEADERS_PER_PAGE + 6  # a table of two pages
    tier, _ = make_ssd(per_path, SLOT)
    put(tier, {SsdLocation(0, s): (K(s), s + 1) for s in (0, 63, 64, 65)})
    tier.close()
    io = BadSector()
    tier, recovered = make_ssd(per_path, SLOT, io=io)
    # The table read in one request fails; page by page, only the second one does.
    assert io.failed == 2
    assert sorted(rec.key for _, rec in recovered) == [K(0), K(63)]
    # Every slot whose header is on that page (64 .. 69) is rewritten before reuse.
    assert tier.unreadable == {SsdLocation(0, s) for s in range(64, per_path)}


class BadSectorSuperFails(BadSector):
    """The bad sector, and the start's write of the superblock (its first) fails too."""

    def __init__(self) -> None:
        super().__init__()
        self.super_writes = 0

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if offset == 0:
            self.super_writes += 1
            if self.super_writes == 1:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize("io", [BadSector, BadSectorSuperFails], ids=["bound-written", "bound-write-fails"])
def test_a_reset_floor_is_above_the_headers_a_start_could_not_read(make_ssd, io: type[IoOps]) -> None:
    """The newest block's header is on a page the next start cannot read, a
    reset comes, and that header cannot be emptied (the page still fails).
    The reset's floor is above its number all the same (the bound the
    superblock keeps), so once the page reads again a restart does not bring
    a block from before the reset back."""
    per_path = HEADERS_PER_PAGE + 6  # a table of two pages
    tier, _ = make_ssd(per_path, SLOT)
    for s in (0, 1, 64):  # numbered as the store numbers them: K(64), on the second page, is the newest
        put(tier, {SsdLocation(0, s): (K(s), tier.next_seq())})
    tier.close()
    tier, recovered = make_ssd(per_path, SLOT, io=io())
    assert sorted(rec.key for _, rec in recovered) == [K(0), K(1)]
    assert tier.high == (0 if io is BadSectorSuperFails else 1 + 2 * ssd_module.SEQ_RESERVE)
    floor = tier.reset_floor()
    assert floor > 3
    tier.set_floor(floor)
    with pytest.raises(TierIOError):  # its headers cannot be emptied: the page is read before it is written
        tier.invalidate([SsdLocation(0, s) for s in range(HEADERS_PER_PAGE, per_path)])
    put(tier, {SsdLocation(0, 2): (K(2), tier.next_seq())})  # after the reset
    assert tier.reset_floor() == floor + 1  # a later reset skips no numbers
    tier.close()
    tier, recovered = make_ssd(per_path, SLOT)
    assert [rec.key for _, rec in recovered] == [K(2)]


def test_the_sequence_bound_survives_restarts_and_a_start_without_it_falls_back(make_ssd, tmp_path: Path) -> None:
    per_path = HEADERS_PER_PAGE + 6
    tier, _ = make_ssd(per_path, SLOT)
    assert tier.high == 1 + ssd_module.SEQ_RESERVE
    put(tier, {SsdLocation(0, 0): (K(0), tier.next_seq())})
    tier.close()
    tier, _ = make_ssd(per_path, SLOT)
    # Every page read: numbering goes on from the newest header, the bound
    # is reserved above it.
    assert tier.high == 2 + ssd_module.SEQ_RESERVE
    assert tier.next_seq() == 2
    put(tier, {SsdLocation(0, 64): (K(64), 2)})
    tier.close()
    # A superblock from before the bound, and a header page that cannot be
    # read: the numbers there are unknown, and a reset falls back on the next.
    path = tmp_path / "ssd0.bin"
    with open(path, "r+b") as f:
        f.seek(ssd_module._SUPER.size + ssd_module._FLOOR.size)
        f.write(bytes(ssd_module._HIGH.size))
    tier, recovered = make_ssd(per_path, SLOT, io=BadSector())
    assert [rec.key for _, rec in recovered] == [K(0)] and tier.high == 0
    assert tier.reset_floor() == 2
    tier.close()
    # Read whole again: the bound follows what recovery read, and is written back.
    tier, recovered = make_ssd(per_path, SLOT)
    assert sorted(rec.key for _, rec in recovered) == [K(0), K(64)]
    assert tier.high == 3 + ssd_module.SEQ_RESERVE
    tier.close()


# --- what start-up may format, and what it leaves behind -----------------------------------


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("layout", ["start", "btrfs", "end", "small", "tail"])
def test_a_file_holding_other_data_is_refused_and_left_byte_identical(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "photos.img"
    body = bytearray(4 << 20)
    if layout == "small":  # a few bytes, under a page: no range to sniff but the file itself
        body = bytearray(b"remember the milk\n")
    elif layout == "tail":  # data in a last partial page only
        body += b"last words"
    elif layout == "start":
        body[SNIFF - 1] = 1  # one byte set in the first MiB
    elif layout == "btrfs":  # zeros up to 64 KiB, then btrfs's superblock (its magic at 0x10040)
        body[0x10040 : 0x10048] = b"_BHRfS_M"
    else:  # a label in the last MiB only (md 1.0, GPT's backup header)
        body[-4096] = 0xA9
    path.write_bytes(bytes(body))
    before = sha(path)
    for size, force_new in ((None, False), (8 << 20, False), (None, True)):
        # Also when ssd_size asks for a larger file, and with force_new_disk
        # (which starts kvtier's own tier afresh, and claims no one's data).
        with pytest.raises(ConfigError) as info:
            SsdTier.open([str(path)], size, SLOT, force_new=force_new)
        assert (info.value.key, info.value.value) == ("ssd_path", str(path))
        assert "not kvtier's" in str(info.value) and f"kvtier disk prepare --force {path}" in str(info.value)
        assert sha(path) == before and _unlocked(str(path))
    # Given to kvtier by the operator, it is formatted.
    prepare(str(path), 4 << 20, force=True)
    tier, recovered = SsdTier.open([str(path)], None, SLOT)
    tier.close()
    assert len(recovered) == 0 and path.read_bytes()[:8] == b"KVTSSD01"


def test_discard_removes_only_what_the_open_created(tmp_path: Path) -> None:
    """A start that fails after the tier opened (placement.open_store)
    discards it: a file that open created goes, one that was there stays."""
    made = tmp_path / "made.img"
    tier, _ = SsdTier.open([str(made)], 4 << 20, SLOT)
    assert tier.created == [str(made)]
    tier.discard()
    assert not made.exists()
    kept = tmp_path / "kept.img"
    prepare(str(kept), 4 << 20)
    tier, _ = SsdTier.open([str(kept)], None, SLOT)
    assert tier.created == []
    tier.discard()
    assert kept.exists() and kept.read_bytes()[:8] == b"KVTSSD01"


def test_a_file_of_zeros_is_formatted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "zeros.img"
    path.write_bytes(bytes(SNIFF) + os.urandom(1 << 20) + bytes(SNIFF))  # only the ends must be zeros
    caplog.set_level("INFO", logger="kvtier.tier.ssd")
    tier, recovered = SsdTier.open([str(path)], None, SLOT)
    tier.close()
    assert len(recovered) == 0 and path.read_bytes()[:8] == b"KVTSSD01"
    assert any(f"{path} is new" in r.getMessage() for r in caplog.records)


def test_kvtier_disk_of_an_older_format_starts_empty(make_ssd, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT)
    put(tier, {tier.locations()[0]: (K(1), 1)})
    tier.close()
    path = tmp_path / "ssd0.bin"
    with open(path, "r+b") as f:  # the superblock of format 2: same magic, version 2
        f.seek(8)
        f.write((2).to_bytes(4, "little"))
    caplog.set_level("INFO", logger="kvtier.tier.ssd")
    tier, recovered = make_ssd(PER_PATH, SLOT)
    assert len(recovered) == 0
    [line] = [r.getMessage() for r in caplog.records if "starts empty" in r.getMessage()]
    assert "holds SSD tier format 2, this is format 3" in line


def test_another_layout_fingerprint_starts_the_tier_empty(make_ssd, caplog: pytest.LogCaptureFixture) -> None:
    a, b = bytes(range(16)), bytes(range(1, 17))
    tier, _ = make_ssd(PER_PATH, SLOT, fingerprint=a)
    rec = put(tier, {tier.locations()[0]: (K(1), 1)})
    tier.close()
    tier, recovered = make_ssd(PER_PATH, SLOT, fingerprint=a)
    assert list(recovered) == list(rec.items())
    tier.close()
    caplog.set_level("INFO", logger="kvtier.tier.ssd")
    tier, recovered = make_ssd(PER_PATH, SLOT, fingerprint=b)
    assert len(recovered) == 0 and tier.fingerprint == b
    [line] = [r.getMessage() for r in caplog.records if "starts empty" in r.getMessage()]
    assert f"another KV layout (fingerprint {a.hex()}, now {b.hex()})" in line
    tier.close()
    # Formatted for b: the blocks written for a are gone for good.
    assert len(make_ssd(PER_PATH, SLOT, fingerprint=a)[1]) == 0
    with pytest.raises(ValueError):
        make_ssd(PER_PATH, SLOT, fingerprint=bytes(17))


def test_a_superblock_read_error_refuses_to_start_and_writes_nothing(make_ssd, tmp_path: Path) -> None:
    tier, _ = make_ssd(PER_PATH, SLOT, num_paths=2)
    put(tier, {loc: (K(i), i + 1) for i, loc in enumerate(tier.locations())})
    tier.close()
    before = [sha(tmp_path / f"ssd{i}.bin") for i in range(2)]
    for err in (errno.EIO, None):  # an error, and a short read
        io = FaultIo()
        io.arm("preadv", err, nth=1)  # the second path's superblock
        with pytest.raises(ConfigError) as info:
            make_ssd(PER_PATH, SLOT, num_paths=2, io=io)
        assert io.fired
        assert (info.value.key, info.value.value) == ("ssd_path", str(tmp_path / "ssd1.bin"))
        assert "superblock" in str(info.value)
        assert [sha(tmp_path / f"ssd{i}.bin") for i in range(2)] == before
    assert len(make_ssd(PER_PATH, SLOT, num_paths=2)[1]) == 2 * PER_PATH  # all still there


def test_a_size_larger_than_the_free_space_is_refused_before_any_allocation(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    paths = [str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]
    with pytest.raises(ConfigError) as info:
        SsdTier.open(paths, 2 * (free // 2 + (1 << 30)), SLOT)  # each half fits alone, both do not
    assert info.value.key == "ssd_size"
    assert "free" in str(info.value) and paths[0] in str(info.value) and paths[1] in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_failed_start_removes_the_files_it_created_and_only_those(tmp_path: Path) -> None:
    size = 3 * ssd_path_bytes(PER_PATH, SLOT)
    paths = [tmp_path / "new0.bin", tmp_path / "old.bin", tmp_path / "new2.bin"]
    paths[1].write_bytes(bytes(ssd_path_bytes(PER_PATH, SLOT)))  # there before: zeros, acceptable
    old = sha(paths[1])
    # Path 3 of 3 cannot be pre-allocated (ENOSPC at the OS boundary).
    io = FaultIo()
    io.arm("fallocate", errno.ENOSPC, nth=1)  # new0 is grown first, then new2
    with pytest.raises(ConfigError) as info:
        SsdTier.open([str(p) for p in paths], size, SLOT, io=io)
    assert info.value.value == str(paths[2]) and "pre-allocate" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["old.bin"] and sha(paths[1]) == old and _unlocked(str(paths[1]))
    # The superblock write fails.
    io.arm("pwritev", errno.EIO, nth=2)
    with pytest.raises(ConfigError) as info:
        SsdTier.open([str(p) for p in paths], size, SLOT, io=io)
    assert info.value.value == str(paths[2]) and "superblock" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["old.bin"] and _unlocked(str(paths[1]))
    # Path 2 of 3 holds someone's data: nothing is created, nothing touched.
    paths[1].write_bytes(b"not kvtier" + bytes(ssd_path_bytes(PER_PATH, SLOT)))
    old = sha(paths[1])
    with pytest.raises(ConfigError, match="not kvtier's"):
        SsdTier.open([str(p) for p in paths], size, SLOT)
    assert sorted(os.listdir(tmp_path)) == ["old.bin"] and sha(paths[1]) == old


def test_failure_of_path_2_of_2_removes_path_1(tmp_path: Path) -> None:
    paths = [tmp_path / "ssd0.bin", tmp_path / "ssd1.bin"]
    paths[1].write_bytes(os.urandom(PAGE) + bytes(ssd_path_bytes(PER_PATH, SLOT)))
    before = sha(paths[1])
    with pytest.raises(ConfigError) as info:
        SsdTier.open([str(p) for p in paths], 2 * ssd_path_bytes(PER_PATH, SLOT), SLOT)
    assert info.value.value == str(paths[1])
    assert not paths[0].exists() and sha(paths[1]) == before


def _mount_small_fs(tmp_path: Path, size_mib: int) -> Path | None:
    """A loop-mounted ext4 of ``size_mib`` MiB under ``tmp_path``, or None where mounting is not permitted."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        return None
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    for cmd in (["mkfs.ext4", "-q", "-F", str(image)], ["mount", "-o", "loop", str(image), str(mnt)]):
        if subprocess.run(cmd, check=False, capture_output=True).returncode != 0:
            return None
    return mnt


@pytest.fixture
def small_fs(tmp_path: Path):
    mnt = _mount_small_fs(tmp_path, 64)
    if mnt is None:
        pytest.skip("cannot loop-mount a small file system here (needs root, mkfs.ext4, loop devices)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_on_a_small_file_system_too_large_is_refused_and_what_fits_is_allocated(small_fs: Path) -> None:
    path = small_fs / "ssd.bin"
    free = shutil.disk_usage(small_fs).free
    with pytest.raises(ConfigError) as info:
        SsdTier.open([str(path)], free + (8 << 20), SLOT)
    assert info.value.key == "ssd_size" and f"{free} bytes free" in str(info.value)
    assert not path.exists() and shutil.disk_usage(small_fs).free == free
    tier, _ = SsdTier.open([str(path)], free // 2, SLOT)
    tier.close()
    assert os.stat(path).st_blocks * 512 >= free // 2 - PAGE


def test_unequal_paths_interleave_while_both_have_slots(tmp_path: Path) -> None:
    sizes = (ssd_path_bytes(2, SLOT), ssd_path_bytes(5, SLOT))
    paths = [tmp_path / "short.bin", tmp_path / "long.bin"]
    for p, size in zip(paths, sizes):
        p.write_bytes(bytes(size))
    tier, _ = SsdTier.open([str(p) for p in paths], None, SLOT)
    try:
        assert tier.locations() == [SsdLocation(0, 0), SsdLocation(1, 0), SsdLocation(0, 1), SsdLocation(1, 1),
                                    SsdLocation(1, 2), SsdLocation(1, 3), SsdLocation(1, 4)]
        assert [tier.slot_number(loc) for loc in tier.locations()] == list(range(7))
        recs = put(tier, {loc: (K(g), g + 1) for g, loc in enumerate(tier.locations())})
        tier.close()
        tier, recovered = SsdTier.open([str(p) for p in paths], None, SLOT)
        assert sorted(recovered.slots.tolist()) == list(range(7))
        assert dict(recovered) == recs
    finally:
        tier.close()


def test_header_sums_see_every_change_of_one_word() -> None:
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**63, size=(1000, 7), dtype=np.uint64)
    base = ssd_module.header_sums(words)
    assert np.unique(base).size == 1000
    for i in range(7):
        flipped = words.copy()
        flipped[:, i] ^= np.uint64(1) << rng.integers(0, 64, size=1000, dtype=np.uint64)  # one bit of word i
        assert (ssd_module.header_sums(flipped) != base).all()
    # One header or a table of them: the same sums.
    assert ssd_module.header_sums(words[3:4])[0] == base[3]
