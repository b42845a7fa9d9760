"""kvtier.tier.dram: the shared-memory arena, its headers and its life cycle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.tier import DramTier
from kvtier.tier.dram import MAX_RANKS, checksum
from kvtier.tools.server import poll_until

PAGE = 4096
KEY_A = bytes(range(16))
KEY_B = bytes(range(16, 32))


def _fill(view: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (view.numel(),), dtype=torch.uint8, generator=g)
    view.copy_(data)
    return data


def _seal(tier: DramTier, slot: int, key: bytes, rank: int) -> None:
    tier.seal(slot, key, rank, checksum(tier.rank_view(slot, rank), key))


# --- geometry -------------------------------------------------------------


@pytest.mark.parametrize("rank_bytes", [1, 4096, 4097, 10_000])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("capacity", [3 * PAGE, 100_000, 1 << 20, (1 << 20) + 123])
def test_layout_for_fits_capacity_and_is_page_aligned(capacity: int, rank_bytes: int, ranks: int,
                                                      capacity_for) -> None:
    num_slots, slot_stride, data_off = DramTier.layout_for(capacity, rank_bytes, ranks)
    assert slot_stride == -(-rank_bytes // PAGE) * PAGE * ranks
    assert slot_stride % PAGE == 0
    assert data_off % PAGE == 0
    assert data_off >= PAGE + 128 * num_slots  # superblock and headers before the data
    if num_slots:
        assert data_off + num_slots * slot_stride <= capacity
    # As many slots as fit: one more would not.
    assert capacity_for(num_slots + 1, rank_bytes, ranks) > capacity


@pytest.mark.parametrize("num_slots", [1, 20, 31, 32, 33, 100])
def test_layout_for_exact_capacity(num_slots: int, capacity_for) -> None:
    cap = capacity_for(num_slots, 4096)
    assert DramTier.layout_for(cap, 4096, 1)[0] == num_slots
    assert DramTier.layout_for(cap - 1, 4096, 1)[0] == num_slots - 1


def test_create_geometry_and_preallocation(make_tier, shm_path: str, capacity_for) -> None:
    tier = make_tier(capacity_for(5, 5000, 2), 5000, ranks=2)
    assert (tier.num_slots, tier.ranks, tier.rank_bytes) == (5, 2, 5000)
    assert tier.rank_stride == 2 * PAGE
    assert tier.slot_stride == 4 * PAGE
    assert tier.size_bytes == 5 * 4 * PAGE
    st = os.stat(shm_path)
    assert st.st_size == capacity_for(5, 5000, 2)
    assert st.st_mode & 0o777 == 0o600
    # posix_fallocate: every page is backed now, not on first touch.
    assert st.st_blocks * 512 >= st.st_size


def test_rank_views_are_aligned_sized_and_disjoint(make_tier, capacity_for) -> None:
    tier = make_tier(capacity_for(4, 5000, 3), 5000, ranks=3)
    for slot in range(tier.num_slots):
        for rank in range(tier.ranks):
            view = tier.rank_view(slot, rank)
            assert view.dtype == torch.uint8
            assert view.shape == (5000,)
            assert view.is_contiguous()
            assert view.data_ptr() % PAGE == 0
            view.fill_(1 + slot * tier.ranks + rank)
    for slot in range(tier.num_slots):
        for rank in range(tier.ranks):
            assert torch.all(tier.rank_view(slot, rank) == 1 + slot * tier.ranks + rank)


def test_create_refuses_existing_path(make_tier, shm_path: str) -> None:
    tier = make_tier(1 << 16, 4096)
    tier.rank_view(0).fill_(7)
    with pytest.raises(FileExistsError):
        DramTier.create(shm_path, 1 << 16, 4096)
    # The existing arena is untouched.
    other = DramTier.attach(shm_path)
    try:
        assert torch.all(other.rank_view(0) == 7)
    finally:
        other.close()


def test_create_refuses_existing_foreign_file(shm_path: str) -> None:
    with open(shm_path, "wb") as f:
        f.write(b"not mine")
    with pytest.raises(FileExistsError):
        DramTier.create(shm_path, 1 << 16, 4096)
    with open(shm_path, "rb") as f:
        assert f.read() == b"not mine"


def test_capacity_too_small_is_config_error(shm_path: str) -> None:
    with pytest.raises(ConfigError) as info:
        DramTier.create(shm_path, 2 * PAGE, 4096)
    assert info.value.key == "dram_size"
    assert info.value.value == 2 * PAGE
    assert not os.path.exists(shm_path)


@pytest.mark.parametrize("ranks", [0, MAX_RANKS + 1])
def test_rank_count_out_of_range(shm_path: str, ranks: int) -> None:
    with pytest.raises(ValueError):
        DramTier.create(shm_path, 1 << 20, 4096, ranks)
    assert not os.path.exists(shm_path)


def test_attach_refuses_foreign_file(shm_path: str) -> None:
    with open(shm_path, "wb") as f:
        f.write(b"\0" * PAGE)
    with pytest.raises(ValueError):
        DramTier.attach(shm_path)


# --- headers ----------------------------------------------------------------


def test_fresh_slot_is_not_sealed(make_tier) -> None:
    tier = make_tier(1 << 16, 4096)
    assert tier.header(0).ready_mask == 0
    assert not tier.is_sealed(0, KEY_A)
    assert not tier.verify(0, KEY_A, 0)
    # An all-zero key must not read as sealed on a fresh slot either.
    assert not tier.verify(0, bytes(16), 0, check_data=False)


def test_seal_then_verify(make_tier) -> None:
    tier = make_tier(1 << 16, 4096)
    _fill(tier.rank_view(3), seed=1)
    digest = checksum(tier.rank_view(3), KEY_A)
    tier.seal(3, KEY_A, 0, digest)
    h = tier.header(3)
    assert h.key == KEY_A
    assert h.ready_mask == 1
    assert h.checksums[0] == digest
    assert tier.is_sealed(3, KEY_A)
    assert tier.verify(3, KEY_A, 0)
    # Other slots are not affected.
    assert tier.header(2).ready_mask == 0 and tier.header(4).ready_mask == 0


def test_verify_fails_on_key_mismatch(make_tier) -> None:
    tier = make_tier(1 << 16, 4096)
    _fill(tier.rank_view(0), seed=2)
    _seal(tier, 0, KEY_A, 0)
    assert not tier.is_sealed(0, KEY_B)
    assert not tier.verify(0, KEY_B, 0)
    assert not tier.verify(0, KEY_B, 0, check_data=False)


def test_verify_needs_every_rank(make_tier, capacity_for) -> None:
    tier = make_tier(capacity_for(2, 4096, 2), 4096, ranks=2)
    _fill(tier.rank_view(1, 0), seed=3)
    _fill(tier.rank_view(1, 1), seed=4)
    _seal(tier, 1, KEY_A, 0)
    assert tier.header(1).ready_mask == 0b01
    assert not tier.is_sealed(1, KEY_A)
    assert not tier.verify(1, KEY_A, 0)
    assert not tier.verify(1, KEY_A, 1)
    _seal(tier, 1, KEY_A, 1)
    assert tier.header(1).ready_mask == 0b11
    assert tier.is_sealed(1, KEY_A)
    assert tier.verify(1, KEY_A, 0) and tier.verify(1, KEY_A, 1)


def test_verify_fails_on_flipped_byte(make_tier, capacity_for) -> None:
    tier = make_tier(capacity_for(2, 4096, 2), 4096, ranks=2)
    for rank in range(2):
        _fill(tier.rank_view(0, rank), seed=10 + rank)
        _seal(tier, 0, KEY_A, rank)
    assert tier.verify(0, KEY_A, 1)
    view = tier.rank_view(0, 1)
    view[1234] ^= 0x01
    assert not tier.verify(0, KEY_A, 1)
    assert tier.verify(0, KEY_A, 1, check_data=False)  # headers alone still hold
    assert tier.is_sealed(0, KEY_A)
    assert tier.verify(0, KEY_A, 0)  # the other rank's part is intact
    view[1234] ^= 0x01
    assert tier.verify(0, KEY_A, 1)


def test_checksum_covers_the_last_byte(make_tier) -> None:
    tier = make_tier(1 << 16, 5000)
    _fill(tier.rank_view(0), seed=5)
    _seal(tier, 0, KEY_A, 0)
    tier.rank_view(0)[4999] ^= 0x80
    assert not tier.verify(0, KEY_A, 0)


def test_clear_unpublishes(make_tier) -> None:
    tier = make_tier(1 << 16, 4096)
    _fill(tier.rank_view(0), seed=6)
    _seal(tier, 0, KEY_A, 0)
    tier.clear(0, KEY_B)
    h = tier.header(0)
    assert h.ready_mask == 0
    assert h.key == KEY_B
    assert not tier.is_sealed(0, KEY_B) and not tier.is_sealed(0, KEY_A)
    assert not tier.verify(0, KEY_B, 0) and not tier.verify(0, KEY_A, 0)
    tier.clear(0)
    assert tier.header(0).key == bytes(16)
    # Each clear is counted (a copy that read the slot across one is told,
    # headers_unchanged), and unpublishes it for an adopting service.
    tier.publish(0)
    before, _ = tier.header_snapshot([0], [bytes(16)])
    assert before["published"][0] == 1
    tier.clear(0)
    after, _ = tier.header_snapshot([0], [bytes(16)])
    assert (after["published"][0], int(after["gen"][0])) == (0, int(before["gen"][0]) + 1)
    assert tier.headers_unchanged([0], after) == [True] and tier.headers_unchanged([0], before) == [False]
    # Only those fields: the checksums and the padding stay, every rank's mark goes.
    tier._headers[0]["ready"][:] = 1
    tier._headers[0]["pad"] = np.void(bytes(range(35)))
    raw = bytes(tier._headers[0:1].tobytes())
    tier.clear(0, KEY_A)
    now = bytes(tier._headers[0:1].tobytes())
    fields = tier._headers.dtype.fields
    for name in ("checksum", "pad"):
        dt, at = fields[name][0], fields[name][1]
        assert now[at : at + dt.itemsize] == raw[at : at + dt.itemsize], name
    assert tier._headers[0]["ready"].tolist() == [0] * len(tier._headers[0]["ready"])
    tier._headers[0]["gen"] = 0xFFFFFFFF
    tier.clear(0)
    assert int(tier.header_snapshot([0], [bytes(16)])[0]["gen"][0]) == 0  # wraps
    with pytest.raises(ValueError, match="16 bytes, not 3"):
        tier.clear(0, b"abc")
    with pytest.raises(IndexError):
        tier.clear(tier.num_slots)
    # Sealing again after a clear publishes the new contents.
    _seal(tier, 0, KEY_B, 0)
    assert tier.verify(0, KEY_B, 0)


# --- two processes ----------------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys
    import torch
    from kvtier.tier import DramTier
    from kvtier.tier.dram import checksum

    path, expect = sys.argv[1], bytes.fromhex(sys.argv[2])
    tier = DramTier.attach(path)
    assert not tier.owner
    print(tier.num_slots, tier.ranks, tier.rank_bytes, tier.slot_stride)
    key_a, key_b = bytes(range(16)), bytes(range(16, 32))
    # What the parent wrote and sealed is visible and verifies here.
    assert tier.verify(1, key_a, 0), tier.header(1)
    assert bytes(tier.rank_view(1).numpy()[:64]) == expect
    # Write slot 2 for the parent to read.
    view = tier.rank_view(2)
    view.copy_(torch.arange(view.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    tier.seal(2, key_b, 0, checksum(view, key_b))
    del view
    tier.close()
    print("ok")
""")


