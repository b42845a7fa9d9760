"""A highly available cluster master with real parts: etcd (Debian's
``etcd-server``) on free loopback ports with a data folder of its own, two
``kvtier meta`` processes whose files set ``kvtier.cluster.etcd_endpoints``
(each runs Mooncake's master in HA mode, on a port of its own: a leader and
a standby), and a client process (cluster_ha_client.py) set up through etcd.
The client puts and gets blocks; the leader's ``kvtier meta`` is killed with
-9; puts and gets work again through the standby, now leader. A worker
node (``kvtier local``, its file naming etcd and no master) finds the
leader through etcd and hits the blocks the master's node saved; two node
pools follow a takeover and share blocks again; a leading master killed
alone is restarted by its node into the pair; etcd killed and started
again under all of them.

etcd missing is a failure, not a skip (CI installs it: .ci/run). Needs the
``kvtier[cluster]`` extra; skipped without it, as test_cluster.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mooncake.store", reason="the cluster tier needs the kvtier[cluster] extra")

from kvtier.cluster import etcd  # noqa: E402
from kvtier.cluster.master import MasterSupervisor, master_role  # noqa: E402
from kvtier.config import ClusterConfig  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.pool.client import PoolPlacement  # noqa: E402
from kvtier.tier.dram import DramTier  # noqa: E402
from kvtier.tools.meta import MetaProcess  # noqa: E402
from kvtier.tools.server import ServerError, exit_status, free_port, parse_metrics, poll_until  # noqa: E402
from tests.etcd_member import Etcd, end_lease, leader_lease, leader_now  # noqa: E402
from tests.unit.helpers import JsonLineProcess, freeze, pool_cluster_up, pool_fetched, wait_for  # noqa: E402
from tests.unit.helpers import pool_save as save  # noqa: E402

CLIENT = Path(__file__).with_name("cluster_ha_client.py")
BLOCK_BYTES = 16 << 10  # a block's bytes in the node pools' tests


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[Etcd]:
    e = Etcd(tmp_path)
    yield e
    e.close()


class Node:
    """A node's ``kvtier meta`` with the cluster tier on and etcd configured: its pool and a master."""

    def __init__(self, folder: Path, etcd_endpoint: str) -> None:
        folder.mkdir()
        (folder / "shm").mkdir()
        self.master_port, self.master_metrics_port = free_port(), free_port()
        conf = folder / "mmc.conf"
        conf.write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{free_port()}\n"
                        f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n"
                        "ock.mmc.local_service.dram.size = 8MB\n"
                        "ock.mmc.local_service.world_size = 1\n"
                        f"kvtier.shm_dir = {folder / 'shm'}\n"
                        "kvtier.cluster.enabled = true\n"
                        f"kvtier.cluster.master_port = {self.master_port}\n"
                        f"kvtier.cluster.master_metrics_port = {self.master_metrics_port}\n"
                        f"kvtier.cluster.etcd_endpoints = {etcd_endpoint}\n"
                        "kvtier.cluster.segment_size = 32MB\n")
        self.address = f"127.0.0.1:{self.master_port}"
        self.proc = MetaProcess(conf, conf, log_path=folder / "meta.log",
                                args=["--cluster-log", str(folder / "master.log")])

    def role(self) -> str | None:
        return master_role(ClusterConfig(master_port=self.master_port,
                                         master_metrics_port=self.master_metrics_port))

    def metrics_role(self) -> list[str]:
        """The roles this node's /metrics reports for its master (one when it answers)."""
        text = httpx.get(self.proc.metrics_url + "/metrics", timeout=5).text
        return [k.split('role="')[1].split('"')[0] for k, v in parse_metrics(text).items()
                if k.startswith("kvtier_cluster_master_role{") and v == 1]

    def kill(self) -> None:
        if self.proc.proc is not None and exit_status(self.proc.proc) is None:
            self.proc.kill()  # the process group: kvtier meta and its mooncake_master


