"""TieredStore: the index of what the pool holds, its slots, pins, evictions and tier moves.

Runs in the process that owns the index: vLLM's scheduler process for the
embedded backend (later, the pool's service). Data never passes through the
store's callers: workers copy into and out of DRAM slots themselves; the
store hands out slots, publishes them, and moves blocks between DRAM and the
SSD tier on its own I/O threads (accelerator -> DRAM -> SSD; an SSD hit is
promoted back to DRAM, "rewarm", and loaded from there).

Order of calls for one engine step ``s``::

    probe(keys)                   how many leading keys are in DRAM / on SSD
    promote(keys)                 start reading SSD-only keys into DRAM
    pin(keys, s)        -> slots  the DRAM slots a reader will copy from
    prepare_save(keys, s) -> slots  DRAM slots a writer will fill (PENDING)
    complete_step(s, failed)      writers and readers of step s are done

DRAM eviction (a save or promotion that would pass ``high_pct``) runs down
to ``low_pct`` in policy order: a block already on SSD is freed at once; one
that is not is demoted (written to SSD through a bounded queue, freed once
durable), unless DRAM usage is at or above ``dram_watermark_pct`` or the
queue is full, when it is freed without a copy. The SSD tier evicts its
own least recently used blocks between its own watermarks. Ahead of that,
once DRAM holds more than ``2 * low - high`` percent, the least recently
used blocks are copied to SSD in the background ("cleaned"), so that the
eviction that follows frees them at once: a promotion or a burst of saves
then finds room without waiting for writes.

Invariants: PENDING and PROMOTING entries are never readable and never
evicted; pinned and demoting entries are never evicted; a slot (DRAM or SSD)
returns to its free list only once no entry points at it. Every public
method and every I/O completion takes the store's lock; I/O itself runs
outside it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import xxhash

from kvtier.errors import TierIOError
from kvtier.policy import EvictionPolicy, LruPolicy
from kvtier.tier import DramTier
from kvtier.tier.dram import checksum
from kvtier.tier.ssd import BlockRecord, SsdLocation, SsdTier

log = logging.getLogger(__name__)

_IO_BATCH = 16  # blocks per demotion job: one round of fdatasyncs per batch
_PROMOTE_BATCH = 4  # blocks per promotion job: small, so all I/O threads share a prefix's reads


class EntryState(enum.Enum):
    PENDING = "pending"  # a worker is writing the DRAM slot
    PROMOTING = "promoting"  # an I/O thread is reading the block from SSD into the DRAM slot
    READY = "ready"


@dataclass
class _Entry:
    slot: int
    state: EntryState
    step: int
    pins: int = 0
    on_ssd: bool = False
    demoting: bool = False  # being written to SSD
    evict_after: bool = False  # free the DRAM copy once the SSD copy is durable
    doomed: bool = False  # found bad: unreadable now, dropped as soon as nothing uses it


@dataclass
class _SsdEntry:
    loc: SsdLocation
    rec: BlockRecord | None  # None while being written
    pins: int = 0  # promotions reading it

    @property
    def ready(self) -> bool:
        return self.rec is not None


@dataclass(frozen=True)
class Probe:
    """Leading keys: ``ready`` readable in DRAM now; ``total`` held in DRAM or on SSD."""

    ready: int
    total: int


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


class TieredStore:
    """Index over a :class:`DramTier` and, optionally, an :class:`SsdTier` below it."""

    def __init__(self, tier: DramTier, high_pct: float = 95.0, low_pct: float = 85.0,
                 policy: EvictionPolicy | None = None, *, ssd: SsdTier | None = None,
                 ssd_high_pct: float = 95.0, ssd_low_pct: float = 85.0, dram_watermark_pct: float = 95.0,
                 io_threads: int = 4, demote_queue_blocks: int = 256,
                 recovered: Iterable[tuple[SsdLocation, BlockRecord]] = ()) -> None:
        self.tier = tier
        self._policy = policy if policy is not None else LruPolicy()
        self._entries: dict[bytes, _Entry] = {}
        self._free: list[int] = list(range(tier.num_slots - 1, -1, -1))
        self._high, self._low = _marks(tier.num_slots, high_pct, low_pct)
        self._watermark = max(1, int(tier.num_slots * dram_watermark_pct / 100))
        self._c = EventCounts()
        self._pending_by_step: dict[int, list[bytes]] = {}
        self._last_eviction_log = self._last_ssd_eviction_log = float("-inf")  # the first one always logs
        # Re-entrant: a job's done-callback may run on the thread that submitted it.
        self._lock = threading.RLock()
        self._pins_by_step: dict[int, list[bytes]] = {}
        self._demoting = 0  # entries being written to SSD
        self._freeing = 0  # of those, the ones evicted (freed once written)
        # Above this many entries, the least recently used blocks are copied to
        # SSD ahead of need ("cleaned"), so that eviction later frees them at
        # once instead of waiting for a write.
        self._clean_mark = max(0, 2 * self._low - self._high)
        self._demote_limit = demote_queue_blocks
        self._inflight: set[Future] = set()
        self._idle = threading.Condition(self._lock)

        self.ssd = ssd
        self._ssd_entries: dict[bytes, _SsdEntry] = {}
        self._ssd_policy = LruPolicy()
        self._ssd_free: list[SsdLocation] = []
        self._ssd_dirty: set[SsdLocation] = set()  # may hold a valid older header on disk
        self._io: ThreadPoolExecutor | None = None
        if ssd is not None:
            if ssd.slot_bytes != tier.slot_stride:
                raise ValueError(f"SSD slots of {ssd.slot_bytes} bytes cannot hold DRAM slots of {tier.slot_stride}")
            self._ssd_high, self._ssd_low = _marks(ssd.num_slots, ssd_high_pct, ssd_low_pct)
            self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-io")
            self._adopt(recovered)

    def _adopt(self, recovered: Iterable[tuple[SsdLocation, BlockRecord]]) -> None:
        used: set[SsdLocation] = set()
        for loc, rec in sorted(recovered, key=lambda lr: lr[1].seq):
            old = self._ssd_entries.get(rec.key)
            if old is not None:  # written twice: the newer copy wins, the older slot is reused later
                self._ssd_dirty.add(old.loc)
                used.discard(old.loc)
                self._ssd_policy.remove(rec.key)
            self._ssd_entries[rec.key] = _SsdEntry(loc, rec)
            self._ssd_policy.insert(rec.key)
            used.add(loc)
        self._ssd_free = [loc for loc in reversed(self.ssd.locations()) if loc not in used]
        self._ssd_dirty |= self.ssd.unreadable - used

    def close(self) -> None:
        """Finish the I/O in flight, then stop the I/O threads (tiers are closed by their owner)."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    # --- readers ----------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` readable from DRAM now. Refreshes their recency."""
        return self.probe(keys).ready

    def probe(self, keys: Sequence[bytes]) -> Probe:
        with self._lock:
            ready = total = 0
            entries, ssd = self._entries, self._ssd_entries
            for key in keys:
                e = entries.get(key)
                if e is not None and e.doomed:
                    break
                if e is not None and e.state is EntryState.READY:
                    if ready == total:
                        ready += 1
                    total += 1
                    continue
                if e is not None and e.state is EntryState.PROMOTING:
                    total += 1
                    continue
                s = ssd.get(key)
                if e is None and s is not None and s.ready:
                    total += 1
                    continue
                break
            self._c.lookups += 1
            self._c.lookup_hits += total
            if total:
                self._policy.touch(keys[:total])
                if ssd:
                    self._ssd_policy.touch(keys[:total])
            return Probe(ready, total)

    def promote(self, keys: Sequence[bytes]) -> int:
        """Start reading the SSD-only ``keys`` into DRAM; returns how many of
        ``keys`` are on their way: PROMOTING, or waiting for DRAM slots that
        demotions in flight are about to free. Stops at the first key that
        is not on SSD."""
        if self.ssd is None:
            return 0
        jobs: list[tuple[bytes, int, SsdLocation, BlockRecord]] = []
        moving = 0
        with self._lock:
            wanted: list[bytes] = []
            for key in keys:
                e = self._entries.get(key)
                if e is not None:
                    if e.state is EntryState.PROMOTING:
                        moving += 1
                    continue
                s = self._ssd_entries.get(key)
                if s is None or not s.ready:
                    break
                wanted.append(key)
            if wanted:
                self._make_room_locked(len(wanted))
            for i, key in enumerate(wanted):
                if not self._free:
                    if self._freeing:
                        # Room is on its way: demotions in flight free their
                        # DRAM slots when durable. Count these as coming, so
                        # the caller asks again instead of giving up.
                        moving += len(wanted) - i
                    break
                slot = self._free.pop()
                s = self._ssd_entries[key]
                self.tier.clear(slot, key)
                self._entries[key] = _Entry(slot, EntryState.PROMOTING, -1, on_ssd=True)
                self._policy.insert(key)
                s.pins += 1
                jobs.append((key, slot, s.loc, s.rec))  # type: ignore[arg-type]
                moving += 1
            for i in range(0, len(jobs), _PROMOTE_BATCH):
                self._submit(self._promote, jobs[i : i + _PROMOTE_BATCH])
        return moving

    def pin(self, keys: Sequence[bytes], step: int) -> list[int | None]:
        """Pin READY ``keys`` until :meth:`complete_step` of ``step``; None where not READY."""
        out: list[int | None] = []
        with self._lock:
            pinned = self._pins_by_step.setdefault(step, [])
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.state is not EntryState.READY or e.doomed:
                    out.append(None)
                    continue
                e.pins += 1
                pinned.append(key)
                out.append(e.slot)
        return out

    # --- writers ----------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def prepare_save(self, keys: Sequence[bytes], step: int) -> list[int | None]:
        """DRAM slots for writing ``keys`` in ``step``; None for a key already
        held in DRAM (or being written) and for one there is no room for."""
        out: list[int | None] = []
        with self._lock:
            new = [k for k in dict.fromkeys(keys) if k not in self._entries]
            self._make_room_locked(len(new))
            wanted = set(new)
            pending = self._pending_by_step.setdefault(step, [])
            added: list[bytes] = []
            for key in keys:
                if key not in wanted:
                    out.append(None)
                    continue
                wanted.discard(key)
                if not self._free:
                    out.append(None)
                    continue
                slot = self._free.pop()
                self.tier.clear(slot, key)
                s = self._ssd_entries.get(key)
                self._entries[key] = _Entry(slot, EntryState.PENDING, step, on_ssd=s is not None and s.ready)
                pending.append(key)
                added.append(key)
                out.append(slot)
            # Insert tail first so that the head of a prefix is evicted last.
            for key in reversed(added):
                self._policy.insert(key)
        return out

    def complete_step(self, step: int, failed_slots: Iterable[int] = ()) -> None:
        """Everything the workers did for steps up to ``step`` is finished.

        PENDING entries of those steps become READY unless their slot is in
        ``failed_slots`` (then they are dropped and their slot freed); pins
        taken for those steps are released. Steps finish in order, so a step
        whose report was lost is settled by a later one.
        """
        failed = set(failed_slots)
        with self._lock:
            for s in [s for s in self._pending_by_step if s <= step]:
                for key in self._pending_by_step.pop(s):
                    e = self._entries.get(key)
                    if e is None or e.state is not EntryState.PENDING:
                        continue
                    if e.slot in failed or e.doomed:
                        self._c.save_failures += 1
                        self._drop(key, e)
                    else:
                        e.state = EntryState.READY
            for s in [s for s in self._pins_by_step if s <= step]:
                for key in self._pins_by_step.pop(s):
                    e = self._entries.get(key)
                    if e is not None:
                        e.pins -= 1
                        if e.doomed and e.pins == 0 and e.state is EntryState.READY and not e.demoting:
                            self._drop(key, e)
            self._clean_locked()

    def abandon_saves(self, step: int) -> int:
        """Drop the PENDING entries of ``step``: no writer will fill them. Returns how many."""
        with self._lock:
            n = 0
            for key in self._pending_by_step.pop(step, []):
                e = self._entries.get(key)
                if e is not None and e.state is EntryState.PENDING:
                    self._drop(key, e)
                    n += 1
            return n

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
        return n

    def doom_pending(self, after_step: int) -> int:
        """Make every PENDING entry of the steps after ``after_step`` unreadable.

        When a load failed in ``after_step``, the steps already planned
        after it (asynchronous scheduling) may have computed blocks from the
        bad KV; their saves are dropped when their steps complete.
        """
        n = 0
        with self._lock:
            for s, keys in self._pending_by_step.items():
                if s <= after_step:
                    continue
                for key in keys:
                    e = self._entries.get(key)
                    if e is not None and e.state is EntryState.PENDING:
                        e.doomed = True
                        n += 1
        return n

    def clear(self) -> int:
        """Drop every DRAM and SSD entry not in use (an operator's reset). Returns how many.

        Dropped SSD blocks also get empty headers on disk (on an I/O thread),
        so a restart does not bring them back; their slots are reused only
        after that.
        """
        with self._lock:
            keys = [k for k, e in self._entries.items()
                    if e.pins == 0 and e.state is EntryState.READY and not e.demoting]
            for key in keys:
                self._drop(key, self._entries[key])
            ssd_keys = [k for k, s in self._ssd_entries.items() if s.ready and s.pins == 0]
            locs = []
            for key in ssd_keys:
                s = self._ssd_entries.pop(key)
                self._ssd_policy.remove(key)
                locs.append(s.loc)
                e = self._entries.get(key)
                if e is not None:
                    e.on_ssd = False
            if locs:
                self._submit(self._invalidate, locs)
        return len(keys) + len(ssd_keys)

    def _invalidate(self, locs: list[SsdLocation]) -> None:
        assert self.ssd is not None
        try:
            self.ssd.invalidate(locs)
            dirty = False
        except TierIOError as err:
            log.warning("kvtier: clearing SSD headers failed (%s); the slots are rewritten before reuse", err)
            dirty = True
        with self._lock:
            self._ssd_free.extend(locs)
            if dirty:
                self._ssd_dirty.update(locs)
            else:
                self._ssd_dirty.difference_update(locs)

    # --- DRAM room --------------------------------------------------------

    def _effective_used(self) -> int:
        return len(self._entries) - self._freeing

    def _clean_locked(self) -> None:
        if self.ssd is None or len(self._entries) <= self._clean_mark or self._demoting >= self._demote_limit:
            return
        batch: list[bytes] = []
        for key in self._policy.victims():
            if self._demoting >= self._demote_limit:
                break
            e = self._entries[key]
            if e.on_ssd or e.demoting or e.pins or e.doomed or e.state is not EntryState.READY:
                continue
            e.demoting = True
            self._demoting += 1
            batch.append(key)
            if len(batch) == _IO_BATCH:
                self._submit(self._demote, batch)
                batch = []
        if batch:
            self._submit(self._demote, batch)

    def _make_room_locked(self, n_new: int) -> None:
        if self._effective_used() + n_new > self._high:
            self._evict_to(max(0, self._low - n_new))

    def _evict_to(self, target: int) -> None:
        freed = demoted = lost = 0
        batch: list[bytes] = []
        if self.ssd is not None and (len(self._entries) >= self._watermark or self._demoting >= self._demote_limit):
            # Freeing fast: among the colder half of DRAM, blocks whose SSD
            # copy is already written go first, before any block is freed
            # without a copy. The hotter half is left alone: it holds what
            # was just promoted or looked up and is about to be read.
            window = max(self._effective_used() - target, len(self._entries) // 2)
            for key in list(itertools.islice(self._policy.victims(), window)):
                if self._effective_used() <= target:
                    break
                e = self._entries[key]
                if e.on_ssd and not (e.pins or e.demoting or e.evict_after or e.doomed) \
                        and e.state is EntryState.READY:
                    self._drop(key, e)
                    freed += 1
        for key in self._policy.victims():
            if self._effective_used() <= target:
                break
            e = self._entries[key]
            if e.pins or e.state is not EntryState.READY or e.evict_after:
                continue
            if e.doomed:
                if not e.demoting:
                    self._drop(key, e)
                    freed += 1
                continue
            if e.demoting:  # being cleaned already: free it when the write lands
                e.evict_after = True
                self._freeing += 1
                demoted += 1
            elif self.ssd is None or e.on_ssd:
                self._drop(key, e)
                freed += 1
            elif len(self._entries) >= self._watermark or self._demoting >= self._demote_limit:
                # Above the DRAM watermark (or with the queue full) free fast: no new writes.
                self._drop(key, e)
                lost += 1
            else:
                e.demoting = e.evict_after = True
                self._demoting += 1
                self._freeing += 1
                batch.append(key)
                demoted += 1
                if len(batch) == _IO_BATCH:
                    self._submit(self._demote, batch)
                    batch = []
        if batch:
            self._submit(self._demote, batch)
        self._c.evictions += freed + lost + demoted
        self._c.evicted_without_copy += lost
        if freed + lost + demoted:
            now = time.monotonic()
            if now - self._last_eviction_log > EVICTION_LOG_INTERVAL_S:
                self._last_eviction_log = now
                log.info("kvtier: DRAM eviction: %d freed (copy on SSD), %d demoting, %d freed without copy; "
                         "%d/%d slots used; totals: %d evictions", freed, demoted, lost, len(self._entries),
                         self.tier.num_slots, self._c.evictions)

    def _drop(self, key: bytes, e: _Entry) -> None:
        del self._entries[key]
        self._policy.remove(key)
        self.tier.clear(e.slot)
        self._free.append(e.slot)

    # --- SSD room ---------------------------------------------------------

    def _take_ssd_locked(self) -> tuple[SsdLocation, bool] | None:
        if len(self._ssd_entries) + 1 > self._ssd_high:
            self._evict_ssd_to(self._ssd_low)
        if not self._ssd_free:
            return None
        loc = self._ssd_free.pop()
        reused = loc in self._ssd_dirty
        self._ssd_dirty.discard(loc)
        return loc, reused

    def _evict_ssd_to(self, target: int) -> None:
        n = 0
        for key in self._ssd_policy.victims():
            if len(self._ssd_entries) <= target:
                break
            s = self._ssd_entries[key]
            if s.pins or not s.ready:
                continue
            self._drop_ssd(key)
            n += 1
        self._c.ssd_evictions += n
        now = time.monotonic()
        if n and now - self._last_ssd_eviction_log > EVICTION_LOG_INTERVAL_S:
            self._last_ssd_eviction_log = now
            log.info("kvtier: SSD eviction: %d blocks dropped; %d/%d slots used; totals: %d evictions",
                     n, len(self._ssd_entries), self.ssd.num_slots, self._c.ssd_evictions)

    def _drop_ssd(self, key: bytes) -> None:
        s = self._ssd_entries.pop(key)
        self._ssd_policy.remove(key)
        # The header on disk still names the block until the slot is reused;
        # reuse first writes an empty header (SsdTier.write, step 1).
        self._ssd_free.append(s.loc)
        self._ssd_dirty.add(s.loc)
        e = self._entries.get(key)
        if e is not None:
            e.on_ssd = False

    # --- I/O jobs (run on the I/O threads) ----------------------------------

    def _submit(self, fn, arg) -> None:
        assert self._io is not None
        fut = self._io.submit(fn, arg)
        self._inflight.add(fut)
        fut.add_done_callback(self._job_done)

    def _job_done(self, fut: Future) -> None:
        with self._lock:
            self._inflight.discard(fut)
            self._idle.notify_all()
        if fut.exception() is not None:
            log.error("kvtier: I/O job failed", exc_info=fut.exception())

    def wait_progress(self, timeout_s: float) -> None:
        """Block for at most ``timeout_s`` or until an I/O job finishes, releasing the GIL."""
        with self._idle:
            if self._inflight:
                self._idle.wait(timeout_s)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until no demotion or promotion is in flight (tests, shutdown, benchmarks)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout_s)

    def _demote(self, keys: list[bytes]) -> None:
        assert self.ssd is not None
        plan: list[tuple[bytes, int, SsdLocation, BlockRecord, bool]] = []
        with self._lock:
            for key in keys:
                e = self._entries[key]
                got = self._take_ssd_locked()
                old = self._ssd_entries.get(key)
                if got is None or (old is not None and not old.ready):
                    if got is not None:
                        self._ssd_free.append(got[0])
                        if got[1]:
                            self._ssd_dirty.add(got[0])
                    self._finish_demotion_locked(key, ok=False)
                    continue
                loc, reused = got
                hdr = self.tier.header(e.slot)
                rec = BlockRecord(key, self.ssd.next_seq(), 0, hdr.ready_mask, hdr.checksums)
                self._ssd_entries[key] = _SsdEntry(loc, None)
                if old is not None:  # an older copy elsewhere: this one replaces it
                    self._ssd_free.append(old.loc)
                    self._ssd_dirty.add(old.loc)
                    self._ssd_policy.remove(key)
                plan.append((key, e.slot, loc, rec, reused))
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
                if not self._dram_intact(slot, key, rec):
                    bad.add(key)
                    continue
                data = self.tier.slot_buffer(slot)
                items.append((loc, replace(rec, checksum=xxhash.xxh3_64_intdigest(data)), data))
                good.append(loc)
            self.ssd.write(items, [loc for _, _, loc, _, reused in plan if reused and loc in good])
            ok = True
        except TierIOError as err:
            log.warning("kvtier: demoting %d blocks to SSD failed (%s); they are dropped", len(plan), err)
        except Exception:  # noqa: BLE001 - never leave entries demoting forever
            log.exception("kvtier: demoting %d blocks failed", len(plan))
        written = {loc: rec for loc, rec, _ in items} if ok else {}
        with self._lock:
            for key, _, loc, _, _ in plan:
                rec = written.get(loc)
                if rec is not None:
                    self._ssd_entries[key].rec = rec
                    self._ssd_policy.insert(key)
                else:
                    del self._ssd_entries[key]
                    self._ssd_free.append(loc)
                    self._ssd_dirty.add(loc)  # a header may have reached the disk
                if key in bad:
                    self._c.corrupt_dram += 1
                    self._entries[key].doomed = True
                self._finish_demotion_locked(key, rec is not None)

    def _dram_intact(self, slot: int, key: bytes, rec: BlockRecord) -> bool:
        hdr = self.tier.header(slot)
        if hdr.key != key or hdr.ready_mask != (1 << self.tier.ranks) - 1:
            return False
        return all(checksum(self.tier.rank_view(slot, r)) == rec.dram_checksums[r] for r in range(self.tier.ranks))

    def _finish_demotion_locked(self, key: bytes, ok: bool) -> None:
        e = self._entries[key]
        e.demoting = False
        self._demoting -= 1
        evict, e.evict_after = e.evict_after, False
        if evict:
            self._freeing -= 1
        if ok:
            self._c.demotions += 1
        else:
            self._c.demote_failures += 1
        e.on_ssd = ok
        # Evicted (or found bad) while it was written: free the DRAM copy unless a reader holds it.
        if (evict or e.doomed) and e.pins == 0 and e.state is EntryState.READY:
            self._drop(key, e)

    def _promote(self, jobs: list[tuple[bytes, int, SsdLocation, BlockRecord]]) -> None:
        assert self.ssd is not None
        results = []
        for key, slot, loc, rec in jobs:
            io_error = False
            try:
                ok = self.ssd.read(loc, rec, self.tier.slot_buffer(slot))
                if ok:
                    self.tier.seal_all(slot, key, rec.dram_ready, rec.dram_checksums)
            except TierIOError as err:
                log.warning("kvtier: reading a block from SSD failed: %s", err)
                ok, io_error = False, True
            except Exception:  # noqa: BLE001 - never leave entries PROMOTING forever
                log.exception("kvtier: promoting a block failed")
                ok, io_error = False, True
            results.append((key, ok, io_error))
        with self._lock:
            for key, ok, io_error in results:
                s = self._ssd_entries.get(key)
                if s is not None:
                    s.pins -= 1
                e = self._entries[key]
                if ok:
                    e.state = EntryState.READY
                    self._c.promotions += 1
                    continue
                self._c.promote_failures += 1
                self._drop(key, e)
                if s is not None and key in self._ssd_entries:
                    # A checksum or header mismatch means the SSD copy is bad; a
                    # read error means it cannot be had. Either way it is
                    # forgotten, or every later request would promote it again
                    # and wait on the same failure.
                    if io_error:
                        self._c.ssd_read_errors += 1
                    else:
                        self._c.ssd_corrupt += 1
                    self._drop_ssd(key)

    # --- statistics -------------------------------------------------------

    @property
    def used_slots(self) -> int:
        return self.tier.num_slots - len(self._free)

    @property
    def evictions(self) -> int:
        return self._c.evictions

    def counters(self) -> dict[str, int]:
        """Cumulative event counts and slot usage, cheap enough to read every engine step."""
        c = self._c
        return {
            "evictions": c.evictions, "blocks_demoted": c.demotions, "demote_failures": c.demote_failures,
            "evicted_without_copy": c.evicted_without_copy, "blocks_promoted": c.promotions,
            "promote_failures": c.promote_failures, "ssd_corrupt_blocks": c.ssd_corrupt,
            "ssd_read_errors": c.ssd_read_errors,
            "ssd_evictions": c.ssd_evictions, "corrupt_blocks": c.corrupt_dram,
            "dram_slots_used": self.used_slots,
            "dram_slots_total": self.tier.num_slots, "ssd_slots_used": len(self._ssd_entries),
            "ssd_slots_total": self.ssd.num_slots if self.ssd else 0,
        }

    def statistics(self) -> StoreStatistics:
        with self._lock:
            pending = sum(1 for e in self._entries.values() if e.state is not EntryState.READY)
            pinned = sum(1 for e in self._entries.values() if e.pins)
            return StoreStatistics(self.tier.num_slots, len(self._entries), pending, pinned,
                                   self.ssd.num_slots if self.ssd else 0, len(self._ssd_entries), replace(self._c))
