"""An instance's side of the node pool: the store's calls, over the meta service's socket.

Runs in vLLM's scheduler process (the connector's scheduler half), as the
:class:`~kvtier.placement.Placement` the connector uses with
``backend: pool`` (or ``memcache``, the name the seeds' transfer config
uses). Workers never talk to the service: they map the arena whose path
each step's plan carries.

The meta service going away never takes the engine with it: a call that
fails (connection refused or reset, a reply later than ``timeout_s``, a
reply that breaks the protocol) marks the pool down and answers "miss"
(nothing found, nothing pinned, saves dropped), and so does every call
while it is down, at once: the engine's calls never connect. A thread of
the client's reconnects, with a backoff of 0.1 s doubling to 5 s, and
hands the engine a connection only once the service has answered both
the handshake and a lookup on it (a service whose store hangs is not
taken); the backoff starts over only once a call of the engine's is
answered, so a service that answers those but hangs on other calls costs
the engine one ``timeout_s`` per attempt, spaced out to 5 s. An engine
call that finds the connection busy for longer than ``LOCK_WAIT_S``
(another call waiting on a hung service) answers "miss" too, but for the
calls that settle saves (``complete_step``, ``doom_pending``, ``reset``,
``abandon_saves``): those are sent, in order, before the next call that
gets the connection, so that no later ``complete_step`` publishes saves
they were to doom. A reconnection opens a new session (``epoch`` counts
them): pins and slots of the old one are gone with it (the service
released them), and calls the old one deferred are not sent; a step
planned across a reconnection loads nothing and saves nothing
(connector/scheduler.py).

While connected and idle, the same thread pings the service every third
of the lease's time so that the session's leases hold.

Two files of the service's are read without a call: its counters page
(pool/statspage.py) and its ready index (pool/readymap.py), where a lookup
counts its leading run of plain READY DRAM blocks. A run that covers the
request is the answer, and the service is told of it without waiting
(wire.Touch); else the rest of the keys is a call, the head's slots with it.
The Touch is not sent at once: it goes with the instance's next call (the
pin of the load that follows a hit, or the step's completion), or with a
later lookup once it has waited ``TOUCH_HOLD_S``. Sent at once, it woke the
service while the scheduler still ran, and on a busy 2-core host the
service's turn on the core fell inside the lookup (p99 of a 4,096-key
lookup 1.2-1.8x that of the same count without the send).
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from kvtier.config import POOL_CALL_TIMEOUT_S
from kvtier.keys import KEY_BYTES
from kvtier.pool import wire
from kvtier.pool.service import parse_url
from kvtier.pool.readymap import ReadyMap
from kvtier.pool.shmfile import SharedFile
from kvtier.pool.statspage import StatsPage
from kvtier.store import Probe, SaveSlots

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
COUNTERS_EVERY_S = 0.25
UNANSWERED_MAX = 64  # calls sent without waiting whose replies are unread; past this a call waits
LOCK_WAIT_S = 0.05  # an engine call waits this long at most for the connection (a ping holds it ~0.1 ms)
# A lookup counted in the ready index is told to the service (wire.Touch)
# with the next call; with a later lookup once the first held has waited
# this long, or once this many runs are held (lookups of the same run in a
# row are one Touch, its ``times``). The service's tallies and the blocks'
# recency are that late at most, while lookups go on without other calls.
TOUCH_HOLD_S = 0.5
TOUCH_RUNS = 8
# Calls that settle a session's saves: never dropped while the session lives (see _call).
_SETTLES = (wire.CompleteStep, wire.DoomPending, wire.Reset, wire.AbandonSaves)


class PoolUnavailable(Exception):
    pass


class PoolRefused(Exception):
    """The service answered the handshake with a refusal (token, version, geometry, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def transient(self) -> bool:
        """The service is up but cannot take a session now (it is stopping, or
        could not make its pool for a reason of the moment, such as its
        folder gone): a later attempt may be taken, unlike a wrong token,
        version, geometry or a configuration that makes no pool."""
        return self.code in ("stopping", "internal")


class PoolPlacement:
    def __init__(self, url: str, *, ranks: int, rank_bytes: int, name: str = "", token: str | None = None,
                 timeout_s: float = POOL_CALL_TIMEOUT_S, connect: bool = True, promote_timeout_s: float = 0.0,
                 map_ready: bool = True) -> None:
        """``map_ready``: count lookups in the service's ready index where
        they can be (False: every lookup is a call; benchmarks compare)."""
        self.url = url
        self._where = parse_url(url)
        self.ranks = ranks
        self.rank_bytes = rank_bytes
        # The scheduler's wait for moves, told to the service at each
        # handshake (wire.Hello.promote_timeout_ms); 0: the service's own.
        self.promote_timeout_s = promote_timeout_s
        self.name = wire.instance_name(name) or f"vllm-{os.getpid()}"
        self.token = token if token is not None else os.environ.get("KVTIER_TOKEN", "")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        # Polls the connection for its end (the service's process gone, or
        # the session ended) without reading: a lookup counted in the ready
        # index is no answer once the service that keeps it is gone.
        self._hangup: select.poll | None = None
        self._next_id = 1
        self._welcome: wire.Welcome | None = None
        self._unanswered: deque[tuple[int, str]] = deque()  # (id, call) sent with wait=False, reply not read
        # (epoch, call) settling calls that found the connection busy: sent
        # first by the next call that gets it, if the connection is the same.
        self._deferred: deque[tuple[int, msgspec.Struct]] = deque()
        # [epoch, slots, times] of the lookups counted in the ready index and
        # not yet told to the service (sent with the next call), since when.
        self._touch_lock = threading.Lock()
        self._touches: list[list[Any]] = []
        self._touch_since = 0.0
        self._epoch = 0  # connections installed so far
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._last_call = 0.0
        self._last_counters: dict[str, int] = {}
        self._counters_at = -1.0  # when _last_counters came from the service
        self.map_ready = map_ready
        # The service's files mapped (Welcome.stats, Welcome.ready: see
        # _mapped), and the last path of each that could not be (not tried again).
        self._maps: dict[str, SharedFile] = {}
        self._unmappable: dict[str, str] = {}
        self._closed = threading.Event()
        self._wake = threading.Event()  # the client's thread: the connection dropped, or shutdown
        self._refused = ""  # the last refusal of a reconnection, logged once
        self.reconnects = 0
        self.failures = 0  # calls answered "miss" because the pool was down
        self.stalls = 0  # waits of ``timeout_s`` for the service on a thread not the client's (the engine's)
        self.attempts = 0  # reconnections tried by the client's thread
        self.deferred = 0  # settling calls that found the connection busy and went with the next call
        self.mapped_lookups = 0  # lookups counted in the service's ready index, without a call
        self.mapped_heads = 0  # lookups whose head was counted there, the rest by call
        if connect:
            sock, welcome = self._open()  # the first connection's refusal is a start-up error
            with self._lock:
                self._install_locked(sock, welcome)
        self._pinger = threading.Thread(target=self._ping_loop, name="kvtier-pool-ping", daemon=True)
        self._pinger.start()

    # --- connection -------------------------------------------------------

    def _open(self) -> tuple[socket.socket, wire.Welcome]:
        """A new connection, handshake done and an empty lookup answered (a
        service that takes a Hello but whose store does not answer is not
        taken). Holds no lock: the engine's calls never wait on it."""
        scheme, host, port = self._where
        if scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: object = host
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            target = (host, port)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(target)
            if scheme != "unix":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, self.token or "", self.name, os.getpid(),
                                                self.ranks, self.rank_bytes,
                                                math.ceil(self.promote_timeout_s * 1000))))
            body = wire.recv_frame(sock)
            if body is None:
                raise PoolUnavailable("the meta service closed the connection during the handshake")
            msg = wire.decode_server(body)
            if isinstance(msg, wire.Error):
                if msg.code == "bad-request" and msg.message.startswith("expected Hello"):
                    # A service older than this client's protocol cannot
                    # read the Hello far enough to find its version.
                    raise PoolRefused(msg.code, f"{msg.message} (a meta service of another kvtier version? "
                                                "run the same version on both)")
                raise PoolRefused(msg.code, msg.message)
            if not isinstance(msg, wire.Welcome):
                raise wire.WireError(f"expected Welcome, got {type(msg).__name__}")
            if msg.version != wire.PROTOCOL_VERSION:
                raise PoolRefused("version", f"the meta service speaks protocol {msg.version}, this instance "
                                             f"{wire.PROTOCOL_VERSION}: run the same kvtier version")
            # A lookup of no keys: it goes through the store's lock, as
            # every real call does (a ping would not).
            sock.sendall(wire.encode(wire.Probe(0, b"")))
            body = wire.recv_frame(sock)
            if body is None:
                raise PoolUnavailable("the meta service closed the connection after the handshake")
            if not isinstance(wire.decode_server(body), wire.ProbeReply):
                raise wire.WireError("the meta service did not answer a lookup")
        except BaseException as err:
            sock.close()
            if isinstance(err, TimeoutError) and threading.current_thread() is not getattr(self, "_pinger", None):
                self.stalls += 1
            raise
        return sock, msg

    def _install_locked(self, sock: socket.socket, welcome: wire.Welcome) -> None:
        self._epoch += 1  # first: a reader that sees the new arena sees the new epoch too
        self._sock = sock
        self._hangup = select.poll()
        self._hangup.register(sock, select.POLLRDHUP)  # POLLHUP and POLLERR come whatever is asked
        self._welcome = welcome
        self._next_id = 1
        self._last_call = time.monotonic()

    def _reconnect(self) -> None:
        """On the client's thread: a new connection for the engine's calls."""
        self.attempts += 1
        try:
            sock, welcome = self._open()
        except (OSError, wire.WireError, PoolUnavailable, PoolRefused) as err:
            with self._lock:
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            if isinstance(err, PoolRefused) and str(err) != self._refused:
                self._refused = str(err)  # said once per reason: the service is up and says no
                log.warning("kvtier: the meta service at %s refused this instance: %s", self.url, err)
            else:
                log.debug("kvtier: meta service at %s still unreachable: %s", self.url, err)
            return
        self._refused = ""
        with self._lock:
            if self._closed.is_set() or self._sock is not None:
                sock.close()
                return
            self._install_locked(sock, welcome)
            self.reconnects += 1
        log.info("kvtier: reconnected to the meta service at %s (session %d)", self.url, welcome.session)

    def _drop_locked(self, why: object) -> None:
        self._unanswered.clear()  # their session ends with the connection: the service settles them
        self._deferred.clear()  # so does what they were to settle
        if self._sock is not None:
            log.warning("kvtier: the meta service at %s is unreachable (%s); lookups miss and saves are dropped "
                        "until it is back", self.url, why)
            self._sock.close()
            self._sock = None
            self._hangup = None
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        self._wake.set()  # the client's thread sleeps a lease's third while connected

    def _call(self, msg: msgspec.Struct | None, wait: bool = True, lock_wait: float | None = LOCK_WAIT_S
              ) -> wire.Reply | None:
        """The reply, or None when the pool is down (the caller answers "miss").
        The Touches held (:meth:`_hold_touch`) go first, in the same send;
        ``msg`` None sends only those, answered with an Ok once sent.

        ``wait=False``: send and return None at once; the reply is read (and
        an error in it logged) by the next call that waits, before its own:
        the service answers a session's requests in order. For calls whose
        answer nobody needs (CompleteStep runs on the path of each step's
        tokens; waiting for its "ok" cost a round trip per step).

        A call that settles saves (``_SETTLES``) and finds the connection
        busy is not dropped: dropping a DoomPending would let the next
        CompleteStep publish saves computed on a block that failed its
        check. It is deferred, and the next call that gets the connection
        sends it first (the session's calls stay in order); if the
        connection drops before, the session ends and the service drops
        the saves itself."""
        if not self._lock.acquire(timeout=-1 if lock_wait is None else lock_wait):
            if msg is None:
                pass  # the held Touches go with the call that has the connection, or the next
            elif isinstance(msg, _SETTLES):
                self._deferred.append((self._epoch, msg))
                self.deferred += 1
            else:
                self.failures += 1  # another call is waiting on a service that does not answer
            return None
        try:
            if self._closed.is_set():
                return None
            if self._sock is None:  # down: the client's thread reconnects
                self.failures += 1
                return None
            # The whole call within timeout_s, sends and the answer: a
            # service that reads slowly, or trickles its replies, must not
            # hold the engine longer.
            deadline = time.monotonic() + self.timeout_s
            try:
                assert self._sock is not None
                self._send_deferred_locked(deadline)
                frames = self._touch_frames_locked()
                mid = self._next_id
                if msg is not None:
                    self._next_id += 1
                    msg.id = mid  # type: ignore[attr-defined]
                    frames.append(wire.encode(msg))
                wire.time_left(self._sock, deadline)
                self._sock.sendall(b"".join(frames))
                if msg is None:
                    return wire.Ok(mid)
                if not wait and len(self._unanswered) < UNANSWERED_MAX:
                    self._unanswered.append((mid, type(msg).__name__))
                    return None
                reply = self._reply_locked(mid, deadline)
            except (OSError, wire.WireError, PoolUnavailable) as err:
                if isinstance(err, TimeoutError):
                    self.stalls += 1
                self._drop_locked(err)
                self.failures += 1
                return None
            self._last_call = time.monotonic()
            if isinstance(reply, wire.Error):
                log.warning("kvtier: the meta service refused %s: %s", type(msg).__name__, reply.message)
                if reply.code == "bad-request":
                    self._drop_locked(reply.message)
                return None
            if not isinstance(msg, wire.Ping):
                self._backoff = BACKOFF_FIRST_S  # the service does real work again
            return reply
        finally:
            if self._deferred and self._sock is not None:
                # Deferred while this call held the connection (the engine's,
                # while the ping thread waited): sent now, not at the next
                # call, which may be a lease's third away on an idle engine.
                try:
                    self._sock.settimeout(self.timeout_s)  # not what the call's deadline left
                    self._send_deferred_locked()
                except OSError as err:
                    self._drop_locked(err)
            self._lock.release()

    def _reply_locked(self, mid: int, deadline: float) -> wire.Reply:
        """The reply to call ``mid``, read after those of the calls sent before it without waiting."""
        assert self._sock is not None
        while True:
            body = wire.recv_frame(self._sock, deadline=deadline)
            if body is None:
                raise PoolUnavailable("connection closed")
            reply = wire.decode_server(body)
            if isinstance(reply, wire.Welcome):
                raise wire.WireError("a reply out of order")
            if self._unanswered and reply.id == self._unanswered[0][0]:
                _, name = self._unanswered.popleft()
                if isinstance(reply, wire.Error):
                    log.warning("kvtier: the meta service refused %s: %s", name, reply.message)
                continue
            if reply.id != mid:
                raise wire.WireError("a reply out of order")
            return reply

    def _hold_touch(self, slots: bytes) -> bool:
        """Hold the Touch of a lookup counted in the ready index (the run's
        ``slots``) for the next call; True when the held ones are due now."""
        now = time.monotonic()
        with self._touch_lock:
            held = self._touches
            if held and held[-1][0] == self._epoch and held[-1][1] == slots:
                held[-1][2] += 1  # the same run again (a request that waits): one Touch
            else:
                if not held:
                    self._touch_since = now
                held.append([self._epoch, slots, 1])
            return len(held) >= TOUCH_RUNS or now - self._touch_since >= TOUCH_HOLD_S

    def _touch_frames_locked(self) -> list[bytes]:
        """The Touches held for this connection, encoded (those held for an
        earlier one are dropped: its session has ended)."""
        if not self._touches:
            return []
        with self._touch_lock:
            held, self._touches = self._touches, []
        frames = []
        for epoch, slots, times in held:
            if epoch == self._epoch:
                frames.append(wire.encode(wire.Touch(self._next_id, slots, min(times, wire.TOUCH_TIMES_MAX))))
                self._next_id += 1
        return frames

    def _send_deferred_locked(self, deadline: float | None = None) -> None:
        """Send the deferred calls, each by ``deadline`` when one is given."""
        assert self._sock is not None
        while self._deferred:
            if deadline is not None:
                wire.time_left(self._sock, deadline)
            epoch, earlier = self._deferred.popleft()
            if epoch == self._epoch:  # else made for a session that has ended
                self._send_unanswered_locked(earlier)

    def _send_unanswered_locked(self, msg: msgspec.Struct) -> None:
        """Send ``msg`` without waiting for its reply (read by a later call)."""
        assert self._sock is not None
        mid = self._next_id
        self._next_id += 1
        msg.id = mid  # type: ignore[attr-defined]
        self._sock.sendall(wire.encode(msg))
        self._unanswered.append((mid, type(msg).__name__))

    def _ping_loop(self) -> None:
        while True:
            welcome = self._welcome
            period = (welcome.lease_ttl_ms / 3000) if welcome else 1.0
            # Connected: wake when the session will have been idle a period
            # (a call since the last wake moves that on), so that it is never
            # silent much longer than ttl / 3.
            wait = period - (time.monotonic() - self._last_call) if self._sock is not None \
                else self._retry_at - time.monotonic()
            self._wake.wait(max(0.05, wait))
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                if self._sock is None:
                    if time.monotonic() >= self._retry_at:
                        self._reconnect()  # down: reconnect without waiting for a request
                elif time.monotonic() - self._last_call >= period:
                    self._call(wire.Ping(0), lock_wait=None)  # idle: keep the leases
                elif self._touches:
                    self._call(None, lock_wait=None)  # lookups held since the last call
            except Exception:  # noqa: BLE001 - the pinger must outlive any one failure
                log.exception("kvtier: pinging the meta service failed")

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def session(self) -> int:
        return self._welcome.session if self._welcome else 0

    @property
    def epoch(self) -> int:
        """Connections made so far: slots from calls under one epoch mean
        nothing under another (the session that held them has ended)."""
        return self._epoch

    # --- Placement --------------------------------------------------------

    @property
    def arena_path(self) -> str:
        return self._welcome.arena if self._welcome else ""

    @property
    def num_slots(self) -> int:
        return self._welcome.num_slots if self._welcome else 0

    def probe(self, keys: Sequence[bytes]) -> Probe:
        if not keys or self._closed.is_set():
            return Probe(0, 0)
        blob = wire.pack_keys(keys)
        head, ahead = 0, b""  # the leading run counted in the service's ready index, and its slots
        hangup = self._hangup
        if self.map_ready and self._sock is not None and hangup is not None and not hangup.poll(0):
            ready = self._mapped("ready", ReadyMap.attach)
            # The last key first: one not held ends the run before the end
            # (a conversation's next turn), and the service counts it whole.
            run = ready.leading(np.frombuffer(blob, dtype="<u8").reshape(-1, 2)) \
                if ready is not None and ready.holds(bytes(blob[-KEY_BYTES:])) else None
            if run is not None and run[0]:
                head, ahead = run[0], run[1].astype("<i4").tobytes()
            if head == len(keys):
                # Counted without a call; the service is told the run's slots
                # (its tallies, the blocks' recency) with the next call.
                if self._hold_touch(ahead):
                    self._call(None, lock_wait=0)  # due: sent now, unless a call has the connection
                    if self._sock is None:
                        return Probe(0, 0)  # down: a miss, as any lookup now
                self.mapped_lookups += 1
                return Probe(head, head)
        # The service counts the rest (SSD, moves, the cluster), told the
        # head's slots with it: one lookup, counted once.
        r = self._call(wire.Probe(0, blob[head * KEY_BYTES :] if head else blob, ahead))
        if not isinstance(r, wire.ProbeReply) or not 0 <= r.ready <= r.total <= len(keys) - head \
                or not 0 <= r.remote <= r.total - r.ready:
            return Probe(0, 0)  # down, or an answer that cannot be right: a miss
        self.mapped_heads += head > 0
        return Probe(head + r.ready, head + r.total, r.remote)

    def promote(self, keys: Sequence[bytes]) -> int:
        r = self._call(wire.Promote(0, wire.pack_keys(keys)))
        return r.n if isinstance(r, wire.Count) else 0

    def wait_progress(self, timeout_s: float) -> None:
        if self._call(wire.WaitProgress(0, max(1, int(timeout_s * 1000)))) is None:
            time.sleep(min(timeout_s, 0.001))

    def pin(self, keys: Sequence[bytes], step: int) -> list[int | None]:
        r = self._call(wire.Pin(0, step, wire.pack_keys(keys))) if keys else None
        if not isinstance(r, wire.Slots) or len(r.slots) != len(keys):
            return [None] * len(keys)
        return [None if x < 0 else x for x in r.slots]

    def prepare_save(self, keys: Sequence[bytes], step: int) -> SaveSlots:
        r = self._call(wire.PrepareSave(0, step, wire.pack_keys(keys))) if keys else None
        if not isinstance(r, wire.Slots) or len(r.slots) != len(keys):
            # Pool down: the saves are dropped, not retried (they are settled).
            return SaveSlots([None] * len(keys), placed=len(keys))
        return SaveSlots([None if x < 0 else x for x in r.slots], placed=min(max(r.placed, 0), len(keys)))

    def complete_step(self, step: int, failed_slots: Iterable[int] = (), all_failed: bool = False) -> None:
        self._call(wire.CompleteStep(0, step, list(failed_slots), all_failed), wait=False)

    def flush(self) -> bool:
        """Wait until the service has answered every call sent without
        waiting (complete_step): what they did is then visible to every
        session. False when the pool is down."""
        return self._call(wire.Ping(0)) is not None

    def abandon_saves(self, step: int) -> int:
        r = self._call(wire.AbandonSaves(0, step))
        return r.n if isinstance(r, wire.Count) else 0

    def discard(self, keys: Iterable[bytes]) -> int:
        r = self._call(wire.Discard(0, wire.pack_keys(keys)))
        return r.n if isinstance(r, wire.Count) else 0

    def doom_pending(self, after_step: int) -> int:
        r = self._call(wire.DoomPending(0, after_step))
        return r.n if isinstance(r, wire.Count) else 0

    def reset(self) -> int:
        r = self._call(wire.Reset(0))
        return r.n if isinstance(r, wire.Count) else 0

    def counters(self) -> dict[str, int]:
        """The pool's counters: read from the service's counters page
        (pool/statspage.py: shared memory, no call), else asked of the
        service at most every ``COUNTERS_EVERY_S``. vLLM asks every engine
        step, before the step's tokens go out; as a call, under load each
        waited ~0.8 ms on average for the service (230 of an instance's
        first 300 calls in bench/pool.py's throughput phase), and 1.6 ms on
        a pool hit's first token. They are the node's counts, a tenth of a
        second old at most; the service's /metrics has them exact."""
        page = self._counters_page()
        if page is not None:
            values = page.read()
            if values is not None:
                return values
        now = time.monotonic()
        if self._counters_at < 0 or now - self._counters_at >= COUNTERS_EVERY_S:
            r = self._call(wire.Counters(0))
            if isinstance(r, wire.CounterValues):
                self._last_counters = dict(r.values)
                self._counters_at = now
        return dict(self._last_counters)

    def _counters_page(self) -> StatsPage | None:
        return self._mapped("stats", StatsPage.attach)  # type: ignore[return-value]

    def _mapped(self, kind: str, attach: Callable[[str], SharedFile]) -> Any:
        """The file of ``kind`` (a field of the Welcome: "stats", "ready")
        that the current session's service named, mapped on first use and
        again after a reconnection to another service; None if it named
        none or it cannot be mapped (asked of the service instead)."""
        welcome = self._welcome
        path = getattr(welcome, kind) if welcome is not None and not self._closed.is_set() else ""
        have = self._maps.get(kind)
        if have is not None and have.path == path:
            return have
        if have is not None:
            self._maps.pop(kind, None)  # shutdown() may have taken it meanwhile
            have.close()
        if not path or path == self._unmappable.get(kind):
            return None
        try:
            mapped = attach(path)
        except (OSError, ValueError) as err:
            log.info("kvtier: cannot map the pool's %s file %s (%s); asking the service instead", kind, path, err)
            self._unmappable[kind] = path
            return None
        if self._closed.is_set():  # shut down while it was mapped: never kept
            mapped.close()
            return None
        self._maps[kind] = mapped
        return mapped

    def shutdown(self) -> None:
        """Close the session; the service releases whatever it still holds of it."""
        self._closed.set()
        self._wake.set()
        for kind in list(self._maps):  # a probe of the scheduler's may be reading one: see ReadyMap.close
            mapped = self._maps.pop(kind, None)
            if mapped is not None:
                mapped.close()
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
