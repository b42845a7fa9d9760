"""kvtier.store: the index over a real DRAM arena (20 slots in /dev/shm)."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import pytest

from kvtier.policy import LruPolicy
from kvtier.store import EventCounts, StoreStatistics, TieredStore
from kvtier.tier import DramTier

SLOTS = 20
RANK_BYTES = 4096


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture
def tier(make_tier_of) -> DramTier:
    return make_tier_of(SLOTS, RANK_BYTES)


@pytest.fixture
def make_store(tier: DramTier) -> Callable[..., TieredStore]:
    def make(high_pct: float = 95.0, low_pct: float = 85.0, policy: LruPolicy | None = None) -> TieredStore:
        return TieredStore(tier, high_pct, low_pct, policy)

    return make


def save_ready(store: TieredStore, keys: list[bytes], step: int) -> list[int]:
    """Save ``keys`` in ``step`` and complete the step; every key must get a slot."""
    slots = store.prepare_save(keys, step)
    assert None not in slots, slots
    store.complete_step(step)
    return slots  # type: ignore[return-value]


def held(store: TieredStore, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if store.contains(k)]


@pytest.mark.parametrize(("high", "low"), [(50, 50), (50, 60), (0, 0), (101, 50), (50, 0)])
def test_thresholds_validated(tier: DramTier, high: float, low: float) -> None:
    with pytest.raises(ValueError):
        TieredStore(tier, high, low)


# --- lookup and readiness --------------------------------------------------


def test_lookup_counts_only_leading_ready_keys(make_store) -> None:
    store = make_store()
    save_ready(store, [K(0), K(1), K(2)], step=0)
    store.prepare_save([K(3)], step=1)  # PENDING
    assert store.lookup([K(0), K(1), K(2), K(3)]) == 3
    assert store.lookup([K(0), K(1), K(3), K(2)]) == 2
    assert store.lookup([K(9), K(0), K(1)]) == 0
    assert store.lookup([K(3)]) == 0
    assert store.lookup([]) == 0
    store.complete_step(1)
    assert store.lookup([K(0), K(1), K(2), K(3), K(4)]) == 4


def test_entries_not_readable_until_complete_step(make_store, tier: DramTier) -> None:
    store = make_store()
    [slot] = store.prepare_save([K(0)], step=4)
    assert slot is not None
    assert store.contains(K(0))
    assert store.lookup([K(0)]) == 0
    assert store.pin([K(0)], step=4) == [None]
    assert store.statistics().pending_slots == 1
    # The slot is handed out cleared and named after its key.
    assert tier.header(slot).ready_mask == 0
    assert tier.header(slot).key == K(0)
    store.complete_step(3)  # an earlier step settles nothing of step 4
    assert store.lookup([K(0)]) == 0
    store.complete_step(4)
    assert store.lookup([K(0)]) == 1
    assert store.pin([K(0)], step=5) == [slot]
    assert store.statistics().pending_slots == 0


def test_complete_step_settles_earlier_steps(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0)], step=1)
    store.prepare_save([K(1)], step=2)
    store.prepare_save([K(2)], step=3)
    store.complete_step(2)  # the report of step 1 was lost
    assert store.lookup([K(0), K(1)]) == 2
    assert store.lookup([K(2)]) == 0


# --- prepare_save -------------------------------------------------------------


def test_prepare_save_none_for_duplicates_and_held_keys(make_store) -> None:
    store = make_store()
    slots = store.prepare_save([K(0), K(1), K(0)], step=0)
    assert slots[2] is None
    assert slots[0] is not None and slots[1] is not None and slots[0] != slots[1]
    # Held while PENDING ...
    again = store.prepare_save([K(0), K(2)], step=0)
    assert again[0] is None and again[1] not in (None, *slots)
    store.complete_step(0)
    # ... and once READY.
    assert store.prepare_save([K(1), K(0)], step=1) == [None, None]
    assert store.statistics().used_slots == 3


def test_a_save_does_not_evict_the_held_keys_it_reports_as_held(make_store) -> None:
    """The room made for a call's new keys is not made from its own held
    keys: one evicted there was reported as held, never saved again, and
    left a hole in the prefix."""
    store = make_store(high_pct=30, low_pct=20)  # high 6 of 20 slots, low 4
    for i in range(6):
        save_ready(store, [K(i)], step=i)  # K0 the least recently used
    got = store.prepare_save([K(0), K(6)], step=6)
    store.complete_step(6)
    assert got.placed == 2 and got[0] is None
    assert store.contains(K(0)) and store.contains(K(6))


def test_prepare_save_tells_held_from_no_room(make_store) -> None:
    # Issue 7, item 8: a key with no slot for lack of room must be saved
    # later; one already held must not.
    store = make_store()  # high 19 slots
    save_ready(store, [K(0)], step=0)
    store.pin([K(0)], step=1)
    slots = store.prepare_save([K(0), K(1), K(1)], step=1)
    assert slots[0] is None and slots[1] is not None and slots[2] is None
    assert slots.placed == 3  # all settled: held, saved, repeated
    # 18 more PENDING blocks: K0 pinned, all 20 slots in use, nothing evictable.
    assert None not in store.prepare_save([K(i) for i in range(2, 20)], step=1)
    slots = store.prepare_save([K(1), K(0), K(30), K(31), K(5)], step=2)
    assert slots == [None, None, None, None, None]
    assert slots.placed == 2  # K30 got no room: it and what follows are planned again
    store.complete_step(1)  # everything READY and unpinned: evictable
    slots = store.prepare_save([K(30), K(31)], step=3)
    assert None not in slots and slots.placed == 2


def test_prepare_save_stops_at_a_doomed_key(make_store) -> None:
    # A doomed PENDING entry (a save of a step after a failed load) will not
    # become readable: the key is not settled until it has gone.
    store = make_store()
    store.prepare_save([K(0), K(1)], step=4)
    store.doom_pending(after_step=3)
    slots = store.prepare_save([K(2), K(0), K(3)], step=5)
    assert slots[0] is not None and slots[1] is None and slots[2] is not None
    assert slots.placed == 1
    store.complete_step(4)  # the doomed entries are dropped
    slots = store.prepare_save([K(2), K(0), K(1)], step=6)
    assert slots[0] is None and None not in slots[1:] and slots.placed == 3


def test_slots_are_distinct_until_freed(make_store) -> None:
    store = make_store()
    slots = store.prepare_save([K(i) for i in range(SLOTS)], step=0)
    assert sorted(slots) == list(range(SLOTS))


def test_a_save_with_a_key_of_another_length_changes_nothing(make_store) -> None:
    # Refused before any slot is taken: the arena would refuse the short
    # key only once a slot was taken for it, with K(1) already entered but
    # not yet in the recency order (never evictable once READY).
    store = make_store()
    save_ready(store, [K(0)], step=0)
    before = store.slot_counts()
    with pytest.raises(ValueError, match="5 bytes, not 16"):
        store.prepare_save([K(1), b"short"], step=1)
    assert store.slot_counts() == before
    assert not store.contains(K(1)) and store.statistics().pending_slots == 0
    store.complete_step(1)
    assert store.odd_keys_consistent()
    with pytest.raises(ValueError, match="15 bytes, not 16"):  # as long as two 16-byte keys together
        store.prepare_save([K(1), K(2)[:15], K(3) + b"x"], step=1)
    assert store.slot_counts() == before and not store.contains(K(1))
    # Every slot still comes back into use: the pool fills and evicts K(0) and the rest in order.
    for i in range(1, 3 * SLOTS):
        save_ready(store, [K(i)], step=1 + i)
    assert not store.contains(K(0))
    total, free, entries, held = store.slot_counts()
    assert total == free + entries + held


def test_failed_slots_are_dropped_and_freed(make_store, tier: DramTier) -> None:
    store = make_store()
    a, b, c = store.prepare_save([K(0), K(1), K(2)], step=0)
    tier.seal(b, K(1), 0, 0)  # a writer got as far as sealing, then reported failure
    store.complete_step(0, failed_slots=[b])
    assert store.lookup([K(0)]) == 1 and store.lookup([K(2)]) == 1
    assert store.lookup([K(1)]) == 0
    assert not store.contains(K(1))
    assert tier.header(b).ready_mask == 0 and tier.header(b).key == bytes(16)
    stats = store.statistics()
    assert (stats.used_slots, stats.events.save_failures, stats.pending_slots) == (2, 1, 0)
    assert store.used_slots == 2
    # The freed slot is handed out again, and the key can be saved again.
    assert store.prepare_save([K(1)], step=1) == [b]


def test_failed_slots_only_touch_pending_entries(make_store) -> None:
    store = make_store()
    [a] = save_ready(store, [K(0)], step=0)
    store.prepare_save([K(1)], step=1)
    store.complete_step(1, failed_slots=[a])  # slot a holds a READY entry: not this step's
    assert store.lookup([K(0), K(1)]) == 2
    assert store.statistics().events.save_failures == 0


# --- pins -------------------------------------------------------------------


def test_pins_hold_until_complete_step_of_their_step(make_store) -> None:
    store = make_store()
    slots = save_ready(store, [K(0), K(1)], step=0)
    assert store.pin([K(0), K(5), K(1)], step=7) == [slots[0], None, slots[1]]
    assert store.statistics().pinned_slots == 2
    store.complete_step(6)
    assert store.statistics().pinned_slots == 2
    store.complete_step(7)
    assert store.statistics().pinned_slots == 0
    assert store.discard([K(0), K(1)]) == 2
    assert store.statistics().used_slots == 0


def test_discarding_a_pinned_block_makes_it_unreadable_then_drops_it(make_store) -> None:
    store = make_store()
    slots = save_ready(store, [K(0), K(1)], step=0)
    store.pin([K(0)], step=7)  # a reader of step 7 still copies from it
    assert store.discard([K(0)]) == 1
    assert store.lookup([K(0)]) == 0  # no new reader may find it
    assert store.pin([K(0)], step=8) == [None]
    assert store.statistics().used_slots == 2  # but its slot is not reused under the reader
    store.complete_step(7)
    assert store.statistics().used_slots == 1
    assert not store.contains(K(0))
    assert store.lookup([K(1)]) == 1 and slots[1] is not None


def test_doomed_pending_saves_never_become_readable(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0)], step=3)
    store.prepare_save([K(1)], step=4)
    assert store.doom_pending(after_step=3) == 1
    store.complete_step(4)
    assert store.lookup([K(0)]) == 1
    assert store.lookup([K(1)]) == 0 and not store.contains(K(1))


def test_pins_count(make_store) -> None:
    store = make_store()
    save_ready(store, [K(0)], step=0)
    store.pin([K(0)], step=1)
    store.pin([K(0)], step=2)
    store.discard([K(0)])
    store.complete_step(1)
    assert store.contains(K(0))  # still pinned by step 2
    store.complete_step(2)
    assert not store.contains(K(0))


def test_watermark_evicts_down_to_low_in_lru_order(make_store, tier: DramTier) -> None:
    store = make_store(high_pct=50, low_pct=25)  # high 10 slots, low 5
    slots = {}
    for i in range(10):
        slots[K(i)] = save_ready(store, [K(i)], step=i)[0]
    assert store.statistics().events.evictions == 0
    assert store.statistics().used_slots == 10  # at the high mark, not past it
    assert store.lookup([K(0)]) == 1  # K(0) becomes the most recent
    [new] = store.prepare_save([K(10)], step=10)
    assert new is not None
    stats = store.statistics()
    assert stats.events.evictions == 6
    assert stats.used_slots == 5
    assert held(store, [K(i) for i in range(11)]) == [K(0), K(7), K(8), K(9), K(10)]
    # Evicted slots are cleared in the arena; one of them now names K(10).
    evicted = {slots[K(i)] for i in range(1, 7)}
    assert new in evicted
    for slot in evicted - {new}:
        assert tier.header(slot).ready_mask == 0
        assert tier.header(slot).key == bytes(16)
    assert tier.header(new).key == K(10)


def test_a_run_down_to_the_low_mark_frees_a_slice_more_each_save(make_store, monkeypatch) -> None:
    # All at once, the run from the high mark to the low one held the lock
    # ~300 ms at 340,000 blocks: it is now spread over the saves that follow.
    monkeypatch.setattr(TieredStore, "EVICT_SLICE", 2)
    store = make_store(high_pct=50, low_pct=25)  # high 10 slots, low 5
    for i in range(10):
        save_ready(store, [K(i)], step=i)
    save_ready(store, [K(10)], step=10)  # past the high mark: its own room and 2 more
    assert (store.statistics().used_slots, store.statistics().events.evictions) == (8, 3)
    assert held(store, [K(i) for i in range(11)]) == [K(i) for i in range(3, 11)]
    save_ready(store, [K(11)], step=11)  # below the high mark, the run goes on
    assert (store.statistics().used_slots, store.statistics().events.evictions) == (6, 6)
    save_ready(store, [K(12)], step=12)  # down to the low mark: the run ends
    assert (store.statistics().used_slots, store.statistics().events.evictions) == (5, 8)
    save_ready(store, [K(13)], step=13)
    assert (store.statistics().used_slots, store.statistics().events.evictions) == (6, 8)
    assert held(store, [K(i) for i in range(14)]) == [K(i) for i in range(8, 14)]


def test_a_run_that_frees_nothing_ends_until_the_next_crossing(make_store, monkeypatch) -> None:
    monkeypatch.setattr(TieredStore, "EVICT_SLICE", 2)
    store = make_store(high_pct=50, low_pct=25)  # high 10 slots, low 5
    for i in range(10):
        save_ready(store, [K(i)], step=i)
    store.pin([K(i) for i in range(10)], step=20)
    save_ready(store, [K(10)], step=10)  # past the high mark, every block pinned: nothing goes
    assert (store.statistics().used_slots, store.statistics().events.evictions) == (11, 0)
    store.complete_step(20)
    assert store.discard([K(0), K(1), K(2)]) == 3
    save_ready(store, [K(11)], step=11)  # 9 of 10: no run under way, none started
    assert (store.statistics().used_slots, store.statistics().events.evictions) == (9, 0)
    save_ready(store, [K(12)], step=12)
    save_ready(store, [K(13)], step=13)  # past the high mark again: a new run
    assert (store.statistics().used_slots, store.statistics().events.evictions) == (8, 3)


def test_entries_are_not_tracked_by_the_garbage_collector(make_store) -> None:
    # A full collection walked every entry: 170-200 ms at 340,000 blocks.
    store = make_store()
    save_ready(store, [K(0)], step=0)
    store.prepare_save([K(1)], step=1)
    assert not any(gc.is_tracked(e) for e in store._entries.values())


def test_batch_save_lands_at_low_mark(make_store) -> None:
    store = make_store(high_pct=50, low_pct=25)
    for i in range(10):
        save_ready(store, [K(i)], step=i)
    store.prepare_save([K(100), K(101), K(102)], step=10)
    stats = store.statistics()
    assert stats.used_slots == 5
    assert stats.events.evictions == 8
    assert held(store, [K(i) for i in range(10)]) == [K(8), K(9)]


def test_eviction_skips_pending_and_pinned(make_store) -> None:
    store = make_store(high_pct=50, low_pct=25)
    save_ready(store, [K(0), K(1), K(2), K(3)], step=0)
    store.pin([K(0), K(1)], step=9)
    store.prepare_save([K(i) for i in range(4, 10)], step=1)  # PENDING
    store.prepare_save([K(10)], step=2)
    stats = store.statistics()
    # Only K(2) and K(3) could go; everything else stays although above low.
    assert stats.events.evictions == 2
    assert held(store, [K(i) for i in range(11)]) == [K(0), K(1)] + [K(i) for i in range(4, 11)]
    store.complete_step(2)
    assert store.lookup([K(0), K(1)]) == 2
    assert store.lookup([K(i) for i in range(4, 11)]) == 7


def test_no_room_returns_none_for_the_overflow(make_store) -> None:
    store = make_store()
    keys = [K(i) for i in range(SLOTS + 5)]
    slots = store.prepare_save(keys, step=0)
    assert all(s is not None for s in slots[:SLOTS])
    assert slots[SLOTS:] == [None] * 5
    assert not any(store.contains(k) for k in keys[SLOTS:])
    # Everything is PENDING: nothing may be evicted.
    assert store.prepare_save([K(100)], step=1) == [None]
    # READY but pinned: still nothing.
    store.complete_step(0)
    store.pin(keys[:SLOTS], step=2)
    assert store.prepare_save([K(100)], step=2) == [None]
    assert store.statistics().events.evictions == 0
    store.complete_step(2)  # pins released
    assert store.prepare_save([K(100)], step=3) != [None]
    assert store.statistics().events.evictions > 0


def test_saves_in_one_step_keep_call_order(make_store) -> None:
    # Two requests save in the same engine step: the first call's blocks are
    # older than the second's, and each prefix's tail goes before its head.
    policy = LruPolicy()
    store = make_store(policy=policy)  # high 19 slots, low 17
    store.prepare_save([K(0), K(1)], step=3)
    store.prepare_save([K(10), K(11)], step=3)
    assert list(policy.victims()) == [K(1), K(0), K(11), K(10)]
    store.complete_step(3)
    for i in range(15):
        save_ready(store, [K(100 + i)], step=4 + i)
    assert store.statistics().used_slots == 19
    store.prepare_save([K(200)], step=30)  # evicts down to 16 before adding
    assert store.statistics().events.evictions == 3
    assert held(store, [K(0), K(1), K(10), K(11)]) == [K(10)]


def test_policy_order_after_saves_and_lookups(make_store) -> None:
    policy = LruPolicy()
    store = make_store(policy=policy)
    a = [K(0), K(1), K(2)]
    b = [K(10), K(11)]
    store.prepare_save(a, step=0)
    store.prepare_save(b, step=1)
    # Within a save, the tail of a prefix goes first.
    assert list(policy.victims()) == [K(2), K(1), K(0), K(11), K(10)]
    store.complete_step(1)
    assert store.lookup(a) == 3
    assert list(policy.victims()) == [K(11), K(10), K(2), K(1), K(0)]
    store.discard([K(10)])
    assert K(10) not in list(policy.victims())


def test_a_probe_without_refresh_leaves_the_order_to_a_later_refresh(make_store) -> None:
    policy = LruPolicy()
    store = make_store(policy=policy)
    a = [K(0), K(1), K(2)]
    b = [K(10), K(11)]
    save_ready(store, a, step=0)
    save_ready(store, b, step=1)
    before = list(policy.victims())
    assert store.probe(a + [K(99)], refresh=False).ready == 3  # what the meta service answers first
    assert list(policy.victims()) == before
    store.discard([K(1)])  # gone between the answer and the refresh: passed over
    store.refresh()
    assert list(policy.victims()) == [K(11), K(10), K(2), K(0)]
    store.refresh()  # nothing left to refresh
    assert list(policy.victims()) == [K(11), K(10), K(2), K(0)]


# --- discard and statistics -------------------------------------------------


def test_discard_drops_only_unpinned_ready(make_store, tier: DramTier) -> None:
    store = make_store()
    slots = save_ready(store, [K(0), K(1), K(2)], step=0)
    store.pin([K(1)], step=5)
    store.prepare_save([K(3)], step=1)
    assert store.discard([K(0), K(1), K(3), K(99), K(0)]) == 2  # K1 pinned: doomed, dropped when free
    assert not store.contains(K(0))
    assert store.contains(K(1)) and store.contains(K(3))
    assert store.lookup([K(0)]) == 0 and store.lookup([K(1)]) == 0
    assert tier.header(slots[0]).ready_mask == 0
    assert store.statistics().used_slots == 3
    assert store.prepare_save([K(0)], step=1) == [slots[0]]  # its slot is free again


def test_statistics(make_store) -> None:
    store = make_store(high_pct=50, low_pct=25)
    empty = store.statistics()
    assert empty == StoreStatistics(SLOTS, 0, 0, 0)
    assert empty.usage == 0.0
    for i in range(10):
        save_ready(store, [K(i)], step=i)
    store.prepare_save([K(10)], step=10)  # evicts 6, K(10) PENDING
    a, b = store.prepare_save([K(11), K(12)], step=11)
    store.complete_step(11, failed_slots=[b])
    store.pin([K(7)], step=12)
    store.lookup([K(7), K(8), K(99)])  # 2 hits
    store.lookup([K(99)])  # 0 hits
    stats = store.statistics()
    # Held: K(6..9) and K(10), K(11) minus what the second save evicted.
    assert stats == StoreStatistics(
        num_slots=SLOTS,
        used_slots=len(held(store, [K(i) for i in range(13)])),
        pending_slots=0,
        pinned_slots=1,
        events=EventCounts(evictions=stats.events.evictions, save_failures=1, lookups=2, lookup_hits=2),
    )
    assert stats.events.evictions >= 6
    assert stats.used_slots == store.used_slots
    assert stats.usage == stats.used_slots / SLOTS
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.used_slots = 0  # type: ignore[misc]



def test_clear_leaves_nothing_readable_pinned_or_pending(make_store) -> None:
    # Issue 7, item 1: a block pinned by a load and a save in flight at the
    # reset both looked up as ready once the step completed.
    store = make_store()
    save_ready(store, [K(0), K(1), K(2)], step=0)
    [pinned] = store.pin([K(0)], step=1)  # a load of step 1 still copies from it
    [pending] = store.prepare_save([K(3)], step=1)  # a writer of step 1 is filling it
    assert store.clear() == 4  # K1, K2 dropped; K0, K3 doomed
    assert store.lookup([K(0)]) == 0 and store.lookup([K(3)]) == 0
    assert store.pin([K(0), K(3)], step=2) == [None, None]
    # Their slots stay theirs while the step's reader and writer use them.
    assert store.statistics().used_slots == 2
    assert store.prepare_save([K(5)], step=2) not in ([pinned], [pending])
    store.complete_step(1)
    assert store.lookup([K(0)]) == 0 and store.lookup([K(3)]) == 0
    assert not store.contains(K(0)) and not store.contains(K(3))
    store.complete_step(2)
    assert store.statistics().used_slots == 1  # only K5, saved after the reset
    assert store.lookup([K(5)]) == 1
    assert store.clear() == 1


def test_clear_twice_counts_doomed_entries_once(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0)], step=0)
    assert store.clear() == 1
    assert store.clear() == 0
    store.complete_step(0)
    assert store.statistics().used_slots == 0


def test_abandoned_saves_free_their_slots(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0), K(1)], step=3)
    store.prepare_save([K(2)], step=4)
    assert store.abandon_saves(3) == 2
    assert store.statistics().used_slots == 1
    store.complete_step(4)
    assert store.lookup([K(2)]) == 1 and not store.contains(K(0))
