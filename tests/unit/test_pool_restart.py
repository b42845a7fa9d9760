"""A meta service process killed with -9 and started again: what its clients and the pool keep.

The service is a real process (``python -m kvtier.meta``) started from
config files; the test plays one instance (a :class:`PoolPlacement`) and
its worker (sealing slots in the arena).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from kvtier.pool.client import PoolPlacement, PoolRefused
from kvtier.tier.dram import DramTier, checksum
from kvtier.tools.meta import MetaProcess
from kvtier.tools.server import free_port
from tests.unit.helpers import freeze

RANK_BYTES = 4096


def keys(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def configs(tmp: Path) -> Path:
    shm = tmp / "shm"
    shm.mkdir()
    conf = tmp / "mmc.conf"
    conf.write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{free_port()}\n"
                    f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n"
                    "ock.mmc.local_service.dram.size = 2MB\n"
                    "ock.mmc.local_service.world_size = 1\n"
                    f"kvtier.shm_dir = {shm}\n")
    return conf


def seal(arena: str, slots: list[int | None], ks: list[bytes], corrupt: bool = False) -> None:
    tier = DramTier.attach(arena)
    for slot, key in zip(slots, ks):
        assert slot is not None
        view = tier.rank_view(slot, 0)
        view.fill_(3)
        tier.seal(slot, key, 0, checksum(view, key))
        if corrupt:
            view[0] = 4
    tier.close()


def stop_all(meta: MetaProcess, *placements: PoolPlacement | None) -> None:
    """The clients first (an open one keeps reconnecting to the service's port), then the service."""
    for placement in placements:
        if placement is not None:
            placement.shutdown()
    meta.stop()


def save(c: PoolPlacement, ks: list[bytes]) -> None:
    """What an instance does for a save in step 1: its slots filled and sealed, the step completed.
    complete_step is not waited for: the flush makes it visible to the other
    sessions' probes (without it, a probe from another instance could come
    first; seen once under load)."""
    seal(c.arena_path, list(c.prepare_save(ks, step=1)), ks)
    c.complete_step(1)
    assert c.flush()


def wait_connected(c: PoolPlacement) -> None:
    deadline = time.monotonic() + 20
    while not c.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.connected


def test_a_restarted_service_adopts_the_blocks_that_verify_and_nothing_else(tmp_path: Path) -> None:
    conf = configs(tmp_path)
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log").start()
    c = None
    try:
        c = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="i")
        published, unpublished, corrupt, doomed = keys(1, 4), keys(2, 2), keys(3, 2), keys(4, 2)
        slots = c.prepare_save(published + corrupt + doomed, step=1)
        seal(c.arena_path, list(slots[:4]), published)
        seal(c.arena_path, list(slots[4:6]), corrupt)
        seal(c.arena_path, list(slots[6:]), doomed)
        c.complete_step(1)
        assert c.probe(published).ready == 4
        c.discard(doomed)  # found bad by a reader: never readable again
        seal(c.arena_path, list(c.prepare_save(unpublished, step=2)), unpublished)  # step 2 never completes
        tier = DramTier.attach(c.arena_path)
        for slot in slots[4:6]:  # flipped after publication: fails its checksum
            tier.rank_view(slot, 0)[7] ^= 0xFF
        tier.close()
        arena = c.arena_path
        meta.kill()
        assert c.probe(published).total == 0  # down: a miss, at once

        meta.start()
        wait_connected(c)
        assert c.arena_path == arena  # the same file: workers' mappings stay valid
        assert "4 blocks adopted from the old arena" in meta.log_text()
        assert c.probe(published).ready == 4
        for ks in (unpublished, corrupt, doomed):
            assert c.probe(ks).total == 0
        assert c.pin(published, step=1) == list(slots[:4])
        health = httpx.get(meta.metrics_url + "/health", timeout=5).json()
        assert health["slots"]["used"] == 4 and health["slots"]["pins"] == 4
        # The slots the dead service's writers had filled but it never
        # published (2 unpublished, 2 flipped) stay out of use for a while: a
        # late write must not land in a block handed out again. The doomed
        # ones were cleared when they were dropped.
        assert health["slots"]["held"] == 4
        c.complete_step(1)
    finally:
        stop_all(meta, c)
    assert not any((tmp_path / "shm").iterdir())  # a clean stop removes the arena


