"""Helpers shared by several test modules (fixtures shared by the unit tests are in conftest.py).

* :func:`wait_for`: poll a condition up to a deadline (a bound against hangs, not a timing assert);
* :func:`freeze`: SIGSTOP a process and wait until every thread of it has stopped;
* :class:`FakeRequest`, :class:`FakeBlocks`: the parts of vLLM's request and
  block objects that the connector's scheduler half reads;
* :class:`JsonLineProcess`: a helper process of a test that answers one JSON
  line per JSON command on its stdin (the cluster tests' nodes and clients);
* :func:`ssd_stores`: a store factory over one DRAM arena and an SSD tier
  opened through a gated I/O stand-in, closed when the fixture ends;
* :func:`pool_save`, :func:`pool_fetched`, :func:`pool_cluster_up`: a node
  pool's client saving blocks as a worker does, fetching as a scheduler
  does, and the pool's /metrics saying it is in the cluster (the cluster
  tests with ``kvtier meta`` processes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from kvtier.pool.client import PoolPlacement
from kvtier.store import TieredStore
from kvtier.tier import DramTier
from kvtier.tier.dram import checksum
from kvtier.tools.server import parse_metrics, poll_until

BLOCK = 4  # tokens per block in the connector's tests


def wait_for(cond: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition",
             interval_s: float = 0.1) -> None:
    """Wait until ``cond()`` holds, checking every ``interval_s``; AssertionError
    naming ``what`` past ``timeout_s``."""
    if not poll_until(cond, timeout_s, interval_s):
        raise AssertionError(f"timed out waiting for {what}")


def freeze(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP ``pid`` and wait until all its threads are stopped: the
    signal is delivered asynchronously, and a thread still running could
    answer a request sent right after kill() returned."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that ended meanwhile
        return bool(states) and all(st in ("T", "t") for st in states)

    wait_for(stopped, timeout_s, f"process {pid} to stop")


@dataclass
class FakeRequest:
    """The fields of vLLM's Request that the scheduler half reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeBlocks:
    ids: list[int] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


class JsonLineProcess:
    """A process of the test's that reads one JSON command per stdin line and
    answers one JSON line on stdout each. Subclasses start ``proc`` (text
    mode, stdin and stdout piped) and name it in ``what`` for the failure
    when it exits."""

    proc: subprocess.Popen
    what = "process"

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the {self.what} exited"
        return json.loads(line)

    def do(self, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self) -> None:
        """SIGKILL and reap it."""
        self.proc.kill()
        self.proc.wait()


class _Gates(Protocol):
    """An SSD I/O stand-in whose reads and writes can be held at a gate."""

    reads: Any  # threading.Event
    writes: Any


@contextlib.contextmanager
def ssd_stores(dram: DramTier, open_ssd: Callable[[], tuple[Any, Any]],
               gates: _Gates) -> Iterator[Callable[..., TieredStore]]:
    """``make(ssd=None, recovered=(), **kwargs)``: a store over ``dram`` and an
    SSD tier (a new one from ``open_ssd`` unless given). DRAM marks default
    to high 80 %, low 50 % and no DRAM watermark. On exit the gates open (a
    held I/O would keep close() waiting) and every store made is closed."""
    stores: list[TieredStore] = []

    def make(ssd=None, recovered=(), **kwargs) -> TieredStore:
        if ssd is None:
            ssd, recovered = open_ssd()
        kwargs = {"high_pct": 80, "low_pct": 50, "dram_watermark_pct": 100, **kwargs}
        store = TieredStore(dram, ssd=ssd, recovered=recovered, **kwargs)
        stores.append(store)
        return store

    try:
        yield make
    finally:
        gates.reads.set()
        gates.writes.set()
        for store in stores:
            store.close()


@contextlib.contextmanager
def store_on_remote(tier: DramTier, remote: Any, release: Callable[[], None],
                    **kwargs: Any) -> Iterator[TieredStore]:
    """A store (DRAM marks 99/90) over ``tier`` whose cluster tier is
    ``remote`` (a stand-in for Mooncake's client), once the cluster counts
    as up; on exit ``release()`` lets any call the remote holds go, then the
    store closes."""
    store = TieredStore(tier, 99, 90, cluster=remote, **kwargs)
    assert poll_until(lambda: store.cluster.up, 10)
    try:
        yield store
    finally:
        release()
        store.close()


def pool_save(c: PoolPlacement, ks: list[bytes], step: int, fill: int) -> None:
    """Save ``ks`` through a node pool's client as a worker does: each slot's
    bytes set to ``fill`` and sealed, then the step completed."""
    slots = c.prepare_save(ks, step)
    assert None not in slots
    tier = DramTier.attach(c.arena_path)
    try:
        for slot, key in zip(slots, ks):
            view = tier.rank_view(slot, 0)
            view.fill_(fill)
            tier.seal(slot, key, 0, checksum(view, key))
    finally:
        tier.close()
    c.complete_step(step)


def pool_fetched(c: PoolPlacement, ks: list[bytes], timeout_s: float = 30) -> int:
    """Look up and promote as the scheduler does, until no block is on its way."""
    deadline = time.monotonic() + timeout_s
    while True:
        p = c.probe(ks)
        if p.total == p.ready or time.monotonic() > deadline:
            return p.ready
        c.promote(ks[p.ready : p.total])
        c.wait_progress(0.05)


def pool_cluster_up(metrics_url: str) -> bool:
    """Whether the node pool serving ``metrics_url`` says it is in the cluster."""
    return parse_metrics(httpx.get(metrics_url + "/metrics", timeout=5).text).get("kvtier_cluster_up", 0) == 1
