"""kvtier.placement.open_store: the connector's config reaches the tiers it opens.

A real arena in /dev/shm and a real SSD file in ``tmp_path``; the store's own
I/O threads demote. Each start is a fresh ``open_store`` on the same paths,
as an engine restart does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import parse_connector_config
from kvtier.placement import close_store, open_store
from tests.unit.conftest import PAGE, _capacity_for, ssd_path_bytes
from tests.unit.test_store_ssd import K, save

pytestmark = pytest.mark.timeout(120)

SLOTS = 10
KEYS = [K(i) for i in range(30)]


def start(shm_path: str, ssd: Path, **extra: object):
    cfg = parse_connector_config({"dram_size": _capacity_for(SLOTS, PAGE), "ssd_path": str(ssd),
                                  "ssd_size": ssd_path_bytes(64, PAGE), **extra}, check_memory=False)
    return open_store(cfg, shm_path, PAGE, 1, fingerprint=b"geometry", reaper=False)


def on_ssd(store) -> int:
    return sum(store.probe([k]).total for k in KEYS if not store.contains(k))


@pytest.mark.parametrize(("promote_timeout", "limit"), [(20, 20.0), (1, 5.0)])
def test_a_move_counts_as_stalled_after_the_schedulers_wait_or_5_s(shm_path: str, tmp_path: Path,
                                                                     promote_timeout: float, limit: float) -> None:
    # A scheduler told to wait 20 s for its blocks is not cut short at 5 s.
    store = start(shm_path, tmp_path / "ssd.img", promote_timeout_s=promote_timeout)
    try:
        assert store.stale_move_s == limit
    finally:
        close_store(store)


def test_a_restart_recovers_the_ssd_tier_and_force_new_disk_starts_it_empty(shm_path: str, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd.img"
    store = start(shm_path, ssd)
    for step, key in enumerate(KEYS):  # three times DRAM: most blocks go down to SSD
        assert save(store, [key], step) != [None]
        assert store.wait_idle()
    kept = on_ssd(store)
    assert kept > 0
    close_store(store)

    store = start(shm_path, ssd)
    try:
        assert on_ssd(store) >= kept  # DRAM is new and empty: every block found is a recovered one
    finally:
        close_store(store)

    store = start(shm_path, ssd, force_new_disk=True)
    try:
        assert on_ssd(store) == 0
        # The fresh tier works: blocks saved now go down to it.
        for step, key in enumerate(KEYS):
            save(store, [key], step)
            assert store.wait_idle()
        assert on_ssd(store) > 0
    finally:
        close_store(store)


def resident_bytes(path: str) -> int:
    """This process's resident bytes of its mapping of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line: "start-end perms ... path"
                inside = line.rstrip("\n").endswith(" " + path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_the_arena_owner_reads_every_page_of_it_until_closed(shm_path: str, tmp_path: Path) -> None:
    import mmap

    from tests.unit.helpers import wait_for

    store = start(shm_path, tmp_path / "ssd.img", kv_warm_interval_s=60)
    tier = store.tier
    warmer = tier._warmer
    try:
        assert warmer is not None and warmer.bytes == tier.mapped_range[1] and warmer.interval_s == 60
        wait_for(lambda: warmer.passes >= 1, what="the first pass over the arena")
        # Drop the mapping's pages (the file keeps them): a pass maps every
        # one of them again.
        tier._mm.madvise(mmap.MADV_DONTNEED)
        assert resident_bytes(shm_path) < tier.mapped_range[1] // 2
        warmer.touch()
        assert resident_bytes(shm_path) >= tier.mapped_range[1]
    finally:
        close_store(store)
    assert not warmer._thread.is_alive() and tier._warmer is None


def test_no_arena_warmer_when_off(shm_path: str, tmp_path: Path) -> None:
    store = start(shm_path, tmp_path / "ssd.img", kv_warm_interval_s=0)
    try:
        assert store.tier._warmer is None
    finally:
        close_store(store)


def test_an_adopted_arena_is_kept_warm_too(shm_path: str, tmp_path: Path) -> None:
    from kvtier.tier.dram import DramTier

    import gc

    gone = DramTier.create(shm_path, _capacity_for(SLOTS, PAGE), PAGE)
    gone.owner = False  # its owner gone without removing the file: the lock goes with the last mapping
    gone.close()
    del gone
    gc.collect()
    tier = DramTier.adopt(shm_path)
    assert tier is not None
    cfg = parse_connector_config({"dram_size": _capacity_for(SLOTS, PAGE), "kv_warm_interval_s": 30},
                                 check_memory=False)
    store = open_store(cfg, shm_path, PAGE, 1, fingerprint=b"geometry", reaper=False, tier=tier)
    try:
        assert tier._warmer is not None and tier._warmer.interval_s == 30
    finally:
        close_store(store)


def test_a_warmer_that_cannot_start_leaves_the_store_working(shm_path: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.tier.dram import DramTier

    def refuse(self: DramTier, interval_s: float) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(DramTier, "keep_warm", refuse)
    store = start(shm_path, tmp_path / "ssd.img", kv_warm_interval_s=5)
    try:
        assert "not kept warm" in caplog.text and "can't start new thread" in caplog.text
        assert save(store, [KEYS[0]], 0) != [None] and store.contains(KEYS[0])
    finally:
        close_store(store)