def test_slots_held_for_a_gone_instance_stay_held_across_a_restart(tmp_path: Path) -> None:
    """An instance whose session ended with saves unwritten: its slots are
    held, since its workers may still write into them. The hold was the
    dead service's memory alone and their headers were cleared, so a
    restart within it handed them to new writers, and a late write could
    mix into (and be sealed as part of) another instance's block."""
    conf = configs(tmp_path)
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log").start()
    a = b = None
    try:
        a = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="a")
        late = list(a.prepare_save(keys(7, 3), step=1))
        assert None not in late
        a.shutdown()  # gone, its workers maybe still copying
        health = lambda: httpx.get(meta.metrics_url + "/health", timeout=5).json()  # noqa: E731
        deadline = time.monotonic() + 20
        while health()["slots"]["held"] != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health()["slots"]["held"] == 3
        meta.kill()
        meta.start()
        b = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="b")
        assert b.arena_path == a.arena_path  # adopted
        assert health()["slots"]["held"] == 3
        free = health()["slots"]["free"]
        given = b.prepare_save(keys(8, free), step=1)
        assert given.placed == free and not set(late) & set(given)
    finally:
        stop_all(meta, a, b)


def test_a_pool_that_cannot_be_made_yet_keeps_the_old_arena_for_the_next_instance(tmp_path: Path) -> None:
    """The first instance after a restart finds the SSD tier's folder gone
    (a disk not mounted yet): its pool is not made, and the arena the dead
    service left stays to be adopted once the folder is back, instead of
    being removed with the failed attempt."""
    conf = configs(tmp_path)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    with conf.open("a") as f:
        f.write(f"ock.mmc.local_service.storage.enabled = true\nubsio.disk.path = {ssd / 'kv.img'}\n"
                "kvtier.ssd_size = 4MB\n")
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log").start()
    c = None
    try:
        c = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="i")
        ks = keys(9, 3)
        save(c, ks)
        assert c.probe(ks).ready == 3
        arena = c.arena_path
        c.shutdown()
        meta.kill()
        ssd.rename(tmp_path / "ssd-away")
        meta.start()
        try:
            PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="j").shutdown()
        except PoolRefused as err:
            assert "the pool could not be made" in err.message
        else:
            raise AssertionError("a pool was made without its SSD folder")
        assert Path(arena).exists()
        (tmp_path / "ssd-away").rename(ssd)
        c = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="k")
        assert c.arena_path == arena and c.probe(ks).ready == 3
        assert "3 blocks adopted from the old arena" in meta.log_text()
    finally:
        stop_all(meta, c)


def test_a_restart_with_another_geometry_starts_cold_and_removes_the_old_arena(tmp_path: Path) -> None:
    conf = configs(tmp_path)
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log").start()
    c = d = None
    try:
        c = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="i")
        ks = keys(5, 2)
        save(c, ks)
        old = c.arena_path
        c.shutdown()
        meta.kill()
        meta.start()
        d = PoolPlacement(meta.address, ranks=1, rank_bytes=2 * RANK_BYTES, name="j")
        assert d.arena_path != old and not Path(old).exists()
        assert d.probe(ks).total == 0
        assert "starting cold" in meta.log_text()
    finally:
        stop_all(meta, c, d)


def test_a_restart_whose_first_instance_has_smaller_blocks_adopts_the_larger_arena(tmp_path: Path) -> None:
    """Two models shared the pool, the larger one's instance first. After a
    kill -9, the smaller one's instance comes back first: its blocks fit
    the old arena's parts, so the arena is adopted (the larger model's
    blocks kept) rather than made anew for the smaller blocks, which would
    leave the larger model out."""
    conf = configs(tmp_path)
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log").start()
    big = small = None
    try:
        big = PoolPlacement(meta.address, ranks=1, rank_bytes=2 * RANK_BYTES, name="big")
        small = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="small")
        theirs, mine = keys(7, 2), keys(8, 2)
        save(big, theirs)
        save(small, mine)
        arena = big.arena_path
        big.shutdown()
        small.shutdown()
        meta.kill()
        meta.start()
        small = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="small")
        assert small.arena_path == arena and "4 blocks adopted from the old arena" in meta.log_text()
        assert small.probe(mine).ready == 2
        big = PoolPlacement(meta.address, ranks=1, rank_bytes=2 * RANK_BYTES, name="big")
        assert big.probe(theirs).ready == 2
    finally:
        stop_all(meta, big, small)


