"""kvtier.pool.statspage: the counters page instances read without a call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.pool.statspage import _HEAD, PAGE_BYTES, StatsPage
from kvtier.tier.dram import remove_stale_files


def test_what_the_service_writes_an_instance_reads(tmp_path: Path) -> None:
    page = StatsPage.create(str(tmp_path / "kvtier-poolstats-x"))
    reader = StatsPage.attach(page.path)
    assert reader.read() is None  # nothing published yet
    assert page.write({"lookups": 3, "dram_slots_used": 7})
    assert reader.read() == {"lookups": 3, "dram_slots_used": 7}
    assert page.write({"lookups": 4})
    assert reader.read() == {"lookups": 4}
    assert os.stat(page.path).st_mode & 0o777 == 0o600
    reader.close()
    page.close()
    assert not os.path.exists(page.path)


def test_a_page_being_written_is_not_read(tmp_path: Path) -> None:
    page = StatsPage.create(str(tmp_path / "kvtier-poolstats-x"))
    reader = StatsPage.attach(page.path)
    page.write({"lookups": 1})
    page._mm[: _HEAD.size] = _HEAD.pack(page._seq + 1, 0)  # the writer stopped half way: odd
    assert reader.read() is None
    page._mm[: _HEAD.size] = _HEAD.pack(page._seq + 2, 5)  # even, but the map is not one
    page._mm[_HEAD.size : _HEAD.size + 5] = b"\xc1" * 5
    assert reader.read() is None
    reader.close()
    page.close()


def test_counters_too_many_for_the_page_are_not_written(tmp_path: Path) -> None:
    page = StatsPage.create(str(tmp_path / "kvtier-poolstats-x"))
    reader = StatsPage.attach(page.path)
    page.write({"a": 1})
    assert not page.write({f"c{i:06d}": i for i in range(PAGE_BYTES // 8)})
    assert reader.read() == {"a": 1}  # the last whole values stay
    reader.close()
    page.close()


def test_only_a_dead_services_page_is_swept_and_a_foreign_file_is_refused(tmp_path: Path) -> None:
    live = StatsPage.create(str(tmp_path / "kvtier-poolstats-a-1"))
    dead = tmp_path / "kvtier-poolstats-a-2"
    dead.write_bytes(b"\0" * PAGE_BYTES)  # no owner holds its lock
    assert remove_stale_files(str(tmp_path), "kvtier-poolstats-a-") == [dead.name]
    assert os.path.exists(live.path)
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="not a counters page"):
        StatsPage.attach(str(short))
    live.close()
