"""Per-step cost of the store's index at 10k, 100k and 340k DRAM blocks.

Every engine step the scheduler calls, under the store's lock, ``probe`` (a
lookup), ``prepare_save`` (the step's new blocks) and, when the step's
output comes back, ``complete_step``. Their cost must follow what the step
changed (a few dozen blocks), not how many blocks the pool holds: issue 7
measured 44 ms per step at 50k blocks and 359 ms at 340k, from cleaning
that walked and copied the whole LRU order every step.

For each pool size the store is filled to 90 % of its DRAM slots (between
the clean mark and the high mark, where the old cost showed), with an SSD
tier below it, then runs ``--steps`` steps of: probe a 32-block prefix,
prepare_save ``--saves`` new blocks (filled and sealed as workers do),
complete_step. Only those three calls are timed; the step's SSD copies,
made by the store's I/O threads, are waited for untimed after each step.
The SSD tier goes through an ``IoOps`` that writes nothing (a sparse file,
no data, no fdatasync): what is measured is the index, not the disk.

Prints p50 / p99 / max per step and the ratio of each size's p50 to the
smallest one's: flat (about 1) means per-step cost follows the step, not
the pool. Steps that evict free a slice of the run from the high to the
low mark (1,024 blocks more than they add); they are counted, and show in
p99 and max.

Also, per size, the one step that does cost the pool's size: after lookups
far below the clean mark (which then leave the order of blocks without an
SSD copy as it is), the first cleaning sorts that order from the LRU order
(``LruPolicy.reorder_as`` over ``in_order``), a pause under the store's
lock. Timed on two policies holding the size's keys in opposite orders
(median of 3), against the same size's step p50 and spread over the
blocks saved between two sorts at the store's default marks (an eighth of
the clean mark, ``2 * low - high``); then again with the LRU order moved
by lookups since the keys were saved, as a served pool's is: reading an
OrderedDict follows its links, and out of the keys' memory order each key
costs a cache miss or two.

With ``--saves-run BLOCKS``, the largest size then goes on saving until
BLOCKS more blocks are saved, the pool passing its high mark again and
again, and the pauses of that run are reported: p99.9 and max per step,
steps over 20 ms, and the garbage collector's full collections.

Usage: .venv/bin/python bench/store_step.py [--sizes 10000,100000,340000] [--steps 300] [--saves-run 200000]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from kvtier.policy import LruPolicy
from kvtier.store import EntryState, TieredStore
from kvtier.tier.dram import DramTier, checksum
from kvtier.tier.ssd import IoOps, SsdTier

PAGE = 4096
FILL_CHUNK = 4096  # blocks saved per step while filling


class NullIo(IoOps):
    """An SSD that takes every write at once and keeps nothing (reads see zeros)."""

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return sum(len(b) for b in buffers)

    def fdatasync(self, fd: int) -> None:
        pass

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.ftruncate(fd, offset + length)  # sparse: the bench needs no disk space


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def seal(store: TieredStore, keys: list[bytes], slots: Sequence[int | None]) -> None:
    tier = store.tier
    for k, slot in zip(keys, slots):
        if slot is not None:
            tier.seal(slot, k, 0, checksum(tier.rank_view(slot, 0), k))


def timed_step(store: TieredStore, hot: list[bytes], new: list[bytes], step: int) -> float:
    """Seconds of one step's index calls: probe ``hot``, prepare_save ``new``, complete_step."""
    t = time.perf_counter()
    store.probe(hot)
    slots = store.prepare_save(new, step)
    dt = time.perf_counter() - t
    seal(store, new, slots)  # the workers' part: not the index's
    t = time.perf_counter()
    store.complete_step(step)
    return dt + time.perf_counter() - t


