"""SSD tier throughput against fio, and TTFT of an 8k-token prompt served from SSD.

Part 1 (no server): batches of blocks written to and read from the SSD tier
by the store's own code path (SsdTier.write / SsdTier.read on I/O threads,
DRAM arena slots as buffers), against fio direct I/O on the same file in
the same run. Goal: >= 0.85x fio each way.

Part 2 (vLLM CPU server, test model hidden 512 / 4 layers): an 8k-token
prompt cold, then a device hit, then pushed out of the device cache and out
of DRAM by fillers, so it comes back from SSD (DRAM cold, SSD warm). Goal:
SSD-hit TTFT <= device-hit TTFT + 1.3 x (KV bytes / fio read bandwidth).

Usage: .venv/bin/python bench/ssd.py [--dir /tmp] [--blocks 512] [--rounds 3] [--skip-server]
Needs fio (Debian package ``fio``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import xxhash

from kvtier.tier.dram import DramTier
from kvtier.tier.ssd import BlockRecord, SsdTier, slots_for, table_pages
from kvtier.tools.client import stream_completion
from kvtier.tools.model import build_model
from kvtier.tools.server import ServerOptions, VllmServer

BLOCK_BYTES = 4 * 128 * 1024  # one block of the bench model: 4 layers x 128 KiB (64 tokens, bf16)


def fio(path: str, rw: str, size: int, bs: int, jobs: int) -> float:
    """GB/s of fio direct I/O on ``path`` with ``jobs`` synchronous threads (as the tier's I/O threads)."""
    cmd = ["fio", "--name=kvtier", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--direct=1",
           "--ioengine=psync", "--thread", f"--numjobs={jobs}", f"--size={size // jobs}",
           f"--offset_increment={size // jobs}", "--group_reporting", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")  # the tier's writes are durable; so are fio's
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    job = json.loads(out.stdout)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["bw_bytes"] / 1e9


def raw_throughput(path: str, blocks: int, threads: int, slot_bytes: int,
                   buffers: list[memoryview]) -> tuple[float, float]:
    """GB/s of bare O_DIRECT pwritev / preadv of the same slot buffers at the
    tier's data offsets, one fdatasync per thread's share: the OS path under
    the tier, with the tier's memory (distinct buffers) but no headers, no
    ordering and no checksums."""
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        n = slots_for(os.fstat(fd).st_size, slot_bytes)  # the tier's layout: header table, then data
        offsets = [4096 + table_pages(n) * 4096 + s * slot_bytes for s in range(blocks)]
        shares = [list(range(t, blocks, threads)) for t in range(threads)]

        def write(idx: list[int]) -> None:
            for s in idx:
                os.pwritev(fd, [buffers[s]], offsets[s])
            os.fdatasync(fd)

        def read(idx: list[int]) -> None:
            for s in idx:
                os.preadv(fd, [buffers[s]], offsets[s])

        with ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            list(pool.map(write, shares))
            write_s = time.perf_counter() - t
            t = time.perf_counter()
            list(pool.map(read, shares))
            read_s = time.perf_counter() - t
    finally:
        os.close(fd)
    total = blocks * len(buffers[0])
    return total / write_s / 1e9, total / read_s / 1e9


def tier_throughput(path: str, blocks: int, threads: int, batch: int = 16) -> tuple[float, float, float, float]:
    """(tier write, tier read, raw write, raw read) GB/s over the same DRAM slot buffers."""
    shm = os.path.join("/dev/shm", f"kvtier-bench-ssd-{os.getpid()}")
    dram = DramTier.create(shm, (blocks + 8) * (BLOCK_BYTES + 4096) + (2 << 20), BLOCK_BYTES)
    try:
        ssd, _ = SsdTier.open([path], None, dram.slot_stride, force_new=True)
        try:
            rnd = os.urandom(BLOCK_BYTES)
            for s in range(blocks):
                dram.slot_buffer(s)[:] = rnd[s % 97:] + rnd[: s % 97]
            locs = ssd.locations()[:blocks]
            recs = [BlockRecord(s.to_bytes(16, "little"), s + 1, xxhash.xxh3_64_intdigest(dram.slot_buffer(s)))
                    for s in range(blocks)]
            jobs = [list(range(i, min(i + batch, blocks))) for i in range(0, blocks, batch)]
            with ThreadPoolExecutor(threads) as pool:
                t = time.perf_counter()
                list(pool.map(lambda idx: ssd.write([(locs[s], recs[s], dram.slot_buffer(s)) for s in idx], []),
                              jobs))
                write_s = time.perf_counter() - t
                t = time.perf_counter()
                oks = list(pool.map(lambda s: ssd.read(locs[s], recs[s], dram.slot_buffer(s)), range(blocks)))
                read_s = time.perf_counter() - t
            assert all(oks), "a block failed verification"
        finally:
            ssd.close()
        raw_w, raw_r = raw_throughput(path, blocks, threads, dram.slot_stride,
                                      [dram.slot_buffer(s) for s in range(blocks)])
    finally:
        dram.close()
    total = blocks * BLOCK_BYTES
    return total / write_s / 1e9, total / read_s / 1e9, raw_w, raw_r


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the SSD file goes")
    ap.add_argument("--blocks", type=int, default=512, help="blocks per throughput run (512 KiB each)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="blocks per durable write batch (the store's demotion job)")
    ap.add_argument("--rounds", type=int, default=3, help="server rounds (8k prompts)")
    ap.add_argument("--reps", type=int, default=5, help="throughput repetitions")
    ap.add_argument("--skip-server", action="store_true")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2

    path = os.path.join(args.dir, f"kvtier-bench-ssd-{os.getpid()}.img")
    size = args.blocks * (BLOCK_BYTES + 4096) + (64 << 20)
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    fw, fr, tw, tr, rw, rr = [], [], [], [], [], []
    try:
        # Interleaved, and medians: the virtual disk's speed drifts from one
        # second to the next, so each side is measured next to the other.
        for _ in range(args.reps):
            fw.append(fio(path, "write", args.blocks * BLOCK_BYTES, BLOCK_BYTES, args.threads))
            fr.append(fio(path, "read", args.blocks * BLOCK_BYTES, BLOCK_BYTES, args.threads))
            w, r, raw_w, raw_r = tier_throughput(path, args.blocks, args.threads, args.batch)
            tw.append(w)
            tr.append(r)
            rw.append(raw_w)
            rr.append(raw_r)
    finally:
        os.unlink(path)
    med = statistics.median
    fio_w, fio_r, tier_w, tier_r = med(fw), med(fr), med(tw), med(tr)

    print(f"\n## SSD tier throughput, {args.blocks} blocks of {BLOCK_BYTES >> 10} KiB, {args.threads} I/O threads, "
          f"median of {args.reps}\n")
    print("| direction | kvtier SSD tier | fio (same file, bs 512k, psync, "
          f"{args.threads} jobs, direct) | ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| write (batches of {args.batch}, durable) | {tier_w:.2f} GB/s | {fio_w:.2f} GB/s | {tier_w / fio_w:.2f}x | >= 0.85x |")
    print(f"| read (verified) | {tier_r:.2f} GB/s | {fio_r:.2f} GB/s | {tier_r / fio_r:.2f}x | >= 0.85x |")
    raw_w, raw_r = med(rw), med(rr)
    print("\nPeer with the tier's own buffers: bare O_DIRECT pwritev / preadv of the same DRAM slots at the same "
          "offsets (no headers, no ordering, no checksums; one fdatasync per thread).\n")
    print("| direction | kvtier SSD tier | bare syscalls, same buffers | ratio |")
    print("|---|---|---|---|")
    print(f"| write | {tier_w:.2f} GB/s | {raw_w:.2f} GB/s | {tier_w / raw_w:.2f}x |")
    print(f"| read | {tier_r:.2f} GB/s | {raw_r:.2f} GB/s | {tier_r / raw_r:.2f}x |")

    if args.skip_server:
        return 0
    model = str(build_model("bench"))
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    ssd_path = os.path.join(args.dir, f"kvtier-bench-ssd-srv-{os.getpid()}.img")
    # DRAM of 96 MiB holds one and a half 8k prompts: fillers push a prompt to SSD.
    opts = ServerOptions(model=model, block_size=64, max_num_batched_tokens=2048, max_model_len=8448,
                         kvtier={"dram_size": "96MB", "ssd_path": ssd_path, "ssd_size": "2GB"})
    cold, device, ssd_hit = [], [], []
    try:
        with VllmServer(opts, log_path="/tmp/kvtier-bench-ssd.log") as srv, httpx.Client() as client:
            def ttft(p: list[int]) -> float:
                r = stream_completion(client, srv.url, p, max_tokens=4)
                if not r.ok:
                    raise RuntimeError(r.error)
                return r.ttft_s

            ttft(prompt(999, 256, vocab))
            for i in range(args.rounds):
                p = prompt(40_000 + i, 8192, vocab)
                cold.append(ttft(p))
                device.append(ttft(p))
                for j in range(2):  # two more 8k prompts: out of DRAM, onto SSD
                    ttft(prompt(50_000 + 10 * i + j, 8192, vocab))
                srv.reset_prefix_cache()
                before = srv.metrics()
                ssd_hit.append(ttft(p))
                after = srv.metrics()
                key = 'vllm:prompt_tokens_cached_by_source_total{source="disk"}'
                disk = after.get(key, 0) - before.get(key, 0)
                print(f"round {i}: cold {cold[-1] * 1000:.0f} ms, device hit {device[-1] * 1000:.1f} ms, "
                      f"SSD hit {ssd_hit[-1] * 1000:.1f} ms ({disk:.0f} tokens from disk)")
    finally:
        if os.path.exists(ssd_path):
            os.unlink(ssd_path)
    kv_bytes = 8192 * 8192  # 8k tokens x 8 KiB of KV per token (4 layers x 8 heads x 64 x 2 x bf16)
    budget = med(device) + 1.3 * kv_bytes / (fio_r * 1e9)
    print(f"\n## TTFT, 8192-token prompt from SSD (DRAM cold, SSD warm), {args.rounds} rounds (median)\n")
    print("| measure | value | goal |")
    print("|---|---|---|")
    print(f"| TTFT cold | {med(cold) * 1000:.0f} ms | |")
    print(f"| TTFT device hit | {med(device) * 1000:.1f} ms | |")
    print(f"| TTFT SSD hit | {med(ssd_hit) * 1000:.1f} ms | <= device hit + 1.3 x 64 MiB / fio read = "
          f"{budget * 1000:.1f} ms ({med(ssd_hit) / budget:.2f}x of budget) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
