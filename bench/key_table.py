"""Batch lookups in the key table under the ready index and the SSD index.

A probe of a 64k-token prompt of 16-token blocks asks the meta service's
ready index for 4,096 keys at once (``KeyTable._find_array``); the SSD
index asks its table the same way for the keys past the DRAM run. This
times that call on one table of ``--slots`` keys at the two loads used
(the ready index's 0.25, the SSD index's 0.75), for 4,096 keys held and
4,096 keys held nowhere, p50 and p99 over ``--reps`` calls. Peers in the
same run, on the same keys: the same table key by key (``_find``, the
path of short lookups) and a dict lookup of each key as a bytes object
(what the store's key-by-key probe pays per key, its hash cached).

Old against new code: run it with ``PYTHONPATH`` at an export of the old
commit's ``src``, alternating with the working tree.

Usage: .venv/bin/python bench/key_table.py [--slots 60000] [--keys 4096] [--reps 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from kvtier.keys import KEY_DTYPE
from kvtier.tier.key_table import KeyTable

LOADS = (("ready index", 0.25), ("SSD index", 0.75))


def timed_us(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    p50, p99 = np.percentile(np.asarray(out) * 1e6, [50, 99])
    return float(p50), float(p99)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=60_000)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**64 - 1, size=(args.slots, 2), dtype=np.uint64, endpoint=True)
    print(f"{args.keys} keys a call, tables of {args.slots} keys, {args.reps} calls; p50 / p99 in us\n")
    print("| table (load) | keys | batch (_find_array) | key by key (_find) | dict, bytes keys "
          "| key by key / batch | dict / batch |")
    print("|---|---|---|---|---|---|---|")
    for name, load in LOADS:
        table = KeyTable(args.slots, max_load=load)
        table._keys[:] = keys
        table._insert_many(np.arange(args.slots))
        held = keys[np.sort(rng.choice(args.slots, args.keys, replace=False))]
        absent = rng.integers(0, 2**64 - 1, size=(args.keys, 2), dtype=np.uint64, endpoint=True)
        by_key = dict(zip(np.ascontiguousarray(keys).view(KEY_DTYPE).ravel().tolist(), range(args.slots)))
        for what, want in (("held", held), ("held nowhere", absent)):
            as_bytes = np.ascontiguousarray(want).view(KEY_DTYPE).ravel().tolist()
            expect = [by_key.get(k, -1) for k in as_bytes]
            assert table._find_array(want).tolist() == expect, "the batch lookup disagrees with a dict"
            batch = timed_us(lambda: table._find_array(want), args.reps)
            one = timed_us(lambda: [table._find(k) for k in as_bytes], max(10, args.reps // 10))
            get = by_key.get
            plain = timed_us(lambda: list(map(get, as_bytes)), args.reps)
            print(f"| {name} ({load}) | {what} | {batch[0]:.0f} / {batch[1]:.0f} | {one[0]:.0f} / {one[1]:.0f} "
                  f"| {plain[0]:.0f} / {plain[1]:.0f} | {one[0] / batch[0]:.2f}x | {plain[0] / batch[0]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
