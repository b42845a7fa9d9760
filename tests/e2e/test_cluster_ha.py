"""A takeover of the highly available cluster master under vLLM instances.

etcd (Debian's ``etcd-server``) on loopback and two nodes on 127.0.0.1,
each a ``kvtier meta`` whose file sets ``kvtier.cluster.etcd_endpoints``:
its pool, and a Mooncake master in HA mode (one leads, the other stands
by). One vLLM instance per node, attached to its own node's pool only, so
that node 2 can hit node 1's KV through the cluster tier alone. The leading
node's ``kvtier meta`` is killed with -9 (its master with it) while both
instances serve: every request completes with the output computed before,
both engines live, the standby takes over; the killed node is started again
on its files, its instance reconnects, and a prefix prefilled on either
node is a p2p hit on the other through the new leader. Outputs are compared
token for token (greedy, float32).

etcd missing is a failure, not a skip (CI installs it: .ci/run). Needs the
``kvtier[cluster]`` extra; skipped without it, as test_cluster.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mooncake.store", reason="the cluster tier needs the kvtier[cluster] extra")

from kvtier.tools.meta import MetaProcess  # noqa: E402
from kvtier.tools.server import VllmServer, exit_status, free_port, parse_metrics, poll_until  # noqa: E402
from tests.e2e.conftest import (BLOCK, PROMOTE_WAIT, complete, delta, reconnects, server_options,  # noqa: E402
                                tokens, wait_reconnected)
from tests.etcd_member import Etcd, end_lease, leader_lease, leader_now  # noqa: E402
from tests.unit.helpers import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

P2P = 'vllm:prompt_tokens_cached_by_source_total{source="p2p"}'
PUBLISHED = 'kvtier_cluster_events_total{event="published"}'
CORRUPT = 'kvtier_cluster_dropped_blocks_total{cause="corrupt"}'
UNREACHABLE = "is unreachable"  # the instance's line when it gives up on its pool and drops the session


class Node:
    """A node: its ``kvtier meta`` (pool and master, etcd in its file) and one vLLM instance on its pool."""

    def __init__(self, folder: Path, etcd_endpoint: str, model: str) -> None:
        (folder / "shm").mkdir(parents=True)
        self.folder, self.model = folder, model
        master_port = free_port()
        conf = folder / "mmc.conf"  # both variables name it, as on a single-file node
        conf.write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{free_port()}\n"
                        f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n"
                        "ock.mmc.local_service.protocol = host_shm\n"
                        "ock.mmc.local_service.dram.size = 24MB\n"
                        "ock.mmc.local_service.world_size = 1\n"
                        f"kvtier.shm_dir = {folder / 'shm'}\n"
                        "kvtier.cluster.enabled = true\n"
                        f"kvtier.cluster.master_port = {master_port}\n"
                        f"kvtier.cluster.master_metrics_port = {free_port()}\n"
                        f"kvtier.cluster.etcd_endpoints = {etcd_endpoint}\n"
                        "kvtier.cluster.segment_size = 64MB\n")
        self.master = f"127.0.0.1:{master_port}"  # as etcd names the leader
        self.meta = MetaProcess(conf, conf, log_path=folder / "meta.log",
                                args=["--cluster-log", str(folder / "master.log")])
        self.server: VllmServer | None = None

    def start_instance(self) -> VllmServer:
        opts = server_options(self.model, {"backend": "memcache", **PROMOTE_WAIT},
                              env=self.meta.env_for_clients() | {"VLLM_LOG_STATS_INTERVAL": "1"})
        self.server = VllmServer(opts, log_path=self.folder / "vllm.log").start()
        return self.server

    @property
    def vllm(self) -> VllmServer:
        assert self.server is not None
        return self.server

    def pool_metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.meta.metrics_url + "/metrics", timeout=5).text)

    def cluster_up(self) -> bool:
        try:
            return self.pool_metrics().get("kvtier_cluster_up") == 1
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """kill -9 of the node's ``kvtier meta`` and its master (one process
        group), then reaped (its log closed), so that it can start again."""
        if self.meta.proc is not None and exit_status(self.meta.proc) is None:
            self.meta.kill()
        self.meta.stop()


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Etcd, Node, Node]]:
    # Whatever fails, every part started is stopped (each step runs even if
    # one before it raises): the instances, then the nodes (-9: a node's
    # pool set up through etcd takes up to 30 s to close), then etcd.
    with ExitStack() as stack:
        etcd = Etcd(tmp_path_factory.mktemp("etcd"))
        stack.callback(etcd.close)
        nodes = [Node(tmp_path_factory.mktemp(f"node{n}"), etcd.endpoint, tiny_model) for n in (1, 2)]
        for n in nodes:
            stack.callback(n.kill)
            stack.callback(lambda n=n: n.server is not None and n.server.stop())
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(n.meta.start) for n in nodes]:
                started.result()
        # The two vLLM instances start side by side; each attaches to its own node's pool.
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(n.start_instance) for n in nodes]:
                started.result()
        # A node's pool joins the leader once its instance attached.
        wait_for(lambda: all(n.cluster_up() for n in nodes), 90, "both pools to join the leading master")
        yield etcd, nodes[0], nodes[1]


def p2p_hit(src: Node, dst: Node, prompt: list[int]) -> bool:
    """``prompt`` prefilled on ``src``, then asked of ``dst``: the same
    output, and True when all its whole blocks were p2p hits there (False
    when ``src`` did not publish them all: a put that fails while a pool
    follows a new leader is not counted)."""
    was = src.pool_metrics().get(PUBLISHED, 0)
    ref = complete(src.vllm, prompt)["text"]
    n_blocks = len(prompt) // BLOCK
    if not poll_until(lambda: src.pool_metrics().get(PUBLISHED, 0) >= was + n_blocks, 30.0, 0.05):
        return False
    before = dst.vllm.metrics()
    got = complete(dst.vllm, prompt)["text"]
    assert got == ref
    return delta(dst.vllm.metrics(), before, P2P) == n_blocks * BLOCK


def test_leader_node_killed_under_vllm_the_standby_takes_over_and_hits_resume(
        cluster: tuple[Etcd, Node, Node]) -> None:
    etcd, n1, n2 = cluster
    named = leader_now(etcd.endpoint)
    assert named in {n1.master, n2.master}, named
    leader, standby = (n1, n2) if named == n1.master else (n2, n1)
    # The standby's instance keeps its session throughout: its pool's
    # lookups that wait on the lost leader (at most CLUSTER_LOOKUP_WAIT_S;
    # whether one does depends on the moment, tests/unit/test_cluster.py
    # makes sure) are answered before the instance's own wait runs out.
    lost = standby.vllm.log_text().count(UNREACHABLE)

    # Before: the standby's node hits the leader's node's blocks, and back.
    seeds = iter(range(200, 400))
    wait_for(lambda: p2p_hit(leader, standby, tokens(next(seeds), 16 * BLOCK + 5)), 120, "p2p hits on the standby")
    wait_for(lambda: p2p_hit(standby, leader, tokens(next(seeds), 16 * BLOCK + 5)), 120, "p2p hits on the leader")

    # Prompts computed on each node (published), then each asked of both
    # while the leading node dies: its instance's loads fail into
    # recompute, its saves are dropped, the other's cluster lookups miss.
    prompts = [tokens(80 + i, 10 * BLOCK + 3) for i in range(4)]
    refs = [complete((leader if i % 2 else standby).vllm, p)["text"] for i, p in enumerate(prompts)]
    results: list[str | None] = [None] * 8
    go = threading.Event()

    def ask(i: int) -> None:
        go.wait()
        results[i] = complete((standby if i < 4 else leader).vllm, prompts[i % 4])["text"]

    for n in (n1, n2):
        assert n.pool_metrics().get(CORRUPT, 0) == 0
    assert leader_now(etcd.endpoint) == leader.master
    lease = leader_lease(etcd.endpoint)
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(ask, i) for i in range(8)]
        go.set()
        leader.kill()
        end_lease(etcd.endpoint, lease)  # as its running out does, at once
        for f in futs:
            f.result()
    assert results == [refs[i % 4] for i in range(8)]
    for n in (n1, n2):
        assert httpx.get(n.vllm.url + "/health", timeout=5).status_code == 200
    # The standby takes over: etcd names it, its node lives on.
    wait_for(lambda: leader_now(etcd.endpoint) == standby.master, 60, "etcd to name the standby")
    assert exit_status(standby.meta.proc) is None
    # With the dead node's pool gone, its instance serves on: a new prompt
    # there computes the same output as on the other node.
    fresh = tokens(90, 6 * BLOCK + 1)
    assert complete(leader.vllm, fresh)["text"] == complete(standby.vllm, fresh)["text"]

    # The dead node back on its files: its instance reconnects, its pool
    # joins the new leader (its master stands by), and sharing resumes both ways.
    seen = reconnects(leader.vllm)
    leader.meta.start()
    wait_reconnected(leader.vllm, seen)
    wait_for(lambda: leader.cluster_up() and standby.cluster_up(), 90, "both pools to join the new leader")
    assert leader_now(etcd.endpoint) == standby.master
    wait_for(lambda: p2p_hit(standby, leader, tokens(next(seeds), 8 * BLOCK + 1)), 150,
             "p2p hits on the restarted node through the new leader")
    wait_for(lambda: p2p_hit(leader, standby, tokens(next(seeds), 8 * BLOCK + 1)), 150,
             "p2p hits from the restarted node through the new leader")
    for n in (n1, n2):
        assert n.pool_metrics().get(CORRUPT, 0) == 0
    assert standby.vllm.log_text().count(UNREACHABLE) == lost  # its session kept throughout
