"""The cluster tier with real parts: a ``mooncake_master`` process on 127.0.0.1
(free ports), a peer node in a process of its own (cluster_node.py: its own
arena, store and Mooncake client, so transfers cross processes over TCP as
between nodes), and this process as the other node: a store whose misses
go to the cluster.

Needs the ``kvtier[cluster]`` extra; skipped without it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("mooncake.store", reason="the cluster tier needs the kvtier[cluster] extra")

from kvtier import movers  # noqa: E402
from kvtier.cluster.client import Fetched, MooncakeTier, verify_staged  # noqa: E402
from kvtier.cluster.master import MasterSupervisor, port_open  # noqa: E402
from kvtier.config import ClusterConfig  # noqa: E402
from kvtier.store import EntryState, TieredStore  # noqa: E402
from kvtier.tier.dram import HEADER_BYTES, HEADER_DTYPE, DramTier, checksum  # noqa: E402
from kvtier.tools.server import free_port  # noqa: E402
from tests.unit import helpers  # noqa: E402
from tests.unit.cluster_node import block_bytes, block_key  # noqa: E402
from tests.unit.helpers import JsonLineProcess, freeze  # noqa: E402

NODE = Path(__file__).with_name("cluster_node.py")
RANK_BYTES = 64 << 10


# Checks twice as often as elsewhere: the conditions here are flags and counters of this process.
wait_for = functools.partial(helpers.wait_for, interval_s=0.05)


def own_master(test):
    """The test stops or kills the master, or kills the peer: it gets a
    master, a peer and a node of its own instead of the module's (the others
    share one of each)."""
    test.own_master = True
    return test


def _owns_master(request: pytest.FixtureRequest) -> bool:
    return getattr(request.function, "own_master", False)


def new_cluster_cfg() -> ClusterConfig:
    return ClusterConfig(master_port=free_port(), master_metrics_port=free_port(), segment_bytes=64 << 20)


class Peer(JsonLineProcess):
    """The other node: cluster_node.py in its own process. Its kill()
    (SIGKILL) ends the whole node, which has no child processes: its
    Mooncake client and the memory it lent the cluster, while the master
    still lists the values held there."""

    what = "peer node"

    def __init__(self, cfg: ClusterConfig, tmp_path: Path) -> None:
        self.shm = f"/dev/shm/kvtier-test-peer-{uuid.uuid4().hex}"
        self.proc = subprocess.Popen([sys.executable, str(NODE), "--master", cfg.master_address, "--shm", self.shm,
                                      "--metrics-port", str(cfg.master_metrics_port),
                                      "--rank-bytes", str(RANK_BYTES)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(tmp_path / "peer.log", "ab"), text=True)
        assert self.read() == {"ready": True}

    def begin_close(self) -> None:
        """EOF on its stdin: it closes its store and exits (close() waits for that)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> None:
        self.begin_close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
        if os.path.exists(self.shm):
            os.unlink(self.shm)


# The master and the peer node are shared by the tests of this module (a
# master and a peer process each cost seconds to start and to close); each
# test uses keys of its own (its seeds) and a node of its own, so what it
# asserts of its node's counters is its own. Tests that stop or kill the
# master, or kill the peer, are marked @own_master and get their own.


@pytest.fixture(scope="module")
def shared_cluster(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterConfig, MasterSupervisor]]:
    cfg = new_cluster_cfg()
    sup = MasterSupervisor(cfg, log_path=tmp_path_factory.mktemp("cluster") / "master.log")
    sup.start()
    yield cfg, sup
    sup.stop()


