"""TieredStore: the index of what the pool holds, its slots, pins and evictions.

Runs in the process that owns the index: vLLM's scheduler process for the
embedded backend (later, the pool's service). Data never passes through
here; writers and readers copy into and out of the tier's slots themselves
and the store only hands out slots and publishes them.

Order of calls for one engine step ``s``::

    lookup(keys)                  how many leading keys are readable
    pin(keys)           -> slots  the slots a reader will copy from
    prepare_save(keys, s) -> slots  slots a writer will fill (entries PENDING)
    complete_step(s, failed)      writers and readers of step s are done:
                                  PENDING entries of s become READY (except
                                  ``failed``), pins of s are released

Invariants: a PENDING entry is never readable and never evicted (a writer
may still be filling it); a pinned entry is never evicted; a slot returns to
the free list only once no entry points at it. Thread safety: every public
method takes the store's lock.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.policy import EvictionPolicy, LruPolicy
from kvtier.tier import DramTier

log = logging.getLogger(__name__)


class EntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass
class _Entry:
    slot: int
    state: EntryState
    step: int
    pins: int = 0


@dataclass(frozen=True)
class StoreStatistics:
    num_slots: int
    used_slots: int
    pending_slots: int
    pinned_slots: int
    evictions: int
    save_failures: int
    lookups: int
    lookup_hits: int  # keys found, over all lookups

    @property
    def usage(self) -> float:
        return self.used_slots / self.num_slots if self.num_slots else 0.0


@dataclass
class _Counters:
    evictions: int = 0
    save_failures: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    pending_by_step: dict[int, list[bytes]] = field(default_factory=dict)


class TieredStore:
    """Index over one :class:`DramTier` with watermark eviction.

    ``high_pct`` / ``low_pct``: when a save would take usage above
    ``high_pct`` percent of the slots, READY unpinned entries are evicted in
    policy order until usage is at most ``low_pct``.
    """

    def __init__(self, tier: DramTier, high_pct: float = 95.0, low_pct: float = 85.0,
                 policy: EvictionPolicy | None = None) -> None:
        if not 0 < low_pct < high_pct <= 100:
            raise ValueError(f"need 0 < low ({low_pct}) < high ({high_pct}) <= 100")
        self.tier = tier
        # Not ``policy or LruPolicy()``: an empty policy has len 0 and is falsy,
        # so a caller's policy would be silently replaced
        # (tests/unit/test_store.py::test_policy_order_after_saves_and_lookups).
        self._policy = policy if policy is not None else LruPolicy()
        self._entries: dict[bytes, _Entry] = {}
        self._free: list[int] = list(range(tier.num_slots - 1, -1, -1))
        self._high = max(1, int(tier.num_slots * high_pct / 100))
        self._low = min(self._high - 1, int(tier.num_slots * low_pct / 100))
        self._c = _Counters()
        self._lock = threading.Lock()
        self._pins_by_step: dict[int, list[bytes]] = {}

    # --- readers ----------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are READY. Refreshes their recency."""
        with self._lock:
            n = 0
            entries = self._entries
            for key in keys:
                e = entries.get(key)
                if e is None or e.state is not EntryState.READY:
                    break
                n += 1
            self._c.lookups += 1
            self._c.lookup_hits += n
            if n:
                self._policy.touch(keys[:n])
            return n

    def pin(self, keys: Sequence[bytes], step: int) -> list[int | None]:
        """Pin READY ``keys`` until :meth:`complete_step` of ``step``; None where not READY."""
        out: list[int | None] = []
        with self._lock:
            pinned = self._pins_by_step.setdefault(step, [])
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.state is not EntryState.READY:
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
        """Slots for writing ``keys`` in ``step``; None for a key already held
        (or being written) and for one there is no room for."""
        out: list[int | None] = []
        with self._lock:
            new = [k for k in dict.fromkeys(keys) if k not in self._entries]
            if len(self._entries) + len(new) > self._high:
                # Evict down so that the new entries land at the low mark.
                self._evict_to(max(0, self._low - len(new)))
            wanted = set(new)
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
                self._entries[key] = _Entry(slot, EntryState.PENDING, step)
                added.append(key)
                out.append(slot)
            self._c.pending_by_step.setdefault(step, []).extend(added)
            # Insert tail first so that the head of a prefix is evicted last.
            # Only this call's keys: re-inserting the whole step's list (as
            # once done) made earlier saves of the step look newer than later
            # ones (tests/unit/test_store.py::test_saves_in_one_step_keep_call_order).
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
            for s in [s for s in self._c.pending_by_step if s <= step]:
                for key in self._c.pending_by_step.pop(s):
                    e = self._entries.get(key)
                    if e is None or e.state is not EntryState.PENDING:
                        continue
                    if e.slot in failed:
                        self._c.save_failures += 1
                        self._drop(key, e)
                    else:
                        e.state = EntryState.READY
            for s in [s for s in self._pins_by_step if s <= step]:
                for key in self._pins_by_step.pop(s):
                    e = self._entries.get(key)
                    if e is not None:
                        e.pins -= 1

    def discard(self, keys: Iterable[bytes]) -> int:
        """Drop unpinned READY ``keys`` (a reader found them corrupt). Returns how many."""
        n = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None and e.pins == 0 and e.state is EntryState.READY:
                    self._drop(key, e)
                    n += 1
        return n

    def clear(self) -> int:
        """Drop every unpinned READY entry (an operator's reset). Returns how many."""
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.pins == 0 and e.state is EntryState.READY]
            for key in keys:
                self._drop(key, self._entries[key])
        return len(keys)

    # --- eviction ---------------------------------------------------------

    def _evict_to(self, target: int) -> None:
        if len(self._entries) <= target:
            return
        evicted = 0
        for key in self._policy.victims():
            if len(self._entries) <= target:
                break
            e = self._entries[key]
            if e.pins or e.state is not EntryState.READY:
                continue
            self._drop(key, e)
            evicted += 1
        self._c.evictions += evicted
        if evicted:
            log.debug("kvtier: evicted %d blocks from DRAM (%d/%d slots used)",
                      evicted, len(self._entries), self.tier.num_slots)

    def _drop(self, key: bytes, e: _Entry) -> None:
        del self._entries[key]
        self._policy.remove(key)
        self.tier.clear(e.slot)
        self._free.append(e.slot)

    # --- statistics -------------------------------------------------------

    @property
    def used_slots(self) -> int:
        return self.tier.num_slots - len(self._free)

    @property
    def evictions(self) -> int:
        return self._c.evictions

    def statistics(self) -> StoreStatistics:
        with self._lock:
            pending = sum(1 for e in self._entries.values() if e.state is EntryState.PENDING)
            pinned = sum(1 for e in self._entries.values() if e.pins)
            return StoreStatistics(self.tier.num_slots, len(self._entries), pending, pinned,
                                   self._c.evictions, self._c.save_failures, self._c.lookups,
                                   self._c.lookup_hits)
