"""Cluster lookups against a master that answers its health check but is
slow to answer lookups: one lookup waits its timeout, the next ones answer
"not in the cluster" at once instead of queueing behind it.

The remote stands in for the network peer (Mooncake's client), the only
part faked: its lookup blocks until the test lets it go.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from kvtier.store import TieredStore
from kvtier.tools.server import poll_until
from tests.unit.helpers import store_on_remote


class SlowMaster:
    connected = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0
        self.busy = False
        self.closed_under_a_call = False
        self.closed = False

    def connect(self) -> None:
        pass

    def healthy(self) -> bool:
        return True  # Mooncake's health check reads a cached ping

    def exists(self, keys: list[bytes]) -> list[bool]:
        self.calls += 1
        self.busy = True
        self.release.wait(60)
        self.busy = False
        return [False] * len(keys)

    def capacity(self) -> int | None:
        return None  # no master's metrics to read

    def holds_mark(self) -> bool:
        return True  # the node's mark, asked with each health check: answered at once here

    def put_mark(self) -> bool:
        return True

    def fetch(self, keys, slots):  # noqa: ANN001, ANN201
        return []

    def publish(self, keys, slots):  # noqa: ANN001, ANN201
        return [False] * len(keys)

    def close(self) -> None:
        self.closed = True
        self.closed_under_a_call = self.busy


@pytest.fixture
def slow(make_tier) -> Iterator[tuple[TieredStore, SlowMaster]]:
    """A store on a cluster whose master is up and whose lookups hang until released."""
    remote = SlowMaster()
    with store_on_remote(make_tier(4096 * 4 + 16 * (4096 + 128), 4096), remote, remote.release.set,
                         cluster_timeout_s=0.2) as store:
        yield store, remote


def test_lookups_do_not_queue_behind_one_stuck_on_the_cluster(slow: tuple[TieredStore, SlowMaster]) -> None:
    store, remote = slow
    for _ in range(10):
        # The health check says "up" again right after each timeout.
        assert poll_until(lambda: store.cluster.up, 10)
        assert store.probe([os.urandom(16)]).total == 0
    assert poll_until(lambda: remote.busy, 10)
    assert remote.calls == 1 and store.counters()["cluster_down"] >= 1
    # The master answers again: the next lookup is the second one it
    # gets; the nine made while the first was stuck were never sent (they
    # would have queued behind it, each waiting its own timeout).
    remote.release.set()
    assert poll_until(lambda: store.cluster._asking[0].done(), 10)
    store.cluster.timeout_s = 30  # the next lookup is answered, however late its thread runs
    assert poll_until(lambda: store.cluster.up, 10)
    assert store.probe([os.urandom(16)]).total == 0
    assert remote.calls == 2


def test_the_client_is_not_closed_under_a_lookup_still_running(slow: tuple[TieredStore, SlowMaster]) -> None:
    store, remote = slow
    assert store.probe([os.urandom(16)]).total == 0  # timed out; the call still runs
    assert poll_until(lambda: remote.busy, 10)  # running, not queued (close would cancel a queued one)
    store.close()
    assert not remote.closed and not remote.closed_under_a_call


def test_the_client_is_closed_when_no_call_runs(slow: tuple[TieredStore, SlowMaster]) -> None:
    store, remote = slow
    store.close()
    assert remote.closed and not remote.closed_under_a_call
