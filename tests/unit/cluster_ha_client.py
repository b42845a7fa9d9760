"""A Mooncake client of a highly available master, in a process of its own (test_cluster_ha.py).

``python tests/unit/cluster_ha_client.py --etcd HOST:PORT --shm PATH`` makes
a DRAM arena and a :class:`MooncakeTier` set up with ``etcd://HOST:PORT``
(it finds the leader there and follows it), connects (retrying while no
master leads), prints ``{"ready": true}`` and then serves one JSON command
per stdin line, answering one JSON line each:

* ``{"op": "put", "seed": S, "n": N}``: N blocks written into slots 0..N-1
  (bytes from ``block_bytes(seed, i)``, sealed) and published: ``{"ok": [bool]}``;
* ``{"op": "get", "seed": S, "n": N}``: the same keys fetched into slots
  N..2N-1: ``{"got": [outcome]}``, an outcome being ``ok`` only when the
  bytes are those put;
* ``{"op": "healthy"}``: ``{"healthy": bool}``.

A call that raises answers ``{"error": "..."}``. It runs apart from the
test because Mooncake's client, set up through etcd, takes up to 30 s to
close (its leader watch); the test ends it with SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from kvtier.cluster.client import Fetched, MooncakeTier  # noqa: E402
from kvtier.config import ClusterConfig  # noqa: E402
from kvtier.errors import ClusterError  # noqa: E402
from kvtier.tier.dram import DramTier, checksum  # noqa: E402
from tests.unit.cluster_node import block_bytes, block_key  # noqa: E402

RANK_BYTES = 64 << 10
SLOTS = 32


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--etcd", required=True)
    p.add_argument("--shm", required=True)
    args = p.parse_args()
    cfg = ClusterConfig(etcd_endpoints=args.etcd, segment_bytes=32 << 20)
    tier = DramTier.create(args.shm, 4096 * 4 + SLOTS * (RANK_BYTES + 128), RANK_BYTES, 1)
    remote = MooncakeTier(cfg, tier)
    deadline = time.monotonic() + 60
    while True:
        try:
            remote.connect()
            break
        except ClusterError as err:
            if time.monotonic() > deadline:
                print(json.dumps({"ready": False, "error": str(err)}), flush=True)
                return 1
            time.sleep(0.2)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = serve(remote, tier, cmd)
        except ClusterError as err:
            out = {"error": str(err)}
        print(json.dumps(out), flush=True)
    return 0


def serve(remote: MooncakeTier, tier: DramTier, cmd: dict) -> dict:
    op = cmd["op"]
    if op == "healthy":
        return {"healthy": remote.healthy()}
    seed, n = cmd["seed"], cmd["n"]
    keys = [block_key(seed, i) for i in range(n)]
    if op == "put":
        for i, key in enumerate(keys):
            view = tier.rank_view(i, 0)
            view.numpy()[:] = block_bytes(seed, i, 0, RANK_BYTES)
            tier.seal(i, key, 0, checksum(view, key))
        return {"ok": remote.publish(keys, list(range(n)))}
    if op == "get":
        slots = list(range(n, 2 * n))
        for s in slots:
            tier.clear(s)
            tier.rank_view(s, 0).numpy()[:] = 0
        got = remote.fetch(keys, slots)
        out = []
        for i, (s, g) in enumerate(zip(slots, got)):
            same = (tier.rank_view(s, 0).numpy() == block_bytes(seed, i, 0, RANK_BYTES)).all()
            if g is Fetched.OK and not same:
                out.append("wrong bytes")
            else:
                out.append(g.value)
        return {"got": out}
    raise ValueError(op)


if __name__ == "__main__":
    sys.exit(main())