@pytest.fixture(scope="module")
def shared_peer(shared_cluster: tuple[ClusterConfig, MasterSupervisor],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    p = Peer(shared_cluster[0], tmp_path_factory.mktemp("peer"))
    yield p
    p.close()


@pytest.fixture
def teardown_last() -> Iterator[contextlib.ExitStack]:
    """Callbacks run after the test's node, peer and master are torn down,
    the last registered first: a master a test starts in place of the one
    it stopped is stopped there, after the node and the peer closed (a
    Mooncake client that closes with no master waits out its RPC timeouts,
    seconds each)."""
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def cluster_cfg(request: pytest.FixtureRequest) -> ClusterConfig:
    if _owns_master(request):
        return new_cluster_cfg()
    return request.getfixturevalue("shared_cluster")[0]


@pytest.fixture
def master(request: pytest.FixtureRequest, cluster_cfg: ClusterConfig, teardown_last: contextlib.ExitStack,
           tmp_path: Path) -> Iterator[MasterSupervisor]:
    if not _owns_master(request):
        sup = request.getfixturevalue("shared_cluster")[1]
        restarts = sup.restarts
        yield sup
        assert sup.running and sup.restarts == restarts, \
            "the test stopped or killed the module's master: mark it @own_master"
        return
    sup = MasterSupervisor(cluster_cfg, log_path=tmp_path / "master.log")
    sup.start()
    yield sup
    sup.stop()


@pytest.fixture
def peer(request: pytest.FixtureRequest, master: MasterSupervisor, cluster_cfg: ClusterConfig,
         teardown_last: contextlib.ExitStack, tmp_path: Path) -> Iterator[Peer]:
    if not _owns_master(request):
        yield request.getfixturevalue("shared_peer")
        return
    p = Peer(cluster_cfg, tmp_path)
    yield p
    # Its Mooncake client closes (a second or two) while this process's node closes.
    p.begin_close()
    teardown_last.callback(p.close)


@pytest.fixture
def node(make_tier, cluster_cfg: ClusterConfig, master: MasterSupervisor) -> Iterator[TieredStore]:
    """This process's node: a store of 32 slots with the cluster tier under it."""
    tier: DramTier = make_tier(4096 * 4 + 32 * (RANK_BYTES + 128), RANK_BYTES)
    store = TieredStore(tier, 99, 90, cluster=MooncakeTier(cluster_cfg, tier), cluster_timeout_s=5.0)
    wait_for(lambda: store.cluster.up, what="the cluster to be reachable")
    yield store
    store.close()


def checked_now(store: TieredStore, cond: Callable[[], bool]) -> Callable[[], bool]:
    """``cond`` for wait_for, each call first waking the store's cluster
    health thread so that it checks now, not at its next period (1 s while
    up, so three missed checks before "down"; 0.2 s doubling to 5 s while
    down): the same checks decide up and down, sooner."""

    def check() -> bool:
        store.cluster._wake.set()
        return cond()

    return check


def save_blocks(store: TieredStore, keys: list[bytes], step: int, seed: int,
                start: int = 0) -> list[int | None]:
    """Save ``keys`` in ``step`` as a worker does: each slot handed out filled
    with ``block_bytes(seed, start + i)`` and sealed, then the step completed."""
    tier = store.tier
    slots = store.prepare_save(keys, step)
    for i, (key, slot) in enumerate(zip(keys, slots)):
        if slot is not None:
            view = tier.rank_view(slot, 0)
            view.numpy()[:] = block_bytes(seed, start + i, 0, RANK_BYTES)
            tier.seal(slot, key, 0, checksum(view, key))
    store.complete_step(step)
    return slots


def lending_nothing(make_tier, cluster_cfg: ClusterConfig) -> TieredStore:
    """A node of 32 slots that lends the cluster no memory (a pure client:
    every block it fetches lives in a peer's segment), once the cluster is up."""
    tier = make_tier(4096 * 4 + 32 * (RANK_BYTES + 128), RANK_BYTES)
    store = TieredStore(tier, 99, 90, cluster=MooncakeTier(replace(cluster_cfg, segment_bytes=0), tier),
                        cluster_timeout_s=5.0)
    try:
        wait_for(lambda: store.cluster.up, what="the cluster to be reachable")
    except BaseException:
        store.close()
        raise
    return store


def fetch(store: TieredStore, keys: list[bytes]) -> int:
    """Probe and promote as the scheduler does; the number of keys READY afterwards."""
    p = store.probe(keys)
    store.promote(keys[p.ready : p.total])
    store.wait_idle(30)
    return store.probe(keys).ready


@own_master
def test_master_is_supervised_and_restarted_after_kill(master: MasterSupervisor, cluster_cfg: ClusterConfig) -> None:
    pid = master.pid
    assert pid is not None and port_open(cluster_cfg.master_host, cluster_cfg.master_port)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: master.restarts == 1 and master.pid not in (None, pid), what="the master's restart")
    assert port_open(cluster_cfg.master_host, cluster_cfg.master_port)
    respawned = master._proc
    master.stop()
    assert not master.running
    # Stopped as the first one is (SIGTERM: it exits 0), not killed with the
    # thread that respawned it.
    assert respawned is not None and respawned.returncode == 0
    wait_for(lambda: not port_open(cluster_cfg.master_host, cluster_cfg.master_port), what="the port to close")


def test_master_refuses_a_port_in_use(master: MasterSupervisor, cluster_cfg: ClusterConfig) -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="kvtier.cluster.master_port"):
        MasterSupervisor(cluster_cfg).start()


def test_block_from_another_node_is_fetched_verified_and_counted(node: TieredStore, peer: Peer) -> None:
    # The peer is the module's: its counters hold the earlier tests' saves.
    before = peer.do(op="counters")["counters"]["cluster_published"]
    got = peer.do(op="save", seed=1, n=6)
    assert got["counters"]["cluster_published"] - before == 6
    keys = [bytes.fromhex(k) for k in got["keys"]]
    p = node.probe(keys)
    assert (p.ready, p.total, p.remote) == (0, 6, 6)
    assert fetch(node, keys) == 6
    tier = node.tier
    for i, key in enumerate(keys):
        slot = node.pin([key], 0)[0]
        assert slot is not None and tier.verify(slot, key, 0)
        assert np.array_equal(tier.rank_view(slot, 0).numpy(), block_bytes(1, i, 0, RANK_BYTES))
    node.complete_step(0)
    c = node.counters()
    assert (c["cluster_fetched"], c["cluster_gone"], c["cluster_corrupt"]) == (6, 0, 0)
    assert c["cluster_hits"] == 12  # two lookups found all six: the test's and fetch()'s first
    # Fetched blocks are not published back (the cluster has them).
    assert c["cluster_published"] == 0


def test_save_is_published_to_the_cluster(node: TieredStore, peer: Peer) -> None:
    # (The other way round, a peer's blocks fetched here byte for byte: the test above.)
    keys = [block_key(7, i) for i in range(3)]
    save_blocks(node, keys, 0, seed=7)
    node.wait_idle(30)
    assert node.counters()["cluster_published"] == 3
    assert node.cluster.remote.exists(keys) == [True] * 3


def test_flipped_byte_in_the_cluster_is_a_miss_counted(node: TieredStore, peer: Peer) -> None:
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=2, n=3)["keys"]]
    assert peer.do(op="flip", key=keys[1].hex())["put"] == 0
    assert fetch(node, keys) == 1  # the prefix stops at the bad block
    c = node.counters()
    assert (c["cluster_fetched"], c["cluster_corrupt"]) == (2, 1)
    assert not node.contains(keys[1])


