"""The cluster tier: its transfers against the machine's limits, and TTFT from the other node.

Two measurements, each against its peers measured in the same run.

``transfers`` (the default; no vLLM). A Mooncake master on 127.0.0.1, a
peer node in a process of its own (tests/unit/cluster_node.py: its arena,
store and Mooncake client, lending the memory the blocks live in) and this
process as the reading node (lends none, so every byte crosses processes
over TCP as between nodes). On the same blocks and the same arena
addresses it measures:

* get: kvtier's fetch (``MooncakeTier.fetch``: zero-copy get plus the
  header and checksum checks) vs Mooncake's own ``batch_get_into_multi_buffers``;
* put: kvtier's publish, with the check ``ClusterMover`` makes before it
  (every rank of each block against its checksum), vs Mooncake's
  ``batch_put_from_multi_buffers``;
* the limits: memcpy of the same bytes (numpy), and loopback TCP between
  two processes (Python sockets, 4 MiB sends; iperf3 when installed);
* ``batch_is_exist`` of 256 keys across processes: p50 and p99.

``ttft`` (two vLLM CPU servers at once). Two nodes on one machine as in
tests/e2e/test_cluster.py: each its own ``kvtier meta`` process, config
files, shared-memory folder and loopback address (127.0.0.2 and
127.0.0.3); node 1's service also runs Mooncake's master; one vLLM
instance per node, attached to its own node's pool only. Node 2 lends the
cluster no memory, so every block it reads from the cluster lives in node
1's segment and crosses processes over TCP. For each of ``--prompts``
distinct 8k-token prompts, one request at a time, each after a quiet gap:

* cold on node 1 (its prefill is saved to node 1's pool and published);
* device hit on node 1 (the same prompt again);
* p2p hit on node 2: node 2 never saw the prompt, so its node pool
  misses, the cluster holds it (lookup, fetch into node 2's DRAM slots,
  header and checksum checks), then it loads like a DRAM hit;
* DRAM hit on node 2: its device cache reset, the same prompt again; the
  blocks fetched for the p2p hit are in node 2's own pool now. The peer
  that shows what the fetch itself costs.

A p2p hit happens once per prompt and node (after it the blocks are node
2's), hence a fresh prompt per sample. Node 2's /metrics count the tokens
vLLM took from a ``p2p`` source and the load errors; node 2's pool counts
the blocks fetched.

Usage: .venv/bin/python bench/cluster.py [transfers] [--blocks 64] [--rank-bytes 524288] [--repeat 5]
       flock /tmp/kvtier-vllm.lock .venv/bin/python bench/cluster.py ttft [--geometry bench]
           [--prompt-tokens 8192] [--prompts 9] [--gap 2.0] [--dram-size 1GB] [--segment-size 2GB]
           [--json out.json]

Prints one table per measurement; docs/benchmarks.md records runs.
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
from concurrent.futures import ThreadPoolExecutor
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
from kvtier.tools.client import QUIET_S  # noqa: E402
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


def run_transfers(args: argparse.Namespace) -> int:
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

        # Mooncake's calls get their addresses the way kvtier's do (from the
        # mapping's base, not a slot_address() call per block, ~1 us each),
        # so the pairs differ by what kvtier does beyond the call.
        slot0, hdr0, stride = tier.slot_address(0), tier.header_address(0), tier.slot_stride

        def mc_get() -> None:
            ptrs = [[client._staging_addr + i * HEADER_BYTES, slot0 + s * stride] for i, s in enumerate(slots)]
            got = raw.batch_get_into_multi_buffers(names, ptrs, [[HEADER_BYTES, stride]] * n)
            assert all(x == value for x in got)

        t_mc_get, t_kv_get = best_of(args.repeat, mc_get, kv_get)

        # Puts: this node's own blocks (sealed as a worker would), new names each round.
        for s in slots:
            view = tier.rank_view(s, 0)
            view.numpy()[:] = np.random.default_rng(s).integers(0, 256, rank_bytes, dtype=np.uint8)
            tier.seal(s, bytes([s]) * 16, 0, checksum(view, bytes([s]) * 16))
        rounds = iter(range(10_000))

        def kv_put() -> None:
            # What ClusterMover._publish does: every rank of each pinned block
            # checked against its header, then the put (under new names here).
            assert all(tier.verify_many(slots, [bytes([s]) * 16 for s in slots]))
            r = next(rounds)
            ks = [r.to_bytes(8, "little") + bytes([s]) * 8 for s in slots]
            assert all(client.publish(ks, slots))

        def mc_put() -> None:
            r = next(rounds)
            ns = [f"bench/{r}/{s}" for s in slots]
            ptrs = [[hdr0 + s * HEADER_BYTES, slot0 + s * stride] for s in slots]
            assert all(x == 0 for x in raw.batch_put_from_multi_buffers(
                ns, ptrs, [[HEADER_BYTES, stride]] * n, client._replicate))

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



# --- ttft: two nodes, one vLLM instance each ---------------------------------------

NODE1, NODE2 = "127.0.0.2", "127.0.0.3"  # loopback addresses of their own, as in tests/e2e/test_cluster.py
P2P = 'vllm:prompt_tokens_cached_by_source_total{source="p2p"}'
EXT_HITS = "vllm:external_prefix_cache_hits_total"
PUBLISHED = 'kvtier_cluster_events_total{event="published"}'
FETCHED = 'kvtier_cluster_events_total{event="fetched"}'
VLLM_COUNTS = (P2P, EXT_HITS, "kvtier_blocks_loaded_total", "kvtier_load_errors_total")
# Node 2's pool: blocks fetched, and the calls its instance made while it waited for them.
PROBES = 'kvtier_pool_rpc_seconds_count{call="Probe"}'
PROMOTES = 'kvtier_pool_rpc_seconds_count{call="Promote"}'
POOL_COUNTS = (FETCHED, PROBES, PROMOTES)


def write_node_configs(folder: Path, shm: str, meta_port: int, master_port: int, master_metrics: int,
                       addr: str, second: bool, dram_size: str, segment_size: str) -> tuple[Path, Path]:
    """The seeds' two files for one node. Node 1's meta file names the meta
    service (and so Mooncake's master) on its address; node 2 has a local
    file only, with its own pool's address (``kvtier.node_service_url``)."""
    cluster = ("kvtier.cluster.enabled = true\n"
               f"kvtier.cluster.master_port = {master_port}\n"
               f"kvtier.cluster.master_metrics_port = {master_metrics}\n")
    meta = folder / "mmc-meta.conf"
    meta.write_text(f"ock.mmc.meta_service_url = tcp://{NODE1}:{meta_port}\n"
                    f"ock.mmc.meta_service.metrics_url = http://{addr}:{free_port()}\n"
                    "ock.mmc.evict_threshold_high = 90\n"
                    "ock.mmc.evict_threshold_low = 80\n" + cluster)
    local = folder / "mmc-local.conf"
    local.write_text(f"ock.mmc.meta_service_url = tcp://{NODE1}:{meta_port}\n"
                     "ock.mmc.local_service.protocol = host_shm\n"
                     f"ock.mmc.local_service.dram.size = {dram_size}\n"
                     "ock.mmc.local_service.world_size = 1\n"
                     "ock.mmc.local_service.storage.enabled = false\n"
                     f"kvtier.shm_dir = {shm}\n" + cluster +
                     f"kvtier.cluster.local_hostname = {addr}\n"
                     f"kvtier.cluster.segment_size = {segment_size}\n"
                     + (f"kvtier.node_service_url = tcp://{addr}:{free_port()}\n"
                        f"ock.mmc.meta_service.metrics_url = http://{addr}:{free_port()}\n"
                        "ock.mmc.evict_threshold_high = 90\n"
                        "ock.mmc.evict_threshold_low = 80\n" if second else ""))
    return meta, local


def run_ttft(args: argparse.Namespace) -> dict:
    import httpx
    from transformers import AutoTokenizer

    from kvtier.tools.client import quiet_ttft, random_prompt
    from kvtier.tools.meta import MetaProcess
    from kvtier.tools.model import GEOMETRIES, build_model
    from kvtier.tools.server import ServerOptions, VllmServer, parse_metrics, poll_until

    model = str(build_model(args.geometry))
    vocab = len(AutoTokenizer.from_pretrained(model))
    geo = GEOMETRIES[args.geometry]
    hit_blocks = (args.prompt_tokens - 1) // args.block  # vLLM always computes the last token
    # K and V of every layer, bfloat16: what one block's fetch moves (plus kvtier's 128-byte header).
    block_bytes = 2 * geo.num_layers * geo.num_kv_heads * geo.head_size * args.block * 2
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-cluster-ttft-"))
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None  # arenas where a deployment has them
    meta_port, master_port, master_metrics = free_port(), free_port(), free_port()

    class Node:
        def __init__(self, name: str, addr: str, second: bool) -> None:
            self.folder = root / name
            self.folder.mkdir()
            self.shm = tempfile.mkdtemp(prefix=f"kvtier-bench-cluster-{name}-", dir=shm_root)
            # Node 2 lends no memory: what it reads from the cluster is on node 1.
            segment = "0" if second else args.segment_size
            meta, local = write_node_configs(self.folder, self.shm, meta_port, master_port, master_metrics,
                                             addr, second, args.dram_size, segment)
            self.meta = MetaProcess(local if second else meta, local, log_path=self.folder / "meta.log",
                                    args=["--role", "local"] if second else
                                    ["--cluster-log", str(self.folder / "master.log")])
            self.server: VllmServer | None = None

        def start_server(self) -> None:
            opts = ServerOptions(model=model, kvtier={"backend": "pool"}, env=self.meta.env_for_clients(),
                                 block_size=args.block, max_num_batched_tokens=args.chunk,
                                 max_model_len=args.prompt_tokens + 256)
            self.server = VllmServer(opts, log_path=self.folder / "vllm.log").start()

        def pool_metrics(self) -> dict[str, float]:
            return parse_metrics(httpx.get(self.meta.metrics_url + "/metrics", timeout=5).text)

    def prompt(seed: int, n: int) -> list[int]:
        return random_prompt(seed, n, vocab)

    def ttft(client: httpx.Client, srv: VllmServer, p: list[int]) -> float:
        return quiet_ttft(client, srv.url, p, args.gap)  # see quiet_ttft on why the gap

    def add(total: dict[str, float], before: dict[str, float], after: dict[str, float], keys) -> None:
        for k in keys:
            total[k] = total.get(k, 0.0) + after.get(k, 0.0) - before.get(k, 0.0)

    n1, n2 = Node("node1", NODE1, False), Node("node2", NODE2, True)
    started: list[Node] = []
    out: dict = {"geometry": args.geometry, "prompt_tokens": args.prompt_tokens, "prompts": args.prompts,
                 "gap_s": args.gap, "block": args.block, "block_bytes": block_bytes, "hit_blocks": hit_blocks,
                 "load_avg_start": os.getloadavg()[0], "logs": str(root)}
    try:
        for n in (n1, n2):
            n.meta.start()
            started.append(n)
        # Both instances start side by side (most of a start is single-threaded imports).
        with ThreadPoolExecutor(2) as ex:
            for fut in [ex.submit(n.start_server) for n in (n1, n2)]:
                fut.result()
        a, b = n1.server, n2.server
        assert a is not None and b is not None
        if not poll_until(lambda: all(n.pool_metrics().get("kvtier_cluster_up") == 1 for n in (n1, n2)), 60):
            raise RuntimeError(f"the nodes did not join Mooncake's master; logs in {root}")
        with httpx.Client(timeout=600) as client:
            for s in (a, b):
                ttft(client, s, prompt(999, 256))  # the first request pays one-time set-up
            # The first p2p fetch opens node 2's connection to node 1's transfer engine: not measured.
            warm = prompt(998, 1024)
            published = n1.pool_metrics().get(PUBLISHED, 0)
            ttft(client, a, warm)
            poll_until(lambda: n1.pool_metrics().get(PUBLISHED, 0) >= published + 1023 // args.block, 30)
            out["first_p2p_1k_s"] = ttft(client, b, warm)

            cold, device, p2p, dram = [], [], [], []
            on_p2p: dict[str, float] = {}
            on_dram: dict[str, float] = {}
            pool_p2p: dict[str, float] = {}
            pool_dram: dict[str, float] = {}
            unpublished = 0
            pool2_before = n2.pool_metrics()
            errors_a = a.metrics()
            for i in range(args.prompts):
                p = prompt(50_000 + i, args.prompt_tokens)
                published = n1.pool_metrics().get(PUBLISHED, 0)
                cold.append(ttft(client, a, p))
                device.append(ttft(client, a, p))
                # Write-through: node 1 publishes each block once its save is
                # complete, off the request's path; node 2 asks once all are in.
                if not poll_until(lambda: n1.pool_metrics().get(PUBLISHED, 0) >= published + hit_blocks, 30):
                    unpublished += 1
                before, pool_before = b.metrics(), n2.pool_metrics()
                p2p.append(ttft(client, b, p))
                mid, pool_mid = b.metrics(), n2.pool_metrics()
                b.reset_prefix_cache()  # node 2's device cache forgets; its pool keeps the fetched blocks
                dram.append(ttft(client, b, p))
                after, pool_after = b.metrics(), n2.pool_metrics()
                add(on_p2p, before, mid, VLLM_COUNTS)
                add(on_dram, mid, after, VLLM_COUNTS)
                add(pool_p2p, pool_before, pool_mid, POOL_COUNTS)
                add(pool_dram, pool_mid, pool_after, POOL_COUNTS)
            pool2 = n2.pool_metrics()
            out["load_avg_end"] = os.getloadavg()[0]
            out.update(cold_s=cold, device_s=device, p2p_s=p2p, dram2_s=dram, on_p2p=on_p2p, on_dram2=on_dram,
                       pool_on_p2p=pool_p2p, pool_on_dram2=pool_dram, prompts_not_fully_published=unpublished,
                       node1_load_errors=a.metrics().get("kvtier_load_errors_total", 0.0)
                       - errors_a.get("kvtier_load_errors_total", 0.0),
                       node2_dropped={k: pool2[k] - pool2_before.get(k, 0.0) for k in pool2
                                      if k.startswith("kvtier_cluster_dropped_blocks_total")})
    finally:
        for n in started:
            if n.server is not None:
                n.server.stop()
        for n in reversed(started):
            n.meta.stop()
            shutil.rmtree(n.shm, ignore_errors=True)
    return out


def print_ttft(res: dict) -> None:
    med = statistics.median
    cold, device, p2p, dram = (med(res[k]) for k in ("cold_s", "device_s", "p2p_s", "dram2_s"))
    n = res["prompts"]
    mib = res["hit_blocks"] * res["block_bytes"] / (1 << 20)
    print(f"\n## TTFT of a {res['prompt_tokens']}-token prompt from the other node, "
          f"model '{res['geometry']}', {n} prompts (median; load average "
          f"{res['load_avg_start']:.1f} at start, {res['load_avg_end']:.1f} at end)\n")
    print("| measure | TTFT median | min / max | / device hit | / cold |")
    print("|---|---|---|---|---|")
    rows = [("cold, node 1", "cold_s", cold), ("device hit, node 1", "device_s", device),
            ("p2p hit, node 2 (node 1 prefilled; fetched from node 1 over TCP)", "p2p_s", p2p),
            ("DRAM hit, node 2 (the fetched blocks, device cache reset)", "dram2_s", dram)]
    for what, key, v in rows:
        print(f"| {what} | {v * 1000:.1f} ms | {min(res[key]) * 1000:.1f} / {max(res[key]) * 1000:.1f} ms | "
              f"{v / device:.2f}x | {v / cold:.3f}x |")
    c, d = res["on_p2p"], res["on_dram2"]
    hit_tokens = n * res["hit_blocks"] * res["block"]
    print(f"\nNode 2, p2p requests: {c.get(P2P, 0):.0f} tokens with source p2p (expected {hit_tokens}), "
          f"{res['pool_on_p2p'][FETCHED]:.0f} blocks fetched from the cluster "
          f"(expected {n * res['hit_blocks']}), "
          f"{c.get('kvtier_blocks_loaded_total', 0):.0f} blocks loaded, "
          f"{c.get('kvtier_load_errors_total', 0):.0f} load errors.")
    print(f"Node 2, DRAM-hit requests: {d.get(EXT_HITS, 0):.0f} tokens hit in its pool "
          f"(expected {hit_tokens}), {d.get(P2P, 0):.0f} of them p2p, "
          f"{d.get('kvtier_load_errors_total', 0):.0f} load errors. "
          f"Node 1: {res['node1_load_errors']:.0f} load errors.")
    pp, pd = res["pool_on_p2p"], res["pool_on_dram2"]
    print(f"Node 2's calls to its pool per request (waiting for a fetch, its scheduler asks again every "
          f"pass): p2p hit {pp[PROBES] / n:.0f} probes, {pp[PROMOTES] / n:.0f} promotes; DRAM hit "
          f"{pd[PROBES] / n:.0f} probes, {pd[PROMOTES] / n:.0f} promotes.")
    dropped = {k: v for k, v in res["node2_dropped"].items() if v}
    print(f"Cluster blocks node 2 dropped (gone, corrupt, error): {dropped or 0}; "
          f"prompts not fully published when node 2 asked: {res['prompts_not_fully_published']:.0f}.")
    moved = res["hit_blocks"] * res["block_bytes"]
    print(f"p2p hit - node 2 DRAM hit = {(p2p - dram) * 1000:.1f} ms for {res['hit_blocks']} blocks "
          f"({mib:.1f} MiB): lookup + fetch + checks, {gbps(moved, p2p - dram):.2f} GB/s. First p2p hit "
          f"of the run (1k tokens, connection set-up): {res['first_p2p_1k_s'] * 1000:.1f} ms. "
          f"Logs: {res['logs']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=("transfers", "ttft"), default="transfers")
    p.add_argument("--blocks", type=int, default=64, help="transfers: blocks per batch")
    p.add_argument("--rank-bytes", type=int, default=512 << 10, help="transfers: bytes per block (one rank)")
    p.add_argument("--repeat", type=int, default=5, help="transfers: rounds, best of each")
    p.add_argument("--geometry", default="bench", help="ttft: test model (kvtier.tools.model.GEOMETRIES)")
    p.add_argument("--prompt-tokens", type=int, default=8192, help="ttft")
    p.add_argument("--prompts", type=int, default=9, help="ttft: distinct prompts, each TTFT once per prompt")
    p.add_argument("--gap", type=float, default=QUIET_S,
                   help="ttft: quiet seconds before each request (kvtier.tools.client.quiet_ttft)")
    p.add_argument("--dram-size", default="1GB", help="ttft: each node's DRAM pool")
    p.add_argument("--segment-size", default="2GB", help="ttft: memory node 1 lends the cluster")
    p.add_argument("--block", type=int, default=64, help="ttft: vLLM block size")
    p.add_argument("--chunk", type=int, default=2048, help="ttft: --max-num-batched-tokens")
    p.add_argument("--json", default=None, help="ttft: write every sample and count here")
    args = p.parse_args(argv)
    if args.what == "transfers":
        return run_transfers(args)
    res = run_ttft(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print_ttft(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
