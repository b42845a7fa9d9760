"""The meta service and its clients over real sockets on 127.0.0.1.

The service runs in this process (its own threads); clients are
:class:`PoolPlacement` objects, as in a vLLM scheduler, or raw sockets
where a test needs to break the protocol. Workers are played by mapping
the service's arena and sealing slots, as connector/worker.py does.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from kvtier.config import KvtierConfig
from kvtier.keys import KeyRun
from kvtier.pool import http as pool_http
from kvtier.pool import service as pool_service
from kvtier.pool import client as client_module
from kvtier.pool import wire
from kvtier.pool.client import PoolPlacement, PoolRefused
from kvtier.pool.http import PoolHttp
from kvtier import store as store_module
from kvtier.pool.service import MetaService, ServiceOptions
from kvtier.store import Probe
from kvtier.tier.dram import DramTier, checksum
from kvtier.tools.server import poll_until

RANK_BYTES = 4096


def keys(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def start(tmp_path: Path, **kw: object) -> MetaService:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    store = KvtierConfig(dram_size_bytes=64 * (RANK_BYTES + 4096), shm_dir=str(shm))
    opts = dict(url="tcp://127.0.0.1:0", store=store, lease_ttl_ms=10_000, slot_grace_ms=500)
    opts.update(kw)
    svc = MetaService(ServiceOptions(**opts))  # type: ignore[arg-type]
    svc.start()
    return svc


@pytest.fixture
def service(tmp_path: Path) -> Iterator[MetaService]:
    svc = start(tmp_path)
    yield svc
    svc.stop()


_clients: list[PoolPlacement] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Every client a test made is shut down after it: a client left open
    keeps reconnecting to its address, and a later test's service that is
    given the same port would take it for an instance (and the geometry of
    its blocks for the pool's)."""
    yield
    while _clients:
        _clients.pop().shutdown()


def client(svc: MetaService, **kw: object) -> PoolPlacement:
    opts: dict = dict(ranks=1, rank_bytes=RANK_BYTES, name="test")
    opts.update(kw)
    c = PoolPlacement(svc.address, **opts)
    _clients.append(c)
    return c


def write_blocks(arena: str, slots: list[int | None], ks: list[bytes], fill: int) -> None:
    """What a worker does for a save: copy its part into the slot, seal it."""
    tier = DramTier.attach(arena)
    try:
        for slot, key in zip(slots, ks):
            assert slot is not None
            view = tier.rank_view(slot, 0)
            view.fill_(fill)
            tier.seal(slot, key, 0, checksum(view, key))
    finally:
        tier.close()


def save(c: PoolPlacement, ks: list[bytes], step: int, fill: int = 7) -> list[int | None]:
    slots = c.prepare_save(ks, step)
    assert slots.placed == len(ks) and None not in slots
    write_blocks(c.arena_path, list(slots), ks, fill)
    c.complete_step(step)
    c.flush()  # complete_step does not wait for the service: other sessions see the blocks after this
    return list(slots)


def test_a_reply_trickled_slower_than_the_timeout_is_a_miss_not_a_stall(make_tier) -> None:
    """Each read's timeout restarted by every byte: a service that answered
    a byte at a time held the engine's call for as long as it liked."""
    tier = make_tier(8 * (RANK_BYTES + 4096), RANK_BYTES)
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            assert isinstance(wire.decode_client(wire.recv_frame(conn)), wire.Hello)
            conn.sendall(wire.encode(wire.Welcome(wire.PROTOCOL_VERSION, 1, tier.path, tier.num_slots, 10_000,
                                                  False, "", "")))
            while not done.is_set():
                body = wire.recv_frame(conn)
                if body is None:
                    return
                msg = wire.decode_client(body)
                if isinstance(msg, wire.Probe):
                    for byte in wire.encode(wire.ProbeReply(msg.id, 1, 1, 0)):
                        if done.wait(0.2):
                            return
                        try:
                            conn.sendall(bytes([byte]))
                        except OSError:
                            return

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = PoolPlacement(f"tcp://127.0.0.1:{listener.getsockname()[1]}", ranks=1, rank_bytes=RANK_BYTES, name="t",
                      timeout_s=0.5)
    _clients.append(c)
    try:
        assert c.probe(keys(70, 1)) == Probe(0, 0)  # a miss: the answer did not come whole in time
        assert c.stalls == 1
    finally:
        done.set()
        c.shutdown()
        listener.close()
        t.join(10)


class _SlowReplies:
    """The client's socket, its reads delayed by ``delay_s`` while ``slow``
    (a service slow to answer), each send's timeout recorded."""

    def __init__(self, sock: socket.socket, delay_s: float) -> None:
        self._s, self.delay_s, self.slow, self.send_timeouts = sock, delay_s, False, []

    def recv(self, *args: object) -> bytes:
        if self.slow:
            self.slow = False
            time.sleep(self.delay_s)
        return self._s.recv(*args)  # type: ignore[arg-type]

    def sendall(self, data: bytes) -> None:
        self.send_timeouts.append(self._s.gettimeout())
        self._s.sendall(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self._s, name)


def test_a_slow_answer_does_not_shorten_the_next_call_s_send(service: MetaService) -> None:
    """The socket kept what was left of the last answer's deadline as its
    timeout: a send right after an answer that took most of timeout_s had
    a fraction of it, and a briefly full buffer dropped the session (its
    pins and saves with it)."""
    c = client(service, timeout_s=1.0)
    assert c.probe(keys(71, 1)) == Probe(0, 0)
    slow = _SlowReplies(c._sock, delay_s=0.8)  # type: ignore[arg-type]
    c._sock = slow  # type: ignore[assignment]
    slow.slow = True
    assert c.probe(keys(71, 1)) == Probe(0, 0)  # answered within its timeout, late
    assert c.probe(keys(72, 1)) == Probe(0, 0)
    assert c.stalls == 0 and len(slow.send_timeouts) == 2
    assert slow.send_timeouts[1] > 0.5  # the next call's whole budget, not the 0.2 s the last one left


def test_a_block_saved_by_one_instance_is_found_and_pinned_by_another(service: MetaService) -> None:
    a, b = client(service, name="a"), client(service, name="b")
    ks = keys(1, 5)
    slots = save(a, ks, step=1)
    assert b.arena_path == a.arena_path and a.session != b.session
    assert b.probe(ks).ready == 5
    assert b.pin(ks, step=1) == slots
    tier = DramTier.attach(b.arena_path)
    assert all(tier.verify(s, k, 0) for s, k in zip(slots, ks))
    tier.close()
    b.complete_step(1)
    b.flush()
    assert service.accounting()["pins"] == 0
    a.shutdown()
    b.shutdown()


def test_a_run_all_in_dram_is_counted_in_the_shared_index_and_told_to_the_service(
        service: MetaService, monkeypatch: pytest.MonkeyPatch) -> None:
    # The instance reads the service's ready index (pool/readymap.py): a
    # run plain READY in DRAM from the first key to the last needs no call;
    # the service is told (a Touch, never answered) and counts it as a lookup.
    a, b = client(service, name="a"), client(service, name="b")
    ks = keys(2, 6)
    monkeypatch.setattr(store_module, "READY_LAG_S", 3600.0)  # saves reach the shared index late: by call
    save(a, ks, step=1)
    assert b.probe(ks) == Probe(6, 6) and b.mapped_lookups == 0
    monkeypatch.setattr(store_module, "READY_LAG_S", 0.0)  # with the next call settled
    save(a, keys(4, 1), step=2)
    sent = b._next_id
    assert b.probe(ks) == Probe(6, 6) and b.probe(ks) == Probe(6, 6)
    # Nothing sent yet: the lookups are told with the next call, the same
    # run's two as one Touch (two lookups), never answered.
    assert b.mapped_lookups == 2 and b._next_id == sent and not b._unanswered
    assert service.lookups_by_instance()["b"][:2] == (6, 6)
    assert b.flush()  # the Touch, then the Ping, in one send: the Ping's answer is the next one read
    assert b._next_id == sent + 2 and not b._unanswered
    assert service.lookups_by_instance()["b"][:2] == (18, 18)  # keys asked, found in DRAM (three lookups)
    # A last key the index does not hold: the run stops before it, and the
    # whole lookup is the service's (counted here first, it cost more).
    assert b.probe(ks + keys(3, 2)) == Probe(6, 6)
    assert b.mapped_lookups == 2 and b.mapped_heads == 0
    assert service.lookups_by_instance()["b"][:2] == (26, 24)
    # A block that left is not counted by the next lookup, wherever it is made.
    assert a.discard([ks[3]]) == 1
    assert a.flush()  # answered once the discard's bookkeeping is done (a lookup before it: its pin fails)
    # The last key held, one before it not: the rest is the service's to
    # count, told the head's slots (one lookup).
    assert b.probe(ks).ready == 3 and b.mapped_lookups == 2 and b.mapped_heads == 1
    assert b.flush()
    assert service.lookups_by_instance()["b"][:2] == (32, 27)
    assert b.probe(ks[:3]) == Probe(3, 3) and b.mapped_lookups == 3
    c = client(service, name="c", map_ready=False)
    assert c.probe(ks[:3]) == Probe(3, 3) and c.mapped_lookups == 0