class Client(JsonLineProcess):
    """cluster_ha_client.py: Mooncake's client following the leader through etcd.

    Started at once; :meth:`wait_ready` waits until it has joined the leader
    (it retries while no master leads, so it may start before the masters)."""

    what = "client process"

    def __init__(self, etcd_endpoint: str, log: Path) -> None:
        self.shm = f"/dev/shm/kvtier-test-ha-{uuid.uuid4().hex}"
        cmd = [sys.executable, str(CLIENT), "--etcd", etcd_endpoint, "--shm", self.shm]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "ab"), text=True)

    def wait_ready(self) -> Client:
        got = self.read()
        assert got == {"ready": True}, got
        return self

    def round_trip(self, seed: int, n: int) -> bool:
        """Put n blocks, then get them: True when every put took and every get came back with its bytes."""
        put = self.do(op="put", seed=seed, n=n)
        if put.get("ok") != [True] * n:
            return False
        return self.do(op="get", seed=seed, n=n).get("got") == ["ok"] * n

    def close(self) -> None:
        # SIGKILL: Mooncake's client set up through etcd takes up to 30 s to close.
        self.kill()
        if os.path.exists(self.shm):
            os.unlink(self.shm)


def test_standby_master_takes_over_when_the_leader_is_killed(etcd_server: Etcd, tmp_path: Path) -> None:
    nodes = [Node(tmp_path / "node1", etcd_server.endpoint), Node(tmp_path / "node2", etcd_server.endpoint)]
    # The client process starts beside the masters (its imports take seconds)
    # and joins whichever leads; the two kvtier meta start side by side.
    client: Client | None = Client(etcd_server.endpoint, tmp_path / "client.log")
    try:
        with ThreadPoolExecutor(len(nodes)) as pool:
            for started in [pool.submit(n.proc.start) for n in nodes]:
                started.result()
        # One leads (etcd names it), the other stands by with its RPC port closed.
        wait_for(lambda: leader_now(etcd_server.endpoint) in {n.address for n in nodes}, 30,
                 "a leader in etcd")
        leader = next(n for n in nodes if n.address == leader_now(etcd_server.endpoint))
        standby = next(n for n in nodes if n is not leader)
        wait_for(lambda: leader.role() == "leader" and standby.role() == "standby", 30,
                 "leader and standby roles")
        # Each node's /metrics says which its master is.
        wait_for(lambda: (leader.metrics_role(), standby.metrics_role()) == (["leader"], ["standby"]), 30,
                 "each node's /metrics to name its master's role")

        client.wait_ready()
        assert client.round_trip(seed=1, n=4)

        lease = leader_lease(etcd_server.endpoint)
        leader.kill()
        # A dead leader's lease runs out up to 5 s after its last keep-alive
        # (Mooncake's TTL); the standby campaigns once it is gone, then waits
        # out 5 s of its own before it serves. The lease is ended at once.
        end_lease(etcd_server.endpoint, lease)
        # Gets and puts through the standby, once it has the lease and the
        # client has followed it and mounted its segment there again.
        seeds = iter(range(100, 10_000))
        wait_for(lambda: client.round_trip(seed=next(seeds), n=4), 90, "puts and gets through the standby")
        wait_for(lambda: leader_now(etcd_server.endpoint) == standby.address, 30, "etcd to name the standby")
        wait_for(lambda: standby.role() == "leader" and standby.metrics_role() == ["leader"], 30,
                 "the standby to say it leads")
        # The new leader's index starts empty (no oplog): blocks put before
        # the takeover are misses, never wrong bytes.
        assert set(client.do(op="get", seed=1, n=4)["got"]) <= {"gone", "ok"}
    finally:
        if client is not None:
            client.close()
        for n in nodes:
            n.kill()


def test_unreachable_etcd_is_refused_naming_the_key(tmp_path: Path) -> None:
    """kvtier meta and the master refuse endpoints where no etcd answers, with one line naming the key."""
    closed = f"127.0.0.1:{free_port()}"
    cfg = ClusterConfig(master_port=free_port(), master_metrics_port=free_port(), etcd_endpoints=closed)

    def meta_refuses() -> pytest.ExceptionInfo[ServerError]:
        node = Node(tmp_path / "node", closed)
        with pytest.raises(ServerError) as err:
            node.proc.start()
        return err

    # kvtier meta (a process of its own, with its own wait for etcd) is
    # refused while this process's master is.
    with ThreadPoolExecutor(1) as pool:
        meta = pool.submit(meta_refuses)
        with pytest.raises(ConfigError, match="kvtier.cluster.etcd_endpoints") as err:
            MasterSupervisor(cfg).start()
        assert closed in str(err.value)
        meta_err = meta.result()
    assert "kvtier.cluster.etcd_endpoints" in str(meta_err.value) and "no etcd answers" in str(meta_err.value)


