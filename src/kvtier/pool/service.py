"""The meta service: one pool per node, shared by every vLLM instance on it.

Runs as its own process (``kvtier meta``). It owns the node's store
(store.py: index, slots, pins, watermarks; the SSD tier and its I/O threads
below it) and the shared-memory DRAM arena the store hands slots of;
instances reach it over a local socket (wire.py) and their workers map the
arena and copy blocks themselves, as with the embedded backend.

This module is the shell around the store: the listening socket, one
thread per connection, sessions and their leases, and the pool's creation.

* **Sessions.** A connection opens one with ``Hello``; the session's id is
  the store ``owner`` of everything it pins and saves, so instances' step
  numbers never meet. A session ends when its connection closes (process
  gone) or when nothing arrived from it for ``lease_ttl_ms`` (a hung
  client; clients ping while idle): the store then releases its pins and
  drops its unwritten saves (:meth:`TieredStore.end_session`), and the
  accounting is checked (:meth:`MetaService.accounting`).
* **The pool** is made on the first ``Hello``, in that instance's slot
  geometry (ranks, bytes per rank), or with parts of
  ``ServiceOptions.slot_rank_bytes`` (``kvtier.slot_rank_bytes``) when set.
  An instance with as many ranks whose blocks fit the parts shares it
  (another model: its keys never meet the others'); one with other ranks,
  or larger blocks, is refused with a line saying so (its connector stays
  off, its engine runs).
  The arena is named after the service's address plus a random tag. A
  restarted service adopts the arena a killed one left (same file, so the
  mappings workers hold stay valid): every block sealed by all ranks whose
  checksums still hold is served again; other leftover arenas of its
  address are removed.
* **Safety.** A Unix socket is made mode 0600 in a 0700 folder; TCP binds
  what the URL names (loopback by default); with a token set, a ``Hello``
  without it (compared in constant time) is refused. A malformed frame
  gets an ``Error`` and the connection is closed; other sessions go on.
"""

from __future__ import annotations

import fcntl
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import xxhash

from kvtier.config import ClusterConfig, KvtierConfig
from kvtier.errors import ConfigError
from kvtier.keys import PackedKeys
from kvtier.placement import close_store, open_store
from kvtier.pool import wire
from kvtier.pool.readymap import ReadyMap
from kvtier.pool.statspage import StatsPage
from kvtier.store import TieredStore
from kvtier.tier.dram import PART_ALIGN, DramTier, remove_stale_files
from kvtier.tier.ssd import recorded_layout

log = logging.getLogger(__name__)

ARENA_PREFIX = "kvtier-pool-"
STATS_PREFIX = "kvtier-poolstats-"  # the counters page beside the arena (pool/statspage.py)
READY_PREFIX = "kvtier-poolready-"  # the ready index beside it (pool/readymap.py)
STATS_EVERY_S = 0.1  # how often the counters page is rewritten
HELLO_MAX = 64 << 10  # bytes a handshake may take, before the client is known
HELLO_WAIT_S = 10.0  # the whole Hello must arrive within this long of the connection
# Connections still in their handshake at once (each a thread and a
# descriptor, for HELLO_WAIT_S at most); past this, a new one is closed at
# once, so that peers that connect and stall cannot use up the service's
# descriptors. Sessions (a Hello taken, with the token when one is set) are
# not counted: an instance that has one is never refused for this.
MAX_HANDSHAKES = 64
# Instance names kept one by one in the lookup counts after their last
# session ended. An instance is named after its process (``model@pid``), so
# every restart brings a new name: past this many, the oldest ended name's
# counts are added to ENDED_INSTANCES, and memory and /metrics' label sets
# stay bounded however often instances come and go.
ENDED_NAMES_KEPT = 64
ENDED_INSTANCES = "(ended)"  # no instance has it: wire.instance_name() takes a leading "(" off
_LOW_STEP = -(1 << 62)


def parse_url(url: str) -> tuple[str, str, int]:
    """``tcp://host:port`` -> ("tcp", host, port); ``unix:///path`` -> ("unix", path, 0)."""
    if url.startswith("unix://"):
        path = url[len("unix://"):]
        if not path.startswith("/"):
            raise ConfigError("meta_service_url", url,
                              "a unix socket needs an absolute path: unix:///run/kvtier/meta.sock")
        return "unix", path, 0
    if url.startswith("tcp://"):
        host, sep, port = url[len("tcp://"):].rpartition(":")
        if sep and host and port.isascii() and port.isdigit() and 0 <= int(port) < 65536:
            return "tcp", host.strip("[]"), int(port)
    raise ConfigError("meta_service_url", url, "expected tcp://HOST:PORT or unix:///PATH")


