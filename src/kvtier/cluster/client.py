"""MooncakeTier: the node pool's side of the cluster tier, a Mooncake Store client.

Runs in the process that owns the node's arena (the meta service,
``kvtier meta`` or ``kvtier local``), called from the store's
:class:`~kvtier.movers.ClusterMover` threads, never from the store's lock
or the scheduler's path. It imports ``mooncake`` (the ``kvtier[cluster]``
extra) only in :meth:`connect`.

Order of calls::

    tier = MooncakeTier(cfg, arena)       # nothing connected
    tier.connect()                        # setup, arena registered; ClusterError if the master is away
    tier.exists(keys)       -> [bool]     # batch_is_exist
    tier.fetch(keys, slots) -> [Fetched]  # batch_get_into_multi_buffers, straight into arena slots
    tier.publish(keys, slots) -> [bool]   # batch_put_from_multi_buffers, straight from arena slots
    tier.capacity() -> int | None         # the memory the nodes lend (a drop: a peer left)
    tier.holds_mark() -> bool             # is this node's mark still in the cluster?
    tier.put_mark() -> bool               # put it (again)
    tier.close()                          # removes the mark

Values: a value is the block's 128-byte DRAM slot header (key, a ready mark
per rank, a checksum per rank, each seeded with the key) followed by the
slot's bytes, as the arena holds them; both parts travel zero copy (the
whole arena is registered with Mooncake's transfer engine). A fetch lands
the data in the DRAM slot the store took for it and the header in a staging
buffer; the block counts only if the header names the key, every rank is
marked ready and every rank's bytes match their checksum. Only then is the
arena's header sealed. A value that is torn, flipped, foreign (another
geometry, another writer) or short is a miss (``Fetched.CORRUPT``), never
KV.

Keys: ``kvtier1/<ranks>x<rank_bytes>/<block key hex>``. The block key holds
the model, dtypes, layout and parallel sizes (keys.py), so instances of
different models share one cluster without meeting; the geometry in the
name keeps pools of other slot shapes apart before a byte moves.

The mark: a ``MARK_BYTES`` value under ``kvtier1/mark/<random>``, one per
client, hard-pinned (never evicted for room), put in this node's own
segment when it lends one. A master that restarts starts empty and loses
the mark with everything else: the only sign a client gets (Mooncake's
calls go on working against the new master). A peer that leaves takes the
blocks held in its segment with it; the mark does not tell that, the
cluster's capacity does (:meth:`capacity`, read by the store's mover,
which then asks about what this node published). The store's mover checks the mark
with each health check and, when it is gone, puts it again and counts
everything it had published as unpublished (see ``ClusterMover``). A node
that dies without closing leaves its mark (64 bytes) in the cluster.

Thread safety: Mooncake's client is called from several threads; the
staging buffer of headers is cut in STAGING_REGIONS regions, and each
fetch call holds one while it runs, so a fetch that stalls inside Mooncake
holds up no other.

Highly available master (``kvtier.cluster.etcd_endpoints``): the client is
set up with ``etcd://HOST:PORT;...`` (:func:`master_entry`) and Mooncake
follows the leader etcd names; after a takeover its calls fail until it has
switched and re-mounted its segment (about 10 s in the tests), which the
store's health checks see as the cluster down, then up. Before setup,
:meth:`connect` reads the leader from etcd and requires it to answer on
its port (a stopped leader's port still accepts). Mooncake's close (and its destructor at exit) then waits for
its leader-watch thread, up to 30 s, holding the GIL.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
import queue
from collections.abc import Sequence

from kvtier.cluster import etcd
from kvtier.config import ClusterConfig
from kvtier.errors import ClusterError, ConfigError
import numpy as np
import xxhash

from kvtier.tier.dram import HEADER_BYTES, HEADER_DTYPE, DramTier

log = logging.getLogger(__name__)

KEY_PREFIX = "kvtier1"
STAGING_HEADERS = 1024  # headers staged at once, by all fetch calls together
STAGING_REGIONS = 4  # fetch calls running at once (the mover runs 2); each stages up to a region's headers
REGION_HEADERS = STAGING_HEADERS // STAGING_REGIONS  # bigger batches are split
MARK_BYTES = 64  # this node's mark: a small value whose absence says the cluster lost what the node published
_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND


class Fetched(enum.Enum):
    """How the fetch of one block ended."""

    OK = "ok"  # verified and sealed in its DRAM slot
    GONE = "gone"  # the cluster no longer has it (evicted since the lookup, or its node left)
    CORRUPT = "corrupt"  # it came, but fails its header or checksums (torn, flipped, foreign)
    ERROR = "error"  # the transfer failed (master or peer unreachable, timeout)


def _master_http(cfg: ClusterConfig, path: str, limit: int, timeout_s: float) -> bytes | None:
    """The body of ``path`` on the master's metrics endpoint, None when it does not answer."""
    import http.client
    import urllib.request

    host = f"[{cfg.master_host}]" if ":" in cfg.master_host else cfg.master_host
    try:
        with urllib.request.urlopen(f"http://{host}:{cfg.master_metrics_port}{path}", timeout=timeout_s) as r:
            return r.read(limit)
    except (OSError, ValueError, http.client.HTTPException):  # refused, timed out, cut short, not HTTP
        return None