def test_two_processes_share_the_arena(make_tier, shm_path: str, capacity_for) -> None:
    tier = make_tier(capacity_for(4, 6000), 6000)
    data = _fill(tier.rank_view(1), seed=7)
    _seal(tier, 1, KEY_A, 0)
    out = subprocess.run([sys.executable, "-c", _CHILD, shm_path, bytes(data[:64].numpy()).hex()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0].split() == [str(v) for v in (4, 1, 6000, 2 * PAGE)]
    assert lines[1] == "ok"
    # The child's write and seal are visible here, and its close left the file.
    assert os.path.exists(shm_path)
    assert tier.verify(2, KEY_B, 0)
    expected = torch.arange(6000, dtype=torch.int64).remainder(251).to(torch.uint8)
    assert torch.equal(tier.rank_view(2), expected)
    assert torch.equal(tier.rank_view(1), data)


# --- life cycle -------------------------------------------------------------


def test_owner_close_unlinks_attached_close_does_not(shm_path: str) -> None:
    owner = DramTier.create(shm_path, 1 << 16, 4096)
    try:
        owner.rank_view(0).fill_(9)
        attached = DramTier.attach(shm_path)
        assert attached.owner is False and owner.owner is True
        assert torch.all(attached.rank_view(0) == 9)
        attached.close()
        attached.close()  # idempotent
        assert os.path.exists(shm_path)
        assert torch.all(owner.rank_view(0) == 9)  # the owner's mapping is unaffected
    finally:
        owner.close()
    assert not os.path.exists(shm_path)
    owner.close()  # idempotent


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)


