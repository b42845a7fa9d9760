"""Fixtures shared by the unit tests: DRAM arenas in real shared memory, SSD
tiers on real files.

Arenas live in /dev/shm (tmpfs, as in production) under names unique to the
test process, and are closed and removed at teardown even when a test fails.
SSD tiers live on files in pytest's ``tmp_path`` (ext4 under /tmp: O_DIRECT
works there, unlike on tmpfs) and are closed at teardown.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.store import TieredStore
from kvtier.tier import DramTier
from kvtier.tier.ssd import IoOps, Recovered, SsdTier

SHM_DIR = "/dev/shm"


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A path in /dev/shm that does not exist yet; removed at teardown if created."""
    path = os.path.join(SHM_DIR, f"kvtier-test-{os.getpid()}-{uuid.uuid4().hex}")
    yield path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def make_tier(shm_path: str) -> Iterator[Callable[..., DramTier]]:
    """``make_tier(capacity_bytes, rank_bytes, ranks=1)`` creates an owned arena
    at ``shm_path``; every tier it made is closed at teardown."""
    made: list[DramTier] = []

    def make(capacity_bytes: int, rank_bytes: int, ranks: int = 1) -> DramTier:
        tier = DramTier.create(shm_path, capacity_bytes, rank_bytes, ranks)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def _capacity_for(num_slots: int, rank_bytes: int, ranks: int = 1) -> int:
    """Smallest arena capacity that holds exactly ``num_slots`` slots.

    Worked out from the documented file layout (superblock page, 128-byte
    headers padded to a page, then 4 KiB aligned rank parts), not from
    ``DramTier.layout_for``, so the tests check that function instead of
    trusting it.
    """
    page = 4096
    headers = -(-(page + 128 * num_slots) // page) * page
    return headers + num_slots * ranks * (-(-rank_bytes // page) * page)


@pytest.fixture
def capacity_for() -> Callable[..., int]:
    """``capacity_for(num_slots, rank_bytes, ranks=1)``: see :func:`_capacity_for`."""
    return _capacity_for


@pytest.fixture
def make_tier_of(make_tier) -> Callable[[int, int], DramTier]:
    """``make_tier_of(num_slots, rank_bytes)``: an arena of one rank with
    exactly ``num_slots`` slots (asserted), made by ``make_tier``."""

    def make(num_slots: int, rank_bytes: int) -> DramTier:
        tier = make_tier(_capacity_for(num_slots, rank_bytes), rank_bytes)
        assert tier.num_slots == num_slots
        return tier

    return make


@pytest.fixture
def worker_and_tier(make_tier):
    """A connector worker half (rank 0) over 16 device blocks of ``BLOCK``
    tokens on one layer (values 0, 1, 2, ... in float32), and an arena of 8
    slots of 4 KiB (one block each): ``(worker, tier, kv)``."""
    import torch

    from kvtier.connector.worker import WorkerSide
    from tests.unit.helpers import BLOCK

    tier = make_tier(_capacity_for(8, 4096), 4096)
    w = WorkerSide(rank=0, num_blocks=16)
    kv = torch.arange(16 * 2 * BLOCK * 8, dtype=torch.float32).reshape(16, 2, BLOCK, 8)
    w.register_kv_caches({"l0": kv})
    return w, tier, kv


# --- SSD tier -------------------------------------------------------------------

PAGE = 4096
HEADER = 64  # bytes of one slot header
HEADERS_PER_PAGE = PAGE // HEADER


def ssd_table_bytes(num_slots: int) -> int:
    """Bytes of the header table of a path of ``num_slots`` slots: whole pages of 64 headers."""
    return -(-num_slots // HEADERS_PER_PAGE) * PAGE


def ssd_offsets(slot_bytes: int, slot: int, num_slots: int) -> tuple[int, int]:
    """(header offset, data offset) of ``slot`` in an SSD path of ``num_slots``
    slots, from the documented layout: a 4 KiB superblock, a table of
    64-byte headers in whole pages, then the slots' data."""
    return PAGE + slot * HEADER, PAGE + ssd_table_bytes(num_slots) + slot * slot_bytes


def ssd_path_bytes(slots_per_path: int, slot_bytes: int) -> int:
    """Size of one SSD path that holds exactly ``slots_per_path`` slots."""
    return PAGE + ssd_table_bytes(slots_per_path) + slots_per_path * slot_bytes


__all__ = ["Recovered"]  # re-exported for the tests' type hints


@pytest.fixture
def make_ssd(tmp_path: Path) -> Iterator[Callable[..., tuple[SsdTier, Recovered]]]:
    """``make_ssd(slots_per_path, slot_bytes, num_paths=1, *, io=None,
    force_new=False, size_bytes=None, fingerprint=b"")`` opens an SSD tier on files
    ``ssd0.bin``, ``ssd1.bin``, ... in ``tmp_path``, created with room for
    ``slots_per_path`` slots each unless ``size_bytes`` says otherwise.
    Calling it again with the same ``num_paths`` opens the same files (a
    restart). Returns what :meth:`SsdTier.open` returns; every tier it opened
    is closed at teardown."""
    opened: list[SsdTier] = []

    def make(slots_per_path: int, slot_bytes: int, num_paths: int = 1, *, io: IoOps | None = None,
             force_new: bool = False, size_bytes: int | None = None, fingerprint: bytes = b""):
        paths = [str(tmp_path / f"ssd{i}.bin") for i in range(num_paths)]
        if size_bytes is None:
            size_bytes = num_paths * ssd_path_bytes(slots_per_path, slot_bytes)
        tier, recovered = SsdTier.open(paths, size_bytes, slot_bytes, force_new=force_new, io=io,
                                       fingerprint=fingerprint)
        opened.append(tier)
        return tier, recovered

    yield make
    for tier in opened:
        tier.close()


@pytest.fixture(autouse=True)
def probe_checks_odd_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every probe in the unit tests first checks the store's odd set (keys
    not plain READY) against its entries: the probe's fast path counts a
    held key missing from that set as readable, so a state change that
    forgets the set would make a wrong hit. A store of more than 20,000
    entries (none in the unit tests today) is checked on every 64th probe.
    Probes in a meta service's own process (test_pool_restart) are not."""
    probe = TieredStore.probe
    calls = [0]

    def checked(self: TieredStore, keys, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if len(self._entries) <= 20_000 or calls[0] % 64 == 0:
            assert self.odd_keys_consistent(), "the store's odd set differs from its entries"
        return probe(self, keys, **kw)

    monkeypatch.setattr(TieredStore, "probe", checked)
