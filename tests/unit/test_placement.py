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