def test_a_block_found_bad_in_the_cluster_is_not_asked_for_again_for_a_while(node: TieredStore, peer: Peer,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster still says it holds a block whose value failed its checks:
    looked up again at once, it would be fetched and fail again, and every
    request with the prefix would wait out promote_timeout_s."""
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=90, n=3)["keys"]]
    assert peer.do(op="flip", key=keys[1].hex())["put"] == 0
    assert fetch(node, keys) == 1
    p = node.probe(keys)
    assert (p.ready, p.total, p.remote) == (1, 1, 0)  # the lookup stops at the bad block
    assert node.promote(keys[p.ready : p.total]) == 0
    assert node.counters()["cluster_corrupt"] == 1  # fetched once
    # Once the while has passed, the cluster is asked again.
    monkeypatch.setattr(movers, "CLUSTER_SHUN_S", 0.0)
    keys2 = [bytes.fromhex(k) for k in peer.do(op="save", seed=91, n=2)["keys"]]
    assert peer.do(op="flip", key=keys2[0].hex())["put"] == 0
    assert fetch(node, keys2) == 0
    assert node.probe(keys2).remote == 2


def test_foreign_value_under_a_key_is_a_miss(node: TieredStore, peer: Peer) -> None:
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=3, n=2)["keys"]]
    assert peer.do(op="foreign", key=keys[1].hex(), **{"as": keys[0].hex()})["put"] == 0
    assert fetch(node, keys) == 0
    assert node.counters()["cluster_corrupt"] == 1


def test_value_gone_between_lookup_and_fetch_is_counted(node: TieredStore, peer: Peer) -> None:
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=4, n=2)["keys"]]
    p = node.probe(keys)
    assert p.remote == 2
    peer.do(op="remove", key=keys[0].hex())
    node.promote(keys[p.ready : p.total])
    node.wait_idle(30)
    assert node.probe(keys).ready == 0
    c = node.counters()
    assert c["cluster_gone"] == 1 and c["cluster_fetched"] == 1


def test_a_promotion_with_a_key_of_another_length_changes_nothing(node: TieredStore, peer: Peer) -> None:
    # The cluster's keys are fetched after the SSD's: a short one among
    # them is refused before any slot is taken, not after the keys before
    # it were entered PROMOTING with no fetch ever sent for them.
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=5, n=2)["keys"]]
    before = node.slot_counts()
    with pytest.raises(ValueError, match="5 bytes, not 16"):
        node.promote([*keys, b"short"])
    assert node.slot_counts() == before
    assert not any(node.contains(k) for k in keys)
    assert node.odd_keys_consistent()
    assert fetch(node, keys) == 2  # and the same keys still promote


@own_master
def test_master_down_is_a_fast_miss_and_service_resumes(node: TieredStore, peer: Peer, master: MasterSupervisor,
                                                       cluster_cfg: ClusterConfig, tmp_path: Path,
                                                       teardown_last: contextlib.ExitStack) -> None:
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=5, n=2)["keys"]]
    master.stop()
    wait_for(checked_now(node, lambda: not node.cluster.up), what="the node to see the master gone")
    p = node.probe(keys)
    assert (p.total, p.remote) == (0, 0)
    assert node.counters()["cluster_down"] == 1
    # A promote planned from an earlier lookup while it goes down: a miss, nothing held.
    node.promote(keys)
    node.wait_idle(30)
    assert all(not node.contains(k) for k in keys)
    again = MasterSupervisor(cluster_cfg, log_path=tmp_path / "master2.log")
    teardown_last.callback(again.stop)  # once the node and the peer are closed
    again.start()
    wait_for(checked_now(node, lambda: node.cluster.up), what="the node to see the master back")
    # A restarted master starts empty, and Mooncake's clients re-join it
    # on their own schedule (a ping every few seconds, a reconnection
    # after three missed): what the peer saves once it has is found.
    seeds = iter(range(100, 1000))

    def resumed() -> bool:
        fresh = [bytes.fromhex(k) for k in peer.do(op="save", seed=next(seeds), n=2)["keys"]]
        return fetch(node, fresh) == 2

    wait_for(resumed, timeout_s=120, what="hits after the restart")
    assert node.counters()["cluster_fetched"] >= 2


@own_master
def test_a_joined_master_that_stops_answering_is_a_miss_and_the_node_comes_back(
        node: TieredStore, peer: Peer, master: MasterSupervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The master frozen (SIGSTOP: its port still takes connections, nothing
    answers) after the node joined it: a lookup gives up and answers a miss
    instead of waiting on Mooncake's call, the cluster is marked down, and
    blocks saved to the node itself still hit; once the master answers again
    the node shares the cluster's blocks again."""
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=70, n=2)["keys"]]
    wait_for(lambda: node.probe(keys).remote == 2, what="the peer's blocks in the cluster")
    # The lookup's own wait, short beside Mooncake's for a master that does
    # not answer (about 30 s), so that the call is still running when the
    # lookup has answered.
    monkeypatch.setattr(node.cluster, "timeout_s", 0.5)
    pid = master.pid
    assert pid is not None
    try:
        freeze(pid)
        p = node.probe(keys)
        assert (p.total, p.remote) == (0, 0)
        asking = node.cluster.asking
        assert asking is not None and not asking.done()  # it gave up on its own
        wait_for(lambda: not node.cluster.up, what="the cluster marked down")
        assert node.counters()["cluster_down"] >= 1
        own = [block_key(70, 9)]
        save_blocks(node, own, 0, seed=70)
        assert node.probe(own).ready == 1  # this node's pool serves meanwhile
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(checked_now(node, lambda: node.cluster.up), timeout_s=60, what="the node to see the master back")
    # Blocks the peer saves now hit (those from before may be gone: a
    # master that slept past a client's time to live drops its segment).
    seeds = iter(range(700, 1000))
    wait_for(lambda: fetch(node, [bytes.fromhex(k) for k in peer.do(op="save", seed=next(seeds), n=2)["keys"]]) == 2,
             timeout_s=60, what="the cluster's blocks to hit again")
    assert master.restarts == 0  # the same master, thawed: not one the supervisor restarted


