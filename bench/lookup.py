"""Scheduler-side lookup cost for a 64k-token prompt (vLLM's scheduler waits on it).

Measures, over many repetitions, p50 and p99 of:

* ``lookup``: ``get_num_new_matched_tokens`` for a request whose keys are
  already computed (the common case: vLLM asks again each step it waits);
* ``on_new_request``: hashing every block of the prompt, done once when
  vLLM adds the request (before it waits to be scheduled);
* peer: vLLM's own prefix-cache hashing of the same prompt
  (``hash_block_tokens`` with sha256, vLLM's default), measured in the same run.

Goal: lookup p99 <= 1 ms. Usage: .venv/bin/python bench/lookup.py [--tokens 65536] [--block 64]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from kvtier.connector.scheduler import SchedulerSide
from kvtier.keys import KeyNamespace, block_keys
from kvtier.store import TieredStore
from kvtier.tier.dram import DramTier


@dataclass
class FakeRequest:
    """The fields of vLLM's Request that the scheduler half reads."""

    request_id: str
    all_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e6, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(0, 128000) for _ in range(args.tokens)]
    n_blocks = args.tokens // args.block
    ns = KeyNamespace(model="bench", dtype="torch.bfloat16", layout="cpu", block_tokens=args.block)
    path = os.path.join(tempfile.gettempdir(), f"kvtier-bench-lookup-{os.getpid()}")
    tier = DramTier.create(path, (n_blocks + 64) * (4096 + 128) + (1 << 20), 4096)
    try:
        store = TieredStore(tier)
        keys = block_keys(ns.seed(), tokens, args.block)
        slots = store.prepare_save(keys, step=0)
        assert all(s is not None for s in slots)
        store.complete_step(0)
        side = SchedulerSide(store, ns, args.block, ranks=1)

        warm = FakeRequest("warm", tokens)
        assert side.get_num_new_matched_tokens(warm, 0)[0] == (args.tokens - 1) // args.block * args.block
        hot: list[float] = []
        for _ in range(args.reps):
            t = time.perf_counter()
            side.get_num_new_matched_tokens(warm, 0)
            hot.append(time.perf_counter() - t)

        first: list[float] = []
        for i in range(max(50, args.reps // 5)):
            req = FakeRequest(f"r{i}", tokens)
            t = time.perf_counter()
            side.on_new_request(req)
            first.append(time.perf_counter() - t)
            side.request_finished(req, [])

        peer: list[float] = []
        try:
            from vllm.utils.hashing import sha256
            from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

            init_none_hash(sha256)
            for _ in range(max(20, args.reps // 25)):
                t = time.perf_counter()
                parent = None
                for b in range(n_blocks):
                    parent = hash_block_tokens(sha256, parent, tokens[b * args.block : (b + 1) * args.block])
                peer.append(time.perf_counter() - t)
        except ImportError as err:
            print(f"(vLLM's hashing not measured: {err})")
    finally:
        tier.close()

    print(f"\n## Lookup, {args.tokens}-token prompt, {n_blocks} blocks of {args.block} tokens\n")
    print("| measure | p50 (us) | p99 (us) | goal / peer |")
    print("|---|---|---|---|")
    print(f"| lookup, keys known | {pct(hot, 50):.0f} | {pct(hot, 99):.0f} | p99 <= 1000 us: "
          f"{pct(hot, 99) / 1000:.2f}x of budget |")
    print(f"| on_new_request: hashing every block, once | {pct(first, 50):.0f} | {pct(first, 99):.0f} | |")
    if peer:
        print(f"| peer: vLLM's own block hashing (sha256) | {pct(peer, 50):.0f} | {pct(peer, 99):.0f} | "
              f"kvtier hashing / peer = {pct(first, 50) / pct(peer, 50):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