@dataclass
class Session:
    id: int
    name: str
    pid: int
    conn: socket.socket
    peer: str
    promote_timeout_s: float = 0.0  # its scheduler's wait for moves (Hello.promote_timeout_ms)
    last_seen: float = field(default_factory=time.monotonic)
    ended: bool = False
    calls: int = 0
    # Held while a call runs: a session ended by its lease meanwhile is
    # ended after the call, so nothing it pinned or took outlives it.
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class ServiceOptions:
    url: str = "tcp://127.0.0.1:5000"
    store: KvtierConfig = field(default_factory=KvtierConfig)
    lease_ttl_ms: int = 10_000
    # How long slots a dead session was writing stay out of use (its workers
    # may still write); None: three lease periods.
    slot_grace_ms: int | None = None
    token: str | None = None
    name: str = ""  # names the arena; by default from the URL
    cluster: ClusterConfig | None = None  # the cluster tier under the pool (kvtier.cluster.*), or none
    # Bytes of a slot's part for each rank (kvtier.slot_rank_bytes): the
    # largest of the models that share the pool; None: the first instance's.
    slot_rank_bytes: int | None = None


def _stems(opts: ServiceOptions) -> tuple[str, str, str]:
    """Where the service's arenas, counters pages and ready indexes go: shm_dir/prefix-TAG-*."""
    tag = opts.name or xxhash.xxh64_hexdigest(opts.url.encode())[:12]
    return tuple(os.path.join(opts.store.shm_dir, f"{prefix}{tag}-")  # type: ignore[return-value]
                 for prefix in (ARENA_PREFIX, STATS_PREFIX, READY_PREFIX))


def leftover_bytes(opts: ServiceOptions) -> int:
    """Memory held in shm_dir by files a service of these options left
    (killed): a start removes them or adopts the arena in place, so what
    they hold counts as free for the new pool. A file whose owner still
    holds its lock is a live service's (another container sharing
    /dev/shm, under the same address): it keeps its memory, not counted."""
    stems = _stems(opts)
    shm = opts.store.shm_dir
    total = 0
    try:
        names = os.listdir(shm)
    except OSError:
        return 0
    for name in names:
        path = os.path.join(shm, name)
        if not path.startswith(stems):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            total += os.fstat(fd).st_blocks * 512
        except OSError:
            pass  # held: its owner lives
        finally:
            os.close(fd)
    return total


def pool_fingerprint(ranks: int, rank_bytes: int) -> bytes:
    """What a pool's blocks are, for its SSD tier's superblock: their geometry."""
    return xxhash.xxh3_128_digest(f"kvtier-pool-v1;ranks={ranks};rank_bytes={rank_bytes}".encode())


