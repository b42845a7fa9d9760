"""TierMover: the I/O that moves blocks between a store's DRAM arena and its SSD tier.

:class:`~kvtier.store.TieredStore` decides what is held and what moves (its
index, slots, pins, watermarks, evictions); its mover carries the moves out
on a pool of I/O threads and owns everything about them:

- demotion (DRAM -> SSD): blocks the store hands over are written in batches
  of ``IO_BATCH`` (one round of fdatasyncs each), each block checked against
  its DRAM checksums first. ``demote_queue_blocks`` bounds how many are
  being written at once (:meth:`TierMover.room`).
- the write back-off: a failed batch stops cleaning (writes ahead of need)
  for 2, 4, 8, ... completed steps, then allows one batch at a time until a
  write succeeds; after ``DEMOTE_GIVE_UP`` failed batches in a row no block
  is written to SSD again (reads go on). The clock is the store's completed
  steps (:meth:`TierMover.step_done`), not wall time.
- promotion ("rewarm", SSD -> DRAM): reads in batches of ``PROMOTE_BATCH``,
  verified against the SSD checksum, the DRAM slot header sealed again.
- header invalidation: SSD slots the store forgot get empty headers on disk
  before they are free, so a restart does not bring their blocks back.
- the jobs in flight: :attr:`TierMover.idle` (what the store's wait for progress waits on),
  :meth:`TierMover.wait_idle` and :meth:`TierMover.close`.

:class:`ClusterMover`, when a cluster tier is configured, does the same for
it on threads of its own: lookups (bounded by a timeout, skipped while the
cluster is down), fetches (cluster -> a PROMOTING entry's DRAM slot) and
publishing (a pinned READY slot -> cluster), batched, never on the
scheduler's path and never under the store's lock.

The mover shares the store's lock. The store calls it under that lock; its
jobs do their I/O outside it and take it to tell the store how a move ended,
through the few methods of :class:`MoverHost`: the store changes its index,
the mover only its own counts and back-off.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import xxhash

from kvtier.cluster.client import Fetched
from kvtier.config import CLUSTER_LOOKUP_WAIT_S
from kvtier.errors import ClusterError, TierIOError
from kvtier.tier import DramTier
from kvtier.tier.dram import checksum
from kvtier.tier.ssd import BlockRecord, SsdLocation, SsdTier

if TYPE_CHECKING:
    from kvtier.store import EventCounts

log = logging.getLogger(__name__)

IO_BATCH = 16  # blocks per demotion job: one round of fdatasyncs per batch
PROMOTE_BATCH = 4  # blocks per promotion job: small, so all I/O threads share a prefix's reads
# Failed demotion batches in a row after which SSD writes stop for good. With
# the back-off doubling from 2 steps, the last try comes 2+4+8+16+32 = 62
# completed steps after the first failure: a transient error (a full disk
# being cleaned up) has time to pass, a dead disk is not written forever.
DEMOTE_GIVE_UP = 6

# A promotion: the key, the DRAM slot it is read into, and its SSD copy.
PromoteJob = tuple[bytes, int, SsdLocation, BlockRecord]


class MoverHost(Protocol):
    """What a mover's jobs ask of the store, each under the store's lock."""

    def _begin_demotion_locked(self, keys: list[bytes]) -> list[tuple[bytes, int, int, bool]]:
        """Give each of ``keys`` (marked demoting) an SSD slot and mark it
        being written; a key that gets none ends its demotion here. Returns
        (key, DRAM slot, SSD slot, whether the SSD slot may hold an older
        header) for the blocks to write."""
        ...

    def _end_demotion_locked(self, key: bytes, ssd_slot: int, rec: BlockRecord | None, bad: bool) -> bool:
        """The write of ``key`` into ``ssd_slot`` ended: ``rec``, what was
        written, or None if nothing was; ``bad``: its DRAM copy failed its
        checksums. True when the copy is refused (the entry was doomed
        meanwhile): its header must be emptied, then the slot freed."""
        ...

    def _moves_begin_locked(self, keys: Sequence[bytes]) -> None:
        """The reads (or fetches) of ``keys`` into DRAM start now."""
        ...

    def _end_promotion_locked(self, key: bytes, ok: bool, io_error: bool) -> int | None:
        """The read of ``key`` into DRAM ended; returns an SSD slot whose
        header must be emptied, then the slot freed, or None."""
        ...

    def _release_ssd_locked(self, slots: np.ndarray, dirty: bool) -> None:
        """Free SSD ``slots`` (no longer in the index); ``dirty``: a header may still name a block."""
        ...


class _Jobs:
    """Jobs on a thread pool (``_io``), tracked until they end, under the store's lock."""

    _lock: threading.RLock
    _io: ThreadPoolExecutor | None
    _inflight: set[Future]
    _idle: threading.Condition

    def _submit(self, fn, arg) -> None:
        io = self._io
        try:
            if io is None:
                raise RuntimeError("closed")
            fut = io.submit(fn, arg)
        except RuntimeError:
            # Closed (or closing: a job that ends submits its follow-up):
            # the job runs here, in the caller's thread, so that its blocks'
            # entries end and the in-flight counts stay exact instead of a
            # job lost half-way (a store called during shutdown).
            try:
                fn(arg)
            except Exception:  # noqa: BLE001 - as _job_done logs a job's failure
                log.exception("kvtier: I/O job failed")
            with self._lock:
                self._idle.notify_all()
            return
        self._inflight.add(fut)
        fut.add_done_callback(self._job_done)

    def _job_done(self, fut: Future) -> None:
        with self._lock:
            self._inflight.discard(fut)
            self._idle.notify_all()
        if fut.exception() is not None:
            log.error("kvtier: I/O job failed", exc_info=fut.exception())

    @property
    def busy(self) -> bool:
        """Jobs are in flight (a snapshot, read without the lock)."""
        return bool(self._inflight)

    @property
    def idle(self) -> threading.Condition:
        """Notified, under the store's lock, each time a job ends."""
        return self._idle

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until no job is in flight."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout_s)

    def jobs(self) -> int:
        """I/O jobs submitted and not ended, moves and header clearing (a job
        may submit the next before it ends)."""
        with self._lock:
            return len(self._inflight)


