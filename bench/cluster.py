"""The cluster tier's transfers against the machine's limits, measured in one run.

A Mooncake master on 127.0.0.1, a peer node in a process of its own
(tests/unit/cluster_node.py: its arena, store and Mooncake client, lending
the memory the blocks live in) and this process as the reading node (lends
none, so every byte crosses processes over TCP as between nodes). On the
same blocks and the same arena addresses it measures:

* get: kvtier's fetch (``MooncakeTier.fetch``: zero-copy get plus the
  header and checksum checks) vs Mooncake's own ``batch_get_into_multi_buffers``;
* put: kvtier's publish vs Mooncake's ``batch_put_from_multi_buffers``;
* the limits: memcpy of the same bytes (numpy), and loopback TCP between
  two processes (Python sockets, 4 MiB sends; iperf3 when installed);
* ``batch_is_exist`` of 256 keys across processes: p50 and p99.

Prints one table; docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from kvtier.cluster.client import HEADER_BYTES, MooncakeTier  # noqa: E402
from kvtier.cluster.master import MasterSupervisor  # noqa: E402
from kvtier.config import ClusterConfig  # noqa: E402
from kvtier.errors import ClusterError  # noqa: E402
from kvtier.tier.dram import DramTier, checksum  # noqa: E402
from kvtier.tools.server import free_port  # noqa: E402

NODE = ROOT / "tests" / "unit" / "cluster_node.py"


def gbps(n_bytes: int, seconds: float) -> float:
    return n_bytes / seconds / 1e9


def best(fn, repeat: int) -> float:
    return best_of(repeat, fn)[0]


def best_of(repeat: int, *fns) -> list[float]:
    """Best time of each of ``fns``, run in turn ``repeat`` times: on a busy
    machine the pairs being compared see the same load."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [min(t) for t in times]


