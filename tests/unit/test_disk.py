"""kvtier.tools.disk: prepare, check and release SSD tier paths (real files, real loop devices)."""

from __future__ import annotations

import fcntl
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tier.ssd import SsdTier
from kvtier.tools import disk
from kvtier.tools.disk import check, prepare, release

MiB = 1 << 20


def test_prepare_creates_a_preallocated_file(tmp_path: Path) -> None:
    path = prepare(str(tmp_path / "a.img"), 8 * MiB + 100)
    assert path == str(tmp_path / "a.img")
    st = os.stat(path)
    assert st.st_size == 8 * MiB  # rounded down to whole pages
    assert st.st_blocks * 512 >= 8 * MiB  # allocated, not sparse


def test_prepare_refuses_an_existing_file_unless_forced(tmp_path: Path) -> None:
    path = str(tmp_path / "a.img")
    prepare(path, MiB)
    with pytest.raises(ConfigError, match="exists"):
        prepare(path, MiB)
    prepare(path, 2 * MiB, force=True)
    assert os.path.getsize(path) == 2 * MiB


def test_prepare_refuses_more_than_the_free_space(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="free"):
        prepare(str(tmp_path / "huge.img"), shutil.disk_usage(tmp_path).free + (1 << 40))


def test_check_reports_a_usable_file_and_leaves_its_bytes_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "a.img"
    prepare(str(path), 8 * MiB)
    data = bytes(MiB) + os.urandom(6 * MiB) + bytes(MiB)  # zeros where the SSD tier looks: both ends
    path.write_bytes(data)
    rep = check(str(path), bench_bytes=4 * MiB)
    assert rep.ok, rep.problems
    assert rep.kind == "file" and rep.exclusive and rep.direct_io
    assert rep.size_bytes == 8 * MiB
    assert rep.read_GBps and rep.read_GBps > 0 and rep.write_GBps and rep.write_GBps > 0
    assert path.read_bytes() == data  # the bandwidth test wrote back what it read


def test_check_flags_a_path_held_by_a_running_ssd_tier(tmp_path: Path) -> None:
    path = tmp_path / "a.img"
    tier, _ = SsdTier.open([str(path)], 8 * MiB, 4096)
    try:
        rep = check(str(path), bench_bytes=MiB)
        assert not rep.ok and not rep.exclusive
        assert any("held by another process" in p for p in rep.problems)
        assert rep.read_GBps is None  # nothing is probed on a held path
        with pytest.raises(ConfigError, match="in use"):
            release(str(path), delete=True)
        assert path.exists()
    finally:
        tier.close()
    assert check(str(path), bench_bytes=0).ok


def _taken_after_the_check(monkeypatch: pytest.MonkeyPatch, flags: int, lock: bool) -> list[int]:
    """Another holder takes the path just after check's exclusivity test
    (an open of its own, as another process's would be); its descriptors."""
    held: list[int] = []
    first = disk._exclusive

    def then_taken(path: str, st: os.stat_result) -> str | None:
        why = first(path, st)
        fd = os.open(path, flags)
        held.append(fd)
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return why

    monkeypatch.setattr(disk, "_exclusive", then_taken)
    return held


