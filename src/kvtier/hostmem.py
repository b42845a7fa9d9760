"""Host memory facts the DRAM tier depends on: free memory, hugetlbfs mounts, free huge pages.

Read from /proc and /sys at start-up (configuration checks, arena
creation); nothing here is on a serving path.
"""

from __future__ import annotations

import os

BASE_PAGE = 4096


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (the kernel's estimate), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """Type of the file system ``path`` lives on ("tmpfs", "hugetlbfs", ...), or "" if unknown."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open(mountinfo) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        return ""
    return kind


def hugetlbfs_page_size(directory: str) -> int | None:
    """The huge page size of a hugetlbfs mount holding ``directory``; None
    for any other file system (a large block size alone proves nothing:
    tmpfs reports 64 KiB on hosts with 64 KiB base pages)."""
    if filesystem_type(directory) != "hugetlbfs":
        return None
    return os.statvfs(directory).f_bsize


def free_huge_pages(page_bytes: int) -> int:
    """Huge pages of ``page_bytes`` that a new mapping can take: free, less
    those reserved by mappings made but not yet touched."""
    base = f"/sys/kernel/mm/hugepages/hugepages-{page_bytes // 1024}kB"
    try:
        with open(f"{base}/free_hugepages") as f:
            free = int(f.read())
        with open(f"{base}/resv_hugepages") as f:
            reserved = int(f.read())
    except OSError:
        return 0
    return max(0, free - reserved)