def test_a_stalled_cluster_lookup_costs_an_instance_a_miss_not_its_session(tmp_path: Path) -> None:
    """Through a node pool (``kvtier meta`` running its own master): the
    master frozen (SIGSTOP) after the pool joined it. An instance's lookup
    waits on the cluster at most ``CLUSTER_LOOKUP_WAIT_S``, so the pool
    answers (a miss) before the instance's own wait for any answer runs out:
    the instance keeps its session, and with it the blocks it holds there.
    (With the two waits equal, the instance gave up on the pool, dropped the
    session and reconnected, as a takeover under vLLM showed.)"""
    from kvtier.pool.client import PoolPlacement
    from kvtier.tools.meta import MetaProcess
    from kvtier.tools.server import parse_metrics

    (tmp_path / "shm").mkdir()
    conf = tmp_path / "mmc.conf"
    conf.write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{free_port()}\n"
                    f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n"
                    "ock.mmc.local_service.dram.size = 8MB\n"
                    "ock.mmc.local_service.world_size = 1\n"
                    f"kvtier.shm_dir = {tmp_path / 'shm'}\n"
                    "kvtier.cluster.enabled = true\n"
                    f"kvtier.cluster.master_port = {free_port()}\n"
                    f"kvtier.cluster.master_metrics_port = {free_port()}\n"
                    "kvtier.cluster.segment_size = 32MB\n")
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log", args=["--cluster-log", str(tmp_path / "master.log")])
    meta.start()
    client: PoolPlacement | None = None
    pid = 0
    try:
        client = PoolPlacement(meta.address, ranks=1, rank_bytes=16 << 10, name="a")
        helpers.wait_for(lambda: helpers.pool_cluster_up(meta.metrics_url), 90, "the pool to join its master")
        def figures() -> dict[str, float]:
            return parse_metrics(httpx.get(meta.metrics_url + "/metrics", timeout=5).text)

        own = [os.urandom(16)]
        helpers.pool_save(client, own, 1, fill=5)
        # Its put done before the freeze: a put that failed instead would
        # mark the cluster down first, and the lookup would not wait.
        helpers.wait_for(lambda: figures().get('kvtier_cluster_events_total{event="published"}', 0) == 1, 30,
                         "the block published")
        assert figures()["kvtier_cluster_up"] == 1
        epoch = client.epoch
        pid = int(figures()["kvtier_cluster_master_pid"])
        freeze(pid)
        # Keys the node holds nowhere: the pool asks the cluster, which does not answer.
        p = client.probe([os.urandom(16) for _ in range(4)])
        assert (p.total, p.remote) == (0, 0)
        assert "a lookup took over" in meta.log_text()  # it did wait on the cluster
        assert (client.epoch, client.stalls, client.failures) == (epoch, 0, 0)
        assert client.connected
        assert client.probe(own).ready == 1  # the session's blocks are still there
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        if client is not None:
            client.shutdown()
        meta.kill()
        meta.stop()


class FailNextGet:
    """Mooncake's client whose next get answers a transfer error for every
    key (a peer unreachable for a moment); the calls after it go through."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.failed = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def batch_get_into_multi_buffers(self, names: list, *args: object) -> object:
        if not self.failed.is_set():
            self.failed.set()
            return [-1] * len(names)
        return self.inner.batch_get_into_multi_buffers(names, *args)  # type: ignore[attr-defined]


@own_master
def test_blocks_whose_fetch_failed_in_an_outage_are_asked_for_again_once_the_cluster_is_back(
        node: TieredStore, peer: Peer, master: MasterSupervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch that failed with a transfer error shuns its keys (asking at
    once would fail again and make every request wait); when the node then
    finds the master restarted (its mark gone: an outage it never saw as
    down), those keys are asked for again at once, not after the while.
    Keys whose value failed its checks stay shunned."""
    monkeypatch.setattr(movers, "CLUSTER_SHUN_S", 3600.0)  # only the outage's end may lift them
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=75, n=2)["keys"]]
    bad = [bytes.fromhex(k) for k in peer.do(op="save", seed=76, n=1)["keys"]]
    assert peer.do(op="flip", key=bad[0].hex())["put"] == 0
    assert fetch(node, bad) == 0 and node.counters()["cluster_corrupt"] == 1
    remote = node.cluster.remote
    failing = FailNextGet(remote._store)
    monkeypatch.setattr(remote, "_store", failing)
    assert fetch(node, keys) == 0
    assert failing.failed.is_set() and node.counters()["cluster_fetch_errors"] == 2
    assert node.probe(keys).total == 0  # shunned
    pid = master.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: master.restarts == 1, what="the master's restart")
    wait_for(checked_now(node, lambda: node.counters()["cluster_lost"] >= 1), timeout_s=120,
             what="the node to find its mark gone")
    # The new master starts empty: the peer saves its blocks again (once
    # it has re-joined), and the node finds and fetches them.
    wait_for(lambda: peer.do(op="save", seed=75, n=2)["keys"] == [k.hex() for k in keys] and fetch(node, keys) == 2,
             timeout_s=120, what="the blocks that failed in the outage to hit")
    peer.do(op="save", seed=76, n=1)
    assert peer.do(op="flip", key=bad[0].hex())["put"] == 0
    assert node.probe(bad).total == 0  # a bad value stays shunned


