"""Disk preparation for the SSD tier: ``kvtier disk prepare | check | release``.

Runs from the command line, as an operator, before and after serving. An
SSD tier path is a regular file, a partition, a whole disk or a loop device
on a pre-allocated file (for machines without a spare disk). Every check
here is the one the SSD tier itself makes at start-up, so a path that passes
``check`` is accepted by the server.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.tier.ssd import PAGE, SUPER_MAGIC, check_exclusive, device_size, sniff_ranges

_CHUNK = 1 << 20


@dataclass
class DiskReport:
    path: str
    kind: str
    size_bytes: int = 0
    exclusive: bool = False
    direct_io: bool = False
    read_GBps: float | None = None
    write_GBps: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def kind_of(path: str) -> str:
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISBLK(st.st_mode):
        name = os.path.basename(os.path.realpath(path))
        if name.startswith("loop"):
            return "loop device"
        if os.path.exists(f"/sys/class/block/{name}/partition"):
            return "partition"
        return "disk"
    raise ConfigError("path", path, "not a regular file or block device")


def prepare(path: str, size_bytes: int, loop: bool = False, force: bool = False) -> str:
    """Create a pre-allocated file of ``size_bytes``; with ``loop`` attach a loop
    device with direct I/O on it. Returns the path to configure.

    The file's first and last MiB (:func:`~kvtier.tier.ssd.sniff_ranges`)
    are zeros afterwards, also when ``force`` reuses an existing file: the
    SSD tier formats only paths that are zeros there (or are its own),
    never one that holds someone's data, so preparing a path is how an
    operator says "this one may be overwritten". With ``force``, an
    existing block device (a partition, a disk) is prepared the same way,
    its size kept.
    """
    size = size_bytes - size_bytes % PAGE
    if os.path.exists(path) and not force:
        raise ConfigError("path", path, "exists (pass --force to reuse it)")
    if os.path.exists(path):
        st = os.stat(path)
        why = _exclusive(path, st)
        if why:
            raise ConfigError("path", path, f"in use, not prepared: {why}")
        if stat.S_ISBLK(st.st_mode):
            fd = os.open(path, os.O_RDWR | os.O_EXCL)
            try:
                _zero_sniffed(fd, device_size(fd))
            finally:
                os.close(fd)
            return path
    if size <= 0:
        raise ConfigError("--size", size_bytes, "a file needs a size of at least one page (e.g. 64GB)")
    if loop and os.geteuid() != 0:  # before anything is written
        raise ConfigError("--loop", path, "attaching a loop device needs root")
    if loop and shutil.which("losetup") is None:
        raise ConfigError("--loop", path, "losetup is not installed (package util-linux)")
    parent = os.path.dirname(os.path.abspath(path)) or "."
    try:
        free = shutil.disk_usage(parent).free
    except OSError as err:
        raise ConfigError("path", path, f"its folder {parent}: {err.strerror}") from None
    existing = os.path.getsize(path) if os.path.exists(path) else 0
    if size - existing > free:
        raise ConfigError("size", size, f"larger than the {free} bytes free in {parent}")
    made = not os.path.exists(path)  # else: --force on an existing file
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if made else 0), 0o600)
    except OSError as err:
        raise ConfigError("path", path, err.strerror or str(err)) from None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
            _zero_sniffed(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if not loop:
            return path
        try:
            out = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", path], check=True,
                                 capture_output=True, text=True)
        except subprocess.CalledProcessError as err:
            raise ConfigError("--loop", path, f"losetup failed: {err.stderr.strip()}") from None
        return out.stdout.strip()
    except BaseException:
        if made:  # a failed prepare leaves no file it made (a 64 GB one, pre-allocated)
            os.unlink(path)
        raise


def _zero_sniffed(fd: int, size: int) -> None:
    """Zeros where the SSD tier looks for someone's data, made durable:
    both ends, and a file's last partial page."""
    for off, n in sniff_ranges(size) + ([(size - size % PAGE, size % PAGE)] if size % PAGE else []):
        os.pwrite(fd, bytes(n), off)
    os.fsync(fd)


