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
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.cluster.client import Fetched
from kvtier.store import Probe, TieredStore
from kvtier.tier.ssd import IoOps
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
    assert poll_until(lambda: store.cluster.asking is None, 10)
    store.cluster.timeout_s = 30  # the next lookup is answered, however late its thread runs
    assert poll_until(lambda: store.cluster.up, 10)
    assert store.probe([os.urandom(16)]).total == 0
    assert remote.calls == 2


def test_a_lookup_sent_behind_a_stuck_one_does_not_hide_it(make_tier) -> None:
    """A second lookup sent while the first still ran within its timeout
    queues behind it, times out and is cancelled. Once the cluster counts
    as up again, a third lookup sees the first still running past its
    timeout and answers at once: it is not sent to wait its own timeout
    behind the first, which would mark the cluster down a second time."""
    remote = SlowMaster()
    with store_on_remote(make_tier(4096 * 4 + 16 * (4096 + 128), 4096), remote, remote.release.set,
                         cluster_timeout_s=3.0) as store:
        ask = store.cluster._ask
        sent = []  # lookups handed to the cluster's thread

        def counted_submit(*args):  # noqa: ANN002, ANN202
            sent.append(args)
            return type(ask).submit(ask, *args)
        ask.submit = counted_submit
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(store.probe, [os.urandom(16)])
            assert poll_until(lambda: remote.busy, 10)  # running on the cluster's thread
            second = pool.submit(store.probe, [os.urandom(16)])  # sent within the first's timeout
            assert first.result().total == 0 and second.result().total == 0
        assert len(sent) == 2  # the second was sent, queued behind the first: the case this test is about
        downs = store.counters()["cluster_down"]  # 1, or 2 if it was up again between their timeouts
        assert remote.calls == 1 and downs >= 1
        assert poll_until(lambda: store.cluster.up, 10)  # the health check's cached ping
        assert store.probe([os.urandom(16)]).total == 0
        assert remote.calls == 1 and len(sent) == 2  # not sent
        assert store.counters()["cluster_down"] == downs  # (before: one more, the third lookup timed out too)
        assert store.cluster.up
        assert store.cluster.asking is not None and not store.cluster.asking.done()


def test_the_client_is_not_closed_under_a_lookup_still_running(slow: tuple[TieredStore, SlowMaster]) -> None:
    store, remote = slow
    assert store.probe([os.urandom(16)]).total == 0  # timed out; the call still runs
    assert poll_until(lambda: remote.busy, 10)  # running, not queued (close would cancel a queued one)
    store.close()
    assert not remote.closed and not remote.closed_under_a_call


def test_a_lookup_queued_when_the_store_closes_is_a_plain_miss(make_tier, caplog) -> None:
    """Closing cancels a lookup still queued behind a running one: its
    caller gets a miss, not an error logged as a failed lookup."""
    remote = SlowMaster()
    with store_on_remote(make_tier(4096 * 4 + 16 * (4096 + 128), 4096), remote, remote.release.set,
                         cluster_timeout_s=30) as store:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(store.probe, [os.urandom(16)])
            assert poll_until(lambda: remote.busy, 10)
            second = pool.submit(store.probe, [os.urandom(16)])
            assert poll_until(lambda: len(store.cluster._asked) == 2, 10)  # queued behind the first
            store.cluster.timeout_s = 0.1  # close()'s own wait for the running one
            with caplog.at_level("WARNING", logger="kvtier"):
                store.cluster.close()
                assert second.result().total == 0
            remote.release.set()
            assert first.result().total == 0
    assert "a lookup failed" not in caplog.text


def test_the_client_is_closed_when_no_call_runs(slow: tuple[TieredStore, SlowMaster]) -> None:
    store, remote = slow
    store.close()
    assert remote.closed and not remote.closed_under_a_call


class GarbledMaster(SlowMaster):
    def exists(self, keys: list[bytes]) -> list[bool]:
        raise TypeError("an answer of another shape (a binding of another version)")