def test_lookups_held_past_their_time_or_count_go_with_the_next_lookup(
        service: MetaService, monkeypatch: pytest.MonkeyPatch) -> None:
    # With no other call, the Touches held are sent by a lookup once the
    # first has waited TOUCH_HOLD_S, or once TOUCH_RUNS runs are held.
    a, b = client(service, name="a"), client(service, name="b")
    runs = [keys(300 + i, 4) for i in range(3)]
    for i, ks in enumerate(runs):
        save(a, ks, step=1 + i)
    service.store.refresh()
    monkeypatch.setattr(client_module, "TOUCH_RUNS", 3)
    sent = b._next_id
    assert b.probe(runs[0]) == Probe(4, 4) and b.probe(runs[1]) == Probe(4, 4) and b._next_id == sent
    assert b.probe(runs[2]) == Probe(4, 4) and b._next_id == sent + 3  # the third run held: all three sent
    assert b.flush()
    assert service.lookups_by_instance()["b"][:2] == (12, 12)
    monkeypatch.setattr(client_module, "TOUCH_RUNS", 8)
    monkeypatch.setattr(client_module, "TOUCH_HOLD_S", 0.0)
    assert b.probe(runs[0]) == Probe(4, 4) and b._next_id == sent + 5  # due at once
    assert b.flush()
    assert service.lookups_by_instance()["b"][:2] == (16, 16)
    assert b.mapped_lookups == 4


def test_a_block_evicted_by_a_save_is_not_counted_from_the_shared_index(service: MetaService) -> None:
    # Evictions happen in another instance's PrepareSave: the service takes
    # them out of the shared index once that call is answered, not at the
    # step's completion (which may be a forward pass away).
    a, b = client(service, name="a"), client(service, name="b")
    old = keys(40, 20)
    save(a, old, step=1)
    service.store.refresh()  # the blocks made READY into the shared index now, not within READY_LAG_S
    assert b.probe(old) == Probe(20, 20) and b.mapped_lookups == 1
    step = 2
    while all(map(service.store.contains, old)) and step < 20:
        a.prepare_save(keys(200 + step, 8), step)  # never completed: PENDING, not evictable
        step += 1
    assert a.flush()  # answered after the last PrepareSave's bookkeeping
    held = 0
    while held < len(old) and service.store.contains(old[held]):
        held += 1
    assert held < len(old), "the pool never evicted"
    assert b.probe(old).ready == held