def test_close_without_views_unmaps(shm_path: str) -> None:
    tier = DramTier.create(shm_path, 1 << 16, 4096)
    assert _mapped(shm_path)
    tier.close()
    assert not _mapped(shm_path)


_OUTLIVE = textwrap.dedent("""
    import os, sys
    from kvtier.tier import DramTier
    path = sys.argv[1]
    tier = DramTier.create(path, 1 << 16, 4096)
    view = tier.rank_view(0)
    view.fill_(5)
    tier.close()
    assert not os.path.exists(path)
    view[0] = 6  # the mapping lives as long as the view
    print(int(view[0]), int(view[1]))
""")


def test_view_outlives_close(shm_path: str) -> None:
    # In a child: before the fix, mmap.close() unmapped under the live view
    # and this access died with SIGSEGV.
    out = subprocess.run([sys.executable, "-c", _OUTLIVE, shm_path], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert out.stdout.split() == ["6", "5"]


def _seal_all_slots(path: str, rank: int, n: int, start) -> None:
    from kvtier.tier import DramTier

    t = DramTier.attach(path)
    start.wait()
    for s in range(n):
        t.seal(s, b"k" * 16, rank, 123)
    t.close()


def test_two_ranks_sealing_the_same_slots_at_once_leave_every_slot_sealed(shm_path: str) -> None:
    """Ranks seal concurrently from their own processes; no rank's ready mark may be lost."""
    import multiprocessing as mp

    n = 4096
    tier = DramTier.create(shm_path, n * (2 * 4096 + 128) + 4 * 4096, 4096, ranks=2)
    assert tier.num_slots >= n
    ctx = mp.get_context("fork")
    for _ in range(3):
        start = ctx.Barrier(2)
        procs = [ctx.Process(target=_seal_all_slots, args=(shm_path, r, n, start)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert sum(1 for s in range(n) if not tier.is_sealed(s, b"k" * 16)) == 0
        for s in range(n):
            tier.clear(s)
    tier.close()


# --- liveness by the owner's lock (issue 7, item 11) --------------------------


def _unused_pid() -> int:
    """A pid no process can have: above the kernel's pid_max."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


def _locked_elsewhere(path: str) -> bool:
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


_HOLDER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()  # holds the lock until the test closes stdin
""")


@pytest.fixture
def shm_dir(tmp_path):
    """A directory of its own on tmpfs, so cleanup sees only this test's files."""
    import shutil
    import uuid

    d = os.path.join("/dev/shm", f"kvtier-test-dir-{os.getpid()}-{uuid.uuid4().hex}")
    os.mkdir(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _flocks_on(path: str) -> int:
    """How many flock locks the kernel lists on ``path``'s file (/proc/locks)."""
    st = os.stat(path)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        return sum(1 for line in f if "FLOCK" in line and ident in line.split())


def test_the_owner_holds_an_exclusive_lock_and_workers_none(shm_path: str) -> None:
    owner = DramTier.create(shm_path, 1 << 16, 4096)
    try:
        assert _locked_elsewhere(shm_path)
        assert _flocks_on(shm_path) == 1
        attached = DramTier.attach(shm_path)  # does not wait for the owner's lock
        try:
            assert _flocks_on(shm_path) == 1  # the owner's: the worker takes none
        finally:
            attached.close()
    finally:
        owner.close()
    assert not os.path.exists(shm_path)


def test_stale_cleanup_keeps_a_locked_arena_of_an_invisible_pid(shm_dir: str) -> None:
    from kvtier.tier.dram import remove_stale_files

    # Another container's engine: its pid means nothing here, but it holds its arena's lock.
    live = os.path.join(shm_dir, f"kvtier-dram-{_unused_pid()}-other")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, live], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        dead = os.path.join(shm_dir, f"kvtier-dram-{_unused_pid()}-dead")
        open(dead, "wb").close()  # a killed engine's arena: nobody holds it
        other = os.path.join(shm_dir, "kvtier-test-unrelated")
        open(other, "wb").close()
        assert remove_stale_files(shm_dir, "kvtier-dram-") == [os.path.basename(dead)]
        assert sorted(os.listdir(shm_dir)) == sorted([os.path.basename(live), "kvtier-test-unrelated"])
    finally:
        holder.stdin.close()
        holder.wait(30)
    # Its owner gone (however it died), the same file is stale.
    assert remove_stale_files(shm_dir, "kvtier-dram-") == [os.path.basename(live)]


def test_stale_cleanup_keeps_this_process_s_own_arena(shm_dir: str) -> None:
    from kvtier.tier.dram import remove_stale_files

    path = os.path.join(shm_dir, f"kvtier-dram-{os.getpid()}-0")
    tier = DramTier.create(path, 1 << 16, 4096)
    try:
        assert remove_stale_files(shm_dir, "kvtier-dram-") == []
        assert os.path.exists(path)
    finally:
        tier.close()


def test_a_worker_outliving_its_owner_keeps_its_mapping_after_cleanup(shm_dir: str) -> None:
    from kvtier.tier.dram import remove_stale_files

    path = os.path.join(shm_dir, "kvtier-dram-1-0")
    owner = DramTier.create(path, 1 << 16, 4096)
    worker = DramTier.attach(path)
    try:
        owner.rank_view(0).fill_(7)
        owner.close()  # the owner is gone; the worker has not shut down yet
        assert not os.path.exists(path)
        assert remove_stale_files(shm_dir, "kvtier-dram-") == []
        assert torch.all(worker.rank_view(0) == 7)
    finally:
        worker.close()


def test_an_owner_killed_without_closing_leaves_a_removable_arena(shm_dir: str) -> None:
    from kvtier.tier.dram import remove_stale_files

    path = os.path.join(shm_dir, "kvtier-dram-2-0")
    child = textwrap.dedent(f"""
        import os
        from kvtier.tier import DramTier
        DramTier.create({path!r}, 1 << 16, 4096)
        os._exit(0)  # no close(): as after SIGKILL, only the kernel releases the lock
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    assert os.path.exists(path)
    assert remove_stale_files(shm_dir, "kvtier-dram-") == ["kvtier-dram-2-0"]
    assert not os.path.exists(path)


def _reapers_of(path: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if path.encode() in argv and b"-c" in argv:
                found.append(int(entry))
    return found


def test_the_reaper_removes_the_arena_of_an_owner_killed_without_closing(shm_dir: str) -> None:
    import signal

    path = os.path.join(shm_dir, "kvtier-dram-3-0")
    child = textwrap.dedent(f"""
        import sys, time
        from kvtier.tier import DramTier
        from kvtier.tier.dram import start_reaper
        tier = DramTier.create({path!r}, 1 << 16, 4096)
        start_reaper(tier)
        print("ready", flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        assert poll_until(lambda: len(_reapers_of(path)) == 1, 60, 0.05)
        assert os.path.exists(path)  # the owner lives: the reaper waits
        owner.send_signal(signal.SIGKILL)  # as vLLM kills its engine core
        owner.wait(30)
        assert poll_until(lambda: not os.path.exists(path), 60, 0.05)
        assert poll_until(lambda: _reapers_of(path) == [], 60, 0.05)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_the_reaper_of_a_closed_arena_exits(shm_dir: str) -> None:
    from kvtier.tier.dram import start_reaper

    path = os.path.join(shm_dir, "kvtier-dram-4-0")
    tier = DramTier.create(path, 1 << 16, 4096)
    start_reaper(tier)
    assert poll_until(lambda: len(_reapers_of(path)) == 1, 60, 0.05)
    tier.close()
    assert poll_until(lambda: _reapers_of(path) == [], 60, 0.05)
    assert os.listdir(shm_dir) == []


def test_a_part_sealed_for_one_key_never_verifies_under_another(make_tier) -> None:
    """A late writer of an ended session seals its part for its key; the
    slot's last seal names another key: the checksum, seeded with the key,
    still tells the parts apart."""
    tier = make_tier(1 << 16, 4096, ranks=2)
    _fill(tier.rank_view(1, 0), seed=3)
    _fill(tier.rank_view(1, 1), seed=4)
    tier.seal(1, KEY_A, 0, checksum(tier.rank_view(1, 0), KEY_A))  # the late writer's part
    tier.seal(1, KEY_B, 1, checksum(tier.rank_view(1, 1), KEY_B))  # the new owner's, sealed last
    assert tier.is_sealed(1, KEY_B)  # the header alone looks whole
    assert not tier.verify(1, KEY_B, 0)
    assert tier.verify(1, KEY_B, 1)


def test_sealed_many_says_what_is_sealed_says_for_each(make_tier, capacity_for) -> None:
    # The load path's header check, one batch for a step's blocks: the same
    # answer as is_sealed slot by slot, and no for a slot out of range or an
    # odd-length key.
    tier = make_tier(capacity_for(8, 4096, ranks=2), 4096, ranks=2)
    k = [bytes([i]) * 16 for i in range(8)]
    for s in range(6):
        for r in range(2):
            if not (s == 3 and r == 1):  # slot 3: one rank never sealed
                tier.seal(s, k[s], r, 0)
    slots = [0, 1, 2, 3, 4, 5, 6, 1, -1, 99]
    keys = [k[0], k[1], k[7], k[3], k[4], k[5], k[6], k[1], k[0], k[0]]
    want = [0 <= s < tier.num_slots and tier.is_sealed(s, key) for s, key in zip(slots, keys)]
    assert want == [True, True, False, False, True, True, False, True, False, False]
    assert tier.sealed_many(slots, keys) == want
    assert tier.sealed_many([0, 1], [k[0], b"short"]) == [True, False]
    assert tier.sealed_many([], []) == []


def test_data_checks_agree_with_verify_for_every_part(make_tier, capacity_for) -> None:
    # The load path's checksum pass for a batch (headers read once): the
    # same answer as verify() for each block and rank, a flipped byte, a
    # part sealed under another key and the last byte included.
    tier = make_tier(capacity_for(6, 4096, ranks=2), 4096, ranks=2)
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    for s, k in enumerate(keys):
        for r in range(2):
            view = tier.rank_view(s, r)
            view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8))
            tier.seal(s, k if s != 4 else keys[0], r, checksum(view, k if s != 4 else keys[0]))
    tier.rank_view(2, 1)[100] ^= 0x10
    tier.rank_view(3, 0)[-1] ^= 0x01
    for r in range(2):
        check = tier.data_checks(list(range(6)), keys, r)
        got = [check(i) for i in range(6)]
        want = [not (s == 2 and r == 1) and not (s == 3 and r == 0) and s != 4 for s in range(6)]
        assert got == [tier.verify(s, keys[s], r) for s in range(6)] == want, (r, got)


def test_verify_many_is_verify_of_every_rank_for_each_block(make_tier, capacity_for) -> None:
    # A cluster put's check of its batch: a flipped byte in either rank, a
    # part sealed under another key, a rank not sealed, all refused.
    tier = make_tier(capacity_for(6, 4096, ranks=2), 4096, ranks=2)
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    for s, k in enumerate(keys):
        for r in range(2):
            if s == 5 and r == 1:
                continue  # rank 1 never sealed slot 5
            view = tier.rank_view(s, r)
            view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8))
            sealed_as = keys[0] if s == 4 else k
            tier.seal(s, sealed_as, r, checksum(view, sealed_as))
    tier.rank_view(2, 1)[100] ^= 0x10
    tier.rank_view(3, 0)[-1] ^= 0x01
    got = tier.verify_many(list(range(6)), keys)
    assert got == [all(tier.verify(s, keys[s], r) for r in range(2)) for s in range(6)]
    assert got == [True, True, False, False, False, False]
    assert tier.verify_many([], []) == []