def test_a_lookup_that_fails_in_an_unforeseen_way_is_a_miss_and_marks_the_cluster_down(make_tier) -> None:
    remote = GarbledMaster()
    with store_on_remote(make_tier(4096 * 4 + 16 * (4096 + 128), 4096), remote, remote.release.set,
                         cluster_timeout_s=5) as store:
        assert poll_until(lambda: store.cluster.up, 10)
        assert store.probe([os.urandom(16)]).total == 0  # no exception into the scheduler
        assert store.counters()["cluster_down"] >= 1


class HeldFetch(SlowMaster):
    """A master whose lookups find every key and whose fetches wait until released."""

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [True] * len(keys)

    def fetch(self, keys, slots):  # noqa: ANN001, ANN201
        self.release.wait(60)
        return [Fetched.ERROR] * len(keys)


class HeldWrites(IoOps):
    def __init__(self) -> None:
        self.writes = threading.Event()
        self.writes.set()  # the tier's start writes its superblock

    def pwritev(self, fd: int, buffers, offset: int) -> int:  # noqa: ANN001
        assert self.writes.wait(60)
        return super().pwritev(fd, buffers, offset)


def test_a_wait_for_progress_ends_with_a_fetch_while_an_ssd_job_still_runs(make_tier, make_ssd) -> None:
    """With both tiers, the scheduler's wait between lookups waited on the
    SSD mover's jobs alone when it had some: a fetch that ended did not
    wake it, and the request waited out the poll for nothing."""
    io = HeldWrites()
    ssd, _ = make_ssd(8, 4096, io=io)
    remote = HeldFetch()
    with store_on_remote(make_tier(4096 * 4 + 16 * (4096 + 128), 4096), remote, remote.release.set,
                         ssd=ssd) as store:
        io.writes.clear()
        store._mover.invalidate(np.array([0], dtype=np.int64))  # an SSD job, held at the disk
        assert poll_until(lambda: store._mover.busy, 10)
        assert store.promote([bytes(16)]) == 1  # found nowhere in the node: fetched from the cluster
        cond = store._mover._idle
        waiting = threading.Event()
        wait = cond.wait

        def watched(timeout: float | None = None) -> bool:
            waiting.set()  # under the store's lock: the fetch cannot end before the wait begins
            return wait(timeout)

        cond.wait = watched  # type: ignore[method-assign]
        waiter = threading.Thread(target=store.wait_progress, args=(60.0,), daemon=True)
        waiter.start()
        assert waiting.wait(30)
        remote.release.set()  # the fetch ends; the SSD write is still held
        waiter.join(30)
        assert not waiter.is_alive() and store._mover.busy
        io.writes.set()
        assert store.wait_idle(30)


def test_a_fetch_stalled_past_its_limit_is_a_miss_to_lookups_until_it_ends(make_tier,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer stopped mid-transfer: Mooncake's call does not return. Once
    the fetch has run past its limit (stale_move_s), lookups stop before its block (a
    request would otherwise wait out promote_timeout_s, and so would every
    later one with the prefix), and the cluster is not asked for it again;
    its DRAM slot stays taken until the call returns."""
    remote = HeldFetch()
    with store_on_remote(make_tier(4096 * 4 + 16 * (4096 + 128), 4096), remote, remote.release.set) as store:
        key = os.urandom(16)
        assert store.probe([key]) == Probe(0, 1, 1)  # in the cluster only
        assert store.promote([key]) == 1
        assert store.probe([key]) == Probe(0, 1)  # on its way
        used = store.counters()["dram_slots_used"]
        monkeypatch.setattr(store, "stale_move_s", -1.0)  # every move running counts as stalled
        assert store.probe([key]) == Probe(0, 0)
        assert store.promote([key]) == 0
        c = store.counters()
        assert c["moves_stalled"] == 1 and c["dram_slots_used"] == used
        remote.release.set()  # the call returns (an error): the slot is freed, the block a miss
        assert poll_until(lambda: store.counters()["cluster_fetch_errors"] == 1, 10)
        assert store.counters()["dram_slots_used"] == used - 1