def loopback_tcp_gbps(total: int = 1 << 30, chunk: int = 4 << 20) -> float:
    """Bytes per second from one process to another over 127.0.0.1."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    sender = subprocess.Popen([sys.executable, "-c", (
        "import socket,sys\n"
        f"s=socket.create_connection(('127.0.0.1',{port})); b=bytes({chunk})\n"
        f"for _ in range({total // chunk}): s.sendall(b)\n"
        "s.close()")])
    conn, _ = srv.accept()
    buf = bytearray(chunk)
    view = memoryview(buf)
    got = 0
    t0 = time.perf_counter()
    while True:
        n = conn.recv_into(view)
        if not n:
            break
        got += n
    dt = time.perf_counter() - t0
    sender.wait()
    conn.close()
    srv.close()
    return gbps(got, dt)


def iperf3_gbps() -> float | None:
    if shutil.which("iperf3") is None:
        return None
    port = free_port()
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    try:
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "3", "-J"], capture_output=True,
                             text=True, timeout=30).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        server.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--rank-bytes", type=int, default=512 << 10, help="bytes per block (one rank)")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")
    n, rank_bytes = args.blocks, args.rank_bytes
    cfg = ClusterConfig(master_port=free_port(), master_metrics_port=free_port(), segment_bytes=0)
    master = MasterSupervisor(cfg, log_path=os.devnull)
    master.start()
    shm = f"/dev/shm/kvtier-bench-{uuid.uuid4().hex}"
    peer = subprocess.Popen([sys.executable, str(NODE), "--master", cfg.master_address, "--shm", shm + "-peer",
                             "--metrics-port", str(cfg.master_metrics_port), "--rank-bytes", str(rank_bytes),
                             "--slots", str(n + 8), "--segment", str((2 * args.repeat + 3) * n * (rank_bytes + 8192) * 10 // 8 + (64 << 20))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    tier = DramTier.create(shm, 4096 * 8 + 2 * n * (rank_bytes + 4096 + 128), rank_bytes)
    client = MooncakeTier(cfg, tier)
    try:
        assert json.loads(peer.stdout.readline())["ready"]
        peer.stdin.write(json.dumps({"op": "save", "seed": 1, "n": n}) + "\n")
        peer.stdin.flush()
        keys = [bytes.fromhex(k) for k in json.loads(peer.stdout.readline())["keys"]]
        deadline = time.monotonic() + 30
        while True:
            try:
                client.connect()
                break
            except ClusterError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        slots = list(range(n))
        value = HEADER_BYTES + tier.slot_stride
        moved = n * value
        raw = client._client()
        names = [client.name(k) for k in keys]

        def kv_get() -> None:
            assert all(o.value == "ok" for o in client.fetch(keys, slots))

        def mc_get() -> None:
            ptrs = [[client._staging_addr + i * HEADER_BYTES, tier.slot_address(s)] for i, s in enumerate(slots)]
            got = raw.batch_get_into_multi_buffers(names, ptrs, [[HEADER_BYTES, tier.slot_stride]] * n)
            assert all(x == value for x in got)

        t_mc_get, t_kv_get = best_of(args.repeat, mc_get, kv_get)

        # Puts: this node's own blocks (sealed as a worker would), new names each round.
        for s in slots:
            view = tier.rank_view(s, 0)
            view.numpy()[:] = np.random.default_rng(s).integers(0, 256, rank_bytes, dtype=np.uint8)
            tier.seal(s, bytes([s]) * 16, 0, checksum(view, bytes([s]) * 16))
        rounds = iter(range(10_000))

        def kv_put() -> None:
            r = next(rounds)
            ks = [r.to_bytes(8, "little") + bytes([s]) * 8 for s in slots]
            assert all(client.publish(ks, slots))

        def mc_put() -> None:
            r = next(rounds)
            ns = [f"bench/{r}/{s}" for s in slots]
            ptrs = [[tier.header_address(s), tier.slot_address(s)] for s in slots]
            assert all(x == 0 for x in raw.batch_put_from_multi_buffers(
                ns, ptrs, [[HEADER_BYTES, tier.slot_stride]] * n, client._replicate))

        t_kv_put, t_mc_put = best_of(args.repeat, kv_put, mc_put)

        src = np.random.default_rng(0).integers(0, 256, moved, dtype=np.uint8)
        dst = np.empty_like(src)
        t_memcpy = best(lambda: np.copyto(dst, src), args.repeat)

        probe = keys * (256 // n + 1)
        probe = probe[:256]
        lat = []
        for _ in range(200):
            t0 = time.perf_counter()
            client.exists(probe)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        tcp = loopback_tcp_gbps()
        ip = iperf3_gbps()
    finally:
        client.close()
        tier.close()
        if peer.stdin:
            peer.stdin.close()
        peer.wait(60)
        master.stop()
    rows = [
        ("get, kvtier (fetch + verify)", gbps(moved, t_kv_get)),
        ("get, Mooncake batch_get_into_multi_buffers", gbps(moved, t_mc_get)),
        ("put, kvtier (verify + publish)", gbps(moved, t_kv_put)),
        ("put, Mooncake batch_put_from_multi_buffers", gbps(moved, t_mc_put)),
        ("memcpy, same bytes (numpy)", gbps(moved, t_memcpy)),
        ("loopback TCP, 2 processes (Python sockets)", tcp),
    ]
    if ip is not None:
        rows.append(("loopback TCP, iperf3", ip))
    print(f"{n} blocks of {tier.slot_stride >> 10} KiB + {HEADER_BYTES} B header ({moved / 1e6:.1f} MB) per batch, "
          f"best of {args.repeat}, across processes over TCP on 127.0.0.1")
    print(f"{'what':<46} {'GB/s':>7}")
    for what, v in rows:
        print(f"{what:<46} {v:7.2f}")
    print(f"get: kvtier / Mooncake = {t_mc_get / t_kv_get:.2f}x; put: kvtier / Mooncake = {t_mc_put / t_kv_put:.2f}x")
    print(f"batch_is_exist(256 keys) across processes: p50 {statistics.median(lat) * 1e6:.0f} us, "
          f"p99 {lat[int(len(lat) * 0.99)] * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