@pytest.mark.parametrize("how", ["counted-in-the-shared-index", "head-counted-there", "by-call"])
def test_a_prefix_another_instance_looked_up_outlives_newer_blocks_under_pressure(
        service: MetaService, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    # The service answers a probe before it refreshes the run's recency: the
    # refresh must still happen, before the session's next call. A run the
    # instance counted in the shared index is refreshed from its Touch, or
    # from the slots sent with the lookup of the rest.
    monkeypatch.setattr(store_module, "READY_LAG_S", 0.0)
    a, b = client(service, name="a"), client(service, name="b", map_ready=how != "by-call")
    old, newer = keys(30, 20), keys(31, 20)
    save(a, old, step=1)
    save(a, newer, step=2)
    assert b.probe(old + (keys(32, 1) + newer[:1] if how == "head-counted-there" else [])).ready == 20
    assert (b.mapped_lookups, b.mapped_heads) == {"counted-in-the-shared-index": (1, 0), "head-counted-there": (0, 1),
                                                  "by-call": (0, 0)}[how]
    b.flush()  # a call after the probe on the same connection: answered once the refresh is done
    step = 3
    while all(map(service.store.contains, newer)) and step < 40:  # fill until the pool evicts
        save(a, keys(100 + step, 4), step=step)
        step += 1
    assert not all(map(service.store.contains, newer)), "the pool never evicted"
    assert b.probe(old).ready == 20


def test_the_service_keeps_its_arena_warm_at_the_configured_interval(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    store = KvtierConfig(dram_size_bytes=64 * (RANK_BYTES + 4096), shm_dir=str(shm), kv_warm_interval_s=30)
    svc = MetaService(ServiceOptions(url="tcp://127.0.0.1:0", store=store))
    svc.start()
    try:
        client(svc).probe(keys(1, 1))  # the first instance's hello makes the pool
        warmer = svc.store.tier._warmer
        assert warmer is not None and warmer.interval_s == 30 and warmer.bytes == svc.store.tier.mapped_range[1]
    finally:
        svc.stop()
    assert not warmer._thread.is_alive()


def test_step_numbers_of_two_instances_never_settle_each_other(service: MetaService) -> None:
    a, b = client(service), client(service)
    ks = keys(2, 4)
    save(a, ks, step=3)
    assert a.pin(ks[:2], step=7) != [None, None]
    # b's step 7 (and everything below it) completes: a's pins of its own step 7 hold.
    b.complete_step(7)
    b.flush()
    assert service.accounting()["pins"] == 2
    pending = b.prepare_save(keys(3, 2), step=7)
    a.complete_step(9)  # a's steps settle; b's pending saves stay unreadable
    a.flush()
    acc = service.accounting()
    assert (acc["pins"], acc["pending"], acc["unsettled_entries"]) == (0, 2, 2)
    assert a.probe(keys(3, 2)).ready == 0
    write_blocks(b.arena_path, list(pending), keys(3, 2), 1)
    b.complete_step(7)
    b.flush()
    assert a.probe(keys(3, 2)).ready == 2


def test_a_move_stalls_only_after_the_longest_wait_of_a_live_instance(tmp_path: Path) -> None:
    """Each instance tells the service how long its scheduler waits for a
    move into DRAM (promote_timeout_s): lookups keep counting a move that
    long before taking it for stalled, for the instance that waits longest;
    the service's own promote_timeout_s and 5 s are the floor."""
    service = start(tmp_path, store=KvtierConfig(dram_size_bytes=64 * (RANK_BYTES + 4096),
                                                  shm_dir=str(tmp_path), promote_timeout_s=7))
    try:
        patient = client(service, name="patient", promote_timeout_s=20)
        quick = client(service, name="quick", promote_timeout_s=1)
        assert patient.probe(keys(1, 1)).total == quick.probe(keys(1, 1)).total == 0
        assert service.store.stale_move_s == 20
        patient.shutdown()
        assert poll_until(lambda: [s.name for s in service.sessions()] == ["quick"], 10)
        assert service.store.stale_move_s == 7  # the service's own, over the quick one's 1 s
        later = client(service, name="later", promote_timeout_s=12.5)
        assert later.probe(keys(1, 1)).total == 0
        assert service.store.stale_move_s == 12.5
    finally:
        service.stop()


def test_a_dead_instance_gives_back_its_pins_and_unwritten_slots(tmp_path: Path) -> None:
    # A grace of 3 s: the slots are seen held before it ends, however late
    # this thread looks.
    service = start(tmp_path, slot_grace_ms=3000)
    try:
        a, b = client(service), client(service)
        ks = keys(4, 6)
        save(b, ks, step=1)
        free_before = service.accounting()["free"]
        assert None not in a.pin(ks, step=1)
        assert None not in a.prepare_save(keys(5, 3), step=1)
        acc = service.accounting()
        assert (acc["pins"], acc["pending"], acc["free"]) == (6, 3, free_before - 3)
        a._closed.set()  # the process is gone: its socket closes, nothing more is said
        a._sock.close()  # type: ignore[union-attr]
        assert poll_until(lambda: len(service.sessions()) == 1, 10)
        acc = service.accounting()
        # Its 3 unwritten slots are held for the grace period (its workers may
        # still write into them), then free again.
        assert (acc["pins"], acc["pending"], acc["held"], acc["free"]) == (0, 0, 3, free_before - 3)
        assert (acc["pinned_entries"], acc["unsettled_entries"]) == (0, 0)
        assert acc["free"] + acc["held"] + acc["used"] == acc["total"]
        deadline = time.monotonic() + 20
        while service.accounting()["held"] and time.monotonic() < deadline:
            time.sleep(0.05)
        acc = service.accounting()
        assert (acc["held"], acc["free"]) == (0, free_before)
        assert b.probe(ks).ready == 6  # the other instance's blocks are untouched
        assert b.probe(keys(5, 3)).total == 0  # the dead one's unwritten saves never appear
    finally:
        service.stop()


def test_a_gone_instance_is_listed_until_its_holds_are_released(service: MetaService, monkeypatch) -> None:
    """/health lists a client while the pool still holds something for it:
    one seen gone has nothing left pinned or unsettled (a check read
    between the two used to see one client and unsettled slots)."""
    a, b = client(service, name="a"), client(service, name="b")
    save(b, keys(6, 2), step=1)
    assert None not in a.pin(keys(6, 2), step=1)
    assert None not in a.prepare_save(keys(7, 3), step=1)
    entered, gate = threading.Event(), threading.Event()
    release = service.store.end_session

    def slow_release(*args: object, **kw: object) -> tuple[int, int]:
        entered.set()
        gate.wait(30)
        return release(*args, **kw)

    monkeypatch.setattr(service.store, "end_session", slow_release)
    a._closed.set()  # the process is gone: its socket closes, nothing more is said
    a._sock.close()  # type: ignore[union-attr]
    assert entered.wait(10)
    assert sorted(s.name for s in service.sessions()) == ["a", "b"]
    gate.set()
    assert poll_until(lambda: len(service.sessions()) == 1, 10)
    acc = service.accounting()
    assert [s.name for s in service.sessions()] == ["b"]
    assert (acc["pins"], acc["pending"], acc["pinned_entries"], acc["unsettled_entries"]) == (0, 0, 0, 0)


def test_a_silent_session_loses_its_lease(tmp_path: Path) -> None:
    # 2 s: the pinging client (every third of it) keeps its session through
    # a stall of its thread or the service's on a loaded machine.
    svc = start(tmp_path, lease_ttl_ms=2000)
    try:
        b = client(svc)
        ks = keys(6, 3)
        save(b, ks, step=1)
        raw = socket.create_connection(("127.0.0.1", int(svc.address.rsplit(":", 1)[1])))
        raw.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", "hung", 1, 1, RANK_BYTES)))
        assert isinstance(wire.decode_server(wire.recv_frame(raw)), wire.Welcome)
        raw.sendall(wire.encode(wire.Pin(1, 1, wire.pack_keys(ks))))
        assert wire.decode_server(wire.recv_frame(raw)).slots != [-1, -1, -1]  # type: ignore[union-attr]
        assert svc.accounting()["pins"] == 3
        assert poll_until(lambda: svc.sessions_expired and not svc.accounting()["pinned_entries"], 20)
        acc = svc.accounting()
        assert (acc["pins"], acc["pinned_entries"]) == (0, 0)
        assert svc.sessions_expired == 1
        assert svc.store.counters()["pins_expired"] == 0  # they went with the session
        # The pinging client kept its session through several lease periods,
        # and keeps it idle for three more after its last call.
        assert [s.id for s in svc.sessions()] == [b.session]
        assert raw.recv(1) == b""  # the service closed the expired session
        raw.close()
        time.sleep(6.0)
        assert [s.id for s in svc.sessions()] == [b.session] and b.reconnects == 0 and b.connected
    finally:
        svc.stop()


def test_pins_of_a_step_left_open_end_with_the_lease_while_the_session_lives(tmp_path: Path) -> None:
    """An instance whose engine is stuck but whose client still pings: its
    pins end after a lease (their blocks could never be evicted otherwise),
    its session stays, and its late report of the step is harmless."""
    svc = start(tmp_path, lease_ttl_ms=2000)
    try:
        a, b = client(svc, name="a"), client(svc, name="b")
        ks = keys(8, 3)
        save(b, ks, step=1)
        assert None not in a.pin(ks, step=4)  # step 4 never completes
        assert svc.accounting()["pins"] == 3
        assert poll_until(lambda: svc.accounting()["pins"] == 0, 30)
        acc = svc.accounting()
        assert acc["pinned_entries"] == 0 and svc.store.counters()["pins_expired"] == 3
        assert svc.sessions_expired == 0 and sorted(s.name for s in svc.sessions()) == ["a", "b"]
        a.complete_step(4)  # the engine comes back: nothing left to release
        assert a.flush()
        assert svc.accounting()["pinned_entries"] == 0
        assert a.probe(ks).ready == 3 and None not in a.pin(ks, step=5)
    finally:
        svc.stop()


def test_leases_keep_ending_after_a_pass_of_the_lease_thread_failed(tmp_path: Path, monkeypatch) -> None:
    svc = start(tmp_path, lease_ttl_ms=2000)
    try:
        client(svc)  # makes the pool
        failed = []
        release_held = svc.store.release_held

        def once_broken(now: float) -> int:
            if not failed:
                failed.append(now)
                raise RuntimeError("a store bug, once")
            return release_held(now)

        monkeypatch.setattr(svc.store, "release_held", once_broken)
        assert poll_until(lambda: failed, 10)
        raw = socket.create_connection(("127.0.0.1", int(svc.address.rsplit(":", 1)[1])))
        raw.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", "silent", 1, 1, RANK_BYTES)))
        assert isinstance(wire.decode_server(wire.recv_frame(raw)), wire.Welcome)
        # The thread lived through the failure: the silent session still expires.
        assert poll_until(lambda: svc.sessions_expired, 20)
        assert svc.sessions_expired == 1 and [s.name for s in svc.sessions()] == ["test"]
        raw.close()
    finally:
        svc.stop()


def test_token_is_required_when_set(tmp_path: Path) -> None:
    svc = start(tmp_path, token="s3cret-token")
    try:
        with pytest.raises(PoolRefused) as err:
            client(svc, token="wrong")
        assert err.value.code == "auth"
        with pytest.raises(PoolRefused):
            client(svc, token="")
        ok = client(svc, token="s3cret-token")
        assert ok.probe(keys(7, 1)).total == 0 and ok.connected
    finally:
        svc.stop()


@pytest.mark.parametrize(("url", "token", "warned"), [
    ("tcp://0.0.0.0:0", None, True), ("tcp://0.0.0.0:0", "t0ken", False), ("tcp://127.0.0.1:0", None, False),
    ("tcp://localhost:0", None, False)])
def test_listening_beyond_loopback_without_a_token_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 url: str, token: str | None, warned: bool) -> None:
    with caplog.at_level("WARNING", logger="kvtier"):
        svc = start(tmp_path, url=url, token=token)
        svc.stop()
    assert ("beyond loopback, without a token" in caplog.text) == warned


_OTHER_USER = """
import encodings.idna, os, socket, sys  # imported first: nobody cannot read root's Python
from kvtier.pool import wire
os.setgid(65534)
os.setuid(65534)
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, sys.argv[2], "nobody", os.getpid(), 1, 4096)))
reply = wire.decode_server(wire.recv_frame(s))
print(getattr(reply, "code", type(reply).__name__))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
@pytest.mark.parametrize("token", ["", "t0ken"])
def test_a_local_connection_of_another_user_needs_the_token(tmp_path: Path, token: str) -> None:
    """Without a token, TCP on loopback takes what the Unix socket (0600)
    and the arena take: the service's own user (and root). Another local
    user could otherwise probe which prompts are cached, pin, and discard."""
    svc = start(tmp_path, token=token or None, store=KvtierConfig(dram_size_bytes=64 * (4096 + 4096),
                                                                   shm_dir=str(tmp_path)))
    try:
        port = svc.address.rsplit(":", 1)[1]
        env = dict(os.environ, PYTHONPATH=str(Path(pool_service.__file__).parents[2]))
        out = subprocess.run([sys.executable, "-c", _OTHER_USER, port, token], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == ("Welcome" if token else "auth")
        assert client(svc, token=token).probe(keys(9, 1)).total == 0  # this user's instance is taken
    finally:
        svc.stop()


def test_another_block_geometry_is_refused_with_a_reason(service: MetaService) -> None:
    client(service)
    with pytest.raises(PoolRefused) as err:
        client(service, rank_bytes=RANK_BYTES * 2)
    assert err.value.code == "geometry" and str(RANK_BYTES) in err.value.message
    assert f"kvtier.slot_rank_bytes to the largest model's bytes per part (here at least {RANK_BYTES * 2})" \
        in err.value.message
    with pytest.raises(PoolRefused) as err:  # other rank counts: a block is readable once all its parts are sealed
        client(service, ranks=2, rank_bytes=RANK_BYTES // 2)
    assert err.value.code == "geometry" and "give it a meta service of its own" in err.value.message


def test_a_model_with_smaller_blocks_shares_the_pool_without_meeting_the_other(service: MetaService,
                                                                              caplog) -> None:
    """Two models, as many ranks, the second's blocks half the size: it
    takes whole slots (their parts' tails unused), and each finds only its
    own blocks. Without kvtier.slot_rank_bytes, one warning says to set it."""
    big = client(service, name="big")
    with caplog.at_level("WARNING", logger="kvtier"):
        small = client(service, rank_bytes=RANK_BYTES // 2, name="small")
        client(service, rank_bytes=RANK_BYTES // 2, name="small-2")
    assert small.arena_path == big.arena_path and service.geometry == (1, RANK_BYTES)
    said = [r.getMessage() for r in caplog.records if "kvtier.slot_rank_bytes" in r.getMessage()]
    assert len(said) == 1 and f"set kvtier.slot_rank_bytes = {RANK_BYTES}" in said[0]
    mine, theirs = keys(61, 3), keys(62, 3)
    save(big, theirs, step=1, fill=5)
    save(small, mine, step=1, fill=6)
    assert small.probe(mine).ready == 3 and small.probe(theirs).ready == 3  # keys are the namespace's
    slots = small.pin(mine, step=2)
    tier = DramTier.attach(small.arena_path)
    try:
        for slot, key in zip(slots, mine):
            assert slot is not None and tier.verify(slot, key, 0) and int(tier.rank_view(slot, 0)[0]) == 6
    finally:
        tier.close()
    small.complete_step(2)
    small.flush()
    acc = service.accounting()
    assert acc["used"] == 6 and acc["used"] + acc["free"] + acc["held"] == acc["total"] and acc["pins"] == 0


def test_a_configured_part_size_lets_a_larger_model_come_second(tmp_path: Path) -> None:
    svc = start(tmp_path, slot_rank_bytes=RANK_BYTES * 2)
    try:
        small = client(svc, name="small")
        assert svc.geometry == (1, RANK_BYTES * 2)  # sized as configured, not by the first instance
        big = client(svc, rank_bytes=RANK_BYTES * 2, name="big")
        save(big, keys(63, 2), step=1)
        assert small.probe(keys(63, 2)).ready == 2
        with pytest.raises(PoolRefused) as err:
            client(svc, rank_bytes=RANK_BYTES * 4, name="larger")
        assert err.value.code == "geometry" and str(RANK_BYTES * 4) in err.value.message
    finally:
        while _clients:
            _clients.pop().shutdown()
        svc.stop()


def test_a_first_instance_larger_than_the_configured_parts_is_refused_by_the_key(tmp_path: Path) -> None:
    svc = start(tmp_path, slot_rank_bytes=RANK_BYTES)
    try:
        with pytest.raises(PoolRefused) as err:
            client(svc, rank_bytes=RANK_BYTES * 2)
        assert err.value.code == "geometry" and "kvtier.slot_rank_bytes" in err.value.message
        assert svc.store is None  # no pool made for it
        assert client(svc).probe(keys(64, 1)).total == 0  # the next one that fits makes it
    finally:
        while _clients:
            _clients.pop().shutdown()
        svc.stop()


def _raw(svc: MetaService) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(svc.address.rsplit(":", 1)[1])), timeout=5)
    return s


def _session(svc: MetaService, name: str) -> socket.socket:
    """A raw connection whose handshake the service has answered with a Welcome."""
    s = _raw(svc)
    s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", name, 1, 1, RANK_BYTES)))
    assert isinstance(_answer(s), wire.Welcome)
    return s


def _answer(s: socket.socket) -> object:
    body = wire.recv_frame(s)
    return None if body is None else wire.decode_server(body)


def _random_frames(n: int) -> list[bytes]:
    """Frames of random bytes, each whole (its length right), 1 to 300 bytes."""
    rng = random.Random(8)
    return [struct.pack("<I", k) + rng.randbytes(k) for k in (rng.randint(1, 300) for _ in range(n))]


def _frame_of(raw: object) -> bytes:
    """Any MessagePack value in a whole frame (no schema: what a broken client could send)."""
    body = msgspec.msgpack.encode(raw)
    return struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(("frame", "code", "says"), [
    (struct.pack("<I", 100) + b"\x01\x02", "bad-request", "connection closed inside a frame"),
    (struct.pack("<I", wire.MAX_FRAME + 1), "bad-request", "over the"),
    (wire.encode(wire.Hello(wire.PROTOCOL_VERSION + 1, "", "x", 1, 1, RANK_BYTES)), "version", "speaks"),
    # Protocol 3's Hello, one field short of today's: told its version, not a bad request.
    (_frame_of(["Hello", 3, "", "x", 1, 1, RANK_BYTES]), "version", "protocol 3 asked"),
    (_frame_of(["Hello", wire.PROTOCOL_VERSION, "", "x", 1, 1, RANK_BYTES, -1]), "bad-request",
     "Hello.promote_timeout_ms"),
    (wire.encode(wire.Probe(1, b"k" * 16)), "bad-request", "expected Hello first"),
    (wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", "n" * 4097, 1, 1, RANK_BYTES)), "bad-request",
     "of length <= 4096"),
] + [(f, "bad-request", "expected Hello") for f in _random_frames(10)],
    ids=["truncated", "oversized", "wrong-version", "previous-version", "negative-wait", "no-hello-first",
         "name-over-4096"]
    + [f"random-{i}" for i in range(10)])
def test_bad_frames_before_the_hello_are_refused_and_the_service_keeps_serving(service: MetaService, frame: bytes,
                                                                               code: str, says: str) -> None:
    good = client(service)
    ks = keys(8, 2)
    save(good, ks, step=1)
    s = _raw(service)
    s.sendall(frame)
    s.shutdown(socket.SHUT_WR)
    reply = _answer(s)
    assert isinstance(reply, wire.Error) and reply.code == code and says in reply.message
    s.close()
    assert good.probe(ks).ready == 2
    assert service.accounting()["pending"] == 0


@pytest.mark.parametrize(("frame", "says"), [
    (struct.pack("<I", 100) + b"\x01\x02", "connection closed inside a frame (2 of 100 bytes)"),
    (struct.pack("<I", wire.MAX_FRAME + 1), f"frame of {wire.MAX_FRAME + 1} bytes announced"),
    (wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", "again", 1, 1, RANK_BYTES)), "a second Hello"),
    (_frame_of(["Pin", 7, "two", b"k" * 16]), "`Pin.step`"),
    (_frame_of(["CompleteStep", 7, 2]), "CompleteStep: Expected `array`"),
    (struct.pack("<I", 3004) + b"\x92\xa3Pin" + b"\x91" * 3000, "Expected `array`"),
    # A step a reset could not reach (it dooms steps above -2**62), and one past the range.
    (_frame_of(["Pin", 7, -(1 << 62) - 1, b"k" * 16]), "`Pin.step`"),
    (_frame_of(["DoomPending", 7, 1 << 62]), "`DoomPending.after_step`"),
    # Over NAMED_MAX: msgspec's own words, the body not decoded again to name the
    # field (an 8 MiB array of empty arrays took seconds, holding the interpreter lock).
    (_frame_of(["Pin", 7, [[]] * 5000, b"k" * 16]), "Expected `int`, got `array` - at `$[2]`"),
] + [(f, "") for f in _random_frames(10)],
    ids=["truncated", "oversized", "second-hello", "wrong-type", "too-short", "deeply-nested",
         "step-below-reset", "step-too-far", "large-unnamed"]
    + [f"random-{i}" for i in range(10)])
def test_a_bad_frame_in_a_session_ends_that_session_alone_and_releases_what_it_held(service: MetaService,
                                                                                    frame: bytes, says: str) -> None:
    good = client(service)
    ks = keys(8, 2)
    save(good, ks, step=1)
    s = _session(service, "bad")
    s.sendall(wire.encode(wire.Pin(1, 1, wire.pack_keys(ks))))  # a load's pins, to be given back
    assert isinstance(_answer(s), wire.Slots)
    assert service.accounting()["pins"] == 2
    bad_before = service.bad_messages
    s.sendall(frame)
    if len(frame) < 8:  # announces more than it sends
        s.shutdown(socket.SHUT_WR)
    reply = _answer(s)
    assert isinstance(reply, wire.Error) and reply.code == "bad-request" and says in reply.message
    assert _answer(s) is None  # closed
    s.close()
    assert poll_until(lambda: len(service.sessions()) == 1, 10)
    assert service.bad_messages == bad_before + 1
    acc = service.accounting()
    assert (acc["pins"], acc["pinned_entries"]) == (0, 0)
    assert acc["free"] + acc["used"] + acc["held"] == acc["total"]
    assert good.probe(ks).ready == 2 and good.connected


class _BrokenService:
    """A peer that speaks the wire but answers wrongly: ``welcome`` to the
    Hello, then ``replies`` in turn to the requests (each with the
    request's id), on 127.0.0.1."""

    def __init__(self, welcome: wire.Welcome, replies: list) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.srv.getsockname()[1]}"
        self.welcome, self.replies = welcome, list(replies)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            wire.recv_frame(conn)
            conn.sendall(wire.encode(self.welcome))
            while (body := wire.recv_frame(conn)) is not None and self.replies:
                req = wire.decode_client(body)
                conn.sendall(wire.encode(msgspec.structs.replace(self.replies.pop(0), id=req.id)))

    def close(self) -> None:
        self.srv.close()


def _welcome(version: int = wire.PROTOCOL_VERSION) -> wire.Welcome:
    return wire.Welcome(version, 1, "/nonexistent/arena", 8, 10_000, False, "", "")


def test_a_service_that_cannot_read_this_hello_is_named_as_another_version() -> None:
    # An older service stops at the Hello's length, before its version.
    peer = _BrokenService(wire.Error(0, "bad-request", "expected Hello: Expected `array` of at most length 7"), [])
    try:
        with pytest.raises(PoolRefused) as err:
            PoolPlacement(peer.url, ranks=1, rank_bytes=RANK_BYTES, timeout_s=5)
        assert err.value.code == "bad-request" and "another kvtier version" in err.value.message
        assert not err.value.transient
    finally:
        peer.close()


def test_a_service_of_another_protocol_version_is_refused_by_the_instance() -> None:
    peer = _BrokenService(_welcome(wire.PROTOCOL_VERSION + 1), [])
    try:
        with pytest.raises(PoolRefused) as err:
            PoolPlacement(peer.url, ranks=1, rank_bytes=RANK_BYTES, timeout_s=5)
        assert err.value.code == "version" and f"protocol {wire.PROTOCOL_VERSION + 1}" in err.value.message
    finally:
        peer.close()


@pytest.mark.parametrize("reply", [wire.ProbeReply(0, 3, 2), wire.ProbeReply(0, 1, 3), wire.ProbeReply(0, -1, 1),
                                   wire.ProbeReply(0, 1, 2, 2), wire.Count(0, 1)],
                         ids=["ready-over-total", "more-than-asked", "negative", "remote-over-rest", "wrong-type"])
def test_a_lookup_answer_that_cannot_be_right_is_a_miss(reply: object) -> None:
    # Two keys asked: an answer the instance cannot trust is a miss (vLLM
    # recomputes), never a count of blocks to load.
    peer = _BrokenService(_welcome(), [wire.ProbeReply(0, 0, 0), reply])  # the handshake's empty lookup, then
    try:
        c = PoolPlacement(peer.url, ranks=1, rank_bytes=RANK_BYTES, timeout_s=5)
        got = c.probe(keys(12, 2))
        assert (got.ready, got.total, got.remote) == (0, 0, 0)
        c.shutdown()
    finally:
        peer.close()


def test_a_key_of_the_wrong_length_ends_only_that_session(service: MetaService) -> None:
    good = client(service)
    s = _session(service, "bad")
    s.sendall(wire.encode(wire.Probe(5, b"k" * 16 + b"short")))
    reply = _answer(s)
    assert isinstance(reply, wire.Error) and "16" in reply.message
    assert _answer(s) is None  # closed
    assert service.bad_messages == 1
    assert good.probe(keys(9, 1)).total == 0 and good.connected


def test_a_touch_is_never_answered_and_one_of_broken_slots_ends_only_that_session(service: MetaService) -> None:
    good = client(service)
    ks = keys(9, 2)
    save(good, ks, step=1)
    s = _session(service, "raw")
    slots = good.pin(ks, step=2)
    s.sendall(wire.encode(wire.Touch(4, np.array(slots + [-3, 1 << 30], dtype="<i4").tobytes())))
    s.sendall(wire.encode(wire.Ping(5)))
    reply = _answer(s)
    assert isinstance(reply, wire.Ok) and reply.id == 5  # the Ping's: nothing came for the Touch
    assert service.lookups_by_instance()["raw"][:2] == (4, 4)  # slots that are none are counted, not stamped
    s.sendall(wire.encode(wire.Touch(5, np.array(slots, dtype="<i4").tobytes(), 3)))  # three lookups of the run
    s.sendall(wire.encode(wire.Ping(6)))
    assert isinstance(_answer(s), wire.Ok)
    assert service.lookups_by_instance()["raw"][:2] == (10, 10)
    s.sendall(wire.encode(wire.Touch(6, np.array(slots, dtype="<i4").tobytes(), 0)))
    reply = _answer(s)
    assert isinstance(reply, wire.Error) and "times" in reply.message
    assert _answer(s) is None  # closed
    s = _session(service, "raw")
    s.sendall(wire.encode(wire.Touch(6, b"\0" * 6)))
    reply = _answer(s)
    assert isinstance(reply, wire.Error) and "Touch.slots: 6 bytes" in reply.message
    assert _answer(s) is None  # closed
    assert good.probe(ks).ready == 2 and good.connected
    s = _session(service, "raw")
    s.sendall(wire.encode(wire.Probe(7, ks[1], b"\0" * 5)))
    reply = _answer(s)
    assert isinstance(reply, wire.Error) and "Probe.ahead: 5 bytes" in reply.message
    assert _answer(s) is None
    assert service.bad_messages == 3


@pytest.mark.parametrize(("token", "starts"), [("", True), ("wrong", False)])
def test_an_engine_the_service_cannot_take_yet_starts_and_joins_once_it_can(tmp_path: Path, token: str,
                                                                             starts: bool) -> None:
    # The service is up but cannot make its pool (its shm_dir is gone): a
    # refusal that may pass. The engine starts with lookups missing and
    # joins the pool once it can be made. A wrong token is not such a
    # refusal: it stops the start with the key to fix.
    from kvtier.config import parse_connector_config
    from kvtier.connector.connector import build_pool_scheduler_side
    from kvtier.errors import ConfigError
    from tests.unit.vllm_configs import kv_cache_config, vllm_config

    svc = start(tmp_path, token="secret")
    (tmp_path / "shm").rmdir()
    extra = {"backend": "pool", "meta_service_url": svc.address, "token": token or "secret", "promote_timeout_s": 30}
    try:
        cfg = parse_connector_config(extra, check_memory=False)
        vc = vllm_config(extra=extra, model_kw={"served_model_name": "m"})
        if not starts:
            with pytest.raises(ConfigError) as info:
                build_pool_scheduler_side(vc, kv_cache_config(), cfg)
            assert info.value.key == "meta_service_url" and "token" in str(info.value)
            return
        side = build_pool_scheduler_side(vc, kv_cache_config(), cfg)
        assert side is not None
        pool, ks = side.store, keys(11, 2)
        assert not pool.connected and pool.probe(ks).total == 0
        (tmp_path / "shm").mkdir()
        assert poll_until(lambda: pool.probe(ks) is not None and pool.connected, 15, 0.05)
        assert pool.reconnects == 1 and svc.store is not None
        assert [s.name for s in svc.sessions()] == [pool.name]
        assert svc.store.stale_move_s == 30  # the scheduler's wait, told at the handshake
        pool.shutdown()
    finally:
        svc.stop()


def test_a_configuration_that_makes_no_pool_stops_the_engine_start_with_its_reason(tmp_path: Path) -> None:
    # Not a refusal of the moment: the service's arena cannot hold one
    # block of this instance. Retrying would only fail again; the operator
    # reads why at start-up.
    from kvtier.config import parse_connector_config
    from kvtier.connector.connector import build_pool_scheduler_side
    from kvtier.errors import ConfigError
    from tests.unit.vllm_configs import kv_cache_config, vllm_config

    shm = tmp_path / "shm"
    shm.mkdir()
    svc = start(tmp_path, store=KvtierConfig(dram_size_bytes=4096, shm_dir=str(shm)))
    extra = {"backend": "pool", "meta_service_url": svc.address}
    try:
        cfg = parse_connector_config(extra, check_memory=False)
        with pytest.raises(ConfigError) as info:
            build_pool_scheduler_side(vllm_config(extra=extra, model_kw={"served_model_name": "m"}),
                                      kv_cache_config(), cfg)
        assert info.value.key == "meta_service_url" and "too small for one block" in str(info.value)
        assert svc.store is None and list(shm.iterdir()) == []
    finally:
        svc.stop()


def test_a_gone_service_is_a_miss_at_once_and_the_client_comes_back(tmp_path: Path) -> None:
    svc = start(tmp_path)
    port = int(svc.address.rsplit(":", 1)[1])
    c = client(svc)
    ks = keys(10, 3)
    save(c, ks, step=1)
    svc.stop()
    assert c.probe(ks).total == 0
    assert c.pin(ks, step=2) == [None, None, None]
    got = c.prepare_save(ks, step=2)
    assert list(got) == [None] * 3 and got.placed == 3  # dropped, not retried
    assert not c.connected and c.failures >= 3
    svc2 = start(tmp_path, url=f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 15
        while not c.connected and time.monotonic() < deadline:
            c.probe(ks)
            time.sleep(0.05)
        assert c.connected and c.reconnects == 1
        assert c.probe(ks).total == 0  # a cold pool: a restart without an arena to adopt
        save(c, ks, step=1)
        assert c.probe(ks).ready == 3
    finally:
        svc2.stop()


def test_unix_socket_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "run" / "meta.sock"
    svc = start(tmp_path, url=f"unix://{path}")
    try:
        assert (path.stat().st_mode & 0o777) == 0o600
        assert (path.parent.stat().st_mode & 0o777) == 0o700
        c = client(svc)
        save(c, keys(11, 2), step=1)
        assert c.probe(keys(11, 2)).ready == 2
    finally:
        svc.stop()
    assert not path.exists()


def test_counters_are_read_from_the_services_page_without_a_call(service: MetaService) -> None:
    # vLLM reads the counters every engine step, before the step's tokens
    # go out: an instance reads the page the service rewrites in shared
    # memory, and never calls the service for them.
    c = client(service)
    assert c.counters()["dram_slots_used"] == 0
    save(c, keys(41, 3), step=1)
    calls = c._next_id
    assert poll_until(lambda: c.counters()["dram_slots_used"] == 3, timeout_s=10)  # the page shows the saves
    assert c._next_id == calls  # read, not asked
    page = Path(c._maps["stats"].path)
    assert page.parent == Path(service.opts.store.shm_dir) and page.stat().st_mode & 0o777 == 0o600
    assert c.probe(keys(41, 3)) == Probe(3, 3)
    ready = Path(c._maps["ready"].path)  # the ready index, mapped by the lookup
    assert ready.parent == page.parent and ready.stat().st_mode & 0o777 == 0o600
    c.shutdown()
    service.stop()
    assert not page.exists() and not ready.exists()  # the service's own files, gone with it


def test_without_the_page_counters_are_asked_of_the_service_once_per_interval(
        service: MetaService, monkeypatch: pytest.MonkeyPatch) -> None:
    # A page that cannot be mapped (another user's folder, a full /dev/shm
    # at the service's start): the instance asks the service, at most once
    # per interval, and serves the last values between.
    import kvtier.pool.client as pool_client

    def refuse(path: str):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(pool_client.StatsPage, "attach", staticmethod(refuse))
    monkeypatch.setattr(pool_client, "COUNTERS_EVERY_S", 3600.0)
    c = client(service)
    first = c.counters()
    assert first["dram_slots_used"] == 0
    save(c, keys(40, 3), step=1)
    calls = c._next_id
    assert c.counters() == first  # within the interval: no call, the last values
    assert c._next_id == calls
    monkeypatch.setattr(pool_client, "COUNTERS_EVERY_S", 0.0)
    assert c.counters()["dram_slots_used"] == 3
    assert c._next_id == calls + 1
    c.shutdown()


def test_keys_travel_whole_whatever_their_bytes() -> None:
    # One blob on the wire, split back in C: keys ending in zero bytes (a
    # NUL-stripping split would shorten them) and all-zero keys come back whole.
    ks = [bytes(16), b"\x01" + bytes(15), bytes(15) + b"\x02", random.Random(3).randbytes(16)]
    msg = wire.decode_client(wire.encode(wire.Probe(1, wire.pack_keys(ks)))[4:])
    assert isinstance(msg, wire.Probe) and wire.unpack_keys(msg.keys) == ks
    assert wire.unpack_keys(wire.pack_keys([])) == []
    with pytest.raises(ValueError, match="16 bytes"):
        wire.pack_keys([bytes(16), b"short"])


def test_a_key_run_travels_as_its_buffer_when_the_buffer_fits() -> None:
    ks = [random.Random(i).randbytes(16) for i in range(5)]
    run = KeyRun(ks, b"".join(ks))
    assert wire.pack_keys(run) is run.packed  # sent as kept: no join
    # A buffer that does not fit the list (shorter, longer) is not sent: the keys are joined.
    for packed in (b"".join(ks[:4]), b"".join(ks) + bytes(16)):
        assert wire.pack_keys(KeyRun(ks, packed)) == b"".join(ks)
    assert wire.pack_keys(KeyRun(ks)) == b"".join(ks)
    with pytest.raises(ValueError, match="16 bytes"):
        wire.pack_keys(KeyRun([bytes(16), b"short"], bytes(17)))


def test_complete_step_does_not_wait_and_its_answer_is_read_by_the_next_call(service: MetaService) -> None:
    # CompleteStep runs on the path of every step's tokens: it is sent and
    # not waited for; the service answers a session in order, so the
    # instance's own next call already sees the step settled.
    c = client(service)
    ks = keys(50, 2)
    slots = c.prepare_save(ks, step=1)
    write_blocks(c.arena_path, list(slots), ks, 3)
    c.complete_step(1)
    assert len(c._unanswered) == 1
    assert c.probe(ks).ready == 2  # read the step's answer first, then its own
    assert not c._unanswered
    c.complete_step(2)
    c.complete_step(3)
    assert c.flush() and not c._unanswered
    c.shutdown()


def test_a_doom_that_finds_the_connection_busy_still_comes_before_the_next_complete_step(
        service: MetaService) -> None:
    """A load of step 1 failed, so the saves of step 2 (computed on it) are
    doomed; the connection is busy then (a call of another thread waits on
    a stalled store), past the client's lock wait. The doom is not dropped:
    the next call sends it first, and the complete_step after it does not
    publish step 2's saves."""
    c = client(service)
    ks = keys(51, 3)
    slots = c.prepare_save(ks, step=2)
    write_blocks(c.arena_path, list(slots), ks, 4)
    store = service.store
    assert store is not None
    answered = threading.Event()
    with store._lock:  # the store stalls: a call in flight holds the client's connection
        stalled = threading.Thread(target=lambda: (c.probe(keys(52, 1)), answered.set()))
        stalled.start()
        assert poll_until(lambda: c._lock.locked(), 10)
        assert c.doom_pending(1) == 0  # no answer to give: deferred
        assert c.deferred == 1 and len(c._deferred) == 1
    stalled.join(10)
    assert answered.is_set() and c.connected
    c.complete_step(2)
    assert c.flush() and not c._deferred
    assert c.probe(ks).ready == 0  # doomed, not published
    assert all(not store.contains(k) for k in ks)
    acc = service.accounting()
    assert (acc["pins"], acc["pending"]) == (0, 0)
    assert c.failures == 0 and c.reconnects == 0


def test_a_call_deferred_for_a_session_that_ended_is_not_sent_in_the_next(service: MetaService) -> None:
    """A settling call deferred on one connection is dropped with it: the
    session it was for has ended, and its step numbers mean nothing to the
    session after the reconnection (a complete_step would settle its saves)."""
    c = client(service)
    epoch = c.epoch
    with c._lock:  # busy: deferred under the current epoch
        c.complete_step(5)
    assert len(c._deferred) == 1
    with c._lock:
        c._drop_locked("the test drops the connection")
    assert not c._deferred
    ks = keys(53, 2)
    poll_until(lambda: c.connected, 10)
    assert c.connected and c.epoch == epoch + 1
    slots = c.prepare_save(ks, step=5)
    assert None not in slots
    with c._lock:
        c.complete_step(4)  # deferred under the new epoch
    c._deferred.appendleft((epoch, wire.CompleteStep(0, 5, [], False)))  # one left from the old one
    assert c.flush() and not c._deferred
    # Only complete_step(4) went out: step 5's saves are still pending.
    assert service.accounting()["pending"] == 2 and c.probe(ks).ready == 0


def test_a_step_planned_across_a_reconnection_loads_and_saves_nothing(service: MetaService) -> None:
    """The scheduler half pins a hit's blocks in one session; the client
    reconnects before the step's plan is built. Those slot numbers belong
    to a session that has ended (its pins released, the slots free for any
    instance): the plan loads nothing from them and saves nothing, and the
    blocks are planned again in the next step."""
    from kvtier.connector.scheduler import SchedulerSide
    from tests.unit.helpers import BLOCK
    from tests.unit.helpers import FakeBlocks as Blocks
    from tests.unit.helpers import FakeRequest as Req
    from tests.unit.test_scheduler import NS, Manager, finish, plan_step, tokens

    c = client(service)
    side = SchedulerSide(c, NS, BLOCK, ranks=1)
    side.kv_cache_manager = Manager()
    first = Req("first", tokens(3))
    side.on_new_request(first)
    side.kv_cache_manager.blocks["first"] = [10, 11, 12, 13]
    plan = plan_step(side, {"first": 3 * BLOCK + 1}, {"first": first})
    assert len(plan.saves) == 3
    write_blocks(c.arena_path, [x.slot for x in plan.saves], [x.key for x in plan.saves], 5)
    finish(side, plan.step)
    assert c.flush()

    again = Req("again", tokens(5))
    side.on_new_request(again)
    assert side.get_num_new_matched_tokens(again, 0) == (3 * BLOCK, False)
    blocks = [20, 21, 22, 23, 24, 25]
    side.kv_cache_manager.blocks["again"] = blocks
    side.update_state_after_alloc(again, Blocks(blocks), 3 * BLOCK)
    assert service.accounting()["pins"] == 3
    epoch = c.epoch
    with c._lock:
        c._drop_locked("the test drops the connection")
    assert poll_until(lambda: c.connected, 10) and c.epoch == epoch + 1
    again.num_computed_tokens = 3 * BLOCK
    plan = plan_step(side, {"again": 2 * BLOCK + 1}, {"again": again})
    assert [(x.block_id, x.slot) for x in plan.loads] == [(20, -1), (21, -1), (22, -1)]
    assert plan.saves == []
    acc = service.accounting()
    assert (acc["pins"], acc["pending"]) == (0, 0)
    # The next step plans the blocks of that step again, in the new session.
    finish(side, plan.step)
    plan = plan_step(side, {"again": 0}, {"again": again})
    assert [x.block_id for x in plan.saves] == [23, 24]
    assert all(x.slot >= 0 for x in plan.saves)


def test_a_hello_that_arrives_while_the_service_stops_makes_no_pool(tmp_path: Path) -> None:
    svc = start(tmp_path)
    s = _raw(svc)  # accepted before the stop; its Hello comes after
    try:
        # The service's thread for it is waiting for the Hello.
        assert poll_until(lambda: any(t.name == "kvtier-meta-conn" for t in threading.enumerate()), 10)
        svc.stop()
        s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", "late", 1, 1, RANK_BYTES)))
        reply = _answer(s)
        assert isinstance(reply, wire.Error) and reply.code == "stopping"
        assert svc.store is None and list((tmp_path / "shm").iterdir()) == []  # no arena left behind
    finally:
        s.close()


@pytest.mark.parametrize("stop_meanwhile", [False, True], ids=["made", "stopped-while-made"])
def test_health_and_leases_answer_while_the_pool_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          stop_meanwhile: bool) -> None:
    # Making the pool can take long (a large arena, an SSD index to
    # recover, an old arena's blocks to check): the service's other
    # threads are not held up meanwhile; a stop meanwhile makes no pool.
    from kvtier.pool import service as service_module

    making, go = threading.Event(), threading.Event()
    real = service_module.open_store

    def slow_open_store(*args: object, **kw: object):
        making.set()
        assert go.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(service_module, "open_store", slow_open_store)
    svc = start(tmp_path)
    h = PoolHttp(svc, "127.0.0.1", 0)
    h.start()
    first: list[object] = []
    t = threading.Thread(target=lambda: first.append(_try_client(svc)))
    try:
        t.start()
        assert making.wait(10)
        health = httpx.get(h.url + "/health", timeout=5).json()
        assert health["pool"] is False and health["clients"] == []
        assert "kvtier_pool_clients 0.0" in httpx.get(h.url + "/metrics", timeout=5).text
        if stop_meanwhile:
            threading.Thread(target=svc.stop, daemon=True).start()
            assert poll_until(svc._stop.is_set, 10)
        go.set()
        t.join(30)
        if stop_meanwhile:
            assert isinstance(first[0], PoolRefused) and first[0].code == "stopping"
            assert poll_until(lambda: list((tmp_path / "shm").iterdir()) == [], 10)  # nothing left behind
            assert svc.store is None
        else:
            assert isinstance(first[0], PoolPlacement) and first[0].connected and svc.store is not None
            first[0].shutdown()
    finally:
        go.set()
        h.stop()
        svc.stop()


def _try_client(svc: MetaService) -> object:
    try:
        return PoolPlacement(svc.address, ranks=1, rank_bytes=RANK_BYTES, name="first", timeout_s=30)
    except PoolRefused as err:
        return err


# --- the HTTP side (metrics, health, queries) -------------------------------------


@pytest.fixture
def http_server(service: MetaService, monkeypatch: pytest.MonkeyPatch) -> Iterator[PoolHttp]:
    monkeypatch.setattr(pool_http, "HTTP_TIMEOUT_S", 0.5)
    h = PoolHttp(service, "127.0.0.1", 0)
    h.start()
    yield h
    h.stop()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def test_lookup_counts_keep_a_bounded_number_of_ended_instances_and_lose_no_count(
        service: MetaService, monkeypatch: pytest.MonkeyPatch) -> None:
    """Instances are named after their process, so every restart brings a
    new name: names gone longer than the last few are summed under one."""
    monkeypatch.setattr(pool_service, "ENDED_NAMES_KEPT", 3)
    live = client(service, name="live@1")
    ks = keys(60, 8)
    save(live, ks, step=1)
    assert live.probe(ks).ready == 8
    assert live.flush()  # a lookup counted in the shared index reaches the tallies with its Touch: done by now
    names = [f"m@{100 + i}" for i in range(7)]
    for i, name in enumerate(names):
        c = client(service, name=name)
        assert c.probe(ks[: i + 1] + keys(61, 1)).ready == i + 1
        sid = c.session
        c.shutdown()
        assert poll_until(lambda: all(s.id != sid for s in service.sessions()), timeout_s=10)
    again = client(service, name=names[-1])  # a kept name back: counted on, and no longer among the ended
    assert again.probe(ks[:1]).ready == 1
    assert again.flush()
    again.shutdown()
    by = service.lookups_by_instance()
    assert set(by) == {"live@1", *names[-3:], pool_service.ENDED_INSTANCES}
    assert by["live@1"] == (8, 8, 0, 0)
    assert by[names[-1]] == (8 + 1, 7 + 1, 0, 0)
    assert by[pool_service.ENDED_INSTANCES] == (sum(i + 2 for i in range(4)), sum(i + 1 for i in range(4)), 0, 0)
    assert sum(t[0] for t in by.values()) == 8 + sum(i + 2 for i in range(7)) + 1


@pytest.mark.parametrize(("given", "kept"), [
    ("a\nforged log line", "a?forged log line"),
    ("m@1\n", "m@1?"),
    ("x\u2028y\x85z", "x?y?z"),
    (pool_service.ENDED_INSTANCES, "ended)"),
    ("((/models/" + "x" * 300 + "@42", "x" * (wire.NAME_MAX - 3) + "@42"),
    ("", "pid 1"),
], ids=["line-break", "trailing-newline", "line-separators", "the-service-s-own-label", "too-long", "none"])
def test_the_service_keeps_a_name_logs_and_labels_can_take(service: MetaService, given: str, kept: str) -> None:
    s = _raw(service)
    s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", given, 1, 1, RANK_BYTES)))
    assert isinstance(_answer(s), wire.Welcome)
    assert [x.name for x in service.sessions()] == [kept]
    s.close()


def test_a_client_makes_its_name_one_the_service_takes(service: MetaService) -> None:
    c = client(service, name="((" + "/models/" + "x" * 300 + "\n@42")
    assert c.session >= 0 and c.name.endswith("x?@42") and len(c.name) == wire.NAME_MAX
    (s,) = service.sessions()
    assert s.name == c.name


def test_metrics_and_queries_say_what_the_pool_holds_and_did(service: MetaService, http_server: PoolHttp) -> None:
    url = http_server.url
    # No instance yet: the pool is made for the first one's geometry.
    assert httpx.get(url + "/get_all_segments", timeout=5).json() == {"segments": []}
    assert httpx.get(url + "/api/v1/capacity/usage", timeout=5).json() == {}
    a, b = client(service, name="a"), client(service, name="b")
    held, absent = keys(50, 3), keys(51, 2)
    save(a, held, step=1)
    rpc_before = _samples(httpx.get(url + "/metrics", timeout=5).text)
    assert b.probe(held + absent).ready == 3  # stops at the first absent key
    assert b.probe(absent).total == 0
    assert None not in a.pin(held, step=2)  # a load's lease
    m = _samples(httpx.get(url + "/metrics", timeout=5).text)
    tier = service.store.tier
    dram = (("tier", "dram"),)
    assert m[("kvtier_pool_clients", ())] == 2
    assert m[("kvtier_pool_capacity_bytes", dram)] == tier.num_slots * tier.slot_stride
    assert (m[("kvtier_pool_blocks", dram)], m[("kvtier_pool_used_bytes", dram)]) == (3, 3 * tier.slot_stride)
    assert m[("kvtier_pool_lookup_keys_total", (("instance", "b"),))] == 7
    assert m[("kvtier_pool_hit_keys_total", (("instance", "b"), ("tier", "dram")))] == 3
    assert m[("kvtier_pool_hit_keys_total", (("instance", "b"), ("tier", "ssd")))] == 0
    assert m[("kvtier_pool_miss_keys_total", (("instance", "b"),))] == 4
    assert m[("kvtier_pool_leased_blocks", (("kind", "pinned"),))] == 3
    assert m[("kvtier_pool_leased_blocks", (("kind", "unsettled"),))] == 0
    moves = ("to_ssd", "from_ssd", "to_cluster", "from_cluster")
    assert [m[("kvtier_pool_moving_blocks", (("move", move),))] for move in moves] == [0] * 4  # no tier to move to
    assert m[("kvtier_pool_io_jobs", ())] == 0
    assert m[("kvtier_pool_events_total", (("event", "sessions_started"),))] == 2
    assert m[("kvtier_pool_events_total", (("event", "evictions"),))] == 0
    probes = ("kvtier_pool_rpc_seconds_count", (("call", "Probe"),))
    assert m[probes] - rpc_before[probes] == 2
    # The queries, in MemCache's shapes.
    info = httpx.get(url + "/query_key", params={"key": held[0].hex()}, timeout=5).json()
    assert info["found"] and info["key"] == held[0].hex() and info["tiers"] == ["dram"]
    assert info["dram"]["state"] == "ready" and info["dram"]["pins"] == 1
    r = httpx.get(url + "/batch_query_keys", params={"keys": f"{held[1].hex()},{absent[0].hex()}"}, timeout=5)
    assert [x["found"] for x in r.json()["results"]] == [True, False]
    posted = httpx.post(url + "/batch_query_keys", json={"keys": [absent[1].hex(), held[2].hex()]}, timeout=5)
    assert [(x["key"], x["found"]) for x in posted.json()["results"]] == [(absent[1].hex(), False),
                                                                         (held[2].hex(), True)]
    seg = httpx.get(url + "/get_all_segments", timeout=5).json()["segments"]
    assert seg == [{"name": "dram", "path": tier.path, "capacity_bytes": tier.num_slots * tier.slot_stride,
                    "used_bytes": 3 * tier.slot_stride, "blocks": 3, "block_bytes": tier.slot_stride}]
    usage = httpx.get(url + "/api/v1/capacity/usage", timeout=5).json()
    assert usage == {"dram": {"total_bytes": tier.num_slots * tier.slot_stride, "used_bytes": 3 * tier.slot_stride,
                              "usage": round(3 / tier.num_slots, 6)}}
    health = httpx.get(url + "/health", timeout=5).json()
    assert sorted(c["name"] for c in health["clients"]) == ["a", "b"] and health["slots"]["pins"] == 3


def _http_exchange(h: PoolHttp, raw: bytes, half_close: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` as it is; (status, headers, body) of the answer."""
    host, port = h.server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(("request_", "code", "says"), [
    (b"PUT /health HTTP/1.1\r\nHost: x\r\n\r\n", 405, "use GET"),
    (b"DELETE /query_key HTTP/1.1\r\nHost: x\r\n\r\n", 405, "use GET"),
    (b"OPTIONS /batch_query_keys HTTP/1.1\r\nHost: x\r\n\r\n", 405, "use GET or POST"),
    (b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "use GET"),
    (b"POST /batch_query_keys HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411,
     "Content-Length"),
    (b"POST /batch_query_keys HTTP/1.1\r\nHost: x\r\nContent-Length: 1_0\r\n\r\n", 400, "'1_0' is not"),
    (b"POST /batch_query_keys HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400, "'-5' is not"),
    (b"POST /batch_query_keys HTTP/1.1\r\nHost: x\r\nContent-Length: 2097152\r\n\r\n", 413, "at most"),
    (b"POST /batch_query_keys HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", 400, "after 1 of 100"),
], ids=["put", "delete", "options", "post-to-get-only", "chunked", "underscore-length", "negative-length",
        "too-long", "body-cut-short"])
def test_http_requests_outside_the_endpoints_shapes_get_one_clear_4xx(http_server: PoolHttp, request_: bytes,
                                                                       code: int, says: str) -> None:
    status, headers, body = _http_exchange(http_server, request_, half_close=True)
    assert status == code and says in json.loads(body)["error"]
    if code == 405:
        assert headers["Allow"] in ("GET", "GET, POST")
    assert httpx.get(http_server.url + "/health", timeout=5).status_code == 200


def test_http_head_gets_405_without_a_body(http_server: PoolHttp) -> None:
    status, headers, body = _http_exchange(http_server, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, headers["Allow"], body) == (405, "GET", b"")


def test_a_failing_http_query_answers_500_and_the_endpoint_keeps_serving(
        http_server: PoolHttp, service: MetaService, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(key: bytes) -> dict:
        raise RuntimeError("a bug in a query")

    monkeypatch.setattr(service, "key_info", broken)
    r = httpx.get(http_server.url + "/query_key", params={"key": "00" * 16}, timeout=5)
    assert r.status_code == 500 and "internal error" in r.json()["error"]
    assert httpx.get(http_server.url + "/health", timeout=5).status_code == 200


def test_an_idle_http_connection_is_dropped_and_others_are_served(http_server: PoolHttp) -> None:
    """A client that connects and sends nothing, or less body than it
    announced, no longer holds a thread and a descriptor for good."""
    host, port = http_server.server.server_address[:2]
    idle = socket.create_connection((host, port))
    short = socket.create_connection((host, port))
    short.sendall(b"POST /batch_query_keys HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    try:
        assert httpx.get(http_server.url + "/health", timeout=5).status_code == 200
        for s in (idle, short):
            s.settimeout(30)
            while s.recv(4096):  # the server closes it (an error reply first, or nothing)
                pass
    finally:
        idle.close()
        short.close()


def test_http_connections_past_the_cap_are_closed_and_the_others_served(service: MetaService,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics port needs no token: peers that connect and trickle
    (each read's timeout restarted by a byte) hold at most the cap's
    threads; past it a connection is closed at once, and one freed is
    served again."""
    monkeypatch.setattr(pool_http, "MAX_HTTP_CONNECTIONS", 2)
    h = PoolHttp(service, "127.0.0.1", 0)
    h.start()
    host, port = h.server.server_address[:2]
    held = [socket.create_connection((host, port)) for _ in range(2)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")  # the rest of the headers never comes
        assert poll_until(lambda: h.server._slots._value == 0, 10)
        extra = socket.create_connection((host, port), timeout=10)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(4096) == b""  # closed with no answer
        extra.close()
        assert h.server.refused == 1
        held.pop().close()
        assert poll_until(lambda: h.server._slots._value == 1, 10)
        assert httpx.get(h.url + "/health", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
        h.stop()


def test_an_http_request_trickled_past_its_deadline_is_dropped(http_server: PoolHttp) -> None:
    """A byte every 0.2 s restarts a socket's timeout (0.5 s here) at each
    read; the request as a whole must arrive within it."""
    host, port = http_server.server.server_address[:2]
    s = socket.create_connection((host, port))
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"
    closed = False
    try:
        for i in range(len(request)):  # ~0.2 s a byte: the whole request would take seconds
            s.sendall(request[i : i + 1])
            time.sleep(0.2)
    except OSError:
        closed = True
    if not closed:
        s.settimeout(10)
        assert not s.recv(4096).startswith(b"HTTP/1.0 200")  # dropped, never answered
    s.close()
    assert httpx.get(http_server.url + "/health", timeout=5).status_code == 200


def test_a_hello_trickled_past_its_deadline_is_refused(service: MetaService, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 0.2 s restarts a socket's timeout at each read; the
    Hello as a whole must arrive within HELLO_WAIT_S."""
    monkeypatch.setattr(pool_service, "HELLO_WAIT_S", 1.0)
    s = _raw(service)
    hello = wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "", "slow", 1, 1, RANK_BYTES))
    closed = False
    try:
        for i in range(len(hello)):  # ~0.2 s a byte: the whole Hello would take seconds
            s.sendall(hello[i : i + 1])
            time.sleep(0.2)
    except OSError:  # the service closed it: a write to it failed
        closed = True
    if not closed:
        reply = _answer(s)
        assert isinstance(reply, wire.Error) and "in time" in reply.message
    s.close()
    assert [x.name for x in service.sessions()] == []
    assert poll_until(lambda: service.handshakes == 0, 10)


def test_handshakes_past_the_cap_are_closed_at_once_and_sessions_are_not_counted(
        service: MetaService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_service, "MAX_HANDSHAKES", 3)
    instances = [client(service, name=f"i{i}") for i in range(4)]  # sessions: more than the cap, all taken
    idle = [_raw(service) for _ in range(3)]  # connected, no Hello yet: each holds a thread
    try:
        assert poll_until(lambda: service.handshakes == 3, 10)
        extra = _raw(service)
        assert extra.recv(1) == b""  # closed at once, before any Hello
        extra.close()
        assert service.refused_connections == 1
        assert all(c.connected and c.probe(keys(60, 1)).total == 0 for c in instances)  # still served
        idle.pop().close()
        assert poll_until(lambda: service.handshakes == 2, 10)
        c = client(service)  # one freed: an instance gets in
        assert c.connected and c.probe(keys(60, 1)).total == 0
        assert service.handshakes == 2
    finally:
        for s in idle:
            s.close()


def test_deeply_nested_json_is_a_bad_request(http_server: PoolHttp) -> None:
    r = httpx.post(http_server.url + "/batch_query_keys", content=b"[" * 100_000, timeout=10)
    assert r.status_code == 400 and "nested" in r.json()["error"]
    assert httpx.get(http_server.url + "/health", timeout=5).status_code == 200


def test_metrics_and_health_on_an_ipv6_loopback(service: MetaService) -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    h = PoolHttp(service, "::1", 0)
    h.start()
    try:
        assert h.url.startswith("http://[::1]:")
        assert httpx.get(h.url + "/health", timeout=5).status_code == 200
        assert "kvtier_pool_clients" in httpx.get(h.url + "/metrics", timeout=5).text
    finally:
        h.stop()


@pytest.mark.parametrize(("method", "path", "code"), [("POST", "/batch_query_keys", 413), ("PUT", "/health", 405)],
                         ids=["too-long", "wrong-method"])
def test_a_client_that_sends_a_body_the_service_refuses_reads_the_refusal(http_server: PoolHttp, method: str,
                                                                           path: str, code: int) -> None:
    """Refused before its body is read (3 MiB, more than the socket's
    buffers take at once): the client still reads the whole reply, and
    the service goes on serving."""
    host, port = http_server.server.server_address[:2]
    body = b"{" + b" " * (3 << 20)
    for _ in range(3):
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            try:
                s.sendall(body)
            except OSError:
                pass  # the server stopped reading: the reply must still be there
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(f"HTTP/1.0 {code} ".encode()), data[:80]
    assert httpx.get(http_server.url + "/health", timeout=5).status_code == 200


def test_the_part_size_read_from_an_ssd_superblock_is_the_one_its_fingerprint_names(tmp_path: Path) -> None:
    from kvtier.pool.service import pool_fingerprint, ssd_part_bytes
    from kvtier.tier.ssd import SsdTier

    path = str(tmp_path / "ssd.img")
    part = 3 * 4096 + 100  # rounded up to 4 pages in the slot
    tier, _ = SsdTier.open([path], 64 << 20, 2 * 4 * 4096, False, fingerprint=pool_fingerprint(2, part))
    tier.close()
    assert ssd_part_bytes(path, 2, 4096) == part
    assert ssd_part_bytes(path, 2, part) == part
    assert ssd_part_bytes(path, 2, part + 1) is None  # the instance's blocks would not fit
    assert ssd_part_bytes(path, 3, 4096) is None  # other ranks: the slot does not split so
    assert ssd_part_bytes(path, 1, 4096) is None  # one part of the whole slot: another fingerprint
    for edge in (3 * 4096 + 1, 4 * 4096):  # the ends of the sizes that round to 4 pages
        edge_path = str(tmp_path / f"edge-{edge}.img")
        SsdTier.open([edge_path], 64 << 20, 2 * 4 * 4096, False, fingerprint=pool_fingerprint(2, edge))[0].close()
        assert ssd_part_bytes(edge_path, 2, 4096) == edge
    assert ssd_part_bytes(str(tmp_path / "none.img"), 2, 4096) is None
    notes = tmp_path / "notes.txt"
    notes.write_text("someone's notes")
    assert ssd_part_bytes(str(notes), 2, 4096) is None and notes.read_text() == "someone's notes"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert ssd_part_bytes(str(fifo), 2, 4096) is None  # not opened: a FIFO's open would block


@pytest.mark.parametrize("force_new_disk", [False, True])
def test_the_ssd_tier_sizes_the_parts_unless_it_is_formatted_afresh(tmp_path: Path, force_new_disk: bool) -> None:
    """An SSD tier written by a pool of larger parts: a smaller first
    instance gets parts of that size, so the tier is recovered; with
    force_new_disk the tier starts empty anyway, and the parts are the
    instance's (a retired larger model does not size the pool forever)."""
    from kvtier.pool.service import pool_fingerprint
    from kvtier.tier.ssd import SsdTier

    path = str(tmp_path / "ssd.img")
    SsdTier.open([path], 64 << 20, 2 * RANK_BYTES, False, fingerprint=pool_fingerprint(1, 2 * RANK_BYTES))[0].close()
    shm = tmp_path / "shm"
    shm.mkdir()
    store = KvtierConfig(dram_size_bytes=64 * (RANK_BYTES + 4096), shm_dir=str(shm), ssd_paths=(path,),
                         ssd_size_bytes=64 << 20, force_new_disk=force_new_disk)
    svc = start(tmp_path, store=store)
    try:
        client(svc)
        assert svc.geometry == (1, RANK_BYTES if force_new_disk else 2 * RANK_BYTES)
    finally:
        while _clients:
            _clients.pop().shutdown()
        svc.stop()