def measure(entries: int, steps: int, saves: int, shm_dir: str, ssd_dir: str, run_blocks: int = 0
            ) -> dict[str, float]:
    num_slots = int(entries / 0.90) + 1
    dram_path = os.path.join(shm_dir, f"kvtier-bench-step-{os.getpid()}-{entries}")
    ssd_path = os.path.join(ssd_dir, f"kvtier-bench-step-{os.getpid()}-{entries}.ssd")
    # Superblock and 128-byte slot headers padded to a page, then the slots.
    capacity = -(-(PAGE + 128 * num_slots) // PAGE) * PAGE + num_slots * PAGE
    tier = DramTier.create(dram_path, capacity, PAGE)
    assert tier.num_slots == num_slots, (tier.num_slots, num_slots)
    ssd_slots = num_slots + num_slots // 4
    ssd, recovered = SsdTier.open([ssd_path], PAGE + ssd_slots * 2 * PAGE, PAGE, force_new=True, io=NullIo())
    # A demotion queue as long as the pool: the fill leaves no cleaning
    # backlog behind, so every size starts from the same steady state (a
    # backlog is worked off at most a queue's length per step, whatever the
    # pool's size).
    store = TieredStore(tier, ssd=ssd, recovered=recovered, demote_queue_blocks=num_slots)
    try:
        step = 0
        n = 0
        while n < entries:
            keys = [key(i) for i in range(n, min(entries, n + FILL_CHUNK))]
            slots = store.prepare_save(keys, step)
            assert None not in slots
            seal(store, keys, slots)
            store.complete_step(step)
            store.wait_idle()
            n += len(keys)
            step += 1
        before = store.counters()
        times: list[float] = []
        gc.collect()
        for s in range(steps):
            hot = [key(i) for i in range(s * 7 % (entries // 2), s * 7 % (entries // 2) + 32)]
            new = [key(n + i) for i in range(saves)]
            n += saves
            times.append(timed_step(store, hot, new, step))
            store.wait_idle()
            step += 1
        after = store.counters()
        stats_ms, walk_ms = statistics_ms(store, n, step)
        step += 1
        ms = np.array(times) * 1e3
        out = {
            "entries": entries, "slots": num_slots, "p50": float(np.percentile(ms, 50)),
            "p99": float(np.percentile(ms, 99)), "max": float(ms.max()),
            "evicted": after["evictions"] - before["evictions"],
            "copied": after["blocks_demoted"] - before["blocks_demoted"],
            "stats_ms": stats_ms, "walk_ms": walk_ms,
        }
        if run_blocks:
            out["run"] = saves_run(store, run_blocks, saves, n, step)
        return out
    finally:
        store.close()
        ssd.close()
        tier.close()
        for p in (dram_path, ssd_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def saves_run(store: TieredStore, blocks: int, saves: int, n: int, step: int) -> dict[str, float]:
    """Steps as above until ``blocks`` more blocks are saved: the pool keeps
    passing its high mark, so this meets what a long run of saves meets
    (the runs of eviction, the index's dicts growing, the garbage
    collector's full collections, timed from its callbacks)."""
    times: list[float] = []
    full: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                full.append((time.perf_counter() - started.pop()) * 1e3)

    before = store.counters()
    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        for s in range(blocks // saves):
            hot = [key(i) for i in range(n - 4096 + s * 7 % 2048, n - 4096 + s * 7 % 2048 + 32)]
            new = [key(n + i) for i in range(saves)]
            n += saves
            times.append(timed_step(store, hot, new, step))
            store.wait_idle()
            step += 1
    finally:
        gc.callbacks.remove(on_gc)
    ms = np.array(times) * 1e3
    after = store.counters()
    return {"blocks": blocks, "steps": len(times), "p50": float(np.percentile(ms, 50)),
            "p99": float(np.percentile(ms, 99)), "p999": float(np.percentile(ms, 99.9)), "max": float(ms.max()),
            "over_20ms": int((ms > 20).sum()), "evicted": after["evictions"] - before["evictions"],
            "full_gcs": len(full), "full_gc_ms": max(full, default=0.0)}


def statistics_ms(store: TieredStore, saved: int, step: int) -> tuple[float, float]:
    """(ms) ``store.statistics()`` (what /metrics and /health read, under the
    store's lock) with a 4,096-key load pinned, and, the peer, the walk of
    every entry it did before: medians of 5."""
    keys = [key(i) for i in range(max(0, saved - 4096), saved)]  # the newest: held
    assert None not in store.pin(keys, step)
    try:
        def walk() -> tuple[int, int]:
            with store._lock:
                entries_ = store._entries.values()
                return (sum(1 for e in entries_ if e.state is not EntryState.READY),
                        sum(1 for e in entries_ if e.pins))

        st = store.statistics()
        assert (st.pending_slots, st.pinned_slots) == walk(), "statistics differ from the walk"
        out = []
        for fn in (store.statistics, walk):
            t = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            out.append(statistics.median(t) * 1e3)
        return out[0], out[1]
    finally:
        store.complete_step(step)


def sort_ms(entries: int, reshuffled: bool = False) -> float:
    """Median of 3: the cleaning order's sort over ``entries`` keys held in
    the reverse of the LRU order. ``reshuffled``: the LRU order was moved
    by lookups since the keys were saved (touched in a random order, as a
    served pool's is), so reading it walks the keys' memory out of order."""
    keys = [key(i) for i in range(entries)]
    lru = LruPolicy()
    for k in keys:
        lru.insert(k)
    if reshuffled:
        keys = random.Random(entries).sample(keys, len(keys))
        lru.touch(keys, all_held=True)
        keys.reverse()  # touch() makes its first key the most recent
    out = []
    for _ in range(3):
        dirty = LruPolicy()
        for k in reversed(keys):
            dirty.insert(k)
        t = time.perf_counter()
        dirty.reorder_as(lru.in_order())
        out.append((time.perf_counter() - t) * 1e3)
        assert next(dirty.victims()) == keys[0]
    return float(np.median(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,340000")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--saves", type=int, default=16, help="new blocks per step")
    ap.add_argument("--shm", default="/dev/shm", help="where the DRAM arena goes")
    ap.add_argument("--ssd-dir", default=tempfile.gettempdir(), help="where the (sparse) SSD file goes")
    ap.add_argument("--saves-run", type=int, default=0, metavar="BLOCKS",
                    help="at the largest size, go on saving until BLOCKS more are saved, and report the pauses")
    args = ap.parse_args()
    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    for size in sizes:
        r = measure(size, args.steps, args.saves, args.shm, args.ssd_dir,
                    args.saves_run if size == max(sizes) else 0)
        r["sort_ms"] = sort_ms(size)
        r["sort_reshuffled_ms"] = sort_ms(size, reshuffled=True)
        rows.append(r)
        print(f"  {size} blocks: p50 {r['p50']:.3f} ms", file=sys.stderr)
    base = rows[0]["p50"]
    print(f"\n## Store step cost: probe 32 + prepare_save {args.saves} + complete_step, "
          f"{args.steps} steps per size\n")
    print("| DRAM blocks held | slots | p50 (ms) | p99 (ms) | max (ms) | p50 / smallest | "
          "blocks evicted | blocks copied to SSD |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['entries']} | {r['slots']} | {r['p50']:.3f} | {r['p99']:.3f} | {r['max']:.3f} | "
              f"{r['p50'] / base:.2f}x | {r['evicted']} | {r['copied']} |")
    print("\n## The store's statistics (/metrics, /health), under its lock, a 4,096-key load pinned\n")
    print("| DRAM blocks held | statistics() (ms) | walk of every entry, as before (ms) | statistics / walk |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['entries']} | {r['stats_ms']:.3f} | {r['walk_ms']:.1f} | {r['stats_ms'] / r['walk_ms']:.3f}x |")
    for r in rows:
        if "run" in r:
            x = r["run"]
            print(f"\n## A long run of saves at {r['entries']} blocks: {x['blocks']} blocks in {x['steps']} steps\n")
            print("| p50 (ms) | p99 (ms) | p99.9 (ms) | max (ms) | steps over 20 ms | blocks evicted | "
                  "full garbage collections | longest (ms) |")
            print("|---|---|---|---|---|---|---|---|")
            print(f"| {x['p50']:.3f} | {x['p99']:.3f} | {x['p999']:.3f} | {x['max']:.1f} | {x['over_20ms']} | "
                  f"{x['evicted']} | {x['full_gcs']} | {x['full_gc_ms']:.1f} |")
    # The store's default marks: high 95 %, low 85 %; cleaning from 2 * low - high, sorts an eighth of that apart.
    print("\n## The cleaning order's sort after lookups far below the clean mark (once per crossing)\n")
    print("| DRAM blocks held | sort (ms) | ns per block | x step p50 | sort, LRU order reshuffled by lookups (ms) | "
          "blocks saved between two sorts, at least | sort per block saved, reshuffled (us) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        between = max(1, (2 * int(r["slots"] * 0.85) - int(r["slots"] * 0.95)) // 8)
        print(f"| {r['entries']} | {r['sort_ms']:.1f} | {r['sort_ms'] * 1e6 / r['entries']:.0f} | "
              f"{r['sort_ms'] / r['p50']:.0f}x | {r['sort_reshuffled_ms']:.1f} | {between} | "
              f"{r['sort_reshuffled_ms'] * 1e3 / between:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