def ssd_part_bytes(path: str, ranks: int, at_least: int) -> int | None:
    """The bytes per rank of the pool whose blocks the SSD tier at ``path``
    holds, when they are ``ranks`` parts of at least ``at_least`` bytes;
    else None. The superblock records the slot's size and the fingerprint
    of the geometry: a part is the slot's share rounded up to a page, so
    the part sizes that round to it are tried against the fingerprint."""
    found = recorded_layout(path)
    if found is None:
        return None
    slot_bytes, fingerprint = found
    if slot_bytes % ranks or (slot_bytes // ranks) % PART_ALIGN:
        return None
    stride = slot_bytes // ranks
    for part in range(stride, max(at_least, stride - PART_ALIGN + 1) - 1, -1):
        if pool_fingerprint(ranks, part) == fingerprint:
            return part
    return None


class MetaService:
    def __init__(self, opts: ServiceOptions) -> None:
        self.opts = opts
        self._where = parse_url(opts.url)
        self._arena_stem, self._stats_stem, self._ready_stem = _stems(opts)
        self._stats_page: StatsPage | None = None
        self._ready_map: ReadyMap | None = None
        self._grace_s = (opts.slot_grace_ms if opts.slot_grace_ms is not None else 3 * opts.lease_ttl_ms) / 1000
        self.store: TieredStore | None = None
        self._adoptable: DramTier | None = None  # a dead service's arena, owned now, not yet in use
        self._smaller_seen: set[int] = set()  # bytes per rank of smaller blocks warned about
        self._lock = threading.Lock()
        self._making = threading.Lock()  # held while the pool is made (_pool_for)
        self._sessions: dict[int, Session] = {}
        self._next_session = 1
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.sessions_started = 0
        self.sessions_expired = 0
        self.bad_messages = 0
        self.handshakes = 0  # connections in their handshake now
        self.refused_connections = 0  # closed at once: MAX_HANDSHAKES were in their handshake
        self._refused_logged = float("-inf")
        self.rpc_seconds: Callable[[str, float], None] | None = None  # metrics hook
        self.cluster_master = None  # the MasterSupervisor beside this service (master node), for /metrics
        # Per instance name, kept after its sessions end (the last
        # ENDED_NAMES_KEPT names, oldest first in _ended_names): keys looked
        # up, found in DRAM, found on SSD only, found in the cluster only.
        self._lookups: dict[str, list[int]] = {}
        self._ended_names: dict[str, None] = {}

    @property
    def geometry(self) -> tuple[int, int] | None:
        """The pool's (ranks, bytes per rank's part); None before the first instance."""
        store = self.store
        return None if store is None else (store.tier.ranks, store.tier.rank_bytes)

    # --- lifecycle --------------------------------------------------------

    @property
    def address(self) -> str:
        """Where clients connect (the bound port when the URL asked for port 0)."""
        scheme, host, port = self._where
        if scheme == "unix":
            return f"unix://{host}"
        if self._sock is not None:
            host, port = self._sock.getsockname()[:2]
        return f"tcp://{host}:{port}"

    def start(self) -> None:
        # The arena a killed service left behind is adopted (the newest one,
        # if another service does not hold it): its blocks that still verify
        # are served again once the first instance of its geometry comes.
        stem = os.path.basename(self._arena_stem)
        shm = self.opts.store.shm_dir
        try:
            left = sorted((os.path.join(shm, n) for n in os.listdir(shm) if n.startswith(stem)),
                          key=lambda p: os.stat(p).st_mtime, reverse=True)
        except OSError:
            left = []
        for path in left:
            self._adoptable = DramTier.adopt(path)
            if self._adoptable is not None:
                log.info("kvtier meta: found the arena %s of a service that died; its blocks that verify are "
                         "adopted", path)
                break
        remove_stale_files(shm, os.path.basename(self._stats_stem))
        remove_stale_files(shm, os.path.basename(self._ready_stem))
        removed = remove_stale_files(shm, stem)
        if removed:
            log.info("kvtier meta: removed %d arenas left by a service that died", len(removed))
        if self._where[0] == "unix":
            path = self._where[1]
            folder = os.path.dirname(path)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.path.lexists(path):
                # Only a socket nobody listens on is removed: never a file of
                # someone else's at a mistyped path, nor a live socket.
                if not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise ConfigError("meta_service_url", self.opts.url, "the path exists and is not a socket")
                if not _socket_dead(path):
                    raise ConfigError("meta_service_url", self.opts.url, "another meta service listens there")
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                sock.bind(path)
            finally:
                os.umask(old)
        else:
            _, host, port = self._where
            family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as err:
                sock.close()
                raise ConfigError("meta_service_url", self.opts.url, f"cannot listen there: {err.strerror}") \
                    from None
            if not self.opts.token and not _loopback(str(host)):
                log.warning("kvtier meta: listening on %s, beyond loopback, without a token: any host that "
                            "reaches it can open sessions (probe, pin, save, discard); set kvtier.token (or "
                            "KVTIER_TOKEN) for the service and its instances", self.opts.url)
        sock.listen(64)
        self._sock = sock
        self._spawn(self._accept_loop, "kvtier-meta-accept")
        self._spawn(self._lease_loop, "kvtier-meta-leases")
        self._spawn(self._stats_loop, "kvtier-meta-stats")
        log.info("kvtier meta: listening on %s", self.address)

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> threading.Thread:
        t = threading.Thread(target=target, name=name, args=args, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def stop(self, keep_adoptable: bool = False) -> None:
        """Close the socket and every session, then the store and its arena.
        ``keep_adoptable``: an old arena found at start and not used yet is
        left for the next start (a start that failed)."""
        self._stop.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            if self._where[0] == "unix":
                try:
                    os.unlink(str(self._where[1]))
                except OSError:
                    pass
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            self._end(s, "service stopping")
        # A pool being made is finished first, then closed (by _pool_for,
        # which sees the stop): the process may exit right after this.
        with self._making, self._lock:
            if self.store is not None:
                close_store(self.store)
                self.store = None
            for shared in (self._stats_page, self._ready_map):
                if shared is not None:
                    shared.close()
            self._stats_page = self._ready_map = None
            if self._adoptable is not None:
                if keep_adoptable:
                    self._adoptable.owner = False  # closed, not removed
                self._adoptable.close()
                self._adoptable = None

    # --- the pool ---------------------------------------------------------

    def _pool_for(self, ranks: int, rank_bytes: int) -> TieredStore:
        # One pool is made at a time, outside self._lock: making it (the
        # arena, the SSD index's recovery, checking an old arena's blocks)
        # may take long, and /health, the metrics and the lease loop take
        # self._lock meanwhile.
        with self._making:
            with self._lock:
                if self._stop.is_set():  # stop() may have closed the store already: none is made after it
                    raise _Refused("stopping", "the meta service is stopping")
                store = self.store
                if store is None:
                    part = self.opts.slot_rank_bytes or rank_bytes
                    if rank_bytes > part:
                        raise _Refused("geometry", f"the instance writes {ranks} rank parts of {rank_bytes} bytes, "
                                                   f"more than the {part} bytes per part kvtier.slot_rank_bytes "
                                                   "gives: raise it, or give the instance a meta service of its own")
                    old, self._adoptable = self._adoptable, None
            if store is None:
                try:
                    store, page, ready = self._make_pool(ranks, part, old, grow=self.opts.slot_rank_bytes is None)
                except BaseException:
                    # A failure the next instance may not meet (an SSD path
                    # not mounted yet): the old arena stays for it to adopt.
                    if old is not None and not old.closed:
                        with self._lock:
                            old, self._adoptable = self._adoptable, old
                        if old is not None:
                            old.close()
                    raise
                with self._lock:
                    if not self._stop.is_set():
                        self.store, self._stats_page, self._ready_map = store, page, ready
                        return store
                close_store(store)  # stop() came while it was made
                for shared in (page, ready):
                    if shared is not None:
                        shared.close()
                raise _Refused("stopping", "the meta service is stopping")
            have_r, have_b = store.tier.ranks, store.tier.rank_bytes
            if ranks != have_r or rank_bytes > have_b:
                # Parts of another count: a block is readable once every
                # part is sealed. Larger blocks: they do not fit a part.
                fix = ("set kvtier.slot_rank_bytes to the largest model's bytes per part (here at least "
                       f"{rank_bytes}) and restart the meta service, or give the instance one of its own"
                       if ranks == have_r else "give it a meta service of its own")
                raise _Refused("geometry", f"this pool holds blocks of {have_r} rank parts of up to {have_b} bytes; "
                                           f"the instance writes {ranks} of {rank_bytes} (another model or parallel "
                                           f"layout): {fix}")
            if rank_bytes < have_b and self.opts.slot_rank_bytes is None and rank_bytes not in self._smaller_seen:
                self._smaller_seen.add(rank_bytes)
                log.warning("kvtier meta: an instance with blocks of %d bytes per rank shares this pool of %d-byte "
                            "parts, which the first instance sized: set kvtier.slot_rank_bytes = %d, or after a "
                            "restart that leaves neither the arena nor an SSD tier the first instance to connect "
                            "sizes the pool again (a smaller one first refuses the larger model)",
                            rank_bytes, have_b, have_b)
            return store

    def _make_pool(self, ranks: int, rank_bytes: int, old: DramTier | None,
                   grow: bool = False) -> tuple[TieredStore, StatsPage | None, ReadyMap | None]:
        """The pool of ``ranks`` parts of ``rank_bytes``, adopting ``old`` (an
        arena a dead service left) when it has the same geometry, or, with
        ``grow`` (no part size configured), as many parts of more bytes:
        the blocks of a larger model that came first; its counters page and
        its ready index in shared memory (None where one could not be made:
        instances ask the service instead)."""
        arena = self._arena_stem + secrets.token_hex(4)
        adopt = old is not None and old.ranks == ranks and (
            old.rank_bytes == rank_bytes or (grow and old.rank_bytes > rank_bytes))
        if adopt:
            assert old is not None
            rank_bytes = old.rank_bytes
        elif grow and self.opts.store.ssd_paths and not self.opts.store.force_new_disk:
            kept = ssd_part_bytes(self.opts.store.ssd_paths[0], ranks, rank_bytes)
            if kept is not None and kept > rank_bytes:
                # No arena left (a clean stop, a reboot), but the SSD tier
                # holds blocks in larger parts: a larger model's. Sized as
                # they are, the tier is recovered and that model still fits.
                log.info("kvtier meta: the SSD tier holds blocks in parts of %d bytes per rank; the pool keeps "
                         "them (this instance writes %d)", kept, rank_bytes)
                rank_bytes = kept
        fingerprint = pool_fingerprint(ranks, rank_bytes)
        if old is not None and not adopt:
            log.info("kvtier meta: the old arena holds another geometry; starting cold")
            old.close()  # owner: removes it
        store = open_store(self.opts.store, arena, rank_bytes, ranks, fingerprint, reaper=False,
                           tier=old if adopt else None, cluster=self.opts.cluster, ready_index=True)
        page = None
        try:
            page = StatsPage.create(self._stats_stem + secrets.token_hex(4))
            page.write(store.counters())
        except OSError as err:  # instances ask for the counters instead
            log.warning("kvtier meta: no counters page in %s (%s); instances ask for counters",
                        self.opts.store.shm_dir, err)
        if adopt:
            try:
                tier = store.tier
                blocks = tier.sealed_blocks()
                n = store.adopt_dram(blocks)
                # Slots the dead service's writers were filling stay out of
                # use for a while: a late write must not land in a new block.
                taken = {slot for _, slot in blocks}
                held = store.hold_slots([x for x in tier.written_slots() if x not in taken],
                                        time.monotonic() + self._grace_s)
                log.info("kvtier meta: %d blocks adopted from the old arena, %d slots held for %.0f s",
                         n, held, self._grace_s)
            except Exception:  # noqa: BLE001 - adoption is an optimisation: start cold instead
                log.exception("kvtier meta: adopting the old arena failed part way")
        ready = None
        try:
            ready = ReadyMap.create(self._ready_stem + secrets.token_hex(4), store.tier.num_slots)
            store.share_ready(ready.memory)
        except Exception as err:  # noqa: BLE001 - an optimisation: instances look up by call instead
            log.warning("kvtier meta: no shared ready index in %s (%s); instances look up by call",
                        self.opts.store.shm_dir, err)
            if ready is not None:
                ready.close()
                ready = None
        t, ssd = store.tier, store.ssd
        log.info("kvtier meta: DRAM pool %s, %d slots of %d bytes (%.2f GiB)", t.path, t.num_slots,
                 t.slot_stride, t.size_bytes / (1 << 30))
        if ssd is not None:
            log.info("kvtier meta: SSD tier on %s: %d slots, %d blocks recovered", ":".join(ssd.paths),
                     ssd.num_slots, store.counters()["ssd_slots_used"])
        return store, page, ready

    # --- connections ------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError as err:
                if self._stop.is_set():
                    return
                # Out of descriptors or memory for a moment: keep serving.
                log.warning("kvtier meta: accept failed (%s); retrying", err)
                time.sleep(0.1)
                continue
            with self._lock:
                full = self.handshakes >= MAX_HANDSHAKES
                if full:
                    self.refused_connections += 1
                else:
                    self.handshakes += 1
            if full:
                conn.close()
                now = time.monotonic()
                if now - self._refused_logged >= 10.0:
                    self._refused_logged = now
                    log.warning("kvtier meta: %d connections in their handshake, the most at once; new ones are "
                                "closed (%d so far)", MAX_HANDSHAKES, self.refused_connections)
                continue
            try:
                threading.Thread(target=self._serve, name="kvtier-meta-conn", args=(conn, str(peer or "unix")),
                                 daemon=True).start()
            except RuntimeError as err:
                log.warning("kvtier meta: cannot start a thread for a connection (%s); closed", err)
                conn.close()
                with self._lock:
                    self.handshakes -= 1

    def _serve(self, conn: socket.socket, peer: str) -> None:
        session: Session | None = None
        handshaking = True
        try:
            conn.settimeout(None)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                session = self._handshake(conn, peer)
            finally:
                with self._lock:
                    self.handshakes -= 1
                handshaking = False
            if session is None:
                return
            while not self._stop.is_set() and not session.ended:
                try:
                    body = wire.recv_frame(conn)
                except wire.WireError as err:  # oversized, or cut off inside a frame
                    self.bad_messages += 1
                    log.warning("kvtier meta: %s (%s) sent a bad frame: %s; connection closed", session.name,
                                peer, err)
                    _send(conn, wire.Error(0, "bad-request", str(err)))
                    return
                if body is None:
                    return
                session.last_seen = time.monotonic()
                try:
                    msg = wire.decode_client(body)
                    if isinstance(msg, wire.Hello):
                        raise wire.WireError("a second Hello in one session")
                    with session.lock:
                        if session.ended:
                            return
                        reply, after = self._handle(session, msg)
                except wire.WireError as err:
                    self.bad_messages += 1
                    log.warning("kvtier meta: %s (%s) sent a bad message: %s; connection closed", session.name,
                                peer, err)
                    _send(conn, wire.Error(0, "bad-request", str(err)))
                    return
                if reply is not None:
                    conn.sendall(wire.encode(reply))
                if after is not None:
                    after()
        except (OSError, wire.WireError) as err:
            if session is None or not session.ended:
                log.info("kvtier meta: connection from %s ended: %s", peer, err)
        except Exception:  # noqa: BLE001 - one connection's failure never stops the service
            log.exception("kvtier meta: connection from %s failed", peer)
        finally:
            if session is not None:
                try:
                    self._end(session, "connection closed")
                except Exception:  # noqa: BLE001 - the socket is closed all the same
                    log.exception("kvtier meta: ending session %d failed", session.id)
            conn.close()
            if handshaking:  # failed before the handshake began
                with self._lock:
                    self.handshakes -= 1

    def _handshake(self, conn: socket.socket, peer: str) -> Session | None:
        try:
            body = wire.recv_frame(conn, max_bytes=HELLO_MAX, deadline=time.monotonic() + HELLO_WAIT_S)
            if body is None:
                return None
            msg = wire.decode_client(body)
        except (wire.WireError, OSError) as err:
            self.bad_messages += 1
            log.warning("kvtier meta: bad handshake from %s: %s", peer, err)
            _send(conn, wire.Error(0, "bad-request", f"expected Hello: {err}"))
            return None
        conn.settimeout(None)
        if not isinstance(msg, wire.Hello):
            self.bad_messages += 1
            _send(conn, wire.Error(0, "bad-request", "expected Hello first"))
            return None
        name = wire.instance_name(msg.name) or f"pid {msg.pid}"
        if msg.version != wire.PROTOCOL_VERSION:
            _send(conn, wire.Error(0, "version", f"protocol {msg.version} asked, this service speaks "
                                                 f"{wire.PROTOCOL_VERSION}: run the same kvtier version"))
            return None
        if self.opts.token and not hmac.compare_digest(msg.token.encode(), self.opts.token.encode()):
            log.warning("kvtier meta: %s (%s) gave no valid token; refused", name, peer)
            _send(conn, wire.Error(0, "auth", "the meta service requires its token (KVTIER_TOKEN)"))
            return None
        if not self.opts.token:
            # Without a token, TCP on loopback takes what the Unix socket
            # (mode 0600) and the arena take: this user's processes (and root's).
            uid = loopback_peer_uid(conn)
            if uid is not None and uid not in (os.geteuid(), 0):
                log.warning("kvtier meta: %s (%s) runs as uid %d, not this service's; refused (set kvtier.token "
                            "to share the pool with other users)", name, peer, uid)
                _send(conn, wire.Error(0, "auth", f"this meta service takes local connections of uid "
                                                  f"{os.geteuid()} only (or those with its token, KVTIER_TOKEN)"))
                return None
        try:
            if not (1 <= msg.ranks <= 8 and 0 < msg.rank_bytes <= 1 << 34):
                raise _Refused("geometry", f"{msg.ranks} ranks of {msg.rank_bytes} bytes is not a block geometry")
            store = self._pool_for(msg.ranks, msg.rank_bytes)
        except _Refused as err:
            log.warning("kvtier meta: refused %s (%s): %s", name, peer, err.message)
            _send(conn, wire.Error(0, err.code, err.message))
            return None
        except ConfigError as err:  # this configuration makes no pool: said to the instance's operator
            log.error("kvtier meta: cannot make the pool: %s", err)
            _send(conn, wire.Error(0, "config", f"the pool could not be made: {err}"))
            return None
        except OSError as err:  # the instance tries again later: the service stays up
            log.error("kvtier meta: cannot make the pool: %s", err)
            _send(conn, wire.Error(0, "internal", f"the pool could not be made: {err}"))
            return None
        with self._lock:
            sid = self._next_session
            self._next_session += 1
            session = Session(sid, name, msg.pid, conn, peer, msg.promote_timeout_ms / 1000)
            self._sessions[sid] = session
            self._set_stall_limit_locked()
            self._ended_names.pop(session.name, None)
            self.sessions_started += 1
        page, ready = self._stats_page, self._ready_map
        try:
            conn.sendall(wire.encode(wire.Welcome(wire.PROTOCOL_VERSION, sid, store.tier.path, store.tier.num_slots,
                                                  self.opts.lease_ttl_ms, store.ssd is not None,
                                                  page.path if page is not None else "",
                                                  ready.path if ready is not None else "")))
        except OSError as err:  # the client gave up waiting: no session was started
            self._end(session, f"the Welcome could not be sent ({err})")
            return None
        log.info("kvtier meta: session %d: %s (pid %d) from %s", sid, session.name, msg.pid, peer)
        return session

    def _handle(self, s: Session, msg: wire.Request) -> tuple[wire.Reply | None, Callable[[], None] | None]:
        """The reply to ``msg`` (None: none is sent), and what is left to do once it is sent."""
        store = self.store
        if store is None:
            return (None if isinstance(msg, wire.Touch) else wire.Error(msg.id, "internal", "the pool is closed")), None
        t0 = time.perf_counter()
        s.calls += 1
        owner = s.id
        reply: wire.Reply | None
        # store.settle() once the answer is sent: the recency of what a probe
        # counted, and the ready index's changes (at once for a block that
        # left it: instances read the index without a call).
        refresh = not isinstance(msg, (wire.Counters, wire.Ping, wire.WaitProgress))
        if isinstance(msg, wire.Touch):
            # The instance counted the run in the shared ready index and does
            # not wait: counted here for the tallies, stamped for the recency.
            slots = np.frombuffer(msg.slots, dtype="<i4").astype(np.intp)
            store.touched(slots, times=msg.times)
            self._tally(s, len(slots) * msg.times, len(slots) * msg.times)
            reply = None
        elif isinstance(msg, wire.Probe):
            # The keys stay one buffer: the store's ready index reads them as
            # an array, and bytes objects are made only for what the probe
            # goes on to look at key by key, and for the recency.
            keys = PackedKeys(msg.keys)
            # The recency of the run found is refreshed after the answer is
            # sent (near half the probe's time for 4,096 keys): the instance's
            # scheduler waits for the count only.
            p = store.probe(keys, refresh=False)
            refresh = p.total > p.remote or bool(msg.ahead)
            ahead = 0
            if msg.ahead:
                # The head of the lookup, counted by the instance in the shared
                # ready index: stamped after the rest, so that it comes out
                # the more recent (a prefix's head outlives its tail).
                slots = np.frombuffer(msg.ahead, dtype="<i4").astype(np.intp)
                store.touched(slots, lookup=False)
                ahead = len(slots)
            self._tally(s, ahead + len(keys), ahead + p.ready, p.total - p.ready - p.remote, p.remote)
            reply = wire.ProbeReply(msg.id, p.ready, p.total, p.remote)
        elif isinstance(msg, wire.Pin):
            keys = wire.unpack_keys(msg.keys)
            reply = wire.Slots(msg.id, [-1 if x is None else x for x in store.pin(keys, msg.step, owner=owner)],
                               len(keys))
        elif isinstance(msg, wire.PrepareSave):
            got = store.prepare_save(wire.unpack_keys(msg.keys), msg.step, owner=owner)
            reply = wire.Slots(msg.id, [-1 if x is None else x for x in got], got.placed)
        elif isinstance(msg, wire.CompleteStep):
            failed = range(store.tier.num_slots) if msg.all_failed else msg.failed_slots
            store.complete_step(msg.step, failed_slots=failed, owner=owner)
            reply = wire.Ok(msg.id)
        elif isinstance(msg, wire.Promote):
            reply = wire.Count(msg.id, store.promote(wire.unpack_keys(msg.keys)))
        elif isinstance(msg, wire.WaitProgress):
            store.wait_progress(min(max(msg.timeout_ms, 0), 100) / 1000)
            reply = wire.Ok(msg.id)
        elif isinstance(msg, wire.AbandonSaves):
            reply = wire.Count(msg.id, store.abandon_saves(msg.step, owner=owner))
        elif isinstance(msg, wire.Discard):
            reply = wire.Count(msg.id, store.discard(wire.unpack_keys(msg.keys)))
        elif isinstance(msg, wire.DoomPending):
            reply = wire.Count(msg.id, store.doom_pending(msg.after_step, owner=owner))
        elif isinstance(msg, wire.Reset):
            # Other instances' blocks stay: the instance's new key seed keeps
            # it from its own old ones; what it has in flight is dropped.
            reply = wire.Count(msg.id, store.doom_pending(_LOW_STEP, owner=owner))
        elif isinstance(msg, wire.Counters):
            reply = wire.CounterValues(msg.id, store.counters())
        elif isinstance(msg, wire.Ping):
            reply = wire.Ok(msg.id)
        else:  # pragma: no cover - the decoder admits only the types above
            raise wire.WireError(f"unexpected {type(msg).__name__}")
        spent = time.perf_counter() - t0
        if refresh:
            return reply, lambda: self._refresh(store, type(msg).__name__, spent)
        if self.rpc_seconds is not None:
            self.rpc_seconds(type(msg).__name__, spent)
        return reply, None

    def _tally(self, s: Session, asked: int, dram: int, ssd: int = 0, remote: int = 0) -> None:
        """Count a lookup of ``s``'s: keys asked, found in DRAM, on SSD only, in the cluster only."""
        with self._lock:
            tally = self._lookups.setdefault(s.name, [0, 0, 0, 0])
            tally[0] += asked
            tally[1] += dram
            tally[2] += ssd
            tally[3] += remote

    def _refresh(self, store: TieredStore, call: str, spent: float) -> None:
        """A call's second part, after its answer: the recency of the run a
        probe counted, the ready index's changes a completed step made."""
        t0 = time.perf_counter()
        store.settle()
        if self.rpc_seconds is not None:  # the call's whole time in the service, the send left out
            self.rpc_seconds(call, spent + time.perf_counter() - t0)

    # --- leases -----------------------------------------------------------

    def _stats_loop(self) -> None:
        """Rewrite the counters page a few times a second (instances read it: no call)."""
        while not self._stop.wait(STATS_EVERY_S):
            with self._lock:
                store = self.store
            if store is None:
                continue
            try:
                # The ready index's changes that no call has settled (blocks
                # made READY, or freed by the I/O threads, while all were idle).
                store.flush_ready()
                values = store.counters()
                with self._lock:  # stop() closes the page under it
                    if self._stats_page is not None and not self._stop.is_set():
                        self._stats_page.write(values)
            except Exception:  # noqa: BLE001 - statistics never stop the service
                log.exception("kvtier meta: writing the counters page failed")

    def _lease_loop(self) -> None:
        ttl = self.opts.lease_ttl_ms / 1000
        every = min(1.0, ttl / 4)
        while not self._stop.wait(every):
            try:
                now = time.monotonic()
                with self._lock:
                    store = self.store
                    # Silent for over ttl - every: ended by the time it has
                    # been silent for ttl (the next pass comes within
                    # ``every``). A live client pings every ttl / 3.
                    late = [s for s in self._sessions.values() if not s.ended and now - s.last_seen > ttl - every]
                # Silent sessions first: their pins go with them (not counted
                # as expired pins below).
                for s in late:
                    if self._end(s, f"nothing heard for {self.opts.lease_ttl_ms} ms"):
                        self.sessions_expired += 1
                if store is not None:
                    store.release_held(now)
                    # A live instance with a step open for a whole lease and no
                    # step completed meanwhile: its engine is stuck (its client
                    # still pings); the step's pins end here.
                    expired = store.expire_pins(now - ttl)
                    if expired:
                        log.warning("kvtier meta: %d pins of steps open for over %d ms released (an instance's "
                                    "engine completed no step meanwhile; a load still to come is checked by "
                                    "its checksum)", expired, self.opts.lease_ttl_ms)
            except Exception:  # noqa: BLE001 - leases must keep ending whatever one pass met
                log.exception("kvtier meta: ending expired leases failed; retrying")

    def _end(self, s: Session, why: str) -> bool:
        """End ``s`` (False: it had ended already)."""
        with s.lock:
            with self._lock:
                if s.ended:
                    return False
                s.ended = True
                store = self.store
            pins = pending = 0
            try:
                if store is not None:
                    pins, pending = store.end_session(s.id, hold_until=time.monotonic() + self._grace_s)
            finally:
                # Listed until its pins and saves are released: a client
                # gone from /health has nothing left in the pool.
                with self._lock:
                    self._sessions.pop(s.id, None)
                    self._set_stall_limit_locked()
                    self._name_ended_locked(s.name)
        log.info("kvtier meta: session %d (%s) ended: %s; %d pins released, %d unwritten saves dropped",
                 s.id, s.name, why, pins, pending)
        try:
            s.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def _set_stall_limit_locked(self) -> None:
        """The pool counts a move into DRAM as stalled (a miss to lookups)
        after the longest wait of a live instance's scheduler or this
        service's own ``promote_timeout_s`` (5 s at least): no scheduler is
        cut short of the wait it was told (the embedded store takes its one
        instance's, placement.open_store)."""
        if self.store is not None:
            self.store.wait_for_moves(self.opts.store.promote_timeout_s,
                                      *(s.promote_timeout_s for s in self._sessions.values()))

    def _name_ended_locked(self, name: str) -> None:
        """A session named ``name`` ended: once no live one has the name, it
        joins the ended names, and the oldest past ENDED_NAMES_KEPT is folded
        into ENDED_INSTANCES."""
        if any(other.name == name for other in self._sessions.values()):
            return
        self._ended_names.pop(name, None)
        self._ended_names[name] = None
        while len(self._ended_names) > ENDED_NAMES_KEPT:
            oldest = next(iter(self._ended_names))
            del self._ended_names[oldest]
            tally = self._lookups.pop(oldest, None)
            if tally is not None:
                folded = self._lookups.setdefault(ENDED_INSTANCES, [0, 0, 0, 0])
                for i, n in enumerate(tally):
                    folded[i] += n

    # --- queries ----------------------------------------------------------

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def lookups_by_instance(self) -> dict[str, tuple[int, int, int, int]]:
        """Instance name -> (keys looked up, found readable in DRAM, found to be read back from SSD first,
        found in the cluster only). "DRAM" is the leading run of keys readable there at once; the keys
        after it that were found (on SSD, being promoted, or in DRAM after such a key) count as SSD: the
        load waits for them to be in DRAM. Names of instances gone longer than the last ENDED_NAMES_KEPT
        are summed under ENDED_INSTANCES."""
        with self._lock:
            return {name: (a, b, c, d) for name, (a, b, c, d) in self._lookups.items()}

    def key_info(self, key: bytes) -> dict[str, object]:
        """Where the pool holds ``key`` (read-only: no recency change)."""
        store = self.store
        info = store.key_info(key) if store is not None else None
        return {"key": key.hex(), "found": info is not None, **(info or {})}

    def tier_paths(self) -> list[str]:
        store = self.store
        if store is None:
            return []
        return [store.tier.path] + ([":".join(store.ssd.paths)] if store.ssd is not None else [])

    def accounting(self) -> dict[str, int]:
        """Slots by who holds them. ``free`` (the free list), ``used``
        (under an index entry) and ``held`` (slots of ended sessions, or of
        an adopted arena, kept out of use for the grace period) are counted
        each from where it is kept, at one moment: they add up to ``total``
        unless a slot was lost or given out twice. ``pins`` and
        ``pending``: what live sessions hold; ``pinned_entries`` and ``unsettled_entries``: what the
        store holds, whoever for (PROMOTING included). Once every session
        that held something has ended, both pairs are 0: nothing outlives
        its owner."""
        store = self.store
        if store is None:
            return {"total": 0, "used": 0, "free": 0, "held": 0, "pins": 0, "pending": 0, "pinned_entries": 0,
                    "unsettled_entries": 0}
        with self._lock:
            ids = list(self._sessions)
        pins = pending = 0
        for sid in ids:
            p, q = store.session_holds(sid)
            pins += p
            pending += q
        st = store.statistics()
        total, free, used, held = store.slot_counts()
        return {"total": total, "used": used, "free": free, "held": held,
                "pins": pins, "pending": pending, "pinned_entries": st.pinned_slots,
                "unsettled_entries": st.pending_slots}


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _send(conn: socket.socket, msg: msgspec.Struct) -> None:
    try:
        conn.sendall(wire.encode(msg))
    except OSError:
        pass


def _loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name) is this machine's loopback only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_peer_uid(conn: socket.socket) -> int | None:
    """The user owning the other end of ``conn``, a TCP connection from
    this host's loopback (the uid column of /proc/net/tcp or tcp6, in the
    service's network namespace); None for any other connection, or when
    the table does not list it (it cannot tell)."""
    if conn.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        peer, local = conn.getpeername(), conn.getsockname()
        ip = ipaddress.ip_address(peer[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            return None
        table = "/proc/net/tcp" if conn.family == socket.AF_INET else "/proc/net/tcp6"
        want = (_proc_address(conn.family, peer[0], peer[1]), _proc_address(conn.family, local[0], local[1]))
        with open(table) as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) > 7 and (fields[1], fields[2]) == want:
                    return int(fields[7])
    except (OSError, ValueError):
        return None
    return None


def _proc_address(family: int, host: str, port: int) -> str:
    """``host:port`` as /proc/net/tcp writes it: the address's 32-bit words
    in this machine's byte order, then the port, in hex."""
    raw = socket.inet_pton(family, host.split("%")[0])
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _socket_dead(path: str) -> bool:
    """True only when connecting is refused: a socket left by a dead service."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()
