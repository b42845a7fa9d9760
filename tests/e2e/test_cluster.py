"""Two nodes on one machine over Mooncake Store: a prefix computed on node 1 is a p2p hit on node 2.

Each "node" has its own address, config files, shared-memory folder and
pool. As root (where ``ip netns`` works and the namespaces can be made),
each node runs in a network namespace of its own, loopback up, and a veth
pair joins the two (10.211.T.1 and 10.211.T.2, see :mod:`tests.netns`):
its service, Mooncake's traffic and its vLLM instance (on 127.0.0.1 of its
namespace) are there, and the test talks to a node from a thread that
enters its namespace, as a client on that node would. Elsewhere, or with
``KVTIER_TEST_LOOPBACK=1`` in the environment, everything runs in the
machine's namespace on the loopback addresses 127.0.0.2 and 127.0.0.3; the
test is the same. The run's output says which, in one line. Node 1 runs
``kvtier meta`` (its pool, and Mooncake's master as a supervised child),
node 2 ``kvtier meta --role local`` (its pool at
``kvtier.node_service_url``, joined to the master that node 1's address
names). One vLLM instance per node, attached to its own node's pool only,
so the only way node 2 can hit node 1's KV is the cluster tier. Outputs
are compared token for token (greedy, float32). Then Mooncake's master is
killed with -9 while both serve: requests complete with the same output,
and once node 1's service has restarted it, hits resume.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mooncake.store", reason="the cluster tier needs the kvtier[cluster] extra")

from kvtier.tools.meta import MetaProcess  # noqa: E402
from kvtier.tools.server import VllmServer, free_port, parse_metrics, poll_until  # noqa: E402
from tests.e2e.conftest import (BLOCK, PROMOTE_WAIT, assert_loads_succeeded, complete, delta,  # noqa: E402
                                server_options, tokens)
from tests.netns import NodeLink, announce  # noqa: E402

pytestmark = pytest.mark.e2e

P2P = 'vllm:prompt_tokens_cached_by_source_total{source="p2p"}'
EXT_HITS = "vllm:external_prefix_cache_hits_total"


def write_configs(folder: Path, meta_port: int, master_port: int, master_metrics: int,
                  node1: str, node: str, second: bool) -> tuple[Path, Path]:
    """The node's two files; ``node1``: the master node's address, ``node``: this node's."""
    shm = folder / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    meta = folder / "mmc-meta.conf"
    meta.write_text(f"ock.mmc.meta_service_url = tcp://{node1}:{meta_port}\n"
                    f"ock.mmc.meta_service.metrics_url = http://{node}:{free_port()}\n"
                    "kvtier.cluster.enabled = true\n"
                    f"kvtier.cluster.master_port = {master_port}\n"
                    f"kvtier.cluster.master_metrics_port = {master_metrics}\n")
    local = folder / "mmc-local.conf"
    local.write_text(f"ock.mmc.meta_service_url = tcp://{node1}:{meta_port}\n"
                     "ock.mmc.local_service.protocol = host_shm\n"
                     "ock.mmc.local_service.dram.size = 24MB\n"
                     "ock.mmc.local_service.world_size = 1\n"
                     f"kvtier.shm_dir = {shm}\n"
                     "kvtier.cluster.enabled = true\n"
                     f"kvtier.cluster.master_port = {master_port}\n"
                     f"kvtier.cluster.master_metrics_port = {master_metrics}\n"
                     f"kvtier.cluster.local_hostname = {node}\n"
                     "kvtier.cluster.segment_size = 64MB\n"
                     + (f"kvtier.node_service_url = tcp://{node}:{free_port()}\n"
                        f"ock.mmc.meta_service.metrics_url = http://{node}:{free_port()}\n" if second else ""))
    return meta, local


class Node:
    def __init__(self, link: NodeLink, number: int, folder: Path, model: str, meta_port: int,
                 master_port: int, master_metrics: int) -> None:
        self.link, self.number, self.folder = link, number, folder
        second = number == 2
        meta, self.local = write_configs(folder, meta_port, master_port, master_metrics, link.addresses[1],
                                         link.addresses[number], second)
        # A worker node has only its local file (for both variables);
        # kvtier meta there runs as --role local.
        self.meta = MetaProcess(self.local if second else meta, self.local, log_path=folder / "meta.log",
                                args=["--role", "local"] if second else ["--cluster-log", str(folder / "master.log")])
        self.model = model
        self.server: VllmServer | None = None

    def start_service(self) -> None:
        with self.link.inside(self.number):  # the service (and Mooncake's master) in the node's namespace
            self.meta.start()

    def start_instance(self) -> VllmServer:
        opts = server_options(self.model, {"backend": "memcache", **PROMOTE_WAIT}, env=self.meta.env_for_clients()
                              | {"VLLM_LOG_STATS_INTERVAL": "1"})
        with self.link.inside(self.number):  # vLLM in the node's namespace; waits for it there
            self.server = VllmServer(opts, log_path=self.folder / "vllm.log").start()
        return self.server

    # The node's vLLM and service answer inside its namespace: the test asks from there.

    def complete(self, prompt: list[int]) -> dict:
        assert self.server is not None
        with self.link.inside(self.number):
            return complete(self.server, prompt)

    def vllm_metrics(self) -> dict[str, float]:
        assert self.server is not None
        with self.link.inside(self.number):
            return self.server.metrics()

    def vllm_health(self) -> int:
        assert self.server is not None
        with self.link.inside(self.number):
            return httpx.get(self.server.url + "/health", timeout=5).status_code

    def pool_metrics(self) -> dict[str, float]:
        with self.link.inside(self.number):
            return parse_metrics(httpx.get(self.meta.metrics_url + "/metrics", timeout=5).text)


