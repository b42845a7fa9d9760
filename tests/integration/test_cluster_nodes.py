"""Two nodes' pools over one Mooncake master, as real processes from the seeds' files.

As root, node 2 runs in a network namespace of its own, joined to node 1
by a veth pair (10.211.x.1 and 10.211.x.2: two real addresses on a private
link, nothing leaves the machine; see :mod:`tests.netns`); elsewhere, or
with ``KVTIER_TEST_LOOPBACK=1``, the nodes take 127.0.0.2 and 127.0.0.3.
The run's output says which, in one line.

Node 1 runs ``kvtier meta`` (its pool, and Mooncake's master as its child);
node 2 runs ``kvtier meta --role local`` (its own pool at
``kvtier.node_service_url``, joining the master found at the host of its
local file's ``meta_service_url``). Each node has its own shared-memory
folder. Clients are :class:`PoolPlacement` objects, as in a vLLM scheduler,
and workers are played by mapping each node's arena. A block saved on node
1 is a cluster-only hit on node 2, fetched into node 2's arena and verified
there; both services' /metrics count it.

Needs the ``kvtier[cluster]`` extra; skipped without it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mooncake.store", reason="the cluster tier needs the kvtier[cluster] extra")

from kvtier.pool.client import PoolPlacement  # noqa: E402
from kvtier.tier.dram import DramTier  # noqa: E402
from kvtier.tools.meta import MetaProcess  # noqa: E402
from kvtier.tools.server import free_port, parse_metrics  # noqa: E402
from tests.netns import NodeLink, announce  # noqa: E402
from tests.unit.helpers import pool_cluster_up, pool_fetched, wait_for  # noqa: E402
from tests.unit.helpers import pool_save as save  # noqa: E402

RANK_BYTES = 16 << 10


def write_node_configs(folder: Path, link: NodeLink, master_node_port: int, master_port: int,
                       node2: bool) -> tuple[Path, Path]:
    shm = folder / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    here = link.addresses[2 if node2 else 1]
    meta = folder / "mmc-meta.conf"
    meta.write_text(f"ock.mmc.meta_service_url = tcp://{link.addresses[1]}:{master_node_port}\n"
                    f"ock.mmc.meta_service.metrics_url = http://{here}:{free_port()}\n"
                    "kvtier.cluster.enabled = true\n"
                    f"kvtier.cluster.master_port = {master_port}\n"
                    f"kvtier.cluster.master_metrics_port = {master_port + 1}\n")
    local = folder / "mmc-local.conf"
    local.write_text(f"ock.mmc.meta_service_url = tcp://{link.addresses[1]}:{master_node_port}\n"
                     "ock.mmc.local_service.dram.size = 8MB\n"
                     "ock.mmc.local_service.world_size = 1\n"
                     f"kvtier.shm_dir = {shm}\n"
                     "kvtier.cluster.enabled = true\n"
                     f"kvtier.cluster.master_port = {master_port}\n"
                     f"kvtier.cluster.master_metrics_port = {master_port + 1}\n"
                     f"kvtier.cluster.local_hostname = {here}\n"
                     "kvtier.cluster.segment_size = 32MB\n"
                     + (f"kvtier.node_service_url = tcp://{here}:{free_port()}\n"
                        f"ock.mmc.meta_service.metrics_url = http://{here}:{free_port()}\n" if node2 else ""))
    return meta, local


class Node:
    def __init__(self, folder: Path, link: NodeLink, master_node_port: int, master_port: int, second: bool) -> None:
        self.meta_conf, self.local_conf = write_node_configs(folder, link, master_node_port, master_port, second)
        # A worker node has only its local file: the meta file is the master node's.
        args = ["--role", "local"] if second else ["--cluster-log", str(folder / "master.log")]
        self.proc = MetaProcess(self.local_conf if second else self.meta_conf, self.local_conf,
                                log_path=folder / "meta.log", args=args, prefix=link.prefix(2 if second else 1))

    def client(self, name: str) -> PoolPlacement:
        return PoolPlacement(self.proc.address, ranks=1, rank_bytes=RANK_BYTES, name=name)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.proc.metrics_url + "/metrics", timeout=5).text)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[tuple[Node, Node]]:
    link = NodeLink(isolate=(False, True))  # node 1 in the machine's namespace, where the test runs
    announce(pytestconfig, f"test_cluster_nodes: {link.describe()}")
    try:
        port, master_port = free_port(), free_port_pair()
        n1 = Node(tmp_path_factory.mktemp("node1"), link, port, master_port, second=False)
        n2 = Node(tmp_path_factory.mktemp("node2"), link, port, master_port, second=True)
        n1.proc.start()
        try:
            n2.proc.start()
            try:
                yield n1, n2
            finally:
                n2.proc.stop()
        finally:
            n1.proc.stop()
    finally:
        link.close()


def free_port_pair() -> int:
    """A free port whose next port is free too (the master's RPC and metrics ports)."""
    while True:
        p = free_port()
        if p < 65535 and port_free(p + 1):
            return p


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def cluster_up(node: Node) -> bool:
    return pool_cluster_up(node.proc.metrics_url)


def test_a_block_saved_on_node_1_is_a_cluster_hit_on_node_2(nodes: tuple[Node, Node]) -> None:
    n1, n2 = nodes
    # A node's pool (and its Mooncake client) is made when its first instance attaches.
    a, b = n1.client("a"), n2.client("b")
    try:
        wait_for(lambda: cluster_up(n1) and cluster_up(n2), 60, "both nodes to join the master")
        assert a.arena_path != b.arena_path  # two pools, two arenas
        ks = [os.urandom(16) for _ in range(4)]
        save(a, ks, 1, fill=5)
        wait_for(lambda: n1.metrics().get('kvtier_cluster_events_total{event="published"}', 0) >= 4, 30,
                 "node 1 to publish")
        # A lookup that outlives the 2 s timeout finds nothing (and adds no
        # hit): asked until one is answered.
        seen = []
        wait_for(lambda: seen.append(b.probe(ks)) or seen[-1].total > 0, 60, "node 2 to find the blocks")
        p = seen[-1]
        assert (p.ready, p.total, p.remote) == (0, 4, 4)
        assert pool_fetched(b, ks) == 4
        slots = b.pin(ks, 1)
        tier = DramTier.attach(b.arena_path)
        try:
            assert all(s is not None and tier.verify(s, k, 0) for s, k in zip(slots, ks))
            assert all(int(tier.rank_view(s, 0)[0]) == 5 for s in slots)
        finally:
            tier.close()
        b.complete_step(1)
        m2 = n2.metrics()
        assert m2['kvtier_cluster_events_total{event="fetched"}'] == 4
        assert m2['kvtier_pool_hit_keys_total{instance="b",tier="cluster"}'] == 8  # two lookups found all four
        m1 = n1.metrics()
        assert m1['kvtier_cluster_master{figure="keys"}'] >= 4  # the master's own count, re-exported
    finally:
        a.shutdown()
        b.shutdown()


def test_master_killed_is_restarted_by_its_node_and_hits_resume(nodes: tuple[Node, Node]) -> None:
    """kill -9 of Mooncake's master: the master node's service restarts it,
    and node 2 hits node 1's new blocks again. (Lookups while the master is
    away are misses: test_cluster.py, test_master_down_is_a_fast_miss_and_service_resumes.)"""
    n1, n2 = nodes
    a, b = n1.client("a2"), n2.client("b2")
    try:
        master_pid = int(n1.metrics()["kvtier_cluster_master_pid"])
        os.kill(master_pid, signal.SIGKILL)
        wait_for(lambda: n1.metrics().get("kvtier_cluster_master_restarts", 0) >= 1, 30, "the master's restart")
        seed = iter(range(1000))

        def resumed() -> bool:
            ks = [os.urandom(16) for _ in range(2)]
            save(a, ks, 10 + next(seed), fill=9)
            time.sleep(0.2)
            return pool_fetched(b, ks, timeout_s=5) == 2

        wait_for(resumed, 120, "hits after the master's restart")
        assert n1.metrics()["kvtier_cluster_master_pid"] != master_pid
    finally:
        a.shutdown()
        b.shutdown()