def test_a_header_snapshot_tells_a_reused_slot_from_an_untouched_one(make_tier, capacity_for) -> None:
    """What a load checked its slots against: any clear since the snapshot is
    a change, even one followed by the very header it had (the same block
    promoted back), and so is the same key sealed again with other bytes or
    the slot unpublished (doomed); a slot sealed but never published is not
    loadable."""
    tier = make_tier(capacity_for(6, 4096), 4096)
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    for s, k in enumerate(keys):
        tier.rank_view(s, 0).fill_(s)
        tier.seal(s, k, 0, checksum(tier.rank_view(s, 0), k))
        if s != 5:
            tier.publish(s)
    snap, sealed = tier.header_snapshot(range(6), keys)
    assert sealed == [True] * 5 + [False]
    assert tier.header_snapshot([0, 1, -1, tier.num_slots, 2], [keys[1], keys[1], keys[0], keys[0], b"x"])[1] == \
        [False, True, False, False, False]  # another key, out of range, a key of the wrong length
    assert tier.sealed_many(range(6), keys, published=True) == [True] * 5 + [False]
    assert tier.sealed_many(range(6), keys) == [True] * 6
    tier.clear(1, keys[1])  # being rewritten
    tier.clear(2, keys[2])
    tier.rank_view(2, 0).fill_(9)
    tier.seal(2, keys[2], 0, checksum(tier.rank_view(2, 0), keys[2]))  # the same key, other bytes
    tier.publish(2)
    raw = bytes(tier._headers[3 : 4].view(np.uint8))
    tier.clear(3, keys[3])  # reused, then the same block back with the same header
    tier.restore_header(3, raw)
    tier.publish(3)
    tier.publish(4, False)  # doomed
    assert tier.headers_unchanged(range(6), snap) == [True, False, False, False, False, True]
    check = tier.data_checks(list(range(6)), keys, 0, snap)
    assert [check(i) for i in range(6)] == [True, True, False, True, True, True]  # against the snapshot's checksums