def wait_for(cond, timeout_s: float, what: str) -> None:
    if not poll_until(cond, timeout_s, 0.2):
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def nodes(tiny_model: str, tmp_path_factory: pytest.TempPathFactory,
          pytestconfig: pytest.Config) -> Iterator[tuple[Node, Node]]:
    link = NodeLink(isolate=(True, True))
    announce(pytestconfig, f"test_cluster: {link.describe()}")
    started: list[Node] = []
    try:
        meta_port, master_port, master_metrics = free_port(), free_port(), free_port()
        n1, n2 = (Node(link, n, tmp_path_factory.mktemp(f"node{n}"), tiny_model, meta_port, master_port,
                       master_metrics) for n in (1, 2))
        for n in (n1, n2):
            started.append(n)
            n.start_service()
        # The two vLLM instances start side by side (most of a start is
        # single-threaded imports); each attaches to its own node's pool.
        with ThreadPoolExecutor(2) as pool:
            for fut in [pool.submit(n.start_instance) for n in (n1, n2)]:
                fut.result()
        # A node's pool joins the cluster once its instance attached.
        wait_for(lambda: all(n.pool_metrics().get("kvtier_cluster_up") == 1 for n in (n1, n2)), 60,
                 "both nodes to join Mooncake's master")
        yield n1, n2
    finally:
        try:
            for n in started:
                if n.server is not None:
                    n.server.stop()
            for n in reversed(started):
                n.meta.stop()
        finally:
            link.close()  # the namespaces, and the veth pair with them


def test_prefix_prefilled_on_node_1_is_a_p2p_hit_on_node_2(nodes: tuple[Node, Node]) -> None:
    n1, n2 = nodes
    prompt = tokens(71, 16 * BLOCK + 5)
    cold = n1.complete(prompt)
    wait_for(lambda: n1.pool_metrics().get('kvtier_cluster_events_total{event="published"}', 0) >= 16, 30,
             "node 1 to publish the prompt's blocks")
    before = n2.vllm_metrics()
    on_b = n2.complete(prompt)
    after = n2.vllm_metrics()
    assert on_b["text"] == cold["text"]
    assert delta(after, before, EXT_HITS) == 16 * BLOCK
    assert delta(after, before, P2P) == 16 * BLOCK  # vLLM's source for blocks another node computed
    assert_loads_succeeded(before, after, 16 * BLOCK)
    pool2 = n2.pool_metrics()
    assert pool2['kvtier_cluster_events_total{event="fetched"}'] == 16
    assert pool2.get('kvtier_cluster_dropped_blocks_total{cause="corrupt"}', 0) == 0
    # The two nodes' arenas are in their own folders: no shared memory between them.
    assert not set(os.listdir(n1.folder / "shm")) & set(os.listdir(n2.folder / "shm"))


def test_master_killed_requests_complete_then_hits_resume(nodes: tuple[Node, Node]) -> None:
    n1, n2 = nodes
    prompts = [tokens(80 + i, 10 * BLOCK + 3) for i in range(4)]
    refs = [n1.complete(p)["text"] for p in prompts]  # cold on node 1, published
    results: list[str | None] = [None] * 8
    go = threading.Event()

    def ask(i: int) -> None:
        go.wait()
        results[i] = (n2 if i % 2 else n1).complete(prompts[i % 4])["text"]

    pid = int(n1.pool_metrics()["kvtier_cluster_master_pid"])
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(ask, i) for i in range(8)]
        go.set()
        os.kill(pid, signal.SIGKILL)
        for f in futs:
            f.result()
    assert results == [refs[i % 4] for i in range(8)]
    for n in (n1, n2):
        assert n.vllm_health() == 200
    wait_for(lambda: n1.pool_metrics().get("kvtier_cluster_master_restarts", 0) >= 1, 30, "the master's restart")

    # The restarted master starts empty and Mooncake's clients re-join it on
    # their own schedule: a new prompt from node 1 is a p2p hit on node 2 again.
    seeds = iter(range(200, 300))

    published = 'kvtier_cluster_events_total{event="published"}'

    def resumed() -> bool:
        p = tokens(next(seeds), 8 * BLOCK + 1)
        was = n1.pool_metrics().get(published, 0)
        ref = n1.complete(p)["text"]
        # Node 1's puts of the prompt's 8 blocks end after the request: up
        # to a second for them (puts that fail while its client re-joins
        # are not counted; then the second runs out and node 2 misses).
        poll_until(lambda: n1.pool_metrics().get(published, 0) >= was + 8, 1.0, 0.05)
        before = n2.vllm_metrics()
        got = n2.complete(p)["text"]
        assert got == ref
        return delta(n2.vllm_metrics(), before, P2P) == 8 * BLOCK

    wait_for(resumed, 150, "p2p hits after the master's restart")
