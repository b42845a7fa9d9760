"""One node of the cluster tier in a process of its own (tests and bench/cluster.py).

``python tests/unit/cluster_node.py --master HOST:PORT --shm PATH ...`` makes
a DRAM arena and a store over it with the cluster tier on (write-through),
waits until the master answers, prints ``{"ready": true}`` and then serves
one JSON command per stdin line, answering one JSON line each:

* ``{"op": "save", "seed": S, "n": N}``: N blocks saved as a worker would
  (bytes from ``block_bytes(seed, i)``, sealed per rank), published; answers
  their keys (hex) and the store's counters once the puts ended;
* ``{"op": "flip", "key": HEX}``: the cluster's value of that block replaced
  by one with a byte flipped after its header was made (a value torn or
  corrupted in the cluster);
* ``{"op": "foreign", "key": HEX, "as": HEX}``: the value of block ``key``
  put under the name of block ``as``;
* ``{"op": "remove", "key": HEX}``: the value removed (evicted behind the reader's back);
* ``{"op": "counters"}``.

EOF on stdin ends it (arena removed). Real parts only: Mooncake's client,
a shared-memory arena, the store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from kvtier.cluster.client import MooncakeTier  # noqa: E402
from kvtier.config import ClusterConfig  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.tier.dram import HEADER_BYTES, DramTier, checksum  # noqa: E402


def block_bytes(seed: int, i: int, rank: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, i, rank]).integers(0, 256, n, dtype=np.uint8)


def block_key(seed: int, i: int) -> bytes:
    return (seed * 1_000_003 + i).to_bytes(8, "little") + b"kvtier-t"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--master", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--hostname", default="127.0.0.1")
    p.add_argument("--rank-bytes", type=int, default=64 << 10)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--segment", type=int, default=64 << 20)
    args = p.parse_args()
    host, _, port = args.master.rpartition(":")
    cfg = ClusterConfig(master_host=host, master_port=int(port), master_metrics_port=args.metrics_port,
                        local_hostname=args.hostname,
                        segment_bytes=args.segment)
    stride = -(-args.rank_bytes // 4096) * 4096 * args.ranks
    tier = DramTier.create(args.shm, 4096 * 4 + args.slots * (stride + 128), args.rank_bytes, args.ranks)
    remote = MooncakeTier(cfg, tier)
    store = TieredStore(tier, 99, 90, cluster=remote)
    try:
        deadline = time.monotonic() + 60
        while not store.cluster.up and time.monotonic() < deadline:
            time.sleep(0.05)
        print(json.dumps({"ready": store.cluster.up}), flush=True)
        step = 0
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            out: dict = {}
            if op == "save":
                keys = [block_key(cmd["seed"], i) for i in range(cmd["n"])]
                slots = store.prepare_save(keys, step)
                for i, (key, slot) in enumerate(zip(keys, slots)):
                    if slot is None:
                        continue
                    for r in range(tier.ranks):
                        view = tier.rank_view(slot, r)
                        view.numpy()[:] = block_bytes(cmd["seed"], i, r, tier.rank_bytes)
                        tier.seal(slot, key, r, checksum(view, key))
                store.complete_step(step)
                step += 1
                store.wait_idle(30)
                out = {"keys": [k.hex() for k in keys]}
            elif op in ("flip", "foreign"):
                key = bytes.fromhex(cmd["key"])
                name = remote.name(bytes.fromhex(cmd.get("as", cmd["key"])))
                client = remote._client()
                client.remove(name, True)
                slot = store.pin([key], 1 << 40)[0]
                assert slot is not None
                staging = np.zeros(HEADER_BYTES + tier.slot_stride, dtype=np.uint8)
                staging[:HEADER_BYTES] = np.frombuffer(
                    bytes((ctypes_string(tier.header_address(slot), HEADER_BYTES))), dtype=np.uint8)
                staging[HEADER_BYTES:] = np.frombuffer(
                    bytes(ctypes_string(tier.slot_address(slot), tier.slot_stride)), dtype=np.uint8)
                if op == "flip":
                    staging[HEADER_BYTES + 100] ^= 0x01
                client.register_buffer(staging.ctypes.data, staging.nbytes)
                out = {"put": client.batch_put_from([name], [staging.ctypes.data], [staging.nbytes])[0]}
                client.unregister_buffer(staging.ctypes.data)
                store.complete_step(1 << 40)
            elif op == "remove":
                out = {"removed": remote._client().remove(remote.name(bytes.fromhex(cmd["key"])), True)}
            out["counters"] = store.counters()
            print(json.dumps(out), flush=True)
    finally:
        store.close()
        tier.close()
    return 0


def ctypes_string(addr: int, n: int) -> bytes:
    import ctypes

    return ctypes.string_at(addr, n)


if __name__ == "__main__":
    sys.exit(main())