def test_check_runs_no_bandwidth_test_on_a_path_locked_after_its_check(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.img"
    prepare(str(path), 8 * MiB)
    data = bytes(MiB) + os.urandom(6 * MiB) + bytes(MiB)
    path.write_bytes(data)
    held = _taken_after_the_check(monkeypatch, os.O_RDWR, lock=True)
    try:
        rep = check(str(path), bench_bytes=4 * MiB)
    finally:
        for fd in held:
            os.close(fd)
    assert not rep.ok and not rep.exclusive and rep.read_GBps is None
    assert any("held by another process since the check" in p for p in rep.problems), rep.problems
    assert path.read_bytes() == data


def test_check_writes_back_nothing_after_a_short_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.img"
    prepare(str(path), 8 * MiB)
    data = bytes(MiB) + os.urandom(6 * MiB) + bytes(MiB)
    path.write_bytes(data)
    preadv = os.preadv

    def short(fd: int, buffers: list, offset: int) -> int:  # the bandwidth test's reads end at the path's end
        if offset >= 5 * MiB:
            return preadv(fd, [memoryview(buffers[0])[: MiB // 2]], offset)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", short)
    rep = check(str(path), bench_bytes=2 * MiB)
    monkeypatch.undo()
    assert not rep.ok and rep.write_GBps is None
    assert any(p.startswith("bandwidth test failed: read 524288 of 1048576 bytes") for p in rep.problems), \
        rep.problems
    assert path.read_bytes() == data  # not half a MiB of zeros written back


def test_check_flags_missing_and_non_block_paths(tmp_path: Path) -> None:
    assert check(str(tmp_path / "nope")).problems == ["does not exist"]
    rep = check("/dev/null")
    assert not rep.ok and "not a regular file or block device" in rep.problems[0]


def test_release_deletes_a_file_only_when_asked(tmp_path: Path) -> None:
    path = str(tmp_path / "a.img")
    prepare(path, MiB)
    assert "nothing to detach" in release(path)[0]
    assert os.path.exists(path)
    assert release(path, delete=True) == [f"deleted {path}"]
    assert not os.path.exists(path)


def test_release_deletes_only_what_is_kvtiers(tmp_path: Path) -> None:
    """Someone's file given to release --delete (a typo, the wrong folder)
    is refused and stays; missing paths and folders are one line."""
    notes = tmp_path / "notes.db"
    notes.write_bytes(b"someone's data" * 1000)
    with pytest.raises(ConfigError, match="holds data that is not kvtier's; not deleted"):
        release(str(notes), delete=True)
    assert notes.read_bytes() == b"someone's data" * 1000
    small = tmp_path / "todo.txt"  # smaller than a page: the tier's sniffed ranges miss it
    small.write_bytes(b"call the bank")
    tail = tmp_path / "tail.bin"  # zeros, then data in a last partial page
    tail.write_bytes(bytes(3 * MiB) + b"last words")
    for path in (small, tail):
        with pytest.raises(ConfigError, match="not kvtier's"):
            release(str(path), delete=True)
        assert path.exists()
    used = str(tmp_path / "used.img")  # prepared, then formatted by the SSD tier
    prepare(used, 4 * MiB)
    tier, _ = SsdTier.open([used], None, 4096)
    tier.close()
    assert release(used, delete=True) == [f"deleted {used}"]
    with pytest.raises(ConfigError, match="No such file"):
        release(str(tmp_path / "missing.img"), delete=True)
    with pytest.raises(ConfigError, match="not a regular file or a loop device"):
        release(str(tmp_path), delete=True)


def test_a_prepare_that_fails_leaves_no_file_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kv.img"
    with pytest.raises(ConfigError, match="its folder .*No such file"):
        prepare(str(tmp_path / "no-folder" / "kv.img"), MiB)

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)  # the disk fills meanwhile
    with pytest.raises(OSError, match="No space"):
        prepare(str(path), MiB)
    assert not path.exists()
    mine = tmp_path / "mine.img"
    mine.write_bytes(b"x" * MiB)
    with pytest.raises(OSError, match="No space"):
        prepare(str(mine), MiB, force=True)
    assert mine.exists()  # --force on a file it did not make: left in place


def _loop_devices_work() -> bool:
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        return False
    return subprocess.run(["losetup", "--find"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _loop_devices_work(), reason="needs root and a free loop device")
def test_loop_device_prepare_check_use_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backing = str(tmp_path / "loop.img")
    dev = prepare(backing, 16 * MiB, loop=True)
    try:
        assert dev.startswith("/dev/loop")
        rep = check(dev, bench_bytes=2 * MiB)
        assert rep.ok, rep.problems
        assert rep.kind == "loop device" and rep.size_bytes == 16 * MiB
        # The file under the device is taken: the tier refuses it, and so
        # does release.
        with pytest.raises(ConfigError, match=f"backs loop device {dev}"):
            SsdTier.open([backing], None, 4096)
        assert not check(backing, bench_bytes=0).exclusive
        with pytest.raises(ConfigError, match="in use"):
            release(backing, delete=True)
        assert os.path.exists(backing)
        # A mount or an exclusive open just after the check: no bandwidth test.
        held = _taken_after_the_check(monkeypatch, os.O_RDONLY | os.O_EXCL, lock=False)
        try:
            rep = check(dev, bench_bytes=2 * MiB)
        finally:
            for fd in held:
                os.close(fd)
            monkeypatch.undo()
        assert not rep.ok and rep.read_GBps is None
        assert any("busy since the check" in p for p in rep.problems), rep.problems
        # The SSD tier accepts the device, and holds it exclusively while open.
        tier, recovered = SsdTier.open([dev], None, 4096)
        try:
            assert len(recovered) == 0 and tier.num_slots > 0
            with pytest.raises(ConfigError, match="busy|held"):
                SsdTier.open([dev], None, 4096)
            assert not check(dev, bench_bytes=0).exclusive
            with pytest.raises(ConfigError, match="in use"):
                release(dev, delete=True)
        finally:
            tier.close()
        done = release(dev, delete=True)
        assert done == [f"detached {dev} from {backing}", f"deleted {backing}"]
        dev = ""
        assert not os.path.exists(backing)
    finally:
        if dev:
            subprocess.run(["losetup", "-d", dev], check=False)


def test_cli_prepare_check_release(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvtier.cli import main as cli_main

    path = str(tmp_path / "ssd.img")
    assert cli_main(["disk", "prepare", path, "--size", "8MiB"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == path and os.path.getsize(path) == 8 * MiB
    assert f'"ssd_path": "{path}"' in err and f"ubsio.disk.path = {path}" in err
    assert cli_main(["disk", "prepare", path, "--size", "8MiB"]) == 2  # exists: --force to reuse
    capsys.readouterr()
    assert cli_main(["disk", "check", path, "--bench-size", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert f"{path}: OK" in out and "exclusive   yes" in out and "direct I/O  yes" in out and "read " in out
    tier, _ = SsdTier.open([path], None, 4096)
    try:
        assert cli_main(["disk", "check", path, "--no-bench"]) == 1
        assert "NOT USABLE" in capsys.readouterr().out
        assert cli_main(["disk", "release", path, "--delete"]) == 2
        assert "in use" in capsys.readouterr().err and os.path.exists(path)
    finally:
        tier.close()
    assert cli_main(["disk", "release", path, "--delete"]) == 0
    assert f"deleted {path}" in capsys.readouterr().out and not os.path.exists(path)
    assert cli_main(["disk", "prepare", path, "--size", "lots"]) == 2
    assert "--size" in capsys.readouterr().err


def test_prepare_force_makes_a_path_with_other_data_usable(tmp_path: Path) -> None:
    path = tmp_path / "old.img"
    path.write_bytes(os.urandom(MiB))  # someone's data: the SSD tier refuses it, check says so
    rep = check(str(path), bench_bytes=0)
    assert not rep.ok and any("not kvtier's" in p for p in rep.problems)
    with pytest.raises(ConfigError, match="not kvtier's"):
        SsdTier.open([str(path)], None, 4096)
    assert prepare(str(path), 3 * MiB, force=True) == str(path)
    assert path.read_bytes()[:MiB] == bytes(MiB) and path.read_bytes()[-MiB:] == bytes(MiB)
    assert check(str(path), bench_bytes=0).ok
    tier, recovered = SsdTier.open([str(path)], None, 4096)
    tier.close()
    assert len(recovered) == 0
    # A prepared file that holds a tier keeps passing the check.
    assert check(str(path), bench_bytes=0).ok


def test_prepare_force_refuses_a_path_in_use(tmp_path: Path) -> None:
    path = tmp_path / "a.img"
    tier, _ = SsdTier.open([str(path)], 2 * MiB, 4096)
    try:
        with pytest.raises(ConfigError, match="in use"):
            prepare(str(path), 2 * MiB, force=True)
        assert path.read_bytes()[:8] == b"KVTSSD01"
    finally:
        tier.close()