def master_ready(cfg: ClusterConfig, timeout_s: float = 1.0) -> bool:
    """True when the master's metrics endpoint reports it serving (``service_ready=true``)."""
    body = _master_http(cfg, "/metrics/summary", 1 << 16, timeout_s)
    return body is not None and b"service_ready=true" in body


def master_figures(cfg: ClusterConfig, timeout_s: float = 0.5) -> dict[str, float]:
    """The unlabelled figures of the master's Prometheus ``/metrics`` (name
    -> value: ``master_total_capacity_bytes``, ``master_key_count``, ...);
    {} when it does not answer."""
    body = _master_http(cfg, "/metrics", 1 << 20, timeout_s)
    out: dict[str, float] = {}
    for line in (body or b"").decode("ascii", "replace").splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("#") or "{" in name:
            continue
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def master_entry(cfg: ClusterConfig) -> str:
    """What Mooncake's client is set up with: the master's address, or with
    etcd configured ``etcd://HOST:PORT;...``, from which it finds the leader
    and follows it when a standby takes over."""
    return etcd.entry(cfg.etcd_endpoints) if cfg.etcd_endpoints else cfg.master_address


def _ha_leader(cfg: ClusterConfig) -> str:
    """The leader's ``HOST:PORT`` when it answers (:func:`~kvtier.cluster.master.answers`), else ClusterError."""
    from kvtier.cluster.master import answers

    try:
        where = etcd.leader(cfg.etcd_endpoints)
    except ConfigError as err:
        raise ClusterError(str(err)) from None
    if where is None:
        raise ClusterError(f"no Mooncake master leads yet (etcd at {cfg.etcd_endpoints}: an election under "
                           "way, or no master started)")
    host, _, port = where.rpartition(":")
    if not (port.isascii() and port.isdigit()) or not answers(host.strip("[]"), int(port), timeout_s=0.5):
        raise ClusterError(f"the leading Mooncake master at {where} (named by etcd) does not answer "
                           "(down, stopped or wedged)")
    return where