@own_master
def test_blocks_published_before_a_master_restart_are_published_again(node: TieredStore,
                                                                       master: MasterSupervisor) -> None:
    """A master killed and restarted at once (by its supervisor) starts
    empty, and the node may never see it down; the node's mark is gone with
    it, so the node publishes again the blocks it holds (write-through):
    they are in the new master's cluster, not just in the node's DRAM."""
    keys = [block_key(60, i) for i in range(4)]
    save_blocks(node, keys, 0, seed=60)
    node.wait_idle(30)
    assert node.counters()["cluster_published"] == 4 and node.cluster.remote.exists(keys) == [True] * 4
    pid = master.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: master.restarts == 1, what="the master's restart")

    def published_again() -> bool:
        try:
            return node.cluster.remote.exists(keys) == [True] * 4
        except Exception:  # noqa: BLE001 - the client is reconnecting to the new master
            return False

    # Mooncake's client re-mounts its segment on the new master on its own
    # schedule; the mark can be put, and the blocks published, only then.
    wait_for(published_again, timeout_s=120, what="the blocks to be in the restarted master")
    c = node.counters()
    assert c["cluster_lost"] == 1
    assert c["cluster_published"] >= 8
    assert all(node.contains(k) for k in keys)


@own_master  # the peer leaves: its segment must be the only other one
def test_blocks_lost_with_a_peer_that_left_are_published_again(make_tier, peer: Peer, cluster_cfg: ClusterConfig,
                                                               master: MasterSupervisor, tmp_path: Path,
                                                               teardown_last: contextlib.ExitStack) -> None:
    """A peer that leaves takes the blocks its segment held; the node's mark,
    in the node's own segment, stays, so no new epoch tells the node. The
    cluster's capacity drops, and the node asks it about what it published:
    the blocks gone with the peer are counted and published again
    (write-through), to a node that joined since, and the cluster holds
    every block again."""
    # This node lends 16 MiB (Mooncake's least): its mark and at most 255 of
    # the 320 blocks (64 KiB each); the others can only land in the peer's 64 MiB.
    n = 320
    tier = make_tier(4096 * 4 + (n + 8) * (RANK_BYTES + 128), RANK_BYTES)
    store = TieredStore(tier, 99, 90, cluster=MooncakeTier(replace(cluster_cfg, segment_bytes=16 << 20), tier),
                        cluster_timeout_s=5.0)
    try:
        wait_for(lambda: store.cluster.up, what="the cluster to be reachable")
        keys = [block_key(80, i) for i in range(n)]
        assert None not in save_blocks(store, keys, 0, seed=80)
        assert store.wait_idle(30)
        assert store.counters()["cluster_published"] == n and store.cluster.remote.exists(keys) == [True] * n
        # A second peer joins, then the first one leaves (closes: its segment
        # is unmounted with what it held). The node's checks may find the
        # loss and mend it before close() returns: the counters tell.
        wait_for(checked_now(store, lambda: store.cluster._capacity is not None), what="the capacity read")
        lent = store.cluster._capacity
        other = Peer(cluster_cfg, tmp_path)
        teardown_last.callback(other.close)
        # The node must have seen the second peer's memory: a drop is
        # measured from the capacity of the check before.
        wait_for(checked_now(store, lambda: store.cluster._capacity > lent), what="the capacity with the new peer")
        peer.close()

        def all_held() -> bool:
            return store.cluster.remote.exists(keys) == [True] * n

        wait_for(checked_now(store, all_held), timeout_s=60, what="the lost blocks to be published again")
        assert store.wait_idle(30)  # the puts' ends counted
        c = store.counters()
        assert c["cluster_lost"] == 0  # the mark stayed: the checks of published blocks did it
        assert n - 255 <= c["cluster_vanished"] <= n
        assert c["cluster_published"] == n + c["cluster_vanished"]
    finally:
        store.close()


def test_a_promotion_once_the_cluster_tier_closed_is_a_miss_with_nothing_left_promoting(
        make_tier, peer: Peer, cluster_cfg: ClusterConfig) -> None:
    """The store's calls can meet a cluster tier closing (a service
    stopping): a fetch handed over then was submitted to threads already
    shut down, raised, and left its entries PROMOTING."""
    tier = make_tier(4096 * 4 + 32 * (RANK_BYTES + 128), RANK_BYTES)
    store = TieredStore(tier, 99, 90, cluster=MooncakeTier(replace(cluster_cfg, segment_bytes=0), tier))
    try:
        wait_for(lambda: store.cluster.up, what="the cluster to be reachable")
        keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=92, n=2)["keys"]]
        assert store.probe(keys).remote == 2
        store.cluster.close()
        assert store.promote(keys) == 2
        assert store.moving().from_cluster == 0 and not any(store.contains(k) for k in keys)
        assert store.counters()["cluster_fetch_errors"] == 2
        assert store.used_slots == 0 and store.odd_keys_consistent()  # their DRAM slots are free again
    finally:
        store.close()