def test_something_else_than_etcd_is_refused(tmp_path: Path) -> None:
    """An HTTP server that is not etcd at the endpoint: refused, naming the key."""
    import http.server
    import threading

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the base class's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    # A short poll interval: shutdown() waits for serve_forever's next poll.
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="kvtier.cluster.etcd_endpoints"):
            etcd.require(f"127.0.0.1:{srv.server_address[1]}", timeout_s=0.5)
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_stopped_leader_is_not_joined(etcd_server: Etcd, tmp_path: Path) -> None:
    """A leader that is stopped (or wedged) still holds its etcd key for a
    few seconds, and the kernel still takes connections on its port; Mooncake's
    setup against it would hold the GIL and freeze the meta service. It must
    answer first."""
    import signal

    from kvtier.cluster.client import _ha_leader
    from kvtier.cluster.master import answers
    from kvtier.errors import ClusterError

    cfg = ClusterConfig(master_port=free_port(), master_metrics_port=free_port(),
                        etcd_endpoints=etcd_server.endpoint)
    def leader_answers(cfg: ClusterConfig) -> bool:
        try:
            return _ha_leader(cfg) == cfg.master_address
        except ClusterError:
            return False

    sup = MasterSupervisor(cfg, log_path=tmp_path / "master.log")
    sup.start()
    try:
        wait_for(lambda: leader_now(etcd_server.endpoint) == cfg.master_address, 30, "the master to lead")
        # Elected, it serves a few seconds later (Mooncake waits out a lease period first).
        wait_for(lambda: answers("127.0.0.1", cfg.master_port), 30, "the leader to serve")
        wait_for(lambda: leader_answers(cfg), 30, "the leader to be joined")
        pid = sup.pid
        assert pid is not None
        # Frozen, it stays named in etcd until its lease runs out (seconds):
        # a slow machine can see the lease end before the check is done,
        # and then the leader is looked for again.
        for _ in range(3):
            try:
                freeze(pid)
                if leader_now(etcd_server.endpoint) != cfg.master_address:
                    continue  # no longer named there
                with pytest.raises(ClusterError) as err:
                    _ha_leader(cfg)
                if "does not answer" in str(err.value):
                    break
                # Any other error while it is still named is wrong.
                assert leader_now(etcd_server.endpoint) != cfg.master_address, str(err.value)
            finally:
                os.kill(pid, signal.SIGCONT)
                wait_for(lambda: leader_answers(cfg), 30, "the resumed leader to answer")
        else:
            pytest.fail("the frozen leader's lease ran out before each check")
    finally:
        sup.stop()