class TierMover(_Jobs):
    """The I/O threads of one store and the moves running on them."""

    def __init__(self, host: MoverHost, lock: threading.RLock, counts: EventCounts, tier: DramTier,
                 ssd: SsdTier | None, *, io_threads: int = 4, demote_queue_blocks: int = 256) -> None:
        self._host = host
        self._lock = lock
        self._c = counts
        self._tier = tier
        self._ssd = ssd
        self._limit = demote_queue_blocks
        self.demoting = 0  # blocks handed to demote() whose write has not ended
        self.promoting = 0  # blocks handed to promote() whose read has not ended
        # Back-off of SSD writes, counted in completed steps (step_done
        # calls), not wall time: after a failed batch cleaning starts no
        # write before step ``_resume``; ``_fails`` failed in a row.
        self._steps_done = 0
        self._fails = 0
        self._resume = 0
        self._writes_off = False  # gave up on SSD writes
        self._inflight: set[Future] = set()
        self._idle = threading.Condition(lock)
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-io") if ssd is not None else None

    def close(self) -> None:
        """Finish the I/O in flight, then stop the I/O threads."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    # --- called by the store, under its lock ----------------------------------

    def step_done(self) -> None:
        """One step completed: the clock of the write back-off."""
        self._steps_done += 1

    def room(self, ahead: bool) -> int:
        """How many blocks may start their SSD write now; ``ahead``: for
        cleaning, which backs off after a failure. An eviction still tries
        the one copy of each block it evicts (the block leaves DRAM either
        way, so it is never retried), one batch at a time after a failure."""
        if self._writes_off or (ahead and self._steps_done < self._resume):
            return 0
        if self._fails:
            # After a failed batch, one batch at a time until a write
            # succeeds: a failing disk gets one batch per back-off, not a
            # queue's worth.
            return min(self._limit, IO_BATCH) if self.demoting == 0 else 0
        return max(0, self._limit - self.demoting)

    def demote(self, keys: list[bytes]) -> None:
        """Write ``keys`` (marked demoting by the store) to SSD, ``IO_BATCH`` per job."""
        self.demoting += len(keys)
        for i in range(0, len(keys), IO_BATCH):
            self._submit(self._demote, keys[i : i + IO_BATCH])

    def promote(self, jobs: list[PromoteJob]) -> None:
        """Read the blocks of ``jobs`` (PROMOTING entries) into their DRAM
        slots, ``PROMOTE_BATCH`` per job."""
        for i in range(0, len(jobs), PROMOTE_BATCH):
            batch = jobs[i : i + PROMOTE_BATCH]
            self._submit(self._promote, batch)
            self.promoting += len(batch)  # (the job ends it under the lock the caller holds)

    def invalidate(self, slots: np.ndarray) -> None:
        """Empty the headers of SSD ``slots`` on an I/O thread, then free them."""
        self._submit(self._invalidate, slots)

    def set_floor(self, floor: int) -> None:
        """Persist the SSD tier's reset floor on an I/O thread (a stuck disk
        holds up the thread, never the caller beyond its wait)."""
        self._submit(self._set_floor, floor)

    # --- jobs (run on the I/O threads) -----------------------------------------

    def _demote(self, keys: list[bytes]) -> None:
        ssd, tier = self._ssd, self._tier
        assert ssd is not None
        plan: list[tuple[bytes, int, SsdLocation, BlockRecord, bool]] = []
        dram_sums: dict[bytes, tuple[int, ...]] = {}  # DRAM header checksums, checked before the copy
        with self._lock:
            try:
                begun = self._host._begin_demotion_locked(keys)
            except BaseException:
                self.demoting -= len(keys)  # the count stays exact: room() would otherwise shrink for good
                raise
            self.demoting -= len(keys) - len(begun)
            for key, slot, ssd_slot, reused in begun:
                try:
                    plan.append((key, slot, ssd.location(ssd_slot), BlockRecord(key, ssd.next_seq(), 0), reused))
                    dram_sums[key] = tier.header(slot).checksums
                except Exception:  # noqa: BLE001 - a bug: this block is not written, the others are
                    log.exception("kvtier: planning the SSD write of a block failed")
                    if plan and plan[-1][0] == key:
                        plan.pop()
                    self.demoting -= 1
                    self._host._abandon_demotion_locked(key, (ssd_slot, reused))
        if not plan:
            return
        items = []
        good = []
        bad: set[bytes] = set()
        ok = False
        try:
            for key, slot, loc, rec, _ in plan:
                # Only what still matches its DRAM checksums goes to SSD: the SSD
                # checksum is computed here, so a block that went bad in DRAM
                # would otherwise be stored as a "valid" block.
                if not self._dram_intact(slot, key, dram_sums[key]):
                    bad.add(key)
                    continue
                data = tier.slot_buffer(slot)
                items.append((loc, replace(rec, checksum=xxhash.xxh3_64_intdigest(data)), data))
                good.append(loc)
            ssd.write(items, [loc for _, _, loc, _, reused in plan if reused and loc in good])
            ok = True
        except TierIOError as err:
            log.warning("kvtier: demoting %d blocks to SSD failed (%s); they are dropped", len(plan), err)
        except Exception:  # noqa: BLE001 - never leave entries demoting forever
            log.exception("kvtier: demoting %d blocks failed", len(plan))
        written = {loc: rec for loc, rec, _ in items} if ok else {}
        refused: list[int] = []  # global SSD slot numbers
        with self._lock:
            try:
                for key, _, loc, _, _ in plan:
                    # One block's end failing (a bug) must not leave the
                    # batch's other blocks demoting for good.
                    try:
                        ssd_slot = ssd.slot_number(loc)
                        if self._host._end_demotion_locked(key, ssd_slot, written.get(loc), key in bad):
                            refused.append(ssd_slot)
                    except Exception:  # noqa: BLE001
                        log.exception("kvtier: ending the SSD write of a block failed")
            finally:
                self.demoting -= len(plan)
                if items:
                    self._note_write_locked(ok)
        if refused:
            self._invalidate(refused)  # on this I/O thread: the pool may be shutting down

    def _note_write_locked(self, ok: bool) -> None:
        """Back off SSD writes after a failed batch; give up after DEMOTE_GIVE_UP in a row."""
        if ok:
            self._fails = 0
            return
        if self._writes_off or self._steps_done < self._resume:
            return  # started before the back-off began: the same outage, counted once
        self._fails += 1
        if self._fails >= DEMOTE_GIVE_UP:
            self._writes_off = True
            self._c.ssd_write_give_ups += 1
            log.error("kvtier: %d SSD write batches failed in a row; no more blocks are written to SSD "
                      "(blocks already there are still read); restart kvtier once the disk is fixed",
                      self._fails)
        else:
            # Counted in completed steps: a dead disk costs one batch per
            # back-off, and tests need no clock.
            self._resume = self._steps_done + 2 ** self._fails

    def _dram_intact(self, slot: int, key: bytes, checksums: tuple[int, ...]) -> bool:
        tier = self._tier
        hdr = tier.header(slot)
        if hdr.key != key or hdr.ready_mask != (1 << tier.ranks) - 1:
            return False
        return all(checksum(tier.rank_view(slot, r), key) == checksums[r] for r in range(tier.ranks))

    def _promote(self, jobs: list[PromoteJob]) -> None:
        ssd, tier = self._ssd, self._tier
        assert ssd is not None
        with self._lock:
            self._host._moves_begin_locked([key for key, *_ in jobs])
        results = []
        for key, slot, loc, rec in jobs:
            io_error = False
            try:
                ok = ssd.read(loc, rec, tier.slot_buffer(slot))
                if ok:
                    # The SSD header keeps one checksum of the whole slot: the
                    # per-rank DRAM checksums are computed again from the bytes
                    # just verified against it, and every rank is sealed.
                    ranks = tier.ranks
                    tier.seal_all(slot, key, (1 << ranks) - 1,
                                  tuple(checksum(tier.rank_view(slot, r), key) for r in range(ranks)))
            except TierIOError as err:
                log.warning("kvtier: reading a block from SSD failed: %s", err)
                ok, io_error = False, True
            except Exception:  # noqa: BLE001 - never leave entries PROMOTING forever
                log.exception("kvtier: promoting a block failed")
                ok, io_error = False, True
            results.append((key, ok, io_error))
        refused: list[int] = []  # global SSD slot numbers
        with self._lock:
            try:
                for key, ok, io_error in results:
                    # As for demotions: one block's end failing leaves the others' ends done.
                    try:
                        slot = self._host._end_promotion_locked(key, ok, io_error)
                    except Exception:  # noqa: BLE001
                        log.exception("kvtier: ending the read of a block from SSD failed")
                        continue
                    if slot is not None:
                        refused.append(slot)
            finally:
                self.promoting -= len(jobs)
        if refused:
            self._invalidate(refused)

    def _set_floor(self, floor: int) -> None:
        assert self._ssd is not None
        try:
            self._ssd.set_floor(floor)
        except TierIOError as err:
            log.warning("kvtier: %s; the reset relies on emptying the old headers alone", err)

    def _invalidate(self, slots: Sequence[int] | np.ndarray) -> None:
        """Empty the headers of SSD ``slots`` (global numbers, no longer in the
        index) on disk, then free the slots. Runs on an I/O thread."""
        assert self._ssd is not None
        slots = np.asarray(slots, dtype=np.int64)
        try:
            self._ssd.invalidate(slots)
            dirty = False
        except TierIOError as err:
            log.warning("kvtier: clearing SSD headers failed (%s); the slots are rewritten before reuse", err)
            dirty = True
        with self._lock:
            self._host._release_ssd_locked(slots, dirty)


# --- the cluster tier ------------------------------------------------------------

CLUSTER_BATCH = 32  # blocks per cluster put or get call
CLUSTER_THREADS = 2  # transfers in flight at once
CLUSTER_RETRY_FIRST_S = 0.2
CLUSTER_RETRY_MAX_S = 5.0
CLUSTER_HEALTH_MISSES = 3  # failed health checks in a row that mark a reachable cluster down
CLUSTER_AUDIT_KEYS = 512  # published blocks asked about with each health check during a pass
# A key whose fetch failed (a value that fails its checks, or a transfer
# error) is not looked up in the cluster again for this long: the cluster
# would say it holds it, the fetch would fail again, and every request with
# that prefix would wait out promote_timeout_s. The last CLUSTER_SHUN_MAX
# such keys are remembered. Keys shunned for a transfer error are asked
# again as soon as the cluster is seen back from an outage (up again, or
# its master found restarted): the outage was the likely cause.
CLUSTER_SHUN_S = 30.0
CLUSTER_SHUN_MAX = 4096


class RemoteTier(Protocol):
    """The cluster tier as the mover uses it (:class:`kvtier.cluster.client.MooncakeTier`).

    Every call may raise :class:`~kvtier.errors.ClusterError` or block for
    as long as the remote side takes; the mover bounds the waits it cares
    about and never calls under the store's lock."""

    @property
    def connected(self) -> bool: ...

    def connect(self) -> None: ...

    def healthy(self) -> bool: ...

    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def fetch(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[Fetched]: ...

    def publish(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]: ...

    def capacity(self) -> int | None: ...

    def holds_mark(self) -> bool: ...

    def put_mark(self) -> bool: ...

    def close(self) -> None: ...


class ClusterHost(Protocol):
    """What a cluster mover's jobs ask of the store, each under the store's lock."""

    def _moves_begin_locked(self, keys: Sequence[bytes]) -> None:
        """The fetches of ``keys`` into DRAM start now."""
        ...

    def _end_fetch_locked(self, key: bytes, outcome: Fetched, epoch: int) -> None:
        """The fetch of ``key`` into its PROMOTING entry's DRAM slot, begun
        in ``epoch``, ended."""
        ...

    def _end_publish_locked(self, key: bytes, ok: bool, bad: bool, epoch: int) -> None:
        """The put of ``key``, begun in ``epoch``, ended (``ok``: the cluster has it); ``bad``: its
        DRAM copy failed its checksums and was not sent. Releases the
        publishing pin."""
        ...

    def _publishable_locked(self, key: bytes) -> bool:
        """Whether ``key`` is a block to publish now (held, READY, not in the cluster's current epoch)."""
        ...

    def _publish_locked(self, keys: list[bytes]) -> None:
        """Pin the publishable ``keys``, as many as the room takes, and hand them to :meth:`ClusterMover.publish`."""
        ...

    def _republish_keys_locked(self) -> list[bytes]:
        """A new epoch began with this node's mark put (again): the blocks to
        publish again, hottest first (none when blocks are published on
        their way out of DRAM)."""
        ...

    def _published_keys_locked(self) -> list[bytes]:
        """The blocks published (or fetched) in the current epoch."""
        ...

    def _vanished_locked(self, keys: list[bytes], epoch: int) -> list[bytes]:
        """The cluster no longer holds ``keys``, published in ``epoch``: they
        count as unpublished. Returns the ones to publish again (with
        write-through; none when blocks are published on their way out of
        DRAM)."""
        ...


class ClusterMover(_Jobs):
    """The cluster tier's threads: lookups, fetches (cluster -> DRAM slot) and
    publishing (DRAM slot -> cluster), beside the :class:`TierMover`.

    Whether the cluster is up is decided here: a failed or late call (later
    than ``timeout_s``) marks it down, and until a health check passes again
    (every ``CLUSTER_RETRY_FIRST_S`` doubling to ``CLUSTER_RETRY_MAX_S``, on
    a thread of its own, which also connects in the first place) lookups
    answer 0 at once and nothing is published: the scheduler never waits on
    a dead master. Publishing is bounded by ``queue_blocks`` blocks in
    flight; past that a block is not published (counted), never waited for.

    Epochs: a block published (or fetched) in ``epoch`` is known to be in the
    cluster while the epoch lasts. Each health check also asks whether the
    cluster still holds this node's mark (``MooncakeTier.holds_mark``); a
    restarted master, or one that lost the segment the mark was in, lost
    it, and with it (possibly) this node's blocks: a new epoch begins at
    once (nothing counts as published), and another when the mark is put
    again (the first one, at start, included), after which the store
    publishes again what it holds (``_republish_keys_locked``), as room
    frees, fresh saves first (:meth:`defer`). A quick
    restart is seen this way even when no health check failed.

    A peer that leaves takes the blocks held in its segment with it and
    leaves the mark (in this node's segment) alone. Each health check also
    reads the cluster's capacity (the memory its nodes lend); when it is
    lower than at the check before, a pass asks the cluster about every
    block this node counts as published, ``CLUSTER_AUDIT_KEYS`` a check:
    those it no longer holds count as unpublished (published again with
    write-through, on their way out of DRAM otherwise), so a block is not
    evicted here on the belief that the cluster keeps it. Only then:
    Mooncake renews a key's lease when asked whether it exists, so asking
    all the time would keep this node's blocks from its eviction.
    """

    def __init__(self, host: ClusterHost, lock: threading.RLock, counts: EventCounts, tier: DramTier,
                 remote: RemoteTier, *, timeout_s: float = CLUSTER_LOOKUP_WAIT_S, queue_blocks: int = 1024,
                 idle: threading.Condition | None = None) -> None:
        self._host = host
        self._lock = lock
        self._c = counts
        self._tier = tier
        self.remote = remote
        self.timeout_s = timeout_s
        self._limit = queue_blocks
        self.publishing = 0  # blocks handed to publish() whose put has not ended
        self.fetching = 0  # blocks handed to fetch() whose get has not ended
        self.epoch = 0  # bumped when the cluster lost this node's mark and when it is put again
        self._marked = False  # the mark was put in this epoch
        self._backlog: collections.deque[bytes] = collections.deque()  # blocks to publish again
        self._audit: list[bytes] = []  # published blocks still to ask about in this pass
        self._audit_epoch = -1  # the epoch the pass's list was taken in
        self._capacity: int | None = None  # the cluster's capacity at the last check that read it
        self._up = False
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._inflight: set[Future] = set()
        # ``idle``: the store's SSD mover's condition, shared, so that a wait
        # for progress wakes when a job of either mover ends.
        self._idle = idle if idle is not None else threading.Condition(lock)
        self._io = ThreadPoolExecutor(CLUSTER_THREADS, thread_name_prefix="kvtier-cluster")
        self._ask = ThreadPoolExecutor(1, thread_name_prefix="kvtier-cluster-lookup")
        # Lookups handed to ``_ask`` and not yet done, oldest first, each with
        # when it began to run (0.0 while queued). The lookup thread takes them
        # in order, so the first is the one running.
        self._asked: collections.deque[tuple[Future, list[float]]] = collections.deque()
        self._asked_lock = threading.Lock()
        self._shunned: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # key -> until when
        self._shun_lock = threading.Lock()
        self._shunned_for_errors: set[bytes] = set()  # of _shunned: for a transfer error, not a bad value
        self._health = threading.Thread(target=self._health_loop, name="kvtier-cluster-health", daemon=True)
        self._health.start()

    @property
    def up(self) -> bool:
        return self._up

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        # Under the store's lock: whatever hands jobs over checks ``closed``
        # under it, so no job is submitted to the threads shut down below.
        with self._lock:
            self._closed.set()
        self._wake.set()
        self._io.shutdown(wait=True)
        self._ask.shutdown(wait=False, cancel_futures=True)
        self._health.join(timeout=5)
        asking = self.asking
        if asking is not None:
            futures_wait([asking], timeout=self.timeout_s)
        if self._health.is_alive() or (asking is not None and not asking.done()):
            # A lookup or a connection attempt is still inside Mooncake's
            # client: closing it under that call could crash the process.
            log.warning("kvtier cluster: a call to the cluster has not returned; its client is left to the "
                        "process's exit")
            return
        self.remote.close()

    # --- up and down ----------------------------------------------------------

    def _down(self, why: object) -> None:
        if self._up:
            self._up = False
            self._c.cluster_down += 1
            log.warning("kvtier cluster: unreachable (%s); lookups miss and nothing is published until it "
                        "answers again", why)
        self._wake.set()

    def _health_loop(self) -> None:
        wait = CLUSTER_RETRY_FIRST_S
        missed = 0  # failed checks in a row while up
        while not self._closed.is_set():
            ok = False
            try:
                if not self.remote.connected:
                    self.remote.connect()
                healthy = self.remote.healthy()
                if healthy:
                    self._check_mark()  # raises when the master cannot answer it: a failed check
                    try:
                        self._audit_step()
                    except ClusterError as err:  # the pass goes on at the next check; up stays up
                        log.debug("kvtier cluster: asking about published blocks failed: %s", err)
                ok = healthy
            except ClusterError as err:
                log.debug("kvtier cluster: not reachable yet: %s", err)
            except Exception:  # noqa: BLE001 - the health thread must outlive any one failure
                log.exception("kvtier cluster: health check failed")
            missed = 0 if ok else missed + 1
            if ok:
                if not self._up:
                    log.info("kvtier cluster: reachable; lookups and publishing on")
                    self._forgive_transfer_errors("the cluster answers again")
                    with self._lock:
                        self._up = True
                        # Publishing may go on: blocks to publish again were
                        # listed while down (the mark put before "up").
                        self._feed_locked()
                self._up = True
                wait = CLUSTER_RETRY_FIRST_S
                period = 1.0
            elif self._up and missed < CLUSTER_HEALTH_MISSES:
                # One missed check on a loaded machine is not an outage (the
                # e2e test lost a hit to it); a call that fails still marks
                # the cluster down at once.
                period = 1.0
            else:
                if self._up:
                    self._down("its master does not answer")
                period = wait
                wait = min(wait * 2, CLUSTER_RETRY_MAX_S)
            self._wake.wait(period)
            self._wake.clear()

    def _check_mark(self) -> None:
        """New epochs when the cluster no longer holds this node's mark:
        one at once (what was published may be gone), one when it is put
        again (the store then publishes again). Raises ClusterError."""
        if self.remote.holds_mark():
            return
        with self._lock:
            if self._marked:
                self._marked = False
                self.epoch += 1
                self._c.cluster_lost += 1
                log.warning("kvtier cluster: the cluster lost this node's mark (its master restarted, or the "
                            "segment holding it left): blocks published before count as unpublished")
        if not self._marked:  # not under self._lock: it takes the shunned keys' lock only
            self._forgive_transfer_errors("the cluster lost this node's mark")
        if not self.remote.put_mark():
            return  # no segment with room yet (nodes re-join a restarted master on their own time)
        with self._lock:
            self._marked = True
            self.epoch += 1
            self._backlog = collections.deque(self._host._republish_keys_locked())
            self._feed_locked()

    def _audit_step(self) -> None:
        """A pass begins (the published blocks listed from the store's
        index) when the cluster's capacity dropped since the last check;
        during a pass, ask the cluster about its next ``CLUSTER_AUDIT_KEYS``
        blocks; those it no longer holds count as unpublished. A new epoch
        ends a pass (everything counts as unpublished then). Raises ClusterError."""
        capacity = self.remote.capacity()
        with self._lock:
            if self._audit_epoch != self.epoch:
                self._audit, self._audit_epoch = [], self.epoch
            shrank = capacity is not None and self._capacity is not None and capacity < self._capacity
            if capacity is not None:
                self._capacity = capacity
            if not self._marked:
                return
            if shrank:
                self._audit = self._host._published_keys_locked()
                log.info("kvtier cluster: the cluster's capacity dropped (a node left); asking about the %d "
                         "blocks this node published", len(self._audit))
            epoch = self.epoch
            keys = self._audit[-CLUSTER_AUDIT_KEYS:]
            del self._audit[-CLUSTER_AUDIT_KEYS:]
        if not keys:
            return
        gone = [k for k, held in zip(keys, self.remote.exists(keys)) if not held]
        if not gone:
            return
        with self._lock:
            if epoch != self.epoch:
                return  # everything counts as unpublished already
            again = self._host._vanished_locked(gone, epoch)
            log.info("kvtier cluster: %d blocks this node published are no longer in the cluster (a peer "
                     "that held them left, or the cluster evicted them)%s", len(gone),
                     f"; publishing {len(again)} again" if again else "")
            self._backlog.extend(again)
            self._feed_locked()

    # --- publishing again, as room frees ------------------------------------------

    @property
    def republishing(self) -> bool:
        """Blocks wait to be published again (under the store's lock)."""
        return bool(self._backlog)

    def defer(self, key: bytes) -> None:
        """Publish ``key`` first once room frees (under the store's lock)."""
        self._backlog.appendleft(key)

    def _feed_locked(self) -> None:
        """Hand waiting blocks to the store's publishing, as many as the room
        takes (under the store's lock); dropped once closed."""
        if self.closed:
            self._backlog.clear()
            return
        room = self.room()
        batch: list[bytes] = []
        while self._backlog and len(batch) < room:
            key = self._backlog.popleft()
            if self._host._publishable_locked(key):
                batch.append(key)
        if batch:
            self._host._publish_locked(batch)

    # --- called by the store ------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the cluster holds (0 while it is down).
        Called by the store outside its lock; waits at most ``timeout_s``."""
        keys = keys[: self._unshunned_run(keys)]
        if not keys or not self._up:
            return 0
        started = [0.0]
        with self._asked_lock:
            running = self._oldest_asked_locked()
            if running is not None and 0.0 < running[1][0] <= time.monotonic() - self.timeout_s:
                # A lookup has run a whole timeout on the cluster and still
                # runs: a new one would queue behind it and wait its own
                # timeout (the health check, a cached ping, says "up" again
                # at once). The oldest, not the last sent: one sent while
                # it ran, timed out and cancelled, must not hide it.
                return 0
            try:
                future = self._ask.submit(self._exists, started, list(keys))
            except RuntimeError:  # closed meanwhile
                return 0
            self._asked.append((future, started))
        try:
            found = future.result(self.timeout_s)
        except FutureTimeout:
            future.cancel()  # still queued behind a stuck one: it never runs
            self._down(f"a lookup took over {self.timeout_s} s")
            return 0
        except ClusterError as err:
            self._down(err)
            return 0
        except CancelledError:  # queued when the mover closed: no thread will run it
            return 0
        except Exception as err:  # noqa: BLE001 - an answer not understood: down, as for any failed call
            log.exception("kvtier cluster: a lookup failed")
            self._down(err)
            return 0
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        with self._lock:
            self._c.cluster_lookups += len(keys)
            self._c.cluster_hits += n
        return n

    def _exists(self, started: list[float], keys: list[bytes]) -> list[bool]:
        started[0] = time.monotonic()
        return self.remote.exists(keys)

    def _oldest_asked_locked(self) -> tuple[Future, list[float]] | None:
        asked = self._asked
        while asked and asked[0][0].done():
            asked.popleft()
        return asked[0] if asked else None

    @property
    def asking(self) -> Future | None:
        """The cluster lookup running now (or next to run), if any."""
        with self._asked_lock:
            oldest = self._oldest_asked_locked()
        return None if oldest is None else oldest[0]

    def _unshunned_run(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have no failed fetch within CLUSTER_SHUN_S."""
        if not self._shunned:
            return len(keys)
        now = time.monotonic()
        with self._shun_lock:
            for i, key in enumerate(keys):
                until = self._shunned.get(key)
                if until is None:
                    continue
                if until > now:
                    return i
                del self._shunned[key]
        return len(keys)

    def _shun(self, keys: Sequence[bytes], transfer_error: bool) -> None:
        if not keys:
            return
        until = time.monotonic() + CLUSTER_SHUN_S
        with self._shun_lock:
            for key in keys:
                self._shunned[key] = until
                self._shunned.move_to_end(key)
                if transfer_error:
                    self._shunned_for_errors.add(key)
                else:
                    self._shunned_for_errors.discard(key)
            while len(self._shunned) > CLUSTER_SHUN_MAX:
                self._shunned_for_errors.discard(self._shunned.popitem(last=False)[0])

    def _forgive_transfer_errors(self, why: str) -> None:
        """The cluster is back from an outage: the keys shunned for a
        transfer error are asked again (those whose value failed its checks
        stay shunned: the cluster would hand out the same bytes)."""
        with self._shun_lock:
            for key in self._shunned_for_errors:
                self._shunned.pop(key, None)
            n = len(self._shunned_for_errors)
            self._shunned_for_errors.clear()
        if n:
            log.info("kvtier cluster: %s; %d blocks whose fetch failed are asked for again", why, n)

    def room(self) -> int:
        """Blocks that may start publishing now (under the store's lock)."""
        return max(0, self._limit - self.publishing) if self._up else 0

    def fetch(self, jobs: list[tuple[bytes, int]]) -> None:
        """Get each (key, DRAM slot) of PROMOTING entries, ``CLUSTER_BATCH`` per call."""
        if self.closed:  # shutting down: no thread takes them; their entries end at once (a miss)
            for key, _ in jobs:
                self._host._end_fetch_locked(key, Fetched.ERROR, self.epoch)
            return
        for i in range(0, len(jobs), CLUSTER_BATCH):
            batch = jobs[i : i + CLUSTER_BATCH]
            self._submit(self._fetch, batch)
            self.fetching += len(batch)  # (the job ends it under the lock the caller holds)

    def publish(self, jobs: list[tuple[bytes, int]]) -> None:
        """Put each (key, DRAM slot) of READY entries the store pinned for it."""
        self.publishing += len(jobs)
        for i in range(0, len(jobs), CLUSTER_BATCH):
            self._submit(self._publish, jobs[i : i + CLUSTER_BATCH])

    # --- jobs (on the cluster threads) ------------------------------------------------

    def _fetch(self, jobs: list[tuple[bytes, int]]) -> None:
        keys = [k for k, _ in jobs]
        with self._lock:
            self._host._moves_begin_locked(keys)
        epoch = self.epoch  # what a fetched block is known to be in the cluster for
        asked = self._up  # read once: a cluster down is asked nothing, and nothing is shunned for it
        try:
            outcomes = self.remote.fetch(keys, [s for _, s in jobs]) if asked else [Fetched.ERROR] * len(jobs)
            # The keys the cluster answered for and failed (the whole call
            # failing marks the cluster down instead).
            if asked:
                self._shun([k for k, outcome in zip(keys, outcomes) if outcome is Fetched.CORRUPT], False)
                self._shun([k for k, outcome in zip(keys, outcomes) if outcome is Fetched.ERROR], True)
        except ClusterError as err:
            self._down(err)
            outcomes = [Fetched.ERROR] * len(jobs)
        except Exception:  # noqa: BLE001 - never leave entries PROMOTING forever
            log.exception("kvtier cluster: fetching %d blocks failed", len(jobs))
            outcomes = [Fetched.ERROR] * len(jobs)
        with self._lock:
            try:
                for key, outcome in zip(keys, outcomes):
                    try:  # one block's end failing (a bug) leaves the others' ends done
                        self._host._end_fetch_locked(key, outcome, epoch)
                    except Exception:  # noqa: BLE001
                        log.exception("kvtier cluster: ending the fetch of a block failed")
            finally:
                self.fetching -= len(jobs)

    def _publish(self, jobs: list[tuple[bytes, int]]) -> None:
        tier = self._tier
        epoch = self.epoch  # read before the puts: one that spans a new epoch counts as of the old
        bad = set()
        good: list[tuple[bytes, int]] = []
        # Pinned by the store, so the bytes stay as they are checked: only a
        # block that matches its own header is published (a copy that went
        # bad in DRAM would otherwise travel as a "valid" block).
        try:
            intact = tier.verify_many([s for _, s in jobs], [k for k, _ in jobs])
        except Exception:  # noqa: BLE001 - never leave entries pinned forever
            log.exception("kvtier cluster: checking %d blocks before publishing them failed", len(jobs))
            intact = [False] * len(jobs)
        for (key, slot), ok in zip(jobs, intact):
            if ok:
                good.append((key, slot))
            else:
                bad.add(key)
        ok: list[bool] = []
        if good and self._up:
            try:
                ok = self.remote.publish([k for k, _ in good], [s for _, s in good])
            except ClusterError as err:
                self._down(err)
            except Exception:  # noqa: BLE001 - never leave entries pinned forever
                log.exception("kvtier cluster: publishing %d blocks failed", len(good))
        done = {k for (k, _), y in zip(good, ok) if y}
        with self._lock:
            try:
                for key, _ in jobs:
                    try:  # one block's end failing (a bug) leaves the others' pins released
                        self._host._end_publish_locked(key, key in done, key in bad, epoch)
                    except Exception:  # noqa: BLE001
                        log.exception("kvtier cluster: ending the put of a block failed")
            finally:
                self.publishing -= len(jobs)
            self._feed_locked()
