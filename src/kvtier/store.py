"""TieredStore: the index of what the pool holds, its slots, pins, watermarks and evictions.

Runs in the process that owns the index: vLLM's scheduler process for the
embedded backend, or the pool's service. Data never passes through the
store's callers: workers copy into and out of DRAM slots themselves; the
store hands out slots, publishes them, and decides which blocks move
between DRAM and the SSD tier (accelerator -> DRAM -> SSD; an SSD hit is
promoted back to DRAM, "rewarm", and loaded from there). The moves
themselves, their I/O threads, batches and the SSD write back-off belong to
its :class:`~kvtier.movers.TierMover`; the store is the state machine they
report to, under its lock (the ``_locked`` methods under "moves ending").

Order of calls for one engine step ``s``::

    probe(keys)                   how many leading keys are in DRAM / on SSD
    promote(keys)                 start reading SSD-only keys into DRAM
    pin(keys, s)        -> slots  the DRAM slots a reader will copy from
    prepare_save(keys, s) -> SaveSlots  DRAM slots a writer will fill (PENDING)
    complete_step(s, failed)      writers and readers of step s are done

Several clients may share one store (the pool's service): each is a
session, named by an ``owner`` number (0 for the embedded backend, which
is the only one), and ``pin``, ``prepare_save``, ``complete_step``,
``abandon_saves`` and ``doom_pending`` take it as a keyword. Pins and
PENDING entries are kept per (owner, step), so the clients' step counters
may collide: a step settles, abandons or dooms only its owner's. A client
that dies or whose lease expires is forgotten with ``end_session(owner)``:
its pins are released and the PENDING entries it created are dropped
(``session_holds`` counts both). The entries themselves are shared: a key
saved by one client is found, pinned and evicted for all.

A probe keeps what it reported: a block it counts as readable in DRAM
stays there until the caller pins it (a pending "free once written to SSD"
is cancelled). ``prepare_save`` tells a key already held (nothing to do)
from one that got no slot for lack of room (to be saved in a later step).

DRAM eviction (a save or promotion that would pass ``high_pct``) runs down
to ``low_pct`` in policy order, ``EVICT_SLICE`` blocks more than it needs
per save or promotion until it gets there: a block already on SSD is
freed at once; one that is not is demoted (written to SSD through a bounded queue, freed once
durable), unless DRAM usage is at or above ``dram_watermark_pct``, the
queue is full or SSD writes were given up, when it is freed without a
copy. The SSD tier evicts its own least recently used blocks between its
own watermarks: once a write would pass ``ssd_high_pct``, every SSD slot
taken first frees one bounded batch (:func:`~kvtier.tier.ssd_index.eviction_batch`)
until usage is down to ``ssd_low_pct``, so the store's lock is never held
for a whole high-to-low eviction at once. Ahead of that, once DRAM holds more than ``2 * low - high``
percent, the least recently used blocks without an SSD copy are copied in
the background ("cleaned"), so that the eviction that follows frees them at
once: a promotion or a burst of saves then finds room without waiting for
writes. Blocks without an SSD copy are kept in a recency order of their own
("dirty"), so cleaning looks only at candidates, and every walk stops once
it has what it needs: a step costs what it changes, not the pool's size.

A failed SSD write (a batch of demotions) backs cleaning off (the mover's
back-off): it copies nothing for 2, 4, 8, ... completed steps, and then one
batch at a time until a write succeeds (which resets the count); evictions
still try the one copy of each block they evict, one batch at a time.
After ``DEMOTE_GIVE_UP`` failed batches in a row the store stops writing to
SSD for good (one log line, counted), while SSD reads go on.

``clear`` (vLLM's reset after a weight update) drops every entry not in use
and dooms the rest: pinned, PENDING, PROMOTING and demoting entries become
unreadable at once, are refused at pin, publish, promotion and demotion
completion, and their SSD copies are never published (one written anyway
gets its header emptied). Nothing from before a reset matches after it.

Invariants: PENDING and PROMOTING entries are never readable and never
evicted; pinned and demoting entries are never evicted; doomed entries are
never readable again; a slot (DRAM or SSD) returns to its free list only
once no entry points at it. A PENDING entry is settled (made READY or
dropped) only by a call of the owner that created it, for its step; an
entry's pin count is the number of pins the sessions hold on it, each
released once (at its owner's step or its end_session). Every public
method and every I/O completion takes the store's lock; I/O itself runs
outside it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import operator
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import msgspec
import numpy as np

from kvtier.config import CLUSTER_LOOKUP_WAIT_S
from kvtier.keys import KEY_BYTES, PackedKeys
from kvtier.movers import DEMOTE_GIVE_UP as DEMOTE_GIVE_UP  # re-exported: part of the store's contract
from kvtier.movers import ClusterMover, PromoteJob, RemoteTier, TierMover
from kvtier.movers import Fetched
from kvtier.policy import EvictionPolicy, LruPolicy
from kvtier.ready_index import ReadyIndex
from kvtier.tier import DramTier
from kvtier.tier.ssd import BlockRecord, Recovered, SsdLocation, SsdTier
from kvtier.tier.ssd_index import SlotState, SsdIndex, eviction_batch

_T = TypeVar("_T")
_slot_of = operator.attrgetter("slot")
log = logging.getLogger(__name__)


CLEAR_WAIT_S = 10.0  # how long clear() waits for the SSD headers it empties to be on disk
# From this many keys, given as one buffer (PackedKeys: the meta service's
# probes), a probe finds its run of plain READY blocks in the ready index
# (a few array passes); below, or given as bytes objects (the embedded
# backend's scheduler), key by key: C calls over the entries and the odd
# set, which cost less than the arrays when the keys' hashes are cached
# (a waiting request asked again) and as much when they are not.
PROBE_VECTOR_MIN = 2048
# Blocks stamped by probes and not yet in the recency order past which
# settle() applies them: an eviction inside a save's call, which the saving
# instance's scheduler waits for, finds at most this many to move first
# (~1.2 ms on the 2-core test machine).
STAMPS_PENDING_MAX = 8_192
# Changes to the ready index that settle() applies after an answer; fewer
# wait for the next long probe, which applies them first: a batch costs
# ~0.15 ms of array calls on the 2-core test machine whatever its size, so
# one a step rather than one after every call.
READY_BATCH = 512
# The meta service's shared ready index takes the blocks made READY at most
# this long after (with the next call it settles); blocks that left, at once.
READY_LAG_S = 0.05


class EntryState(enum.Enum):
    PENDING = "pending"  # a worker is writing the DRAM slot
    PROMOTING = "promoting"  # an I/O thread is reading the block from SSD into the DRAM slot
    READY = "ready"


class _Entry(msgspec.Struct, gc=False):
    """A DRAM block's state. Not tracked by the garbage collector: it holds
    ints, bools and an enum member, so no cycle can pass through it, and
    at 340,000 blocks a full collection walking the entries paused the
    store 170-200 ms (bench/store_step.py --saves-run)."""

    slot: int
    state: EntryState
    step: int  # the step of the owner that created it (PENDING), -1 if promoted
    pins: int = 0
    owner: int = 0  # the session that created it (PENDING until its step completes)
    on_ssd: bool = False
    demoting: bool = False  # being written to SSD
    evict_after: bool = False  # free the DRAM copy once the SSD copy is durable
    doomed: bool = False  # found bad: unreadable now, dropped as soon as nothing uses it
    cluster_epoch: int = -1  # the cluster mover's epoch in which it was published (or fetched): in the cluster while it lasts
    failed_epoch: int = -1  # the epoch in which a put of it failed: evicted as a plain block, not published again on the way out
    from_cluster: bool = False  # PROMOTING: being fetched from the cluster tier, not read from SSD
    since: float = 0.0  # PROMOTING: when its move was handed over, then when its read or fetch began
    stalled: bool = False  # PROMOTING: a lookup found it running past stale_move_s (counted once)


class _OddKeys(set):
    """The store's odd set (keys whose DRAM entry is not plain READY) that
    tells the ready index of every change: a key added leaves it, a key
    discarded enters it at its entry's slot (or leaves it with its entry).
    The store changes the set with these calls only."""

    __slots__ = ("_entries", "_changes", "_shared")

    def __init__(self, entries: dict[bytes, _Entry], ready: ReadyIndex) -> None:
        super().__init__()
        self._entries = entries
        self._changes = ready.changes
        # Shared (the meta service's), the index counts the blocks that leave
        # its table (ReadyIndex.leaving): instances read it without a call.
        self._shared = ready if ready.shared else None

    # The index's change dict written here, not through its methods: one
    # Python call a change instead of two, on every save's path.
    def add(self, key: bytes, _add=set.add) -> None:  # noqa: ANN001 - set.add, bound once
        shared = self._shared
        if shared is not None and key not in self:
            e = self._entries.get(key)
            if e is not None and shared.holds_at(key, e.slot):  # plain READY until now, in the table
                shared.leaving += 1
        _add(self, key)
        self._changes[key] = -1

    def discard(self, key: bytes, _discard=set.discard) -> None:  # noqa: ANN001
        e = self._entries.get(key)
        if e is None and self._shared is not None and key not in self:
            self._shared.leaving += 1  # a plain READY block dropped: its key may be in the table
        _discard(self, key)
        self._changes[key] = -1 if e is None else e.slot

    def add_all(self, keys: list[bytes]) -> None:
        """:meth:`add` of ``keys``, new to the pool (never in the index's table)."""
        set.update(self, keys)
        self._changes.update(dict.fromkeys(keys, -1))

    def discard_all(self, keys: list[bytes], slots: list[int]) -> None:
        """:meth:`discard` of ``keys``, each held plain READY at its slot in ``slots``."""
        set.difference_update(self, keys)
        self._changes.update(zip(keys, slots))


class SaveSlots(list):
    """What :meth:`TieredStore.prepare_save` hands out: one DRAM slot per
    key, None where the key got none. A list, so a caller that only wants
    the slots reads it as one.

    ``placed``: the leading keys that are settled, each given a slot or
    already held (READY, PENDING, PROMOTING, or repeated earlier in the
    call): nothing more to do for them. The key at ``placed`` got no slot,
    for lack of room (slots in use, or room still being written out to SSD)
    or because a doomed entry of the same key has not gone yet; it and the
    keys after it are to be planned again in a later step (a repeat is
    harmless: what got a slot now is held then).
    """

    __slots__ = ("placed",)

    def __init__(self, slots: Iterable[int | None] = (), placed: int = 0) -> None:
        super().__init__(slots)
        self.placed = placed


@dataclass(frozen=True)
class Probe:
    """Leading keys: ``ready`` readable in DRAM now; ``total`` held in DRAM,
    on SSD or, the last ``remote`` of them, only in the cluster tier."""

    ready: int
    total: int
    remote: int = 0


# Evictions come in bursts, one per engine step under pressure: each tier
# logs at most one summary line per interval; the counters count every one.
EVICTION_LOG_INTERVAL_S = 10.0


@dataclass
class EventCounts:
    """Cumulative events of a store. The store updates its own under its lock;
    :meth:`TieredStore.statistics` hands out a copy."""

    evictions: int = 0
    save_failures: int = 0
    lookups: int = 0
    lookup_hits: int = 0  # keys found, over all lookups
    demotions: int = 0
    demote_failures: int = 0
    evicted_without_copy: int = 0
    promotions: int = 0
    promote_failures: int = 0
    ssd_corrupt: int = 0
    ssd_read_errors: int = 0  # SSD copies that could not be read back (then forgotten)
    ssd_evictions: int = 0
    corrupt_dram: int = 0  # DRAM blocks found bad before demotion
    moves_stalled: int = 0  # reads or fetches into DRAM that a lookup found running past stale_move_s
    ssd_write_give_ups: int = 0  # 1 once SSD writes stopped after DEMOTE_GIVE_UP failed batches in a row
    # The cluster tier (all 0 without one).
    cluster_lookups: int = 0  # keys asked about
    cluster_hits: int = 0  # keys it said it holds
    cluster_fetched: int = 0  # blocks fetched, verified and made READY
    cluster_gone: int = 0  # said present, gone by the fetch (evicted silently, or its node left)
    cluster_corrupt: int = 0  # fetched but failed the header or checksums (torn, flipped, foreign)
    cluster_fetch_errors: int = 0  # the transfer failed (master or peer unreachable, stalled)
    cluster_published: int = 0
    cluster_publish_failures: int = 0  # puts refused or failed, or the cluster was down
    cluster_publish_skipped: int = 0  # not published: too many puts in flight, or left DRAM unpublished
    cluster_down: int = 0  # times the cluster became unreachable
    cluster_lost: int = 0  # times the cluster lost this node's mark (master restarted): published blocks published again
    cluster_vanished: int = 0  # published blocks found gone from the cluster after its capacity dropped (a peer left)
    pins_expired: int = 0  # pins released because their step stayed open past the lease (expire_pins)


@dataclass(frozen=True)
class Moving:
    """Moves in flight at one moment (:meth:`TieredStore.moving`): blocks
    being written to SSD or published to the cluster, blocks being read
    back into DRAM from either, and the I/O jobs (moves, and the clearing
    of SSD headers) running or queued."""

    to_ssd: int = 0
    from_ssd: int = 0
    to_cluster: int = 0
    from_cluster: int = 0
    jobs: int = 0


@dataclass(frozen=True)
class StoreStatistics:
    num_slots: int
    used_slots: int
    pending_slots: int
    pinned_slots: int
    ssd_slots: int = 0
    ssd_used: int = 0
    events: EventCounts = field(default_factory=EventCounts)

    @property
    def usage(self) -> float:
        return self.used_slots / self.num_slots if self.num_slots else 0.0


def _marks(num_slots: int, high_pct: float, low_pct: float) -> tuple[int, int]:
    if not 0 < low_pct < high_pct <= 100:
        raise ValueError(f"need 0 < low ({low_pct}) < high ({high_pct}) <= 100")
    high = max(1, int(num_slots * high_pct / 100))
    return high, min(high - 1, int(num_slots * low_pct / 100))


def _check_new_keys(keys: list[bytes]) -> None:
    """Refuse ``keys`` unless every one is a 16-byte block key, before a
    call changes anything: the arena refuses another length only once a
    slot has been taken for it, and a call stopped there would leave the
    keys before it half-entered (not in the recency order, a promotion
    never started). The total, then the shortest: keys of 15 and 17 bytes
    side by side add up too; both in C (a Python check of each length cost
    three times as much, pool/wire.py)."""
    if len(b"".join(keys)) != KEY_BYTES * len(keys) or min(map(len, keys), default=KEY_BYTES) != KEY_BYTES:
        bad = next(k for k in keys if len(k) != KEY_BYTES)
        raise ValueError(f"block key {bytes(bad)[:32]!r} is {len(bad)} bytes, not {KEY_BYTES}")


class TieredStore:
    """Index over a :class:`DramTier` and, optionally, an :class:`SsdTier` below it."""

    # Blocks a save or promotion frees beyond its own while DRAM runs down
    # from the high mark to the low one (_make_room_locked).
    EVICT_SLICE = 1024
    # A move into DRAM (an SSD read, a cluster fetch) still running this
    # long after it began (not after it was queued) has stalled: a hung
    # disk, a peer stopped mid-transfer. Lookups stop counting its block
    # (``moves_stalled`` counts it once, with a warning), so requests with
    # the prefix recompute at once instead of each waiting out the
    # scheduler's promote_timeout_s (5 s by default). Its DRAM slot stays
    # held until the move ends. The least a store takes (``stale_move_s``).
    STALE_MOVE_S = 5.0

    def __init__(self, tier: DramTier, high_pct: float = 95.0, low_pct: float = 85.0,
                 policy: EvictionPolicy | None = None, *, ssd: SsdTier | None = None,
                 ssd_high_pct: float = 95.0, ssd_low_pct: float = 85.0, dram_watermark_pct: float = 95.0,
                 io_threads: int = 4, demote_queue_blocks: int = 256,
                 recovered: Recovered | Sequence[tuple[SsdLocation, BlockRecord]] = (),
                 cluster: RemoteTier | None = None, publish_on_evict: bool = False,
                 cluster_timeout_s: float = CLUSTER_LOOKUP_WAIT_S, cluster_lookup_blocks: int = 256,
                 cluster_queue_blocks: int = 1024, stale_move_s: float = STALE_MOVE_S,
                 ready_index: bool = False) -> None:
        self.tier = tier
        self.stale_move_s = self.STALE_MOVE_S
        self.wait_for_moves(stale_move_s)
        self._policy = policy if policy is not None else LruPolicy()
        self._entries: dict[bytes, _Entry] = {}
        self._free: list[int] = list(range(tier.num_slots - 1, -1, -1))
        self._high, self._low = _marks(tier.num_slots, high_pct, low_pct)
        self._watermark = max(1, int(tier.num_slots * dram_watermark_pct / 100))
        self._c = EventCounts()
        # Per session (owner), per step of that owner: the keys of the PENDING
        # entries it created, and the keys it pinned (once per pin).
        self._pending: dict[int, dict[int, list[bytes]]] = {}
        # Slots out of use until a time of the caller's clock (end_session, hold_slots).
        self._held: list[tuple[float, list[int]]] = []
        self._last_eviction_log = self._last_ssd_eviction_log = float("-inf")  # the first one always logs
        # Re-entrant: a job's done-callback may run on the thread that submitted it.
        self._lock = threading.RLock()
        # owner -> step -> (time.monotonic() of the step's first pin, the keys it pinned)
        self._pins: dict[int, dict[int, tuple[float, list[bytes]]]] = {}
        self._progress: dict[int, float] = {}  # owner -> time.monotonic() of its first pin, then of its last completed step
        self._freeing = 0  # entries being written to SSD that are evicted (freed once written)
        self._evicting = False  # a run from the high mark down to the low one is under way
        # Above this many entries, the least recently used blocks are copied to
        # SSD ahead of need ("cleaned"), so that eviction later frees them at
        # once instead of waiting for a write.
        self._clean_mark = max(0, 2 * self._low - self._high)
        # READY entries with no SSD copy and none being written, in recency
        # order: what cleaning may copy. Walking only these keeps a step's
        # cost to what changed; the full policy order is mostly blocks
        # already copied once DRAM sits above the clean mark.
        self._dirty = LruPolicy()
        # Whether lookups keep the dirty order in recency order. Cleaning
        # reads it only above the clean mark; far below it (by the slack)
        # lookups stop touching it, which halved their cost with an SSD tier
        # in a pool not yet full, and cleaning sorts it again from the full
        # order when it next starts (_clean_locked). At least ``slack``
        # blocks are saved between two sorts, so a sort's cost (C calls over
        # the keys held) comes to a few list operations per save.
        self._dirty_ordered = True
        self._clean_slack = max(1, self._clean_mark // 8)
        # Keys whose DRAM entry is not plain READY (see _sync_odd): the
        # probe's fast path counts the others without looking at their
        # entries. Kept exact at every change of an entry's state, doomed or
        # evict_after (odd_keys_consistent, checked in the tests). Long
        # probes count the others in the ready index instead, which the set
        # keeps in step (_OddKeys). Only where probes come as one buffer
        # (``ready_index``: the meta service's store), and from the first
        # such probe of PROBE_VECTOR_MIN keys or more on (_start_ready_locked):
        # it costs a dict store a change, and a batch of array calls for
        # every few hundred changes, which a pool whose probes are all
        # shorter (64k tokens in 64-token blocks: 1,024 keys) never pays.
        self._ready_wanted = ready_index
        self._ready: ReadyIndex | None = None
        self._odd: set[bytes] = set()
        # Keys pinned for a put to the cluster, with how many puts: with the
        # steps' pin lists, every pin there is (statistics counts from them).
        self._publishing: dict[bytes, int] = {}
        # Runs that probe(refresh=False) counted and whose recency is not
        # refreshed yet (the meta service refreshes after its answer, with
        # refresh()), with whether all their keys are in DRAM. Applied in
        # order by refresh() and before anything reads a recency order
        # (eviction, cleaning, republishing): a block a probe reported is as
        # safe from another instance's eviction as if it had been touched
        # under the probe's lock.
        # With the stamp clock when each was counted (see _stamps).
        self._unrefreshed: list[tuple[Sequence[bytes], bool, int]] = []
        # Runs of plain READY blocks that long probes without refresh
        # counted are noted as a stamp per DRAM slot instead (one array
        # call; the first key of a run highest): the moves in the LRU order
        # that cost near 0.6 ms for 4,096 keys wait until something reads
        # the order, or until STAMPS_PENDING_MAX keys wait (settle), and a
        # block probed many times meanwhile is moved once. 0: no stamp. A
        # slot's stamp goes with its block (_drop). Blocks saved, promoted
        # or touched by a save in between come out older than the stamped
        # runs: a probe announces a load, its blocks count as the last used.
        self._stamps = np.zeros(max(1, tier.num_slots) if ready_index else 1, dtype=np.int64)
        self._stamp_at = memoryview(self._stamps)
        self._stamp_clock = 0
        self._stamp_floor = 0  # no stamp at or below this is left (stamps applied up to it)
        self._stamped = 0  # keys stamped since the stamps were last applied, at most (repeats counted)
        self._only_run: np.ndarray | None = None  # the slots stamped, while one run is all there is

        self.ssd = ssd
        # Key -> SSD slot, slot states (free, dirty: may hold a valid older
        # header on disk, writing, ready), recency and pins, in flat arrays:
        # a multi-TB tier has tens of millions of slots (tier/ssd_index.py).
        # An empty one without an SSD tier, so lookups need no branch.
        self._ssd_entries = SsdIndex(ssd.num_slots if ssd is not None else 0,
                                     ssd.location if ssd is not None else None)
        if ssd is not None:
            if ssd.slot_bytes != tier.slot_stride:
                raise ValueError(f"SSD slots of {ssd.slot_bytes} bytes cannot hold DRAM slots of {tier.slot_stride}")
            self._ssd_high, self._ssd_low = _marks(ssd.num_slots, ssd_high_pct, ssd_low_pct)
            # Most SSD blocks one eviction call frees, and whether an eviction
            # from the high mark down to the low one is under way.
            self._ssd_batch = eviction_batch(ssd.num_slots)
            self._ssd_evicting = False
        # The I/O threads (none without an SSD tier) and the moves on them:
        # demotions, promotions, SSD header invalidations (movers.py).
        self._mover = TierMover(self, self._lock, self._c, tier, ssd, io_threads=io_threads,
                                demote_queue_blocks=demote_queue_blocks)
        if ssd is not None:
            self._adopt(recovered)
        # The cluster tier below the node pool (kvtier.cluster.*): its own
        # threads for lookups, fetches and publishing (movers.py). None: the
        # store behaves exactly as without it.
        self._publish_on_evict = publish_on_evict
        self._cluster_lookup = cluster_lookup_blocks
        self._cluster = ClusterMover(self, self._lock, self._c, tier, cluster, timeout_s=cluster_timeout_s,
                                     queue_blocks=cluster_queue_blocks, idle=self._mover.idle) \
            if cluster is not None else None

    def _adopt(self, recovered: Recovered | Sequence[tuple[SsdLocation, BlockRecord]]) -> None:
        # Written twice (a newer copy elsewhere before a crash): the newest
        # sequence number wins, the older slots are reused later (dirty), as
        # are slots whose headers recovery could not read.
        unreadable = [self.ssd.slot_number(loc) for loc in self.ssd.unreadable]
        if isinstance(recovered, Recovered):
            self._ssd_entries.adopt(recovered.slots, recovered.key_bytes, recovered.seqs, recovered.checksums,
                                    unreadable)
            return
        pairs = list(recovered)
        self._ssd_entries.adopt(np.array([self.ssd.slot_number(loc) for loc, _ in pairs], dtype=np.int64),
                                np.frombuffer(b"".join(r.key for _, r in pairs), dtype=np.uint8).reshape(-1, 16),
                                np.array([r.seq for _, r in pairs], dtype=np.uint64),
                                np.array([r.checksum for _, r in pairs], dtype=np.uint64), unreadable)

    def close(self) -> None:
        """Finish the I/O in flight, then stop the I/O threads (tiers are closed by their owner)."""
        if self._cluster is not None:
            self._cluster.close()
        self._mover.close()

    @property
    def cluster(self) -> ClusterMover | None:
        """The cluster tier's mover (its ``remote`` client, whether it is ``up``), or None."""
        return self._cluster

    def wait_progress(self, timeout_s: float) -> None:
        """Block for at most ``timeout_s`` or until an I/O job finishes, releasing the GIL.

        Both movers' jobs end on one condition: with both tiers, a prefix
        found only in the cluster does not have the scheduler ask again at
        once, nor wait for an SSD job while its fetch has ended."""
        cluster = self._cluster
        with self._mover.idle:
            if self._mover.busy or (cluster is not None and cluster.busy):
                self._mover.idle.wait(timeout_s)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until no demotion, promotion, fetch or publication is in flight (tests, shutdown, benchmarks)."""
        ok = self._mover.wait_idle(timeout_s)
        return (self._cluster.wait_idle(timeout_s) if self._cluster is not None else True) and ok

    def moving(self) -> Moving:
        """Moves in flight now (all zero once every move has ended and nothing started one)."""
        with self._lock:
            m, cl = self._mover, self._cluster
            if cl is None:
                return Moving(m.demoting, m.promoting, 0, 0, m.jobs())
            return Moving(m.demoting, m.promoting, cl.publishing, cl.fetching, m.jobs() + cl.jobs())

    # --- readers ----------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` readable from DRAM now. Refreshes their recency."""
        return self.probe(keys).ready

    def wait_for_moves(self, *waits: float) -> None:
        """Count a move into DRAM as stalled no sooner than the longest of
        ``waits`` (the schedulers' promote_timeout_s) nor than
        :data:`STALE_MOVE_S`: a scheduler that waits longer for a move is
        not cut short by the store."""
        self.stale_move_s = max(self.STALE_MOVE_S, *waits)

    def probe(self, keys: Sequence[bytes], *, refresh: bool = True) -> Probe:
        """Leading ``keys`` held, refreshing their recency. A block counted
        as readable in DRAM stays readable there until the caller pins it
        (its pending "free once on SSD" is cancelled): the caller tells vLLM
        about the hit before it can pin it.

        ``refresh=False`` (the meta service): the recency of the keys
        counted is refreshed later: a run counted in the ready index is
        stamped and moved once something reads the recency orders (or past
        STAMPS_PENDING_MAX stamped blocks, :meth:`settle`); another run by
        the caller's :meth:`settle` or :meth:`refresh` soon after (the
        service's, once its answer is sent), or before, by the store
        itself, when anything reads the recency orders in between."""
        absent = False  # the run stopped at a key held nowhere in the node pool
        # A 64k-token prompt of 16-token blocks is 4,096 keys, and the lookup
        # runs on vLLM's scheduler thread (or in the meta service for every
        # instance). First the leading keys in DRAM that are plain READY (not
        # in self._odd), found by C calls alone (takewhile, map, compress):
        # a key costs its hash and two set lookups, where the loop below
        # costs three times that. Then, from the first key that is not, one
        # pass with everything it touches in locals. Keys not in DRAM are
        # looked up on SSD in batches (SsdIndex.ready_many) of 1, 8, 64, ...
        # keys: a cold prompt, whose first key is held nowhere, costs one
        # lookup, and a long run on SSD a few batches instead of a call per key.
        # Long probes find the leading plain READY keys in the ready index
        # instead, with a few array passes over the keys as one buffer.
        ready_state, promoting = EntryState.READY, EntryState.PROMOTING
        want = keys.array() if self._ready_wanted and isinstance(keys, PackedKeys) \
            and len(keys) >= PROBE_VECTOR_MIN else None
        with self._lock:
            if want is not None and self._ready is None:
                self._start_ready_locked()
            entries, ssd, odd = self._entries, self._ssd_entries, self._odd
            run_slots = None  # the slots of the plain run, from the ready index
            if want is not None:
                plain, run_slots = self._ready.leading(want)  # type: ignore[union-attr]
            else:
                run = list(itertools.takewhile(entries.__contains__, keys))
                plain = len(run)
                if plain and odd:
                    plain = next(itertools.compress(itertools.count(), map(odd.__contains__, run)), plain)
            ready = total = plain
            on_ssd: list[bool] = []  # READY on SSD, for keys[base : base + len(on_ssd)]
            base = plain
            window = 1
            ssd_only = False  # a key counted is held on SSD only (not in the DRAM policy)
            stale_before: float | None = None  # moves begun before this have stalled (read at the first one)
            rest = keys.iter_from(plain) if isinstance(keys, PackedKeys) else itertools.islice(keys, plain, None)
            for key in rest:
                e = entries.get(key)
                if e is None:
                    if ssd:
                        if total - base >= len(on_ssd):
                            base = total
                            on_ssd = ssd.ready_many(keys[base : base + window])
                            window = min(window * 8, 4096)
                        if on_ssd[total - base]:
                            ssd_only = True
                            total += 1
                            continue
                    absent = True
                    break
                if e.doomed:
                    break
                state = e.state
                if state is ready_state:
                    if e.evict_after:
                        # Evicted while its SSD copy is written: the I/O thread
                        # would free it between this lookup and the pin, and the
                        # load would be planned from no slot (issue 7, item 7;
                        # test_store_pressure.py). It was just used, so it stays.
                        e.evict_after = False
                        self._freeing -= 1
                        self._sync_odd(key, e)
                    if ready == total:
                        ready += 1
                    total += 1
                    continue
                if state is promoting:
                    if stale_before is None:
                        stale_before = time.monotonic() - self.stale_move_s
                    if e.since < stale_before:
                        if not e.stalled:
                            self._stalled_locked(key, e)
                        break  # a miss now, not a wait (stale_move_s)
                    total += 1
                    continue
                break  # PENDING: being written, not readable yet
            self._c.lookups += 1
            self._c.lookup_hits += total
            if total:
                # Without a key found on SSD only, every key counted is in DRAM (in the policy).
                if not refresh:
                    if total == plain and run_slots is not None:
                        # Counted in the ready index, its slots known: stamped. Key by key,
                        # finding the slots would cost more than the moves (~150 against
                        # ~120 ns a key): the run is kept and refreshed after the answer.
                        self._stamp_locked(run_slots)
                    else:
                        self._unrefreshed.append((keys[:total], not ssd_only, self._stamp_clock))
                else:
                    self._flush_refreshes_locked()  # earlier runs first: they were looked up first
                    self._refresh_locked(keys[:total], all_held=not ssd_only)
        if self._cluster is None or not absent:
            return Probe(ready, total)
        # Then the cluster tier, outside the lock (a remote call, bounded by
        # the mover's timeout): the keys it holds after the node pool's run
        # are fetched by promote().
        after = keys[total : total + self._cluster_lookup]
        remote = self._cluster.lookup(after.as_list() if isinstance(after, PackedKeys) else after)
        return Probe(ready, total + remote, remote)

    def share_ready(self, memory: memoryview) -> None:
        """Keep the ready index in ``memory`` (ready_index.memory_bytes of
        the DRAM slots) from now on, made from the entries held now: the
        meta service's shared form, which instances read without a call
        (pool/readymap.py). A store made without ``ready_index`` is not
        asked."""
        if not self._ready_wanted:
            raise ValueError("this store keeps no ready index (ready_index=False)")
        with self._lock:
            self._start_ready_locked(memory)

    def touched(self, slots: np.ndarray, *, lookup: bool = True, times: int = 1) -> None:
        """A run of plain READY DRAM blocks that an instance counted in the
        shared ready index (``slots``, first block first): counted as a
        lookup that found them (``lookup=False``: as the head of the probe
        that follows, which counts the lookup), and its recency refreshed
        as :meth:`probe` with ``refresh=False`` does: a long run stamped,
        a short one kept for :meth:`settle`. A slot whose block has left the
        index since (evicted, discarded) is passed over; one given to
        another block READY since refreshes that block instead, an
        approximation of the recency only. ``times``: that many lookups of
        the run, counted as such and refreshed once."""
        n = len(slots)
        with self._lock:
            self._c.lookups += times if lookup else 0
            self._c.lookup_hits += n * times
            ready = self._ready
            if ready is None or not n:
                return
            if ready.leaving:
                ready.flush()  # blocks that left, out of ready._in
            slots = slots[(slots >= 0) & (slots < self.tier.num_slots)]
            slots = slots[ready.held_slots(slots)]
            if len(slots) >= PROBE_VECTOR_MIN:
                self._stamp_locked(slots)
            elif slots.size:
                # A run as short as those the service's probe counts key by
                # key: refreshed once the call is settled, as theirs are, not
                # stamped and moved whenever the order is next read (later
                # saves would come out older than it).
                self._unrefreshed.append((ready.keys_of(slots), True, self._stamp_clock))

    def _start_ready_locked(self, memory: memoryview | None = None) -> None:
        """Make the ready index from the entries held now (once: the first
        long probe of keys in one buffer, or :meth:`share_ready`), and the
        odd set that keeps it in step from here on. Costs a pass over the
        entries (C calls)."""
        ready = ReadyIndex(self.tier.num_slots, memory)  # one made before goes: it was made the same way
        odd = _OddKeys(self._entries, ready)
        set.update(odd, self._odd)
        entries = self._entries
        plain = [k for k in entries if k not in odd]
        ready.changes.update(zip(plain, map(_slot_of, map(entries.__getitem__, plain))))
        ready.flush()
        self._ready, self._odd = ready, odd
        log.info("kvtier: long lookups come as one buffer of keys: the ready index holds %d blocks from now on",
                 len(plain))

    def _stalled_locked(self, key: bytes, e: _Entry) -> None:
        e.stalled = True
        self._c.moves_stalled += 1
        log.warning("kvtier: %s of block %s has run for over %.0f s; lookups count it as a miss until it ends",
                    "the cluster fetch" if e.from_cluster else "the SSD read", key.hex()[:16], self.stale_move_s)

    def _moves_begin_locked(self, keys: Sequence[bytes]) -> None:
        """The movers' reads or fetches of ``keys`` start now: the time a
        move may take before it counts as stalled runs from here, not from
        when it was queued."""
        now = time.monotonic()
        for key in keys:
            e = self._entries.get(key)
            if e is not None and e.state is EntryState.PROMOTING:
                e.since = now

    def refresh(self) -> None:
        """Refresh the recency of the runs that ``probe(refresh=False)``
        counted and that nothing has refreshed yet, in the order they were
        counted: each run's keys become the most recently used, its first
        key most of all. Keys that left the node pool since are passed over.
        Also applies the changes the ready index has noted (saves completed,
        evictions), which the next long probe would apply otherwise: the
        meta service calls this once an answer is sent."""
        with self._lock:
            self._flush_refreshes_locked()
            if self._ready is not None:
                self._ready.flush()

    def settle(self) -> None:
        """The bookkeeping that the meta service does once an answer is
        sent: the runs that probes counted with keys not plain READY, and
        the stamps of the others past STAMPS_PENDING_MAX, go into the
        recency orders; the ready index takes the changes noted."""
        with self._lock:
            if self._unrefreshed:
                self._flush_refreshes_locked()
            elif self._stamped > STAMPS_PENDING_MAX:
                self._stamped = int(np.count_nonzero(self._stamps))  # a block probed again is counted once
                if self._stamped > STAMPS_PENDING_MAX:
                    self._apply_stamps_locked()
            self._flush_ready_due_locked()

    def flush_ready(self) -> None:
        """Apply the ready index's changes if they are due (the meta
        service's timer: blocks that left, or made READY, while no call
        came to settle)."""
        with self._lock:
            self._flush_ready_due_locked()

    def _flush_ready_due_locked(self) -> None:
        ready = self._ready
        if ready is not None and ready.changes and (len(ready.changes) >= READY_BATCH or ready.shared and (
                ready.leaving or time.monotonic() - ready.flushed_at >= READY_LAG_S)):
            # Shared (instances count runs in it without a call), a block
            # that left goes at once: it would be counted, and its pin fail.
            # Blocks made READY wait up to READY_LAG_S, a flush costing
            # 0.15-0.6 ms: meanwhile a lookup of them is a call.
            ready.flush()

    def _flush_refreshes_locked(self) -> None:
        if self._unrefreshed:
            runs, self._unrefreshed = self._unrefreshed, []
            for keys, all_held, clock in runs:
                self._apply_stamps_locked(clock)  # the runs stamped before it come first
                self._refresh_locked(keys, all_held)
        self._apply_stamps_locked()

    def _stamp_locked(self, slots: np.ndarray) -> None:
        """Stamp the run of plain READY blocks in ``slots``, first most recent
        (a slot given twice keeps its first place: the higher stamp)."""
        n = len(slots)
        np.maximum.at(self._stamps, slots, np.arange(self._stamp_clock + n, self._stamp_clock, -1))
        self._only_run = slots if not self._stamped else None
        self._stamp_clock += n
        self._stamped += n

    def _apply_stamps_locked(self, upto: int | None = None) -> None:
        """Move the stamped blocks (those stamped at or before ``upto``) to
        the recent end of the recency orders, in stamp order, and clear
        their stamps."""
        if not self._stamped or (upto is not None and upto <= self._stamp_floor):
            return
        stamps = self._stamps
        run, self._only_run = self._only_run, None
        if run is not None and upto is not None and upto < self._stamp_clock:
            run = None  # a part only: the general way
        if run is not None:  # one run stamped (the service settling after its probe): its order is known
            newest_first = run[stamps[run] > 0]  # less the blocks that left since (a repeat moves twice: no harm)
            stamped = newest_first
        else:
            stamped = np.flatnonzero(stamps if upto is None else (stamps > 0) & (stamps <= upto))
            newest_first = stamped[np.argsort(stamps[stamped])[::-1]]
        self._stamp_floor = self._stamp_clock if upto is None else upto
        if upto is None or run is not None:
            self._stamped = 0
        if not stamped.size:
            return
        stamps[stamped] = 0
        # A stamped slot holds the block the probe counted (a block that
        # leaves DRAM takes its stamp with it): the ready index still has its key.
        self._refresh_locked(self._ready.keys_of(newest_first), all_held=True)  # type: ignore[union-attr]

    def _refresh_locked(self, keys: Sequence[bytes], all_held: bool) -> None:
        if isinstance(keys, PackedKeys):  # made into bytes here, after the probe's answer
            keys = keys.as_list()
        self._policy.touch(keys, all_held=all_held)
        if self._dirty_ordered and len(self._entries) < self._clean_mark - self._clean_slack:
            self._dirty_ordered = False  # far below the clean mark: see _clean_locked
        if self._dirty_ordered and self._dirty:
            self._dirty.touch(keys)
        if self._ssd_entries:
            self._ssd_entries.touch(keys)

    def promote(self, keys: Sequence[bytes]) -> int:
        """Start reading the SSD-only ``keys`` into DRAM; returns how many of
        ``keys`` are on their way: PROMOTING, or waiting for DRAM slots that
        demotions in flight are about to free. Stops at the first key that
        is not on SSD, and at one whose move has stalled (``stale_move_s``)."""
        if self.ssd is None and self._cluster is None:
            return 0
        # A key given twice would get two PROMOTING entries, the first one's
        # slot lost (the scheduler's keys are distinct; a pool client's need not be).
        keys = list(dict.fromkeys(keys))
        jobs: list[PromoteJob] = []
        fetches: list[tuple[bytes, int]] = []
        moving = 0
        with self._lock:
            now = time.monotonic()
            wanted: list[bytes] = []
            remote: list[bytes] = []  # held nowhere in the node pool: fetched from the cluster tier
            for key in keys:
                e = self._entries.get(key)
                if e is not None:
                    if e.state is EntryState.PROMOTING:
                        if e.since < now - self.stale_move_s:
                            break  # stalled: not on its way, nor is the prefix past it
                        moving += 1
                    continue
                s = self._ssd_entries.get(key)
                if s is not None and s.ready and not remote:
                    wanted.append(key)
                    continue
                if self._cluster is None:
                    break
                # The caller's probe found it in the cluster; whether it is
                # still there is the fetch's answer (gone: a miss, counted).
                remote.append(key)
            _check_new_keys(remote)  # the others are held on SSD: checked when they came in
            if wanted or remote:
                self._make_room_locked(len(wanted) + len(remote))
            for i, key in enumerate(wanted + remote):
                if not self._free:
                    if self._freeing:
                        # Room is on its way: demotions in flight free their
                        # DRAM slots when durable. Count these as coming, so
                        # the caller asks again instead of giving up.
                        moving += len(wanted) + len(remote) - i
                    break
                slot = self._free.pop()
                self.tier.clear(slot, key)
                if i < len(wanted):
                    s = self._ssd_entries[key]
                    self._entries[key] = _Entry(slot, EntryState.PROMOTING, -1, on_ssd=True, since=now)
                    self._odd.add(key)
                    s.pins += 1
                    jobs.append((key, slot, s.loc, s.rec))  # type: ignore[arg-type]
                else:
                    self._entries[key] = _Entry(slot, EntryState.PROMOTING, -1, from_cluster=True, since=now)
                    self._odd.add(key)
                    fetches.append((key, slot))
                self._policy.insert(key)
                moving += 1
            if jobs:
                self._mover.promote(jobs)
            if fetches:
                assert self._cluster is not None
                self._cluster.fetch(fetches)
        return moving

    def pin(self, keys: Sequence[bytes], step: int, *, owner: int = 0) -> list[int | None]:
        """Pin READY ``keys`` until ``owner``'s :meth:`complete_step` of
        ``step`` (or its :meth:`end_session`); None where not READY."""
        out: list[int | None] = []
        with self._lock:
            now = time.monotonic()
            _, pinned = self._pins.setdefault(owner, {}).setdefault(step, (now, []))
            self._progress.setdefault(owner, now)
            entries, plain = self._entries_of(keys)
            if plain:
                # Every key held and plain READY (the common case: the run a
                # probe just counted): the lookups, slots and bookkeeping in
                # C calls, a Python step per key for the count only.
                for e in entries:
                    e.pins += 1
                pinned.extend(keys)
                return list(map(_slot_of, entries))
            for key, e in zip(keys, entries):
                if e is None or e.state is not EntryState.READY or e.doomed:
                    out.append(None)
                    continue
                e.pins += 1
                pinned.append(key)
                out.append(e.slot)
        return out

    # --- writers ----------------------------------------------------------

    def adopt_dram(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        """Take over READY blocks already in the arena's slots (an arena a
        dead meta service left, :meth:`DramTier.sealed_blocks`): each
        ``(key, slot)`` becomes readable as if just saved. Call on a new
        store, before any other call. Returns how many were adopted (a key
        or slot given twice is adopted once)."""
        with self._lock:
            free = set(self._free)
            n = 0
            for key, slot in blocks:
                if key in self._entries or slot not in free:
                    continue
                free.discard(slot)
                s = self._ssd_entries.get(key)
                e = _Entry(slot, EntryState.READY, -1, on_ssd=s is not None and s.ready)
                self._entries[key] = e
                self._policy.insert(key)
                self._sync_dirty(key, e)
                self._sync_odd(key, e)
                n += 1
            self._free = [x for x in self._free if x in free]
            return n

    def key_info(self, key: bytes) -> dict[str, object] | None:
        """Where ``key`` is held, for queries; None if nowhere. Changes nothing (no recency)."""
        with self._lock:
            e = self._entries.get(key)
            s = self._ssd_entries.get(key)
            if e is None and (s is None or not s.ready):
                return None
            info: dict[str, object] = {"tiers": [t for t, held in (("dram", e is not None), ("ssd", s is not None
                                                                    and s.ready)) if held]}
            if e is not None:
                info["dram"] = {"slot": e.slot, "state": e.state.value, "pins": e.pins, "doomed": e.doomed,
                                "being_written_to_ssd": e.demoting}
            if s is not None and s.ready:
                info["ssd"] = {"slot": int(s.slot), "pins": int(s.pins)}
            return info

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def prepare_save(self, keys: Sequence[bytes], step: int, *, owner: int = 0) -> SaveSlots:
        """DRAM slots for writing ``keys`` in ``owner``'s ``step`` (entries
        PENDING until that owner's :meth:`complete_step`); None for a key
        already held in DRAM (or being written, by any owner) and for one
        there is no room for: ``placed`` on the result tells which (see
        :class:`SaveSlots`)."""
        out = SaveSlots()
        placed = -1  # index of the first key not settled, once found
        with self._lock:
            entries, odd = self._entries, self._odd
            unique = list(dict.fromkeys(keys))
            new = [k for k in unique if k not in entries]
            held = [k for k in unique if k in entries]
            _check_new_keys(new)
            # The held keys of this prefix are in use: made recent first, so
            # that the room made for the new ones is not made from them.
            if held:
                self._policy.touch(held)
            self._make_room_locked(len(new))
            # (Any evicted all the same is saved again.)
            wanted = set(new) | {k for k in held if k not in entries}
            pending = self._pending.setdefault(owner, {}).setdefault(step, [])
            first = len(pending)
            added: list[bytes] = []
            try:
                for i, key in enumerate(keys):
                    if key not in wanted:
                        # Held, or repeated: settled. A doomed entry is on its way
                        # out (a reset, or a save of a step that followed a failed
                        # load): it will not be readable, so the key is to be saved
                        # again once it has gone.
                        e = entries.get(key)
                        if placed < 0 and e is not None and e.doomed:
                            placed = i
                        out.append(None)
                        continue
                    wanted.discard(key)
                    if not self._free:
                        if placed < 0:
                            placed = i
                        out.append(None)
                        continue
                    slot = self._free.pop()
                    self.tier.clear(slot, key)
                    s = self._ssd_entries.get(key)
                    entries[key] = _Entry(slot, EntryState.PENDING, step, on_ssd=s is not None and s.ready,
                                          owner=owner)
                    added.append(key)
                    pending.append(key)
                    out.append(slot)
            finally:
                # Whatever stopped the loop, the keys entered are PENDING:
                # odd, all at once (C calls; a key entered and not in the set
                # would be counted readable), and in the recency order (a key
                # not in it would never be evicted). Insert tail first so that
                # the head of a prefix is evicted last; the step's list keeps
                # that order too (complete_step makes them READY in it, after
                # the keys of the step's earlier calls).
                if isinstance(odd, _OddKeys):
                    odd.add_all(added)
                else:
                    odd.update(added)
                pending[first:] = pending[first:][::-1]
                for key in reversed(added):
                    self._policy.insert(key)
        out.placed = len(out) if placed < 0 else placed
        return out

    def complete_step(self, step: int, failed_slots: Iterable[int] = (), *, owner: int = 0) -> None:
        """Everything ``owner``'s workers did for its steps up to ``step`` is finished.

        PENDING entries of those steps become READY unless their slot is in
        ``failed_slots`` (then they are dropped and their slot freed); pins
        taken for those steps are released. Steps finish in order, so a step
        whose report was lost is settled by a later one. Other owners' steps
        are not touched; every call (of any owner) counts as one completed
        step of the pool for the SSD write back-off, and may start cleaning.
        """
        failed = set(failed_slots)
        saved: list[bytes] = []  # made READY now: published to the cluster tier (write-through)
        ready: list[bytes] = []  # made READY now, and their slots: plain READY from here (none doomed)
        ready_slots: list[int] = []
        with self._lock:
            self._mover.step_done()  # the clock of the SSD write back-off
            try:
                for s, keys in self._take_steps(self._pending, owner, step):
                    # In the order prepare_save put them in the LRU order (each
                    # call's keys tail first, calls in turn): the order of blocks
                    # without an SSD copy gets each prefix's tail before its head,
                    # so cleaning copies first what eviction frees first.
                    # Published head first (saved, reversed below).
                    made = len(saved)
                    for key in keys:
                        e = self._own_pending(key, owner, s)
                        if e is None:
                            continue
                        if e.slot in failed or e.doomed:
                            self._c.save_failures += 1
                            self._drop(key, e)
                        else:
                            e.state = EntryState.READY
                            self.tier.publish(e.slot)
                            self._sync_dirty(key, e)
                            ready.append(key)
                            ready_slots.append(e.slot)
                            if self._cluster is not None and not self._publish_on_evict:
                                saved.append(key)
                    saved[made:] = saved[made:][::-1]
            finally:
                # Out of the odd set at once (C calls, not one _sync_odd a
                # block), whatever stopped the loop.
                if isinstance(self._odd, _OddKeys):
                    self._odd.discard_all(ready, ready_slots)
                else:
                    self._odd.difference_update(ready)
            if owner in self._progress:
                self._progress[owner] = time.monotonic()
            for _, (_, keys) in self._take_steps(self._pins, owner, step):
                self._unpin(keys)
            if saved:
                self._publish_locked(saved)
            self._clean_locked()

    def abandon_saves(self, step: int, *, owner: int = 0) -> int:
        """Drop the PENDING entries of ``owner``'s ``step``: no writer will fill them. Returns how many."""
        with self._lock:
            steps = self._pending.get(owner, {})
            n = self._drop_pending(owner, step, steps.pop(step, []))
            if not steps:
                self._pending.pop(owner, None)
            return n

    def end_session(self, owner: int, hold_until: float | None = None) -> tuple[int, int]:
        """Forget ``owner``, whose client died or whose lease expired: release
        every pin it holds (a doomed entry left free is dropped) and drop every
        PENDING entry it created (no writer will seal it). Afterwards the store
        holds nothing of ``owner``: a late :meth:`complete_step` of it finds
        nothing to settle. Returns (pins released, PENDING entries dropped).

        ``hold_until``: the dropped entries' slots are held out of use until
        :meth:`release_held` is called with a time at or past it (the
        caller's clock): a worker of a client that stopped answering may
        still be writing into them, and a slot handed to another writer
        meanwhile could end up holding a mix of both. None: free at once
        (the caller knows the workers are gone).
        """
        with self._lock:
            unpinned = 0
            for _, keys in self._pins.pop(owner, {}).values():
                self._unpin(keys)
                unpinned += len(keys)
            self._progress.pop(owner, None)
            free_before = len(self._free)
            # Held slots keep naming their key (unpublished, no rank ready):
            # a service that restarts within the hold and adopts the arena
            # then holds them too (DramTier.written_slots), instead of
            # handing them to a new writer while the late one may still write.
            dropped = sum(self._drop_pending(owner, s, keys, keep_key=hold_until is not None)
                          for s, keys in self._pending.pop(owner, {}).items())
            if hold_until is not None and dropped:
                # _drop appended the slots last: move them to the held list.
                self._held.append((hold_until, self._free[free_before:]))
                del self._free[free_before:]
            return unpinned, dropped

    def expire_pins(self, older_than: float) -> int:
        """Release the pins of every step first pinned before ``older_than``
        (``time.monotonic()``) and not completed since, of owners that have
        completed no step since ``older_than`` either: an instance whose
        engine is stuck but whose session lives (its client still pings)
        would otherwise keep them, and their blocks, forever; one that is
        only slow (a step longer than the lease, its next step's pins taken
        meanwhile) completes steps and keeps its pins. A load that still
        reads such a slot later is checked against its key and checksum, and
        fails if the slot was reused. Returns how many pins were released; a
        later :meth:`complete_step` of those steps finds nothing to unpin."""
        with self._lock:
            n = 0
            for owner, steps in list(self._pins.items()):
                if self._progress.get(owner, older_than) < older_than:
                    for step in [st for st, (since, _) in steps.items() if since < older_than]:
                        _, keys = steps.pop(step)
                        self._unpin(keys)
                        n += len(keys)
                if not steps:
                    del self._pins[owner]
            self._c.pins_expired += n
            return n

    def hold_slots(self, slots: Iterable[int], until: float) -> int:
        """Take free ``slots`` out of use until ``until`` (see :meth:`end_session`):
        slots of an adopted arena that a dead owner's writers may still fill."""
        with self._lock:
            want = set(slots) & set(self._free)
            if want:
                self._free = [x for x in self._free if x not in want]
                self._held.append((until, sorted(want)))
            return len(want)

    def release_held(self, now: float) -> int:
        """Free the held slots whose time has come; returns how many."""
        with self._lock:
            due = [slots for t, slots in self._held if t <= now]
            if not due:
                return 0
            self._held = [(t, slots) for t, slots in self._held if t > now]
            for slots in due:
                for slot in slots:
                    self.tier.clear(slot)  # the key it kept while held (a restart holds such slots again)
                self._free.extend(slots)
            return sum(len(x) for x in due)

    @property
    def held_slots(self) -> int:
        with self._lock:
            return self._held_total()

    def slot_counts(self) -> tuple[int, int, int, int]:
        """(slots, on the free list, under an index entry, held), read at
        once: every slot is in exactly one of the last three, so they add up
        to the first unless a slot was lost or handed out twice."""
        with self._lock:
            return self.tier.num_slots, len(self._free), len(self._entries), self._held_total()

    def session_holds(self, owner: int) -> tuple[int, int]:
        """(pins held, PENDING entries) of ``owner``: what :meth:`end_session` would release."""
        with self._lock:
            pins = sum(len(keys) for _, keys in self._pins.get(owner, {}).values())
            pending = sum(self._own_pending(key, owner, s) is not None
                          for s, keys in self._pending.get(owner, {}).items() for key in keys)
            return pins, pending

    @staticmethod
    def _take_steps(by_owner: dict[int, dict[int, _T]], owner: int, step: int) -> list[tuple[int, _T]]:
        """Remove and return ``owner``'s steps up to ``step`` from ``by_owner``."""
        steps = by_owner.get(owner)
        if steps is None:
            return []
        taken = [(s, steps.pop(s)) for s in [s for s in steps if s <= step]]
        if not steps:
            del by_owner[owner]
        return taken

    def _own_pending(self, key: bytes, owner: int, step: int) -> _Entry | None:
        """The PENDING entry of ``key`` if ``owner`` created it in ``step``."""
        e = self._entries.get(key)
        if e is None or e.state is not EntryState.PENDING or e.step != step or e.owner != owner:
            return None
        return e

    def _drop_pending(self, owner: int, step: int, keys: list[bytes], keep_key: bool = False) -> int:
        n = 0
        for key in keys:
            e = self._own_pending(key, owner, step)
            if e is not None:
                self._drop(key, e, keep_key)
                n += 1
        return n

    def _entries_of(self, keys: Sequence[bytes]) -> tuple[list[_Entry | None], bool]:
        """The DRAM entries of ``keys`` (None where not held), and whether
        every key is held and plain READY (none in the odd set), by C calls."""
        entries = list(map(self._entries.get, keys))
        odd = self._odd
        return entries, all(entries) and not (odd and any(map(odd.__contains__, keys)))

    def _unpin(self, keys: list[bytes]) -> None:
        entries, plain = self._entries_of(keys)
        if plain:
            for e in entries:  # none doomed (doomed keys are odd): nothing to drop
                e.pins -= 1
            return
        for key, e in zip(keys, entries):
            if e is not None:
                e.pins -= 1
                if e.doomed and e.pins == 0 and e.state is EntryState.READY and not e.demoting:
                    self._drop(key, e)

    def discard(self, keys: Iterable[bytes]) -> int:
        """Drop the DRAM copies of ``keys`` (a reader found them corrupt).

        One in use (pinned by a later step, or being written to SSD) becomes
        unreadable now and is dropped as soon as it is free. Returns how many
        were dropped or doomed.
        """
        n = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.state is not EntryState.READY or e.doomed:
                    continue  # gone, or another copy of the key on its way: not the one found bad
                n += 1
                if e.pins == 0 and not e.demoting:
                    self._drop(key, e)
                else:
                    e.doomed = True
                    self._odd.add(key)
                    self.tier.publish(e.slot, False)
                    self._sync_dirty(key, e)
        return n

    def doom_pending(self, after_step: int, *, owner: int = 0) -> int:
        """Make every PENDING entry of ``owner``'s steps after ``after_step`` unreadable.

        When a load failed in ``after_step``, the steps already planned
        after it (asynchronous scheduling) may have computed blocks from the
        bad KV; their saves are dropped when their steps complete.
        """
        n = 0
        with self._lock:
            for s, keys in self._pending.get(owner, {}).items():
                if s <= after_step:
                    continue
                for key in keys:
                    e = self._own_pending(key, owner, s)
                    if e is not None and not e.doomed:
                        e.doomed = True
                        self._odd.add(key)
                        n += 1
        return n

    def clear(self) -> int:
        """Forget everything held (vLLM's reset after a weight update): after
        this nothing stored before it is readable, now or later. Returns how
        many DRAM and SSD entries were dropped or doomed.

        DRAM entries not in use are dropped. The others are doomed: a pinned
        one is dropped when its readers are done, a PENDING one when its step
        completes, a PROMOTING one when its read ends (with its SSD copy), a
        demoting one when its write ends, and that SSD copy is never
        published. Dropped SSD blocks get empty headers on disk (on an I/O
        thread), and so do free SSD slots whose headers still name a block
        freed earlier, so a restart does not bring any of them back; their
        slots are reused only after that, and the call returns once it is
        done (at most ``CLEAR_WAIT_S``).
        """
        with self._lock:
            n = 0
            for key, e in list(self._entries.items()):
                if e.doomed:
                    continue
                n += 1
                if e.pins == 0 and e.state is EntryState.READY and not e.demoting:
                    self._drop(key, e)
                else:
                    e.doomed = True
                    self._odd.add(key)
                    self.tier.publish(e.slot, False)
                    self._sync_dirty(key, e)
            # SSD copies pinned by a promotion go when it ends (_promote);
            # those being written are not in the index yet (_demote).
            ssd_slots = self._ssd_entries.ready_unpinned()
            # Forgotten now, but the slots are free only once their headers are empty on disk.
            self._ssd_entries.remove_many(ssd_slots, free=False)
            self._ssd_copies_dropped(ssd_slots)
            # Slots freed before (evicted, replaced, failed writes) whose
            # headers still name their old blocks: emptied too, or a restart
            # would bring those blocks back.
            dirty = self._ssd_entries.take_dirty() if self.ssd is not None else np.zeros(0, dtype=np.int32)
            if ssd_slots.size or dirty.size:
                self._mover.invalidate(np.concatenate([ssd_slots.astype(np.int32), dirty]))
            if self.ssd is not None:
                # Recovery ignores what is numbered below the floor: nothing
                # from before the reset comes back, even where emptying a
                # header fails. Every header written so far (demotions in
                # flight included: their numbers are taken under this lock,
                # and headers recovery could not read: SsdTier.reset_floor)
                # is numbered below it.
                self._mover.set_floor(self.ssd.reset_floor())
        if self.ssd is not None:
            # On disk before the reset returns: a stop right after it must
            # not find the old blocks (bounded: a reset is rare).
            self._mover.wait_idle(CLEAR_WAIT_S)
        return n + int(ssd_slots.size)

    # --- DRAM room --------------------------------------------------------

    def _effective_used(self) -> int:
        # Held slots are in no entry and not free: left out, a pool whose
        # free list a dead session's saves emptied stayed under the high
        # mark and evicted nothing until the hold ended.
        return len(self._entries) - self._freeing + self._held_total()

    def _held_total(self) -> int:
        return sum(len(slots) for _, slots in self._held)  # a batch per ended session: few

    def _sync_odd(self, key: bytes, e: _Entry) -> None:
        """Keep ``key`` in the odd set exactly while its entry is not plain
        READY (PENDING, PROMOTING, doomed, or to be freed once on SSD): the
        probe's fast path counts a key held and not in the set as readable."""
        if e.state is EntryState.READY and not (e.doomed or e.evict_after):
            self._odd.discard(key)
        else:
            self._odd.add(key)

    def odd_keys_consistent(self) -> bool:
        """Whether the odd set, and the ready index with it, are exactly
        what the entries say (for tests: a key missing from the set, or in
        the index, would be counted readable by the probe), and every
        stamp is on the slot of the block that was stamped."""
        with self._lock:
            odd = {k for k, e in self._entries.items()
                   if e.state is not EntryState.READY or e.doomed or e.evict_after}
            if self._odd != odd:
                return False
            if self._ready is None:
                return True
            # A stamped slot still holds the block stamped, whose key the index kept.
            stamped = np.flatnonzero(self._stamps)
            return self._ready.held() == {k: e.slot for k, e in self._entries.items() if k not in odd} and all(
                (e := self._entries.get(k)) is not None and e.slot == s
                for s, k in zip(stamped.tolist(), self._ready.keys_of(stamped)))

    def _sync_dirty(self, key: bytes, e: _Entry) -> None:
        """Keep ``key`` in the dirty order exactly while cleaning may copy it."""
        if self.ssd is None:
            return
        if e.state is EntryState.READY and not (e.on_ssd or e.demoting or e.doomed):
            if key not in self._dirty:
                # A block whose copy failed or was dropped comes back at the
                # recent end, behind the blocks that never had one.
                self._dirty.insert(key)
        else:
            self._dirty.remove(key)

    def _clean_locked(self) -> None:
        if self.ssd is None or len(self._entries) <= self._clean_mark:
            return
        self._flush_refreshes_locked()
        if not self._dirty_ordered:
            if self._dirty:
                self._dirty.reorder_as(self._policy.in_order())
            self._dirty_ordered = True
        room = self._mover.room(ahead=True)
        # Only dirty blocks are walked, coldest first, and only until the
        # queue is full: the cost is the queue's room (plus pinned blocks
        # passed over), not the number of blocks held (issue 7, item 10).
        batch: list[bytes] = []
        walk = self._dirty.victims()
        try:
            for key in walk:
                if room <= 0:
                    break
                e = self._entries[key]
                if e.pins:
                    continue  # being read: copied once its readers are done
                e.demoting = True
                self._dirty.remove(key)
                room -= 1
                batch.append(key)
        finally:
            walk.close()  # closed now even if this raised: reorder_as refuses while a walk is open
        if batch:
            self._mover.demote(batch)

    def _make_room_locked(self, n_new: int) -> None:
        used = self._effective_used()
        if used + n_new > self._high:
            self._evicting = True
        if not self._evicting:
            return
        # A run down to the low mark, a slice a call: each call frees what
        # keeps its own blocks under the high mark and EVICT_SLICE more. At
        # once, 10 % of 340,000 blocks held the lock ~300 ms (every
        # instance's lookup waiting, bench/store_step.py --saves-run).
        goal = max(0, self._low - n_new)
        self._evict_to(max(goal, min(self._high - n_new, used - n_new - self.EVICT_SLICE)))
        after = self._effective_used()
        if after <= goal or after >= used:
            self._evicting = False  # down to the low mark, or nothing could go: the next crossing starts again

    def _evict_to(self, target: int) -> None:
        self._flush_refreshes_locked()
        # Both walks are lazy and stop once DRAM is down to ``target``: they
        # look at the blocks freed plus the ones passed over (pinned, PENDING,
        # PROMOTING, being freed), not at the whole pool.
        freed = demoted = lost = 0
        batch: list[bytes] = []
        room = self._mover.room(ahead=False) if self.ssd is not None else 0
        if self.ssd is not None and (len(self._entries) >= self._watermark or room == 0):
            # Freeing fast: among the colder half of DRAM, blocks whose SSD
            # copy is already written go first, before any block is freed
            # without a copy. The hotter half is left alone: it holds what
            # was just promoted or looked up and is about to be read. Cleaning
            # keeps the cold end copied, so this walk usually stops after the
            # blocks it frees; it is longest when copies lag, and then at most
            # 8 slices deep (a run from the high mark calls it once a slice).
            window = max(self._effective_used() - target, min(len(self._entries) // 2, 8 * self.EVICT_SLICE))
            for key in itertools.islice(self._policy.victims(), window):
                if self._effective_used() <= target:
                    break
                e = self._entries[key]
                if e.on_ssd and not (e.pins or e.demoting or e.evict_after or e.doomed) \
                        and e.state is EntryState.READY:
                    self._count_unpublished(e)
                    self._drop(key, e)
                    freed += 1
        publish: list[bytes] = []
        publish_room = self._cluster.room() if self._cluster is not None and self._publish_on_evict else 0
        for key in self._policy.victims():
            if self._effective_used() <= target:
                break
            e = self._entries[key]
            if e.pins or e.state is not EntryState.READY or e.evict_after:
                continue
            if publish_room and not (self._in_cluster(e) or e.doomed or e.demoting
                                     or e.failed_epoch == self._cluster.epoch):
                # Published on its way out: pinned until the put ends, then an
                # ordinary victim of a later eviction (by then in the cluster).
                publish_room -= 1
                publish.append(key)
                continue
            if e.doomed:
                if not e.demoting:
                    self._drop(key, e)
                    freed += 1
                continue
            self._count_unpublished(e)
            if e.demoting:  # being cleaned already: free it when the write lands
                e.evict_after = True
                self._odd.add(key)
                self._freeing += 1
                demoted += 1
            elif self.ssd is None or e.on_ssd:
                self._drop(key, e)
                freed += 1
            elif len(self._entries) >= self._watermark or room == 0:
                # Above the DRAM watermark, with the queue full or SSD writes
                # given up, free fast: no new writes.
                self._drop(key, e)
                lost += 1
            else:
                e.demoting = e.evict_after = True
                self._odd.add(key)
                self._dirty.remove(key)
                room -= 1
                self._freeing += 1
                batch.append(key)
                demoted += 1
        if batch:
            self._mover.demote(batch)
        if publish:
            self._publish_locked(publish)
        self._c.evictions += freed + lost + demoted
        self._c.evicted_without_copy += lost
        if freed + lost + demoted:
            now = time.monotonic()
            if now - self._last_eviction_log > EVICTION_LOG_INTERVAL_S:
                self._last_eviction_log = now
                log.info("kvtier: DRAM eviction: %d freed (copy on SSD), %d demoting, %d freed without copy; "
                         "%d/%d slots used; totals: %d evictions", freed, demoted, lost, len(self._entries),
                         self.tier.num_slots, self._c.evictions)

    def _count_unpublished(self, e: _Entry) -> None:
        """With publishing on eviction, a block that leaves DRAM without
        reaching the cluster (puts in flight at the limit, or the cluster
        down) is counted: the cluster tier is missing it."""
        if self._publish_on_evict and self._cluster is not None and not (self._in_cluster(e) or e.doomed):
            self._c.cluster_publish_skipped += 1

    def _drop(self, key: bytes, e: _Entry, keep_key: bool = False) -> None:
        """Forget ``key``; its slot goes last on the free list, its header
        cleared (``keep_key``: still naming ``key``, unreadable)."""
        del self._entries[key]
        self._odd.discard(key)
        if self._ready is not None:
            self._stamp_at[e.slot] = 0
        self._policy.remove(key)
        self._dirty.remove(key)
        if keep_key:
            self.tier.clear(e.slot, key)
        else:
            self.tier.clear(e.slot)
        self._free.append(e.slot)

    # --- SSD room ---------------------------------------------------------

    def _take_ssd_locked(self) -> tuple[int, bool] | None:
        """A free SSD slot (global number) and whether it may hold an older header, or None."""
        if len(self._ssd_entries) + 1 > self._ssd_high:
            self._ssd_evicting = True
        if self._ssd_evicting:
            self._evict_ssd_to(self._ssd_low)
        return self._ssd_entries.take()

    def _evict_ssd_to(self, target: int) -> None:
        # One batch of the least recently used READY, unpinned blocks, chosen
        # and removed together: the cost is spread over the blocks it frees.
        # At most ``_ssd_batch`` of them: the eviction goes on in the next
        # calls until usage is down to ``target``, or stops early when nothing
        # more can go now (all written or pinned; the high mark starts it again).
        # Their headers still name them until the slots are reused; reuse
        # first writes empty headers (SsdTier.write, step 1).
        self._flush_refreshes_locked()
        want = min(len(self._ssd_entries) - target, self._ssd_batch)
        slots = self._ssd_entries.victims(want)
        if slots.size < want or len(self._ssd_entries) - slots.size <= target:
            self._ssd_evicting = False
        self._ssd_entries.remove_many(slots)
        self._ssd_copies_dropped(slots)
        n = int(slots.size)
        self._c.ssd_evictions += n
        now = time.monotonic()
        if n and now - self._last_ssd_eviction_log > EVICTION_LOG_INTERVAL_S:
            self._last_ssd_eviction_log = now
            log.info("kvtier: SSD eviction: %d blocks dropped; %d/%d slots used; totals: %d evictions",
                     n, len(self._ssd_entries), self.ssd.num_slots, self._c.ssd_evictions)

    def _drop_ssd(self, key: bytes, last: bool = False) -> None:
        # The header on disk still names the block until the slot is reused;
        # reuse first writes an empty header (SsdTier.write, step 1).
        # ``last``: a read of the slot failed: it is taken after every other
        # free slot (a bad sector taken again at once would fail a write).
        self._ssd_entries.remove_slot(self._ssd_entries[key].slot, last=last)
        e = self._entries.get(key)
        if e is not None:
            e.on_ssd = False
            self._sync_dirty(key, e)  # DRAM holds the only copy again: cleaning may copy it

    def _ssd_copies_dropped(self, slots: np.ndarray) -> None:
        """DRAM entries of the keys just dropped from SSD ``slots`` have no SSD copy any more."""
        if slots.size <= len(self._entries):
            for slot in slots.tolist():
                key = self._ssd_entries.key(slot)  # still there: the slot is not reused under this lock
                e = self._entries.get(key)
                if e is not None:
                    e.on_ssd = False
                    self._sync_dirty(key, e)
        else:  # a drop larger than DRAM: cheaper from the DRAM side
            for key, e in self._entries.items():
                if e.on_ssd and key not in self._ssd_entries:
                    e.on_ssd = False
                    self._sync_dirty(key, e)

    # --- moves ending (TierMover's jobs, under the lock) ----------------------

    def _begin_demotion_locked(self, keys: list[bytes]) -> list[tuple[bytes, int, int, bool]]:
        """SSD slots for the demoting ``keys``: (key, DRAM slot, SSD slot, may
        hold an older header) for each to write, marked being written; a key
        that gets none (doomed, or no room) ends its demotion here."""
        begun = []
        for key in keys:
            got = None
            try:
                e = self._entries[key]
                if e.doomed:  # reset (or found bad) since it was queued: nothing to write
                    self._finish_demotion_locked(key, ok=False, count=False)
                    continue
                got = self._take_ssd_locked()
                old = self._ssd_entries.get(key)
                if got is None or (old is not None and not old.ready):
                    if got is not None:
                        (slot, dirty), got = got, None  # given back here, never twice
                        self._ssd_entries.release([slot], dirty=dirty)
                    self._finish_demotion_locked(key, ok=False)
                    continue
                ssd_slot, reused = got
                # WRITING: held, not readable. An older copy elsewhere is
                # replaced; its slot is freed (dirty: its header names the key).
                self._ssd_entries.begin_write(key, ssd_slot)
                begun.append((key, e.slot, ssd_slot, reused))
            except Exception:  # noqa: BLE001 - a bug must not leave the batch's other keys demoting
                log.exception("kvtier: starting the SSD write of a block failed; it stays in DRAM only")
                self._abandon_demotion_locked(key, got)
        return begun

    def _abandon_demotion_locked(self, key: bytes, got: tuple[int, bool] | None) -> None:
        """Undo what a failed start of ``key``'s SSD write did: the slot it
        took (``got``), and the entry's demoting mark. Each part on its own:
        one failing leaves the others done."""
        if got is not None:
            try:
                if self._ssd_entries.state(got[0]) >= SlotState.WRITING:
                    self._ssd_entries.remove_slot(got[0], last=True)  # freed dirty: its header is unknown
                else:
                    self._ssd_entries.release([got[0]], dirty=got[1])
            except Exception:  # noqa: BLE001
                log.exception("kvtier: freeing the SSD slot of a failed write failed")
        e = self._entries.get(key)
        if e is not None and e.demoting:
            try:
                self._finish_demotion_locked(key, ok=False)
            except Exception:  # noqa: BLE001
                log.exception("kvtier: ending a failed SSD write failed")

    def _end_demotion_locked(self, key: bytes, ssd_slot: int, rec: BlockRecord | None, bad: bool) -> bool:
        """The write of ``key`` to ``ssd_slot`` ended, ``rec`` written (None:
        failed); ``bad``: its DRAM copy failed its checksums. True when the
        copy is refused: its header is to be emptied before the slot is freed."""
        e = self._entries[key]
        stale = e.doomed
        if stale:
            # Doomed while written (a reset, or a reader found it bad): the
            # copy must never be found, now or after a restart, so it is not
            # published and its header is emptied before the slot is freed;
            # also when the write failed: the slot's header may name this
            # block, or the block the slot held before.
            self._ssd_entries.remove_slot(ssd_slot, free=False)
            rec = None
        elif rec is not None:
            self._ssd_entries.publish(ssd_slot, rec.checksum, rec.seq)
        else:
            # Freed dirty: a header may have reached the disk. Taken last
            # from now on when the write failed: it may have failed on this
            # slot's sectors (a block found bad in DRAM was not written).
            self._ssd_entries.remove_slot(ssd_slot, last=not bad)
        if bad:
            self._c.corrupt_dram += 1
            e.doomed = True
            self._odd.add(key)
            self.tier.publish(e.slot, False)
        self._finish_demotion_locked(key, rec is not None, count=not stale and not bad)  # bad: counted above
        return stale

    def _finish_demotion_locked(self, key: bytes, ok: bool, count: bool = True) -> None:
        """The write of ``key`` ended: ``ok`` if its SSD copy is published;
        ``count``: a failure to count (not a copy refused after a reset)."""
        e = self._entries[key]
        e.demoting = False
        evict, e.evict_after = e.evict_after, False
        # Evicted (or found bad, or reset) while it was written: free the DRAM
        # copy unless a reader holds it. Dropped, it stays odd until it goes:
        # plain for an instant, the ready index would take it for a block
        # that leaves its table, and flush at once for nothing.
        drop = (evict or e.doomed) and e.pins == 0 and e.state is EntryState.READY
        if not drop:
            self._sync_odd(key, e)
        if evict:
            self._freeing -= 1
        if ok:
            self._c.demotions += 1
        elif count:
            self._c.demote_failures += 1
        e.on_ssd = ok
        if drop:
            self._drop(key, e)
        else:
            self._sync_dirty(key, e)  # a failed copy: cleaning may try again (after any back-off)

    def _end_promotion_locked(self, key: bytes, ok: bool, io_error: bool) -> int | None:
        """The read of ``key`` into its DRAM slot ended (``ok``: verified and
        sealed). Returns an SSD slot whose header is to be emptied before it
        is freed, or None."""
        s = self._ssd_entries.get(key)
        if s is not None:
            s.pins -= 1
        e = self._entries[key]
        if e.doomed:
            # Reset while it was read (only clear() dooms a PROMOTING entry):
            # neither copy may be found again. The SSD copy, which the read
            # kept from clear(), goes now, its header emptied so that a
            # restart does not bring it back.
            self._drop(key, e)
            if s is not None and s.pins == 0 and s.ready:
                self._ssd_entries.remove_slot(s.slot, free=False)
                return s.slot
            return None
        if ok:
            e.state = EntryState.READY
            self.tier.publish(e.slot)
            self._sync_odd(key, e)
            self._c.promotions += 1
            return None
        self._c.promote_failures += 1
        self._drop(key, e)
        if s is not None and key in self._ssd_entries:
            # A checksum or header mismatch means the SSD copy is bad; a read
            # error means it cannot be had. Either way it is forgotten, or
            # every later request would promote it again and wait on the
            # same failure.
            if io_error:
                self._c.ssd_read_errors += 1
            else:
                self._c.ssd_corrupt += 1
            self._drop_ssd(key, last=io_error)
        return None

    # --- the cluster tier (ClusterMover's jobs and the store's calls to it) ------

    def _publish_locked(self, keys: list[bytes]) -> None:
        """Hand READY ``keys`` to the cluster tier, each pinned until its put
        ends; past the mover's room they are skipped (counted)."""
        assert self._cluster is not None
        if self._cluster.closed:
            return
        room = self._cluster.room()
        jobs = []
        for key in keys:
            if not self._publishable_locked(key):
                continue
            if room <= 0:
                if self._cluster.republishing and self._cluster.up:
                    # Publishing again what a restarted master lost holds the
                    # room: a fresh save goes first in that line instead of
                    # never reaching the cluster.
                    self._cluster.defer(key)
                    continue
                self._c.cluster_publish_skipped += 1
                continue
            room -= 1
            e = self._entries[key]
            e.pins += 1
            self._publishing[key] = self._publishing.get(key, 0) + 1
            jobs.append((key, e.slot))
        if jobs:
            self._cluster.publish(jobs)

    def _in_cluster(self, e: _Entry) -> bool:
        """Whether ``e`` was published (or fetched) in the cluster's current epoch."""
        return self._cluster is not None and e.cluster_epoch == self._cluster.epoch

    def _publishable_locked(self, key: bytes) -> bool:
        """Whether ``key`` is a block to hand to the cluster now: READY, not
        doomed, not published in the cluster's current epoch."""
        e = self._entries.get(key)
        return e is not None and e.state is EntryState.READY and not e.doomed and not self._in_cluster(e)

    def _republish_keys_locked(self) -> list[bytes]:
        # Every entry's cluster_epoch is older now. With publishing on
        # eviction nothing more is needed (victims are published on their
        # way out again); write-through publishes what DRAM holds again.
        if self._publish_on_evict:
            return []
        self._flush_refreshes_locked()
        keys = list(self._policy.victims())  # coldest first
        keys.reverse()
        return keys

    def _published_keys_locked(self) -> list[bytes]:
        return [k for k, e in self._entries.items() if self._in_cluster(e)]

    def _vanished_locked(self, keys: list[bytes], epoch: int) -> list[bytes]:
        again: list[bytes] = []
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.cluster_epoch != epoch:
                continue  # gone from DRAM, or published again since the question
            e.cluster_epoch = -1
            self._c.cluster_vanished += 1
            if not self._publish_on_evict:
                again.append(key)
        return again

    def _end_publish_locked(self, key: bytes, ok: bool, bad: bool, epoch: int) -> None:
        e = self._entries[key]
        if ok:
            e.cluster_epoch = epoch
            self._c.cluster_published += 1
        elif bad:
            self._c.corrupt_dram += 1
            if not e.doomed:
                e.doomed = True
                self._odd.add(key)
                self.tier.publish(e.slot, False)
                self._sync_dirty(key, e)
        else:
            # Not published again on its way out: with puts failing (cluster
            # full or refusing), the same victims were pinned for a put at
            # every eviction and DRAM freed nothing.
            e.failed_epoch = epoch
            self._c.cluster_publish_failures += 1
        n = self._publishing.pop(key, 0) - 1
        if n > 0:
            self._publishing[key] = n
        self._unpin([key])

    def _end_fetch_locked(self, key: bytes, outcome: Fetched, epoch: int) -> None:
        e = self._entries[key]
        if e.doomed:  # reset while it was fetched (only clear() dooms a PROMOTING entry)
            self._drop(key, e)
            return
        if outcome is Fetched.OK:
            e.state = EntryState.READY
            e.cluster_epoch = epoch
            self.tier.publish(e.slot)
            self._c.cluster_fetched += 1
            self._sync_dirty(key, e)
            self._sync_odd(key, e)
            return
        if outcome is Fetched.GONE:
            self._c.cluster_gone += 1
        elif outcome is Fetched.CORRUPT:
            self._c.cluster_corrupt += 1
        else:
            self._c.cluster_fetch_errors += 1
        self._drop(key, e)

    def _release_ssd_locked(self, slots: np.ndarray, dirty: bool) -> None:
        """SSD ``slots``, forgotten, have empty headers on disk (unless ``dirty``): free them."""
        self._ssd_entries.release(slots, dirty)

    # --- statistics -------------------------------------------------------

    @property
    def used_slots(self) -> int:
        return self.tier.num_slots - len(self._free)

    @property
    def evictions(self) -> int:
        return self._c.evictions

    def counters(self) -> dict[str, int]:
        """Cumulative event counts, slot usage and the blocks moving between
        tiers, cheap enough to read every engine step."""
        c = self._c
        return {
            "evictions": c.evictions, "blocks_demoted": c.demotions, "demote_failures": c.demote_failures,
            "evicted_without_copy": c.evicted_without_copy, "blocks_promoted": c.promotions,
            "promote_failures": c.promote_failures, "ssd_corrupt_blocks": c.ssd_corrupt,
            "ssd_read_errors": c.ssd_read_errors,
            "ssd_evictions": c.ssd_evictions, "corrupt_blocks": c.corrupt_dram, "moves_stalled": c.moves_stalled,
            "ssd_write_give_ups": c.ssd_write_give_ups, "pins_expired": c.pins_expired,
            "dram_slots_used": self.used_slots,
            "dram_slots_total": self.tier.num_slots, "ssd_slots_used": len(self._ssd_entries),
            "ssd_slots_total": self.ssd.num_slots if self.ssd else 0,
            # Gauges of the moves in flight (moving(), without its jobs)
            "blocks_moving_to_ssd": self._mover.demoting, "blocks_moving_from_ssd": self._mover.promoting,
        } | (self._cluster_counters() if self._cluster is not None else {})

    def _cluster_counters(self) -> dict[str, int]:
        c = self._c
        return {"cluster_lookups": c.cluster_lookups, "cluster_hits": c.cluster_hits,
                "cluster_fetched": c.cluster_fetched, "cluster_gone": c.cluster_gone,
                "cluster_corrupt": c.cluster_corrupt, "cluster_fetch_errors": c.cluster_fetch_errors,
                "cluster_published": c.cluster_published, "cluster_publish_failures": c.cluster_publish_failures,
                "cluster_publish_skipped": c.cluster_publish_skipped, "cluster_down": c.cluster_down,
                "cluster_lost": c.cluster_lost, "cluster_vanished": c.cluster_vanished,
                "cluster_up": int(self._cluster.up), "blocks_moving_to_cluster": self._cluster.publishing,
                "blocks_moving_from_cluster": self._cluster.fetching}

    def statistics(self) -> StoreStatistics:
        """Counts read at one moment. Only what may be pending or pinned is
        looked at: a walk of every entry held the store's lock 36 ms at
        340,000 blocks, on each scrape of the service's /metrics or /health,
        with every instance's lookups waiting behind it."""
        with self._lock:
            entries = self._entries
            # Entries not READY are all in the odd set; pins are all in the
            # steps' pin lists and the puts in flight.
            pending = sum(1 for k in self._odd if (e := entries.get(k)) is not None and e.state is not EntryState.READY)
            held = {k for steps in self._pins.values() for _, keys in steps.values() for k in keys}
            held.update(self._publishing)
            pinned = sum(1 for k in held if (e := entries.get(k)) is not None and e.pins)
            return StoreStatistics(self.tier.num_slots, len(self._entries), pending, pinned,
                                   self.ssd.num_slots if self.ssd else 0, len(self._ssd_entries), replace(self._c))