def test_after_a_clean_stop_the_ssd_tier_keeps_the_larger_parts_for_a_smaller_first_instance(
        tmp_path: Path) -> None:
    """A clean stop removes the arena, so there is nothing to adopt; the
    SSD tier's superblock still says what its blocks are. A smaller model
    connecting first gets a pool of the larger parts: the SSD tier is
    recovered, not started empty, and the larger model still fits."""
    conf = configs(tmp_path)
    conf.write_text(conf.read_text() + "ock.mmc.local_service.storage.enabled = true\n"
                    f"ubsio.disk.path = {tmp_path / 'ssd.img'}\nkvtier.ssd_size = 64MB\n")
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log").start()
    big = small = None
    try:
        big = PoolPlacement(meta.address, ranks=1, rank_bytes=2 * RANK_BYTES + 100, name="big")
        big.shutdown()
        meta.stop()
        assert not any((tmp_path / "shm").iterdir())  # no arena left to adopt
        meta.start()
        small = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="small")
        log = meta.log_text()
        assert f"the SSD tier holds blocks in parts of {2 * RANK_BYTES + 100} bytes per rank" in log
        assert log.count("starts empty") == 1 and "SSD tier recovered" in log  # emptied by the first start only
        big = PoolPlacement(meta.address, ranks=1, rank_bytes=2 * RANK_BYTES + 100, name="big")
        save(big, keys(9, 2))
        assert small.probe(keys(9, 2)).ready == 2
    finally:
        stop_all(meta, big, small)


def test_a_stopped_service_holds_up_the_engine_once_then_lookups_miss_at_once(tmp_path: Path) -> None:
    # SIGSTOP: the kernel still accepts connections for the frozen process
    # and nothing answers (a service stuck in I/O looks the same).
    conf = configs(tmp_path)
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log").start()
    c = None
    try:
        c = PoolPlacement(meta.address, ranks=1, rank_bytes=RANK_BYTES, name="i")
        ks = keys(6, 2)
        save(c, ks)
        assert c.probe(ks).ready == 2
        assert c.stalls == 0
        # A short timeout from here on only: the first hello builds the pool,
        # which may take longer than it on a loaded machine.
        c.timeout_s = 0.5
        c._sock.settimeout(0.5)  # type: ignore[union-attr]
        try:
            freeze(meta.proc.pid)
            assert c.probe(ks).total == 0  # waits out timeout_s once: the only stall
            deadline = time.monotonic() + 30
            misses = 0
            while c.attempts < 3 and time.monotonic() < deadline:  # the client's thread retries meanwhile
                assert c.probe(ks).total == 0 and c.pin(ks, step=2) == [None, None]
                misses += 1
                time.sleep(0.01)
            assert c.attempts >= 3 and misses > 0
            assert c.stalls == 1 and not c.connected
        finally:
            os.kill(meta.proc.pid, signal.SIGCONT)
        wait_connected(c)
        assert c.probe(ks).ready == 2  # the same service, its blocks still there
    finally:
        stop_all(meta, c)


def test_a_ready_file_that_cannot_be_written_stops_the_service_with_one_line(tmp_path: Path) -> None:
    conf = configs(tmp_path)
    ready = tmp_path / "no-such-dir" / "ready"
    env = dict(os.environ, MMC_META_CONFIG_PATH=str(conf), MMC_LOCAL_CONFIG_PATH=str(conf))
    out = subprocess.run([sys.executable, "-m", "kvtier.meta", "--ready-file", str(ready)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"--ready-file {ready}: cannot write it" in out.stderr and "Traceback" not in out.stderr
    assert list((tmp_path / "shm").iterdir()) == []  # nothing of the pool left behind