@own_master  # a dead peer stays mounted at the master for seconds: other tests' puts would land in it
def test_peer_node_killed_is_a_miss_counted_and_the_store_lives(make_tier, peer: Peer,
                                                                master: MasterSupervisor,
                                                                cluster_cfg: ClusterConfig) -> None:
    """The node whose memory holds published blocks dies (SIGKILL) between
    this node's lookup and its fetch: each fetch fails (a transfer to a
    segment whose owner is gone), is a miss counted as a fetch error, and
    nothing is READY; the cluster is not marked down (its master answers),
    and the store keeps saving and finding blocks."""
    # This node lends no memory (a pure client): every block the peer
    # publishes lives in the peer's segment, so every fetch meets the dead node.
    store = lending_nothing(make_tier, cluster_cfg)
    try:
        keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=11, n=4)["keys"]]
        p = store.probe(keys)
        assert (p.ready, p.total, p.remote) == (0, 4, 4)
        peer.kill()
        # The master forgets a dead client's segment only after its client
        # TTL (seconds): the fetches planned from the lookup go to the dead node.
        assert store.promote(keys) == 4
        # Each fetch gives up after the store's timeout (5 s): a bound of 60 s
        # tells a fetch that ends from one that waits for the dead node forever.
        wait_for(lambda: store.wait_idle(0.1), timeout_s=60, what="the fetches from the dead node to end")
        assert store.probe(keys).ready == 0
        assert all(not store.contains(k) for k in keys)
        c = store.counters()
        assert (c["cluster_fetched"], c["cluster_fetch_errors"], c["cluster_gone"], c["cluster_corrupt"]) == \
            (0, 4, 0, 0)
        assert c["cluster_down"] == 0 and store.cluster.up
        # Still usable: a save on this node is found by the next lookup.
        mine = [block_key(12, i) for i in range(2)]
        assert None not in save_blocks(store, mine, 0, seed=12)
        assert store.probe(mine).ready == 2
        assert store.wait_idle(30)
    finally:
        store.close()


@own_master  # the peer is frozen: the module's other tests would wait on it
def test_a_peer_frozen_mid_fetch_is_a_miss_and_its_slots_come_back(make_tier, peer: Peer,
                                                                    master: MasterSupervisor,
                                                                    cluster_cfg: ClusterConfig) -> None:
    """The node holding published blocks stops (SIGSTOP, all its threads)
    before this node fetches them: Mooncake's get waits on it. Lookups
    count the blocks as a miss once the fetch has run past stale_move_s,
    and never wait for it; the blocks' DRAM slots stay taken while the
    call may still write them; the store saves and finds its own blocks
    meanwhile. Once the peer runs again, every fetch ends: a block is
    READY only if it arrived whole and verified, the others' slots are
    free, and nothing is left moving."""
    store = lending_nothing(make_tier, cluster_cfg)
    tier = store.tier
    try:
        keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=13, n=4)["keys"]]
        p = store.probe(keys)
        assert (p.ready, p.total, p.remote) == (0, 4, 4)
        pid = peer.proc.pid
        freeze(pid)
        try:
            assert store.promote(keys) == 4
            wait_for(lambda: store.probe(keys).total == 0, timeout_s=60,
                     what="lookups to count the stalled fetch as a miss")
            assert store.counters()["moves_stalled"] >= 1
            assert store.moving().from_cluster == 4  # still inside Mooncake's call: their slots stay taken
            assert store.used_slots == 4
            mine = [block_key(14, i) for i in range(2)]
            assert None not in save_blocks(store, mine, 0, seed=14)
            assert store.probe(mine).ready == 2
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: store.wait_idle(0.1), timeout_s=120, what="the fetches to end once the peer runs")
        c = store.counters()
        ends = (c["cluster_fetched"], c["cluster_fetch_errors"], c["cluster_gone"], c["cluster_corrupt"])
        assert sum(ends) == 4 and c["cluster_corrupt"] == 0, ends
        assert store.moving().from_cluster == 0
        held = [k for k in keys if store.contains(k)]
        assert len(held) == c["cluster_fetched"]
        for k in held:  # sealed under its key, with the bytes the peer saved
            slot = store.pin([k], 1)[0]
            assert slot is not None and tier.verify(slot, k, 0)
            assert np.array_equal(tier.rank_view(slot, 0).numpy(), block_bytes(13, keys.index(k), 0, RANK_BYTES))
        store.complete_step(1)
        assert store.used_slots == 2 + len(held) and store.odd_keys_consistent()
    finally:
        store.close()


def test_stalled_lookup_times_out_and_marks_the_cluster_down(make_tier, tmp_path: Path) -> None:
    """A master that accepts connections but never answers (a stalled peer):
    lookups answer 0 at once, the store stays usable and the process is not
    frozen (Mooncake's setup would hold the GIL while it waits: the client
    asks the master's HTTP side first)."""
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    cfg = ClusterConfig(master_port=lsock.getsockname()[1], master_metrics_port=free_port(), segment_bytes=0)
    tier = make_tier(4096 * 4 + 8 * (RANK_BYTES + 128), RANK_BYTES)
    store = TieredStore(tier, 99, 90, cluster=MooncakeTier(cfg, tier), cluster_timeout_s=0.5)
    try:
        assert store.probe([block_key(9, 0)]).total == 0
        assert not store.cluster.up
        slots = store.prepare_save([block_key(9, 1)], 0)
        assert slots[0] is not None
        store.complete_step(0)
        assert store.probe([block_key(9, 1)]).ready == 1
    finally:
        lsock.close()
        store.close()


