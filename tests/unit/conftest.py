"""Fixtures shared by the unit tests: DRAM arenas in real shared memory.

Arenas live in /dev/shm (tmpfs, as in production) under names unique to the
test process, and are closed and removed at teardown even when a test fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvtier.tier import DramTier

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