def _exclusive(path: str, st: os.stat_result) -> str | None:
    """None when nothing else holds ``path``; else why not."""
    try:
        check_exclusive(path, st)
    except ConfigError as err:
        return err.reason
    flags = os.O_RDONLY | (os.O_EXCL if stat.S_ISBLK(st.st_mode) else 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.EBUSY:
            return "busy: mounted or opened exclusively by another process"
        return f"cannot open: {err.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        return "held by another process (locked, e.g. by a running kvtier)"
    finally:
        os.close(fd)
    return None


def check(path: str, bench_bytes: int = 256 << 20) -> DiskReport:
    """Exclusivity, size, direct-I/O support, and a short non-destructive bandwidth test.

    The bandwidth test reads the last ``bench_bytes`` of the path with
    O_DIRECT in 1 MiB requests and writes the same bytes back, so it changes
    nothing on disk. It runs only when nothing else holds the path.
    """
    try:
        rep = DiskReport(path, kind_of(path))
    except FileNotFoundError:
        return DiskReport(path, "missing", problems=["does not exist"])
    except ConfigError as err:
        return DiskReport(path, "other", problems=[err.reason])
    st = os.stat(path)
    why = _exclusive(path, st)
    rep.exclusive = why is None
    if why:
        rep.problems.append(why)
        return rep  # nothing more is probed on a path that something else holds
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as err:
        rep.problems.append(f"direct I/O not supported: {err.strerror}")
        return rep
    try:
        rep.size_bytes = device_size(fd)
        # The tier formats only zeros or its own superblock: anything else is
        # someone's data, and the server would refuse to start on it.
        holds, rep.direct_io = _holds(fd, rep.size_bytes)
        if holds == "foreign":
            rep.problems.append("holds data that is not kvtier's (the SSD tier refuses it); "
                                f"kvtier disk prepare --force {path} overwrites it")
    except OSError as err:
        rep.problems.append(f"direct I/O read failed: {err.strerror}")
    finally:
        os.close(fd)
    if rep.size_bytes < 2 * PAGE:
        rep.problems.append(f"too small: {rep.size_bytes} bytes")
    if rep.ok and bench_bytes > 0:
        try:
            rep.read_GBps, rep.write_GBps = _bandwidth(path, st, rep.size_bytes, bench_bytes)
        except _Taken as err:
            rep.exclusive = False
            rep.problems.append(f"{err}; no bandwidth test was run")
        except OSError as err:
            rep.problems.append(f"bandwidth test failed: {err.strerror or err}")
    return rep


def _holds(fd: int, size: int) -> tuple[str, bool]:
    """What the path open at ``fd`` (``size`` bytes) holds where the SSD
    tier looks: "kvtier" (its superblock), "zeros" or "foreign" (someone's
    data); and whether every read was whole (a short one counts as zeros)."""
    buf = mmap.mmap(-1, _CHUNK)  # page-aligned: ``fd`` may be open with O_DIRECT
    whole, foreign = True, False
    for i, (off, want) in enumerate(sniff_ranges(size)):
        n = os.preadv(fd, [memoryview(buf)[:want]], off)
        whole = whole and n == want
        if i == 0 and n >= 8 and buf[:8] == SUPER_MAGIC:
            return "kvtier", whole
        foreign = foreign or (n == want and buf[:want].count(0) != want)
    return ("foreign" if foreign else "zeros"), whole


class _Taken(Exception):
    """Another process took the path between the exclusivity check and the bandwidth test."""


def _bandwidth(path: str, st: os.stat_result, size: int, bench_bytes: int) -> tuple[float, float]:
    """Read the last ``bench_bytes`` and write the same bytes back, holding
    the path as the SSD tier would: O_EXCL on a block device (a mount or a
    tier opened since the check makes it EBUSY) and the tier's lock, taken
    before anything is read, so that nothing written meanwhile is
    overwritten with what was read. Raises :class:`_Taken` if either is held."""
    n = max(1, min(bench_bytes, size - PAGE) // _CHUNK)
    start = (size - n * _CHUNK) // PAGE * PAGE
    keep = [mmap.mmap(-1, _CHUNK) for _ in range(n)]  # what was there, written back unchanged
    flags = os.O_RDWR | os.O_DIRECT | (os.O_EXCL if stat.S_ISBLK(st.st_mode) else 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.EBUSY:
            raise _Taken("busy since the check: mounted or opened exclusively by another process") from None
        raise
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _Taken("replaced since the check")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise _Taken("held by another process since the check (locked, e.g. by a running kvtier)") from None
        t = time.perf_counter()
        for i in range(n):
            got = os.preadv(fd, [memoryview(keep[i])], start + i * _CHUNK)
            if got != _CHUNK:  # writing back a part read short would put zeros in its place
                raise OSError(errno.EIO, f"read {got} of {_CHUNK} bytes at {start + i * _CHUNK}; nothing written")
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(n):
            os.pwritev(fd, [memoryview(keep[i])], start + i * _CHUNK)
        os.fdatasync(fd)
        write_s = time.perf_counter() - t
    finally:
        os.close(fd)
    total = n * _CHUNK
    return total / read_s / 1e9, total / write_s / 1e9


def release(path: str, delete: bool = False) -> list[str]:
    """Detach a loop device (and with ``delete`` remove its backing file), or
    remove a regular file with ``delete``. Refuses while anything holds it.
    Returns what was done, one line each.

    Only a file that holds kvtier's SSD tier (its superblock) or zeros
    where the tier looks (a file ``prepare`` made and nothing used) is
    deleted: anything else is someone's data, left for its owner to remove.
    """
    try:
        st = os.stat(path)
    except OSError as err:
        raise ConfigError("path", path, err.strerror or str(err)) from None
    if not (stat.S_ISBLK(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise ConfigError("path", path, "not a regular file or a loop device: nothing to release")
    why = _exclusive(path, st)
    if why:
        raise ConfigError("path", path, f"in use, not released: {why}")
    done = []
    if stat.S_ISBLK(st.st_mode):
        name = os.path.basename(os.path.realpath(path))
        backing_file = f"/sys/class/block/{name}/loop/backing_file"
        if not os.path.exists(backing_file):
            raise ConfigError("path", path, "not a loop device: nothing to release")
        with open(backing_file) as f:
            backing = f.read().strip()
        if delete:
            _check_own(backing, f"backing {path}")  # before the detach: a refusal changes nothing
        try:
            subprocess.run(["losetup", "-d", path], check=True, capture_output=True, text=True)
        except FileNotFoundError:
            raise ConfigError("path", path, "losetup is not installed (package util-linux)") from None
        except subprocess.CalledProcessError as err:
            raise ConfigError("path", path, f"losetup -d failed: {err.stderr.strip()}") from None
        done.append(f"detached {path} from {backing}")
        if delete:
            os.unlink(backing)
            done.append(f"deleted {backing}")
    elif delete:
        _check_own(path)
        os.unlink(path)
        done.append(f"deleted {path}")
    else:
        done.append(f"{path} is a file: nothing to detach (--delete removes it)")
    return done


def _check_own(path: str, what: str = "") -> None:
    """ConfigError unless the regular file ``path`` holds kvtier's SSD tier or zeros."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise ConfigError("path", path, f"{what + ': ' if what else ''}{err.strerror}") from None
    try:
        st = os.fstat(fd)
        holds = _holds(fd, st.st_size)[0] if stat.S_ISREG(st.st_mode) else "not a regular file"
        if holds == "zeros":
            # Where the tier does not look: a last partial page, or all of a
            # file too small to be a tier (a note of a few bytes).
            start = 0 if st.st_size < 2 * PAGE else st.st_size - st.st_size % PAGE
            rest = os.pread(fd, st.st_size - start, start)
            if rest.count(0) != len(rest):
                holds = "foreign"
    finally:
        os.close(fd)
    if holds not in ("kvtier", "zeros"):
        why = "holds data that is not kvtier's" if holds == "foreign" else holds
        raise ConfigError("path", path, f"{what + ': ' if what else ''}{why}; not deleted (remove it yourself "
                                        "if it is to go)")
