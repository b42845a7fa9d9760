"""The DRAM arena on huge pages: ``shm_dir`` on a hugetlbfs mount.

Needs root: the fixture reserves a few 2 MiB pages (vm.nr_hugepages, put
back afterwards) and mounts hugetlbfs in a temporary directory. Skipped
where that is not allowed.
"""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.config import KvtierConfig, check_dram_fits
from kvtier.hostmem import free_huge_pages
from kvtier.errors import ConfigError
from kvtier.tier import DramTier
from kvtier.tier.dram import checksum, page_size_of

HUGE = 2 << 20
NR = "/proc/sys/vm/nr_hugepages"
RESERVE = 8  # 16 MiB


@pytest.fixture
def hugetlbfs(tmp_path: Path) -> Iterator[str]:
    if os.geteuid() != 0 or not os.path.exists(NR):
        pytest.skip("needs root to reserve huge pages")
    with open("/proc/meminfo") as f:
        if "Hugepagesize:       2048 kB" not in f.read():
            pytest.skip("the default huge page size here is not 2 MiB")
    before = int(Path(NR).read_text())
    mnt = tmp_path / "huge"
    mnt.mkdir()
    try:
        Path(NR).write_text(str(before + RESERVE))
    except OSError as err:
        pytest.skip(f"cannot reserve huge pages: {err}")
    try:
        if subprocess.run(["mount", "-t", "hugetlbfs", "none", str(mnt)], capture_output=True, check=False).returncode:
            pytest.skip("cannot mount hugetlbfs here")
        try:
            if free_huge_pages(HUGE) < RESERVE:
                pytest.skip("the kernel did not hand out the huge pages asked for")
            yield str(mnt)
        finally:
            subprocess.run(["umount", "--lazy", str(mnt)], check=False)
    finally:
        Path(NR).write_text(str(before))


def test_the_arena_lives_on_whole_huge_pages(hugetlbfs: str) -> None:
    assert page_size_of(hugetlbfs) == HUGE
    free = free_huge_pages(HUGE)
    path = os.path.join(hugetlbfs, "arena")
    # 5.5 MiB asked: the arena takes two whole pages (the capacity rounded down to 4 MiB).
    tier = DramTier.create(path, 5 * HUGE // 2 + 12345, 64 << 10)
    try:
        assert os.path.getsize(path) == 2 * HUGE
        assert free_huge_pages(HUGE) == free - 2
        assert tier.num_slots > 0
        # Data, seal and verify work through the mapping, and a worker attaches.
        view = tier.rank_view(tier.num_slots - 1, 0)
        view.copy_(torch.arange(view.numel(), dtype=torch.int64).to(torch.uint8))
        tier.seal(tier.num_slots - 1, b"k" * 16, 0, checksum(view, b"k" * 16))
        other = DramTier.attach(path)
        try:
            assert other.num_slots == tier.num_slots
            assert other.verify(tier.num_slots - 1, b"k" * 16, 0, check_data=True)
        finally:
            other.close()
        del view
    finally:
        tier.close()
    gc.collect()  # the mapping goes with the last view of it
    assert free_huge_pages(HUGE) == free


def test_dram_size_is_checked_against_free_huge_pages(hugetlbfs: str) -> None:
    free = free_huge_pages(HUGE)
    check_dram_fits(KvtierConfig(dram_size_bytes=free * HUGE, shm_dir=hugetlbfs))
    with pytest.raises(ConfigError) as info:
        check_dram_fits(KvtierConfig(dram_size_bytes=(free + 1) * HUGE, shm_dir=hugetlbfs))
    assert info.value.key == "dram_size" and "huge pages of 2 MiB" in str(info.value)
    assert f"{free} free" in str(info.value)
    with pytest.raises(ConfigError, match="needs 1 huge pages"):
        check_dram_fits(KvtierConfig(dram_size_bytes=HUGE // 2, shm_dir=hugetlbfs))


def test_file_system_type_comes_from_the_mount_table(tmp_path: Path) -> None:
    from kvtier.hostmem import filesystem_type

    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 0:21 / / rw - ext4 /dev/vda1 rw\n"
        "25 22 0:23 / /dev/shm rw,nosuid - tmpfs tmpfs rw\n"
        "30 22 0:40 / /mnt/huge\\040pages rw - hugetlbfs none rw,pagesize=2M\n"
        "31 30 0:41 / /mnt/huge\\040pages/inner rw - tmpfs tmpfs rw\n")
    assert filesystem_type("/dev/shm", str(table)) == "tmpfs"
    assert filesystem_type("/dev/shm/kvtier-dram-1-0", str(table)) == "tmpfs"
    assert filesystem_type("/dev/shmx", str(table)) == "ext4"  # a prefix of the name is not a parent
    assert filesystem_type("/mnt/huge pages", str(table)) == "hugetlbfs"
    assert filesystem_type("/mnt/huge pages/inner/x", str(table)) == "tmpfs"  # the innermost mount
    assert filesystem_type("/", str(tmp_path / "missing")) == ""


def test_tmpfs_is_not_taken_for_huge_pages() -> None:
    # Whatever block size /dev/shm reports (64 KiB on hosts with 64 KiB base
    # pages), only a hugetlbfs mount makes the arena use huge pages.
    assert page_size_of("/dev/shm") == 4096