def test_fetch_outcomes_of_the_client(make_tier, master: MasterSupervisor, cluster_cfg: ClusterConfig,
                                      peer: Peer) -> None:
    """MooncakeTier alone: a missing key is GONE, not an error; nothing is sealed for it."""
    tier = make_tier(4096 * 4 + 8 * (RANK_BYTES + 128), RANK_BYTES)
    client = MooncakeTier(cluster_cfg, tier)
    wait_for(lambda: _connects(client), what="the client to connect")
    try:
        keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=8, n=1)["keys"]]
        out = client.fetch([keys[0], block_key(8, 99)], [0, 1])
        assert out == [Fetched.OK, Fetched.GONE]
        assert tier.is_sealed(0, keys[0]) and not tier.is_sealed(1, block_key(8, 99))
        assert client.exists([keys[0], block_key(8, 99)]) == [True, False]
    finally:
        client.close()


class StallFirstGet:
    """Mooncake's client with its first get stalled until released (a peer that stops answering)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.stalled = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def batch_get_into_multi_buffers(self, *args: object) -> object:
        if not self.stalled.is_set():
            self.stalled.set()
            self.release.wait(60)
        return self.inner.batch_get_into_multi_buffers(*args)  # type: ignore[attr-defined]


def test_a_stalled_fetch_holds_up_no_other(make_tier, master: MasterSupervisor, cluster_cfg: ClusterConfig,
                                           peer: Peer) -> None:
    tier = make_tier(4096 * 4 + 8 * (RANK_BYTES + 128), RANK_BYTES)
    client = MooncakeTier(cluster_cfg, tier)
    wait_for(lambda: _connects(client), what="the client to connect")
    stall = StallFirstGet(client._store)
    client._store = stall
    keys = [bytes.fromhex(k) for k in peer.do(op="save", seed=93, n=2)["keys"]]
    results: dict[str, list[Fetched]] = {}
    first = threading.Thread(target=lambda: results.update(first=client.fetch(keys[:1], [0])), daemon=True)
    second = threading.Thread(target=lambda: results.update(second=client.fetch(keys[1:], [1])), daemon=True)
    try:
        first.start()
        assert stall.stalled.wait(30)
        second.start()
        second.join(30)
        assert results.get("second") == [Fetched.OK]  # while the first is still stalled
        assert "first" not in results
        stall.release.set()
        first.join(30)
        assert results["first"] == [Fetched.OK]
        assert tier.is_sealed(0, keys[0]) and tier.is_sealed(1, keys[1])
    finally:
        stall.release.set()
        for t in (first, second):  # no call may be inside Mooncake's client when it closes
            if t.ident is not None:  # started
                t.join(60)
        client._store = stall.inner
        client.close()


def test_fetched_values_are_checked_per_block_before_any_seal(make_tier) -> None:
    """verify_staged, the check every fetched block passes (two ranks, no
    Mooncake): only a whole value whose header names its key, marks every
    rank ready and whose ranks' bytes all match their checksums is sealed;
    each other block is its miss (gone, error, corrupt) and its slot's
    header is left as it was, whatever its neighbours in the batch are."""
    import ctypes

    ranks, rank_bytes = 2, 8192
    src = make_tier(4096 * 4 + 12 * (2 * rank_bytes + 128), rank_bytes, ranks)
    dst = DramTier.create(src.path + "-dst", 4096 * 4 + 12 * (2 * rank_bytes + 128), rank_bytes, ranks)
    try:
        keys = [block_key(30, i) for i in range(10)]
        for i, key in enumerate(keys):  # the values as the writer's arena holds them, every rank sealed
            for r in range(ranks):
                src.rank_view(i, r).numpy()[:] = block_bytes(30, i, r, rank_bytes)
                src.seal(i, key, r, checksum(src.rank_view(i, r), key))
        value = HEADER_BYTES + dst.slot_stride
        got = [value] * 10
        got[1] = -704  # OBJECT_NOT_FOUND: evicted since the lookup
        got[2] = -1  # the transfer failed
        got[3] = value - 4096  # short: a value of another geometry or cut off
        staging = bytearray(10 * HEADER_BYTES)
        for i in range(10):
            staging[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] = ctypes.string_at(src.header_address(i), HEADER_BYTES)
            dst.slot_buffer(i)[:] = src.slot_buffer(i)
        dst.rank_view(4, 1).numpy()[rank_bytes - 1] ^= 0x01  # a flipped byte in the last rank's last byte
        # Block 5: another key's value (header and bytes, checksums seeded with that key) under this name.
        staging[5 * HEADER_BYTES : 6 * HEADER_BYTES] = staging[7 * HEADER_BYTES : 8 * HEADER_BYTES]
        dst.slot_buffer(5)[:] = src.slot_buffer(7)
        # Block 8: its own header, but its bytes checksummed under another key (a foreign seed).
        other = block_key(31, 0)
        h = np.frombuffer(staging, dtype=HEADER_DTYPE, count=10)
        h["checksum"][8, :ranks] = [checksum(dst.rank_view(8, r), other) for r in range(ranks)]
        h["ready"][6, 1] = 0  # block 6: its checksums right, rank 1 not marked ready (a torn seal)
        # Block 9: bytes and checksums right for its key, but a header that names another key.
        h["key"][9] = np.void(other)
        before = [ctypes.string_at(dst.header_address(i), HEADER_BYTES) for i in range(10)]

        out = verify_staged(dst, staging, keys, list(range(10)), got, value)

        O, G, E, C = Fetched.OK, Fetched.GONE, Fetched.ERROR, Fetched.CORRUPT
        assert out == [O, G, E, C, C, C, C, O, C, C]
        for i, key in enumerate(keys):
            if out[i] is O:
                assert dst.is_sealed(i, key) and all(dst.verify(i, key, r) for r in range(ranks))
                sealed = np.frombuffer(ctypes.string_at(dst.header_address(i), HEADER_BYTES), dtype=HEADER_DTYPE)
                assert sealed["published"][0] == 0  # the index publishes it, not the fetch
            else:
                assert ctypes.string_at(dst.header_address(i), HEADER_BYTES) == before[i]
                assert not dst.is_sealed(i, key)
        # A batch of blocks all good (headers staged in the call's order); and one of none.
        two = staging[:HEADER_BYTES] + staging[7 * HEADER_BYTES : 8 * HEADER_BYTES]
        ok = verify_staged(dst, two, [keys[0], keys[7]], [0, 7], [value, value], value)
        assert ok == [O, O]
        assert verify_staged(dst, staging, [], [], [], value) == []
    finally:
        dst.close()


def _connects(client: MooncakeTier) -> bool:
    from kvtier.errors import ClusterError

    try:
        client.connect()
        return True
    except ClusterError:
        return False


def test_store_without_cluster_has_no_cluster_counters(make_tier) -> None:
    tier = make_tier(4096 * 4 + 8 * (RANK_BYTES + 128), RANK_BYTES)
    store = TieredStore(tier, 99, 90)
    try:
        assert store.cluster is None
        assert not any(k.startswith("cluster_") for k in store.counters())
        assert store.probe([block_key(1, 0)]).remote == 0
        assert store.promote([block_key(1, 0)]) == 0
        assert EntryState.READY  # the enum is unchanged by the cluster tier
    finally:
        store.close()


def test_publish_on_evict_sends_blocks_as_they_leave_dram(make_tier, cluster_cfg: ClusterConfig,
                                                          master: MasterSupervisor) -> None:
    """kvtier.cluster.publish = evict: nothing is published on save; a block
    DRAM eviction picks is published first and freed by a later eviction."""
    tier = make_tier(4096 * 4 + 8 * (RANK_BYTES + 128), RANK_BYTES)  # 8 slots: high mark 7, low 4
    store = TieredStore(tier, 90, 50, cluster=MooncakeTier(cluster_cfg, tier), publish_on_evict=True)
    try:
        wait_for(lambda: store.cluster.up, what="the cluster to be reachable")

        def save(keys: list[bytes], step: int) -> None:
            save_blocks(store, keys, step, seed=20, start=step * 10)

        first = [block_key(20, i) for i in range(6)]
        save(first, 0)
        store.wait_idle(30)
        assert store.counters()["cluster_published"] == 0  # not on save
        save([block_key(21, i) for i in range(3)], 1)  # past the high mark: eviction starts
        store.wait_idle(30)
        assert store.counters()["cluster_published"] >= 1
        assert store.cluster.remote.exists(first[:1]) == [True]  # the coldest went first
        save([block_key(22, i) for i in range(3)], 2)  # the next eviction frees what was published
        store.wait_idle(30)
        assert not store.contains(first[0])
    finally:
        store.close()


@own_master  # the module's master has segments other tests' nodes lend it
def test_blocks_whose_put_failed_are_evicted_not_published_again(make_tier, cluster_cfg: ClusterConfig,
                                                                  master: MasterSupervisor) -> None:
    """kvtier.cluster.publish = evict with a cluster that is up but takes no
    block (no node lends it memory): each victim is tried once, then
    evicted as a plain block; DRAM keeps making room for saves."""
    cfg = replace(cluster_cfg, segment_bytes=0)
    tier = make_tier(4096 * 4 + 8 * (RANK_BYTES + 128), RANK_BYTES)  # 8 slots: high mark 7, low 4
    store = TieredStore(tier, 90, 50, cluster=MooncakeTier(cfg, tier), publish_on_evict=True)
    try:
        wait_for(lambda: store.cluster.up, what="the cluster to be reachable")
        placed = []
        for step in range(8):
            slots = save_blocks(store, [block_key(40 + step, i) for i in range(3)], step, seed=40, start=step * 10)
            placed.append(sum(x is not None for x in slots))
            store.wait_idle(30)
        c = store.counters()
        assert c["cluster_published"] == 0 and c["cluster_publish_failures"] > 0
        assert c["evictions"] > 0
        assert placed[-3:] == [3, 3, 3]  # every save found its slots
    finally:
        store.close()


def test_blocks_leaving_dram_unpublished_are_counted(make_tier) -> None:
    """kvtier.cluster.publish = evict with the cluster unreachable: no block
    can be published on its way out, and each one that leaves DRAM is
    counted as skipped (the cluster tier is missing it), none silently."""
    cfg = ClusterConfig(master_port=free_port(), master_metrics_port=free_port(), segment_bytes=0)  # no master
    tier = make_tier(4096 * 4 + 8 * (RANK_BYTES + 128), RANK_BYTES)  # 8 slots: high mark 7, low 4
    store = TieredStore(tier, 90, 50, cluster=MooncakeTier(cfg, tier), publish_on_evict=True,
                        cluster_timeout_s=0.5)
    try:
        assert not store.cluster.up
        for step in range(3):
            save_blocks(store, [block_key(30 + step, i) for i in range(3)], step, seed=30, start=step * 10)
        store.wait_idle(30)
        c = store.counters()
        assert c["evictions"] > 0
        assert c["cluster_published"] == 0
        assert c["cluster_publish_skipped"] == c["evictions"]
    finally:
        store.close()
