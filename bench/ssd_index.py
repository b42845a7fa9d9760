"""Scale of the SSD tier's index: resident bytes per slot, operation rates, and recovery.

Part 1 (no disk): an :class:`SsdIndex` of 10,000,000 slots, filled the way a
restart fills it (``adopt`` of what recovery found, here random keys), then
its resident size measured two ways: tracemalloc (numpy's allocations are
traced) and the process's RSS delta. Goal: <= 64 bytes per slot. Peer: the
per-block Python objects the store kept before (a dict entry, an entry
object and an LRU node per block), measured the same way at 1,000,000
slots. Then lookup, insert (take + begin_write + publish) and touch rates,
and one eviction batch as the store runs it under its lock (1 % of the
slots, at most 65,536: ``eviction_batch``).

Part 2 (a file here): an SSD tier of ``--tier-gb`` (default 20) with slots
of ``--slot-kib`` (default 256), every slot written, then opened again:
recovery timed, and the bytes it read counted at the I/O boundary, as a
share of capacity. Peer: one bare O_DIRECT sequential read of the same
number of bytes. Projected linearly to 4 TB. The file is removed afterwards.

Usage: .venv/bin/python bench/ssd_index.py [--slots 10000000] [--dir /tmp] [--tier-gb 20] [--slot-kib 256]
       [--skip-recovery]
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import random
import sys
import tempfile
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.tier.ssd import BlockRecord, IoOps, SsdLocation, SsdTier
from kvtier.tier.ssd_index import SsdIndex, eviction_batch

GOAL_BYTES_PER_SLOT = 64
TB = 4 * 10**12


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 16), dtype=np.uint8)


def build(n: int) -> SsdIndex:
    """A full index of ``n`` slots, as a restart builds it from recovered headers."""
    index = SsdIndex(n)
    seqs = np.arange(1, n + 1, dtype=np.uint64)
    index.adopt(np.arange(n, dtype=np.int64), random_keys(n, 1), seqs, seqs * np.uint64(7))
    return index


def measure_index(n: int) -> dict:
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    t = time.perf_counter()
    index = build(n)
    build_s = time.perf_counter() - t
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    gc.collect()
    return {"index": index, "traced": current, "peak": peak, "rss": rss_bytes() - rss0, "build_s": build_s}


@dataclass
class _OldEntry:
    """What the store kept per SSD block before SsdIndex (store.py's _SsdEntry)."""

    loc: SsdLocation
    rec: BlockRecord | None
    pins: int = 0


def measure_objects(n: int) -> int:
    """Traced bytes of the per-object index: dict of entries plus an LRU order (an OrderedDict, the
    lightest LRU the store has used), ``n`` blocks."""
    keys = random_keys(n, 2)
    gc.collect()
    tracemalloc.start()
    entries: dict[bytes, _OldEntry] = {}
    order: OrderedDict[bytes, None] = OrderedDict()
    for i in range(n):
        key = keys[i].tobytes()
        entries[key] = _OldEntry(SsdLocation(i % 2, i // 2), BlockRecord(key, i + 1, i * 7))
        order[key] = None
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del entries, order
    gc.collect()
    return traced


def rates(index: SsdIndex, ops: int) -> dict:
    n = index.num_slots
    rng = random.Random(3)
    held = [index.key(rng.randrange(n)) for _ in range(ops)]
    misses = [rng.randbytes(16) for _ in range(ops)]
    out = {}
    t = time.perf_counter()
    for key in held:
        index.get(key)
    out["lookup hit"] = ops / (time.perf_counter() - t)
    t = time.perf_counter()
    for key in misses:
        index.get(key)
    out["lookup miss"] = ops / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(0, ops, 64):
        index.touch(held[i : i + 64])  # a prefix of 64 blocks at a time
    out["touch"] = ops / (time.perf_counter() - t)
    # Replace ``ops`` blocks: remove one, then take a slot, write a new key, publish.
    t = time.perf_counter()
    for key, new in zip(held, misses):
        if index.remove(key) is None:
            continue
        slot, _ = index.take()
        index.begin_write(new, slot)
        index.publish(slot, 1, 1)
    out["remove + insert"] = ops / (time.perf_counter() - t)
    return out


def evict_batch(index: SsdIndex) -> tuple[int, float, float]:
    """(blocks, seconds to pick the victims, seconds to remove them) of one eviction batch."""
    k = eviction_batch(index.num_slots)
    t = time.perf_counter()
    victims = index.victims(k)
    pick_s = time.perf_counter() - t
    t = time.perf_counter()
    index.remove_many(victims)
    return k, pick_s, time.perf_counter() - t


class CountingIo(IoOps):
    def __init__(self) -> None:
        self.read_bytes = 0
        self.reads = 0

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        n = super().preadv(fd, buffers, offset)
        self.read_bytes += max(n, 0)
        self.reads += 1
        return n


def fill_tier(path: str, size: int, slot_bytes: int) -> tuple[int, float]:
    """Create the tier and write every slot (one data buffer for all: recovery reads headers only)."""
    tier, _ = SsdTier.open([path], size, slot_bytes, force_new=True)
    try:
        buf = mmap.mmap(-1, slot_bytes)
        buf[:] = os.urandom(slot_bytes)
        digest = xxhash.xxh3_64_intdigest(buf)
        t = time.perf_counter()
        batch = 64
        for first in range(0, tier.num_slots, batch):
            items = [(tier.location(g), BlockRecord(g.to_bytes(16, "little"), g + 1, digest), memoryview(buf))
                     for g in range(first, min(first + batch, tier.num_slots))]
            tier.write(items, [])
        return tier.num_slots, time.perf_counter() - t
    finally:
        tier.close()


def bare_read_s(path: str, nbytes: int, chunk: int = 1 << 20) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, chunk)
        t = time.perf_counter()
        for off in range(4096, 4096 + nbytes, chunk):
            os.preadv(fd, [memoryview(buf)[: min(chunk, 4096 + nbytes - off)]], off)
        return time.perf_counter() - t
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=10_000_000)
    ap.add_argument("--object-slots", type=int, default=1_000_000, help="slots for the per-object peer")
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the recovery test's file goes")
    ap.add_argument("--tier-gb", type=float, default=20.0)
    ap.add_argument("--slot-kib", type=int, default=256)
    ap.add_argument("--skip-recovery", action="store_true")
    args = ap.parse_args()

    m = measure_index(args.slots)
    index = m["index"]
    per_traced = m["traced"] / args.slots
    per_rss = m["rss"] / args.slots
    per_arrays = index.resident_bytes() / args.slots
    per_object = measure_objects(args.object_slots) / args.object_slots
    print(f"\n## SSD index, {args.slots:,} slots (filled by adopt, as at a restart: {m['build_s']:.1f} s)\n")
    print("| measure | bytes per slot | goal / peer | ratio |")
    print("|---|---|---|---|")
    print(f"| resident, tracemalloc | {per_traced:.1f} | <= {GOAL_BYTES_PER_SLOT} | "
          f"{per_traced / GOAL_BYTES_PER_SLOT:.2f}x of goal |")
    print(f"| resident, RSS delta | {per_rss:.1f} | <= {GOAL_BYTES_PER_SLOT} | {per_rss / GOAL_BYTES_PER_SLOT:.2f}x of goal |")
    print(f"| arrays (nbytes) | {per_arrays:.1f} | | |")
    print(f"| peak while building (tracemalloc) | {m['peak'] / args.slots:.1f} | | |")
    print(f"| per-object index (dict + entry + LRU), {args.object_slots:,} slots | {per_object:.1f} | "
          f"SsdIndex / this | {per_traced / per_object:.2f}x |")

    r = rates(index, args.ops)
    k, pick_s, remove_s = evict_batch(index)
    print(f"\n{args.ops:,} operations each on the full index:\n")
    print("| operation | per second |")
    print("|---|---|")
    for name, rate in r.items():
        print(f"| {name} | {rate:,.0f} |")
    print(f"| one eviction batch of {k:,} (bounded: 1 % of the slots, at most 65,536): pick {pick_s * 1000:.0f} ms + remove {remove_s * 1000:.0f} ms | "
          f"{k / (pick_s + remove_s):,.0f} blocks |")
    del index, m
    gc.collect()

    if args.skip_recovery:
        return 0
    slot_bytes = args.slot_kib << 10
    size = int(args.tier_gb * 10**9)
    path = os.path.join(args.dir, f"kvtier-bench-ssd-index-{os.getpid()}.img")
    try:
        slots, fill_s = fill_tier(path, size, slot_bytes)
        io = CountingIo()
        t = time.perf_counter()
        tier, recovered = SsdTier.open([path], None, slot_bytes, io=io)
        open_s = time.perf_counter() - t
        tier.close()
        assert len(recovered) == slots, (len(recovered), slots)
        t = time.perf_counter()
        SsdIndex(slots).adopt(recovered.slots, recovered.key_bytes, recovered.seqs, recovered.checksums)
        adopt_s = time.perf_counter() - t
        peer_s = bare_read_s(path, io.read_bytes - 4096)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    share = io.read_bytes / size
    scale = TB / size
    old_share = (4096 + slots * 4096) / size  # format 2: a 4 KiB header page per slot
    print(f"\n## SSD recovery, {args.tier_gb:g} GB file, {slots:,} slots of {args.slot_kib} KiB, every slot written "
          f"(filled in {fill_s:.0f} s)\n")
    print("| measure | value | peer | ratio |")
    print("|---|---|---|---|")
    print(f"| bytes read by recovery | {io.read_bytes:,} ({share * 100:.3f} % of capacity, {io.reads} requests) | "
          f"format 2: {old_share * 100:.2f} % | {share / old_share:.4f}x |")
    print(f"| open + recovery | {open_s * 1000:.0f} ms | bare O_DIRECT read of those bytes {peer_s * 1000:.0f} ms | "
          f"{open_s / peer_s:.2f}x |")
    print(f"| index built from it (adopt) | {adopt_s * 1000:.0f} ms | | |")
    print(f"| projected to 4 TB: read | {io.read_bytes * scale / 1e9:.2f} GB ({slots * scale:,.0f} slots) | "
          f"format 2: {old_share * TB / 1e9:.1f} GB | |")
    print(f"| projected to 4 TB: open + recovery + adopt | {(open_s + adopt_s) * scale:.1f} s | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