def worker_node(folder: Path, etcd_endpoint: str) -> MetaProcess:
    """A worker node's ``kvtier local``: its local file names etcd and no master."""
    (folder / "shm").mkdir(parents=True)
    conf = folder / "mmc-local.conf"
    conf.write_text("ock.mmc.local_service.dram.size = 8MB\n"
                    "ock.mmc.local_service.world_size = 1\n"
                    f"kvtier.shm_dir = {folder / 'shm'}\n"
                    "kvtier.cluster.enabled = true\n"
                    f"kvtier.cluster.etcd_endpoints = {etcd_endpoint}\n"
                    "kvtier.cluster.segment_size = 32MB\n"
                    f"kvtier.node_service_url = tcp://127.0.0.1:{free_port()}\n"
                    f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n")
    return MetaProcess(conf, conf, log_path=folder / "meta.log", args=["--role", "local"])


def cluster_up(proc: MetaProcess) -> bool:
    return pool_cluster_up(proc.metrics_url)


def hits_right(c: PoolPlacement, ks: list[bytes], fill: int, step: int = 1) -> None:
    """Fetch ``ks`` into ``c``'s pool; each block pinned there (for ``step``) is whole and holds ``fill``."""
    assert pool_fetched(c, ks) == len(ks)
    slots = c.pin(ks, step)
    tier = DramTier.attach(c.arena_path)
    try:
        assert all(s is not None and tier.verify(s, k, 0) for s, k in zip(slots, ks))
        assert all(int(tier.rank_view(s, 0)[0]) == fill for s in slots)
    finally:
        tier.close()
    c.complete_step(step)


def shares_again(saver: PoolPlacement, finder: PoolPlacement) -> Callable[[], bool]:
    """For wait_for: each call saves three new blocks through ``saver``
    (steps from 12 up) and is True once ``finder`` finds them in the
    cluster within 5 s, fetches them all (a call may still fail while the
    cluster settles: the next call tries new blocks) and they are whole."""
    fills = iter(range(10, 250))

    def attempt() -> bool:
        fill = next(fills)
        ks = [os.urandom(16) for _ in range(3)]
        save(saver, ks, 2 + fill, fill=fill)
        if not poll_until(lambda: finder.probe(ks).remote == 3, 5, 0.1) or pool_fetched(finder, ks) < 3:
            return False
        hits_right(finder, ks, fill=fill, step=fill)
        return True

    return attempt


def test_a_worker_node_follows_the_leader_through_etcd(etcd_server: Etcd, tmp_path: Path) -> None:
    """A worker node (``kvtier local``) whose local file names etcd and no
    master: its pool finds the leading master through etcd, joins it, and a
    block saved on the master's node is a cluster hit there, checked byte
    for byte."""
    master_node = Node(tmp_path / "node1", etcd_server.endpoint)
    worker = worker_node(tmp_path / "node2", etcd_server.endpoint)
    clients: list[PoolPlacement] = []
    try:
        master_node.proc.start()
        worker.start()
        # A pool joins the cluster when its first instance attaches.
        a = PoolPlacement(master_node.proc.address, ranks=1, rank_bytes=BLOCK_BYTES, name="a")
        b = PoolPlacement(worker.address, ranks=1, rank_bytes=BLOCK_BYTES, name="b")
        clients += [a, b]
        wait_for(lambda: cluster_up(master_node.proc) and cluster_up(worker), 90, "both pools to join the leader")
        ks = [os.urandom(16) for _ in range(3)]
        save(a, ks, 1, fill=9)
        wait_for(lambda: b.probe(ks).remote == 3, 60, "the worker node to find node 1's blocks")
        hits_right(b, ks, fill=9)
    finally:
        for c in clients:
            c.shutdown()
        if worker.proc is not None and exit_status(worker.proc) is None:
            worker.kill()
        master_node.kill()


def test_node_pools_follow_a_takeover_and_hit_again(etcd_server: Etcd, tmp_path: Path) -> None:
    """Two node pools (the standby master's node and a worker node) share
    blocks through the leader; the leader's ``kvtier meta`` is killed with
    -9. Both pools see the cluster down, follow the standby once it leads,
    and blocks saved on one are cluster hits on the other again, whole.
    (Blocks from before the takeover: misses or whole, never wrong, in
    test_standby_master_takes_over_when_the_leader_is_killed.)"""
    nodes = [Node(tmp_path / "node1", etcd_server.endpoint), Node(tmp_path / "node2", etcd_server.endpoint)]
    worker = worker_node(tmp_path / "node3", etcd_server.endpoint)
    clients: list[PoolPlacement] = []
    try:
        with ThreadPoolExecutor(3) as pool:
            for started in [pool.submit(p.start) for p in (nodes[0].proc, nodes[1].proc, worker)]:
                started.result()
        wait_for(lambda: leader_now(etcd_server.endpoint) in {n.address for n in nodes}, 30, "a leader in etcd")
        leader = next(n for n in nodes if n.address == leader_now(etcd_server.endpoint))
        standby = next(n for n in nodes if n is not leader)
        # Pools on the standby's node and the worker node; the leader's node
        # runs its master only (no instance attaches there).
        s = PoolPlacement(standby.proc.address, ranks=1, rank_bytes=BLOCK_BYTES, name="s")
        w = PoolPlacement(worker.address, ranks=1, rank_bytes=BLOCK_BYTES, name="w")
        clients += [s, w]
        wait_for(lambda: cluster_up(standby.proc) and cluster_up(worker), 90, "both pools to join the leader")
        before = [os.urandom(16) for _ in range(3)]
        save(w, before, 1, fill=3)
        wait_for(lambda: s.probe(before).remote == 3, 60, "the blocks in the cluster before the takeover")
        hits_right(s, before, fill=3)

        lease = leader_lease(etcd_server.endpoint)
        leader.kill()
        end_lease(etcd_server.endpoint, lease)  # as its running out does, at once
        wait_for(lambda: leader_now(etcd_server.endpoint) == standby.address, 60, "etcd to name the standby")
        wait_for(shares_again(w, s), 120, "blocks shared through the new leader")
        assert cluster_up(standby.proc) and cluster_up(worker)
    finally:
        for c in clients:
            c.shutdown()
        if worker.proc is not None and exit_status(worker.proc) is None:
            worker.kill()
        for n in nodes:
            n.kill()


def test_a_leader_master_killed_alone_is_restarted_into_the_pair(etcd_server: Etcd, tmp_path: Path) -> None:
    """kill -9 of the leading ``mooncake_master`` alone (its ``kvtier meta``
    lives): the node's supervisor restarts it, and the two masters are again
    one leader, the one etcd names, and one standby (the old standby leads,
    unless the restarted master won the election). Twice, the second time
    killing whichever leads then."""
    import signal

    nodes = [Node(tmp_path / "node1", etcd_server.endpoint), Node(tmp_path / "node2", etcd_server.endpoint)]

    def figures(n: Node) -> dict[str, float]:
        return parse_metrics(httpx.get(n.proc.metrics_url + "/metrics", timeout=5).text)

    def a_pair() -> bool:
        named = leader_now(etcd_server.endpoint)
        roles = {n.address: (n.role(), n.metrics_role()) for n in nodes}
        return (named in roles and roles[named] == ("leader", ["leader"])
                and sorted(r for r, _ in roles.values()) == ["leader", "standby"])

    try:
        with ThreadPoolExecutor(len(nodes)) as pool:
            for started in [pool.submit(n.proc.start) for n in nodes]:
                started.result()
        for turn in range(2):
            wait_for(a_pair, 90, f"a leader and a standby (turn {turn})")
            leader = next(n for n in nodes if n.address == leader_now(etcd_server.endpoint))
            before = figures(leader)
            pid = int(before["kvtier_cluster_master_pid"])
            lease = leader_lease(etcd_server.endpoint)
            os.kill(pid, signal.SIGKILL)
            end_lease(etcd_server.endpoint, lease)
            restarts = before.get("kvtier_cluster_master_restarts", 0) + 1
            wait_for(lambda: figures(leader).get("kvtier_cluster_master_restarts") == restarts
                     and int(figures(leader)["kvtier_cluster_master_pid"]) != pid, 60,
                     f"the killed master's restart (turn {turn})")
            wait_for(a_pair, 90, f"a leader and a standby again (turn {turn})")
            assert exit_status(leader.proc.proc) is None  # its kvtier meta lived through it
    finally:
        for n in nodes:
            n.kill()


def test_etcd_lost_while_the_masters_run_is_a_miss_and_sharing_resumes(etcd_server: Etcd, tmp_path: Path) -> None:
    """etcd killed under a leader, a standby and two node pools: the leader
    steps down, lookups of the cluster's blocks are misses, every process
    lives and each node's own
    pool keeps serving its blocks; once etcd is back, a master leads again
    and the pools share whole blocks again."""
    nodes = [Node(tmp_path / "node1", etcd_server.endpoint), Node(tmp_path / "node2", etcd_server.endpoint)]
    worker = worker_node(tmp_path / "node3", etcd_server.endpoint)
    clients: list[PoolPlacement] = []
    try:
        with ThreadPoolExecutor(3) as pool:
            for started in [pool.submit(p.start) for p in (nodes[0].proc, nodes[1].proc, worker)]:
                started.result()
        wait_for(lambda: leader_now(etcd_server.endpoint) in {n.address for n in nodes}, 30, "a leader in etcd")
        s = PoolPlacement(nodes[0].proc.address, ranks=1, rank_bytes=BLOCK_BYTES, name="s")
        w = PoolPlacement(worker.address, ranks=1, rank_bytes=BLOCK_BYTES, name="w")
        clients += [s, w]
        wait_for(lambda: cluster_up(nodes[0].proc) and cluster_up(worker), 90, "both pools to join the leader")
        shared = [os.urandom(16) for _ in range(3)]
        save(w, shared, 1, fill=4)
        wait_for(lambda: s.probe(shared).remote == 3, 60, "the blocks in the cluster")

        etcd_server.kill()
        wait_for(lambda: [n.role() for n in nodes] == ["standby", "standby"], 60, "the leader to step down")
        wait_for(lambda: not cluster_up(nodes[0].proc) and not cluster_up(worker), 60, "both pools to see it down")
        assert s.probe(shared).total == 0  # the cluster's blocks: a miss, not a wait
        own = [os.urandom(16) for _ in range(2)]
        save(w, own, 2, fill=6)
        assert w.probe(own).ready == 2  # the node's own pool serves
        hits_right(w, own, fill=6, step=3)
        assert all(exit_status(p) is None for p in (nodes[0].proc.proc, nodes[1].proc.proc, worker.proc))

        etcd_server.start()
        wait_for(lambda: leader_now(etcd_server.endpoint) in {n.address for n in nodes}, 90, "a leader again")
        wait_for(shares_again(w, s), 120, "blocks shared once etcd is back")
    finally:
        for c in clients:
            c.shutdown()
        if worker.proc is not None and exit_status(worker.proc) is None:
            worker.kill()
        for n in nodes:
            n.kill()
