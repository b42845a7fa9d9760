"""The CPU copy paths of one hit, against memcpy: a load (copies and checksums)
and a save (copies, checksums and seals), outside vLLM.

Builds an arena (a DramTier on /dev/shm, removed at exit) and KV tensors in
vLLM's CPU layout for a model geometry, then times, for the blocks of one
prompt, with fresh random slots and KV blocks each repetition:

* load: ``scatter_checked`` with the checksums read from the slot headers
  (the worker's CPU load path), from slots saved before any timing (four
  prompts' worth, taken in turn) into blocks of the half of the KV cache
  the saves did not read: neither side was just touched;
* save: ``gather_sealed`` (each block's checksum and seal right after its
  copy, the worker's CPU save path) and, beside it, gathering every block
  first and sealing after (what the save path did before);
* copies only: the same block copies with no checksum, and the machine's
  memcpy (bench/ttft.py ``memcpy_gbps``), the limits.

Prints medians, GB/s and ratios to the copies alone and to memcpy.
Copies are made as in the vLLM instances kvtier starts, streamed past the
caches (kvtier.hostmem.streaming_copy_env: the script runs itself again
with that setting); ``--glibc-default``: as glibc makes them by default,
for the comparison.

Usage: .venv/bin/python bench/blockcopy.py [--geometry bench] [--prompt-tokens 8192]
       [--block 64] [--reps 15] [--kv-size 1GB] [--json out.json] [--glibc-default]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import memcpy_gbps  # this machine's memcpy, the copies' limit

from kvtier.config import parse_size
from kvtier.connector.copy import gather_blocks, gather_sealed, scatter_checked, slot_matrix, written_runs
from kvtier.hostmem import streaming_copy_env, streaming_threshold, without_streaming
from kvtier.layout import KvLayout, LayoutKind, block_major, kv_bytes_per_token
from kvtier.tier.dram import DramTier, checksum, checksum_runs
from kvtier.tools.model import GEOMETRIES

GROUPS = 4  # prompts saved for the loads to take in turn


def run(args: argparse.Namespace) -> dict:
    geo = GEOMETRIES[args.geometry]
    dtype = getattr(torch, args.dtype)
    per_block = kv_bytes_per_token(geo.num_layers, geo.num_kv_heads, geo.head_size, dtype.itemsize) * args.block
    kv_blocks = parse_size("--kv-size", args.kv_size) // per_block
    n = (args.prompt_tokens - 1) // args.block  # the blocks of a full hit: one token is always computed
    if 2 * n > kv_blocks:
        raise SystemExit(f"--kv-size {args.kv_size} holds {kv_blocks} blocks, fewer than the {2 * n} of two "
                         "prompts (the loads' sources and destinations)")
    # Random bytes, so that the round trip at the end can tell each block
    # from the others (and from a copy that did not happen).
    shape = (kv_blocks, geo.num_kv_heads, args.block, 2 * geo.head_size * dtype.itemsize)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)
          for i in range(geo.num_layers)}
    layout = KvLayout.from_kv_caches(kv, kv_blocks, LayoutKind.CPU)
    layers = [block_major(kv[name], LayoutKind.CPU) for name in layout.layer_names]
    path = Path(tempfile.mkdtemp(prefix="kvtier-bench-copy-", dir="/dev/shm")) / "arena"
    tier = DramTier.create(str(path), max(GROUPS * n * layout.block_bytes + (8 << 20), 256 << 20),
                           layout.block_bytes, 1)
    try:
        if tier.num_slots < GROUPS * n:
            raise AssertionError(f"the arena holds {tier.num_slots} slots, not {GROUPS * n}")
        tier._slots.fill_(1)  # every slot's pages touched once, as a working arena's are
        slots = slot_matrix(tier._slots[:, : tier.rank_bytes], layout)
        keys = [os.urandom(16) for _ in range(n)]
        rng = random.Random(0)
        # The loads read slots saved before any timing, four prompts' worth
        # taken in turn, from source blocks in the first half of the KV
        # cache, into blocks of the second half: neither side was just
        # touched, as in a server where another instance saved the prefix.
        groups = [rng.sample(range(g * n, (g + 1) * n), n) for g in range(GROUPS)]
        group_keys = [[os.urandom(16) for _ in range(n)] for _ in range(GROUPS)]

        def pick() -> tuple[list[int], list[int]]:
            return rng.sample(range(tier.num_slots), n), rng.sample(range(kv_blocks), n)

        def save_sealed(slot_ids: list[int], blocks: list[int], keys: list[bytes] = keys) -> None:
            runs = written_runs(layers, layout, tier.rank_bytes)

            def seal(i: int) -> None:  # the worker's: the checksum of what the copy read
                part = tier.rank_view(slot_ids[i], 0).data_ptr()
                tier.seal(slot_ids[i], keys[i], 0, checksum_runs(runs(blocks[i], part), keys[i]))
            gather_sealed(layers, layout, blocks, slots, slot_ids, seal)

        def save_then_seal(slot_ids: list[int], blocks: list[int]) -> None:
            gather_blocks(layers, layout, blocks, slots, slot_ids)
            for i, s in enumerate(slot_ids):
                tier.seal(s, keys[i], 0, checksum(tier.rank_view(s, 0), keys[i]))

        def loads() -> list[float]:
            half = kv_blocks // 2
            for g in range(GROUPS):
                save_sealed(groups[g], rng.sample(range(half), n), group_keys[g])
            out = []
            for r in range(args.reps + 1):  # the first one untimed
                g = r % GROUPS
                blocks = rng.sample(range(half, kv_blocks), n)
                start = time.perf_counter()
                check = tier.data_checks(groups[g], group_keys[g], 0)
                if scatter_checked(layers, layout, blocks, slots, groups[g], check):
                    raise AssertionError("a block failed its checksum")
                out.append(time.perf_counter() - start)
            return out[1:]

        def copies_only(slot_ids: list[int], blocks: list[int]) -> None:
            scatter_checked(layers, layout, blocks, slots, slot_ids, lambda i: True)

        def timed(fn) -> list[float]:
            out = []
            for _ in range(args.reps):
                slot_ids, blocks = pick()
                start = time.perf_counter()
                fn(slot_ids, blocks)
                out.append(time.perf_counter() - start)
            return out

        nbytes = n * layout.block_bytes
        res: dict = {"geometry": args.geometry, "dtype": args.dtype, "blocks": n, "block_bytes": layout.block_bytes,
                     "bytes": nbytes, "reps": args.reps, "memcpy_GBps": memcpy_gbps(),
                     "copies": copies_label()}
        res["load"] = loads()
        for name, fn in (("copies_only", copies_only), ("save_sealed", save_sealed),
                         ("save_then_seal", save_then_seal)):
            fn(*pick())  # one untimed pass
            res[name] = timed(fn)
        # Untimed: the save and load paths timed (gather_sealed,
        # scatter_checked) move the right bytes. Blocks saved from the
        # first half and loaded into the second must come back equal.
        half = kv_blocks // 2
        src, dst, slot_ids = rng.sample(range(half), n), rng.sample(range(half, kv_blocks), n), pick()[0]
        save_sealed(slot_ids, src)
        if scatter_checked(layers, layout, dst, slots, slot_ids, tier.data_checks(slot_ids, keys, 0)):
            raise AssertionError("a block saved by the round trip failed its checksum")
        for name in layout.layer_names:
            back, sent = kv[name][dst].view(torch.uint8), kv[name][src].view(torch.uint8)
            if not torch.equal(back, sent):
                raise AssertionError(f"{name}: the blocks loaded back differ from the blocks saved")
        res["round_trip_blocks"] = n
        return res
    finally:
        tier.close()
        path.unlink(missing_ok=True)
        path.parent.rmdir()


def copies_as_instances(glibc_default: bool = False) -> None:
    """Run this script again (same interpreter and arguments) when its
    copies would not stream as those of the vLLM instances kvtier starts
    do (hostmem.streaming_copy_env), or, with ``glibc_default``, when they
    would: glibc reads the setting once, when a process starts. A
    threshold set in the environment is kept. For a script's own
    ``__main__`` only."""
    env = dict(os.environ)
    if glibc_default:
        if streaming_threshold(env) is None:
            return
        env = without_streaming(env)
    else:
        extra = streaming_copy_env(env)
        if not extra:
            return
        env.update(extra)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def copies_label() -> str:
    threshold = streaming_threshold()
    return "glibc's default copies" if threshold is None else f"copies over {threshold:#x} bytes streamed"


def report(res: dict) -> None:
    nbytes, memcpy = res["bytes"], res["memcpy_GBps"]
    copies = statistics.median(res["copies_only"])
    print(f"{res['blocks']} blocks of {res['block_bytes'] / 1024:.0f} KiB ({nbytes / 2**20:.1f} MiB), "
          f"{res['geometry']} {res['dtype']}, median of {res['reps']}; memcpy {memcpy:.1f} GB/s; "
          f"{res.get('copies', copies_label())}")
    print(f"{'path':16s} {'ms':>7s} {'GB/s':>6s} {'x copies':>9s} {'x memcpy':>9s}")
    for name in ("copies_only", "load", "save_sealed", "save_then_seal"):
        t = statistics.median(res[name])
        gbps = nbytes / t / 1e9
        print(f"{name:16s} {t * 1e3:7.2f} {gbps:6.1f} {copies / t:9.3f} {gbps / memcpy:9.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="bench", choices=sorted(GEOMETRIES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--block", type=int, default=64, help="tokens a block")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kv-size", default="1GB", help="vLLM's KV cache to pick blocks from")
    ap.add_argument("--json", type=Path, help="write the raw samples here")
    ap.add_argument("--glibc-default", action="store_true",
                    help="copy as glibc does by default, through the caches, not as the vLLM instances kvtier "
                         "starts do (copies of a block's layer streamed past them: kvtier.hostmem)")
    args = ap.parse_args(argv)
    if __name__ == "__main__":
        copies_as_instances(args.glibc_default)
    if args.reps < 1 or args.block < 1 or args.prompt_tokens <= args.block:
        ap.error("--reps and --block must be positive, --prompt-tokens larger than --block")
    res = run(args)
    report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