class MooncakeTier:
    """One node's client of the cluster: its arena, registered, and the calls on it."""

    def __init__(self, cfg: ClusterConfig, tier: DramTier) -> None:
        self.cfg = cfg
        self.tier = tier
        self._store = None
        self._staging: mmap.mmap | None = None
        self._staging_addr = 0
        self._regions: queue.SimpleQueue[int] = queue.SimpleQueue()  # free staging regions
        for r in range(STAGING_REGIONS):
            self._regions.put(r)
        self._replicate = None
        self._mark_rep = None
        self._tag = f"{KEY_PREFIX}/{tier.ranks}x{tier.rank_bytes}/"
        self._mark = f"{KEY_PREFIX}/mark/{os.urandom(12).hex()}"
        self._value_bytes = HEADER_BYTES + tier.slot_stride

    # --- connection -------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._store is not None

    def connect(self) -> None:
        """Set up Mooncake's client against the master and register the arena.
        Raises ClusterError (the master is not there yet: the caller retries)."""
        if self._store is not None:
            return
        # Mooncake logs every call at INFO through glog on stderr; warnings
        # and errors are enough beside kvtier's own lines (read at load).
        os.environ.setdefault("GLOG_minloglevel", "1")
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as err:  # pragma: no cover - the extra's absence is refused at config time
            raise ClusterError(f"the cluster tier needs the kvtier[cluster] extra: {err}") from None
        cfg = self.cfg
        # Mooncake's setup() holds the GIL while it waits on the master: a
        # master that accepts connections and never answers froze the whole
        # meta service (test_cluster.py::test_stalled_lookup...). Its HTTP
        # side must say it serves first, within a bounded wait. Highly
        # available (etcd): the leader etcd names must answer.
        entry = master_entry(cfg)
        if cfg.etcd_endpoints:
            where = _ha_leader(cfg)
        elif not master_ready(cfg):
            raise ClusterError(f"the master at {cfg.master_host}:{cfg.master_metrics_port} (metrics) does not say "
                               "it serves")
        else:
            where = cfg.master_address
        store = MooncakeDistributedStore()
        # local_buffer_size 0: every transfer is zero copy from or into the
        # registered arena, so Mooncake needs no buffer of its own.
        rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.segment_bytes, 0, cfg.protocol,
                         cfg.rdma_devices, entry)
        if rc != 0:
            store.close()
            raise ClusterError(f"Mooncake setup against the master at {entry} failed ({rc})")
        addr, size = self.tier.mapped_range
        # The staged headers, then the mark's bytes (never written by a fetch).
        staging = mmap.mmap(-1, STAGING_HEADERS * HEADER_BYTES + MARK_BYTES)
        staging[-MARK_BYTES:] = b"kvtier mark".ljust(MARK_BYTES, b"\0")
        staging_addr = ctypes.addressof(ctypes.c_char.from_buffer(staging))
        for what, a, n in (("the arena", addr, size), ("the header staging buffer", staging_addr, len(staging))):
            rc = store.register_buffer(a, n)
            if rc != 0:
                store.close()
                raise ClusterError(f"registering {what} with Mooncake failed ({rc})")
        rep = ReplicateConfig()
        rep.replica_num = cfg.replicas
        self._replicate = rep
        mark_rep = ReplicateConfig()
        mark_rep.replica_num = 1
        mark_rep.with_hard_pin = True
        # In this node's own segment: it then goes with a master that
        # restarts (or with this node), not with a peer that leaves.
        mark_rep.preferred_segment = store.get_hostname()
        self._mark_rep = mark_rep
        self._staging, self._staging_addr = staging, staging_addr
        self._store = store
        log.info("kvtier cluster: joined the Mooncake master at %s as %s (lends %d MiB, %s)",
                 where if where == entry else f"{where} (leader, followed through {entry})",
                 cfg.local_hostname, cfg.segment_bytes >> 20, cfg.protocol)

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.remove(self._mark, True)
            except Exception:  # noqa: BLE001 - a mark left behind is 64 bytes; closing goes on
                log.debug("kvtier cluster: removing this node's mark failed", exc_info=True)
            if self.cfg.etcd_endpoints:
                log.info("kvtier cluster: closing the Mooncake client (with etcd this waits for Mooncake's "
                         "leader watch, up to 30 s)")
            try:
                store.close()
            except Exception:  # noqa: BLE001 - closing a client of a dead master must not raise
                log.debug("kvtier cluster: closing the Mooncake client failed", exc_info=True)

    def healthy(self) -> bool:
        """True when connected and the master answers."""
        store = self._store
        return store is not None and store.health_check() == 0

    def capacity(self) -> int | None:
        """The memory the cluster's nodes lend now (the master's
        ``master_total_capacity_bytes``), or None when it cannot say: no
        answer within half a second, or a highly available master (which
        one leads, and at which metrics port, is not known here)."""
        if self.cfg.etcd_endpoints:
            return None
        lent = master_figures(self.cfg).get("master_total_capacity_bytes")
        return None if lent is None else int(lent)

    def holds_mark(self) -> bool:
        """Whether the cluster still holds this client's mark (False before
        :meth:`put_mark`). ClusterError when it cannot say."""
        got = self._client().batch_is_exist([self._mark])
        if len(got) != 1 or got[0] < 0:
            raise ClusterError(f"existence check failed ({min(got, default=-1)})")
        return got[0] == 1

    def put_mark(self) -> bool:
        """Put this client's mark, hard-pinned; True when the cluster took it
        (False: no segment with room, e.g. before the nodes re-joined a
        restarted master)."""
        store = self._client()
        got = store.batch_put_from_multi_buffers(
            [self._mark], [[self._staging_addr + STAGING_HEADERS * HEADER_BYTES]], [[MARK_BYTES]], self._mark_rep)
        return len(got) == 1 and got[0] == 0

    def _client(self):
        store = self._store
        if store is None:
            raise ClusterError("not connected to the cluster's master")
        return store

    def name(self, key: bytes) -> str:
        return self._tag + key.hex()

    # --- calls ------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the cluster holds each key now. ClusterError when it cannot say."""
        if not keys:
            return []
        got = self._client().batch_is_exist([self.name(k) for k in keys])
        if len(got) != len(keys) or any(x < 0 for x in got):
            raise ClusterError(f"existence check failed ({min(got, default=-1)})")
        return [x == 1 for x in got]

    def publish(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """Put each block from its arena ``slot`` (held unchanged by the caller
        until this returns). True where the cluster took it (or had it)."""
        if not keys:
            return []
        tier = self.tier
        hdr0, slot0, stride = tier.header_address(0), tier.slot_address(0), tier.slot_stride
        # Addresses from the mapping's base: a slot_address() call per block cost ~1 us (numpy's ctypes).
        ptrs = [[hdr0 + s * HEADER_BYTES, slot0 + s * stride] for s in slots]
        sizes = [[HEADER_BYTES, stride]] * len(keys)
        got = self._client().batch_put_from_multi_buffers([self.name(k) for k in keys], ptrs, sizes,
                                                          self._replicate)
        if len(got) != len(keys):
            raise ClusterError("put answered for another number of keys")
        return [x == 0 for x in got]

    def fetch(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[Fetched]:
        """Get each block into its arena ``slot`` (taken by the caller, not
        readable by anyone), verify it and seal the slot's header."""
        out: list[Fetched] = []
        for i in range(0, len(keys), REGION_HEADERS):
            out += self._fetch(keys[i : i + REGION_HEADERS], slots[i : i + REGION_HEADERS])
        return out

    def _fetch(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[Fetched]:
        tier = self.tier
        store = self._client()
        staging = self._staging
        assert staging is not None
        region = self._regions.get()  # one is free whenever fewer than STAGING_REGIONS calls run
        try:
            first = region * REGION_HEADERS * HEADER_BYTES
            staged, slot0, stride = self._staging_addr + first, tier.slot_address(0), tier.slot_stride
            ptrs = [[staged + i * HEADER_BYTES, slot0 + s * stride] for i, s in enumerate(slots)]
            sizes = [[HEADER_BYTES, stride]] * len(keys)
            got = store.batch_get_into_multi_buffers([self.name(k) for k in keys], ptrs, sizes)
            if len(got) != len(keys):
                raise ClusterError("get answered for another number of keys")
            view = memoryview(staging)[first : first + REGION_HEADERS * HEADER_BYTES]
            return verify_staged(tier, view, keys, slots, got, self._value_bytes)
        finally:
            self._regions.put(region)


def verify_staged(tier: DramTier, staging: mmap.mmap | bytearray | memoryview, keys: Sequence[bytes],
                  slots: Sequence[int], got: Sequence[int], value_bytes: int) -> list[Fetched]:
    """The outcome of each fetched block, whose header is staged at index
    ``i`` of ``staging`` and whose bytes are in DRAM slot ``slots[i]``
    (``got[i]``: what Mooncake's get answered for it, bytes or an error).
    A block counts only if its value had the full length, its header names
    its key, every rank is marked ready and every rank's bytes match their
    checksum; only then is the slot's header written (sealed), else the
    slot is left as it was (not readable)."""
    ranks = tier.ranks
    m = len(keys)
    if m == 0:
        return []
    # The headers' fields for the whole batch at once (per-field numpy
    # access per block cost as much as the checksums: bench/cluster.py).
    hdrs = np.frombuffer(staging, dtype=HEADER_DTYPE, count=m)
    wanted = np.frombuffer(b"".join(keys), dtype="V16")
    whole = np.fromiter(got, dtype=np.int64, count=m) == value_bytes
    fit = (whole & (hdrs["key"] == wanted) & hdrs["ready"][:, :ranks].all(axis=1)).tolist()
    sums = hdrs["checksum"][:, :ranks].tolist()
    seeds = wanted.view("<u8")[::2].tolist()  # checksum()'s seed: the key's first 8 bytes
    # Each rank's bytes hashed straight from the arena's mapping (what
    # checksum() computes, without a tensor per rank).
    digest = xxhash.xxh3_64_intdigest
    rank_stride, rank_bytes = tier.rank_stride, tier.rank_bytes
    out: list[Fetched] = []
    for i in range(m):
        if fit[i]:
            slot, seed, want = slots[i], seeds[i], sums[i]
            buf = tier.slot_buffer(slot)
            for r in range(ranks):
                if digest(buf[r * rank_stride : r * rank_stride + rank_bytes], seed=seed) != want[r]:
                    break
            else:
                tier.restore_header(slot, staging[i * HEADER_BYTES : (i + 1) * HEADER_BYTES])
                out.append(Fetched.OK)
                continue
            out.append(Fetched.CORRUPT)
        elif got[i] == _NOT_FOUND:
            out.append(Fetched.GONE)
        elif got[i] < 0:
            out.append(Fetched.ERROR)
        else:
            out.append(Fetched.CORRUPT)
    return out
