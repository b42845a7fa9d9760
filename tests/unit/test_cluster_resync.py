"""Publishing again what a restarted master lost, against a cluster whose
puts the test holds back: a resync does not starve fresh saves, starts when
the cluster comes back after an outage, and a store closed in the middle of
one leaves no pin behind; blocks moving to and from the cluster are
counted until their moves end.

The remote stands in for the network peer (Mooncake's client), the only
part faked: it holds what was put, answers for this node's mark, and lets
puts through only while its gate is open (gets likewise, with a gate of
their own, each failing). The store, its movers and the
arena are real.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.cluster.client import Fetched
from kvtier.store import Moving, TieredStore
from kvtier.tier.dram import checksum
from kvtier.tools.server import poll_until
from tests.unit.helpers import store_on_remote

RANK_BYTES = 4096


class GatedMaster:
    connected = True

    def __init__(self) -> None:
        self.held: set[bytes] = set()  # what the cluster holds
        self.mark = False
        self.up = True
        self.gate = threading.Event()
        self.gate.set()
        self.in_put = 0
        self.fetch_gate = threading.Event()
        self.fetch_gate.set()
        self.in_fetch = 0

    def connect(self) -> None:
        pass

    def healthy(self) -> bool:
        return self.up

    def capacity(self) -> int | None:
        return None  # no master's metrics to read

    def holds_mark(self) -> bool:
        return self.mark

    def put_mark(self) -> bool:
        self.mark = True
        return True

    def exists(self, keys):  # noqa: ANN001, ANN201
        return [k in self.held for k in keys]

    def fetch(self, keys, slots):  # noqa: ANN001, ANN201
        self.in_fetch += 1
        self.fetch_gate.wait(30)
        self.in_fetch -= 1
        return [Fetched.ERROR] * len(keys)  # (the transfer itself is Mooncake's: not faked here)

    def publish(self, keys, slots):  # noqa: ANN001, ANN201
        self.in_put += 1
        self.gate.wait(30)
        self.in_put -= 1
        self.held.update(keys)
        return [True] * len(keys)

    def restart(self) -> None:
        """A master restarted: empty, the node's mark gone with the rest."""
        self.held.clear()
        self.mark = False

    def close(self) -> None:
        pass


@pytest.fixture
def node(make_tier, capacity_for) -> Iterator[tuple[TieredStore, GatedMaster]]:
    remote = GatedMaster()
    with store_on_remote(make_tier(capacity_for(32, RANK_BYTES), RANK_BYTES), remote,
                         lambda: (remote.gate.set(), remote.fetch_gate.set()),
                         cluster_queue_blocks=2, cluster_timeout_s=0.5) as store:
        yield store, remote


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def save(store: TieredStore, keys: list[bytes], step: int) -> None:
    tier = store.tier
    slots = store.prepare_save(keys, step)
    for k, slot in zip(keys, slots):
        assert slot is not None
        view = tier.rank_view(slot, 0)
        view.numpy()[:] = np.frombuffer(k * (RANK_BYTES // 16), dtype=np.uint8)
        tier.seal(slot, k, 0, checksum(view, k))
    store.complete_step(step)


def save_published(store: TieredStore, remote: GatedMaster, keys: list[bytes]) -> None:
    """Save ``keys`` two at a time (the publishing room), each pair published before the next."""
    for i in range(0, len(keys), 2):
        save(store, keys[i : i + 2], 100 + i)
        done = set(keys[: i + 2])
        assert poll_until(lambda: done <= remote.held and store.cluster.publishing == 0, 10)


def check_now(store: TieredStore) -> None:
    store.cluster._wake.set()  # the health thread's next check, now rather than in a second


def start_resync(store: TieredStore, remote: GatedMaster) -> list[bytes]:
    """Six blocks published, then the master restarted: the node publishes
    them again, its puts held at the gate. Returns their keys."""
    old = [key(i) for i in range(6)]
    save_published(store, remote, old)
    remote.gate.clear()
    remote.restart()
    check_now(store)
    assert poll_until(lambda: remote.in_put > 0, 10)  # the resync holds the publishing room
    return old


def test_saves_made_during_a_resync_reach_the_cluster(node: tuple[TieredStore, GatedMaster]) -> None:
    store, remote = node
    old = start_resync(store, remote)
    fresh = [key(100 + i) for i in range(3)]
    save(store, fresh, 1000)
    remote.gate.set()
    assert poll_until(lambda: remote.held >= set(old) | set(fresh), 10), remote.held
    c = store.counters()
    assert c["cluster_lost"] == 1 and c["cluster_publish_skipped"] == 0


def test_a_resync_starts_when_the_cluster_comes_back(node: tuple[TieredStore, GatedMaster]) -> None:
    store, remote = node
    old = [key(i) for i in range(4)]
    save_published(store, remote, old)
    remote.up = False
    check_now(store)
    assert poll_until(lambda: (check_now(store), not store.cluster.up)[1], 10)
    remote.restart()
    remote.up = True
    # Nothing else is saved: the node publishes again on its own.
    assert poll_until(lambda: (check_now(store), remote.held == set(old))[1], 15)


def test_closing_in_the_middle_of_a_resync_leaves_no_pin(node: tuple[TieredStore, GatedMaster]) -> None:
    store, remote = node
    old = start_resync(store, remote)
    threading.Timer(0.3, remote.gate.set).start()
    store.close()  # waits for the puts in flight; no new one may start
    assert store.cluster.publishing == 0
    assert all(store._entries[k].pins == 0 for k in old)


def test_moves_to_and_from_the_cluster_are_counted_until_they_end(node: tuple[TieredStore, GatedMaster]) -> None:
    store, remote = node
    assert store.moving() == Moving()
    remote.gate.clear()
    save(store, [key(1), key(2)], 1)  # published once saved, the puts held at the gate
    assert poll_until(lambda: remote.in_put > 0, 10)
    moving = store.moving()
    assert moving.to_cluster == 2 and moving.jobs >= 1
    assert store.counters()["blocks_moving_to_cluster"] == 2
    remote.gate.set()
    assert poll_until(lambda: store.moving() == Moving(), 10), store.moving()
    assert {key(1), key(2)} <= remote.held
    # Blocks another node published: fetched into DRAM, the gets held.
    theirs = [key(50), key(51)]
    remote.held.update(theirs)
    remote.fetch_gate.clear()
    assert store.probe(theirs).remote == 2
    assert store.promote(theirs) == 2
    assert poll_until(lambda: remote.in_fetch > 0, 10)
    moving = store.moving()
    assert moving.from_cluster == 2 and moving.to_cluster == 0 and moving.jobs >= 1
    assert store.counters()["blocks_moving_from_cluster"] == 2
    remote.fetch_gate.set()
    assert poll_until(lambda: store.moving() == Moving(), 10), store.moving()
    c = store.counters()
    assert c["cluster_fetch_errors"] == 2 and (c["blocks_moving_to_cluster"], c["blocks_moving_from_cluster"]) == (0, 0)
