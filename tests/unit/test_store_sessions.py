"""kvtier.store sessions: several owners share one store (20 DRAM slots in /dev/shm).

Each owner counts its own steps, so the same step numbers come from every
owner: pins and PENDING entries are settled, abandoned and doomed per
owner, and ``end_session`` forgets a dead owner's pins and PENDING entries.
"""

from __future__ import annotations

import time

from kvtier.store import TieredStore
from tests.unit.test_store import SLOTS, K, make_store, tier  # noqa: F401 - fixtures used by name

A, B = 1, 2  # two clients


def save_ready(store: TieredStore, keys: list[bytes], step: int, owner: int) -> list[int]:
    slots = store.prepare_save(keys, step, owner=owner)
    assert None not in slots, slots
    store.complete_step(step, owner=owner)
    return slots  # type: ignore[return-value]


def readable(store: TieredStore, keys: list[bytes]) -> list[bool]:
    return [store.lookup([k]) == 1 for k in keys]


# --- step numbers collide ------------------------------------------------------


def test_same_steps_of_two_owners_settle_only_their_own_pending(make_store) -> None:
    store = make_store()
    a = store.prepare_save([K(0), K(1)], 5, owner=A)
    b = store.prepare_save([K(2)], 5, owner=B)
    assert None not in a and None not in b
    store.complete_step(5, owner=B)
    assert readable(store, [K(0), K(1), K(2)]) == [False, False, True]
    assert store.session_holds(A) == (0, 2)
    assert store.session_holds(B) == (0, 0)
    # A later step of B settles none of A's earlier ones either.
    store.complete_step(99, owner=B)
    assert readable(store, [K(0), K(1)]) == [False, False]
    store.complete_step(5, owner=A)
    assert readable(store, [K(0), K(1), K(2)]) == [True, True, True]
    assert store.statistics().pending_slots == 0


def test_failed_slots_of_one_owner_do_not_drop_the_others_pending(make_store) -> None:
    store = make_store()
    [slot_a] = store.prepare_save([K(0)], 3, owner=A)
    store.prepare_save([K(1)], 3, owner=B)
    # B's whole step failed, naming every slot: only B's save is dropped.
    store.complete_step(3, failed_slots=range(SLOTS), owner=B)
    assert not store.contains(K(1))
    assert store.contains(K(0)) and store.statistics().events.save_failures == 1
    store.complete_step(3, owner=A)
    assert store.pin([K(0)], 4, owner=A) == [slot_a]


def test_pins_are_released_by_their_owners_step_only(make_store) -> None:
    store = make_store()
    [slot] = save_ready(store, [K(0)], 1, owner=A)
    assert store.pin([K(0)], 7, owner=A) == [slot]
    assert store.pin([K(0)], 7, owner=B) == [slot]
    store.clear()  # doomed: dropped once both readers are done
    store.complete_step(7, owner=B)
    assert store.contains(K(0))
    assert store.statistics().pinned_slots == 1
    assert store.session_holds(A) == (1, 0) and store.session_holds(B) == (0, 0)
    store.complete_step(7, owner=A)
    assert not store.contains(K(0))
    assert store.used_slots == 0


def test_abandon_saves_drops_only_the_owners_step(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0), K(1)], 4, owner=A)
    store.prepare_save([K(2)], 4, owner=B)
    assert store.abandon_saves(4, owner=B) == 1
    assert [store.contains(k) for k in (K(0), K(1), K(2))] == [True, True, False]
    assert store.abandon_saves(4, owner=B) == 0
    store.complete_step(4, owner=A)
    assert readable(store, [K(0), K(1)]) == [True, True]


def test_doom_pending_of_one_owner_leaves_the_others_pending(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0)], 5, owner=A)
    store.prepare_save([K(1)], 6, owner=A)
    store.prepare_save([K(2)], 5, owner=B)
    store.prepare_save([K(3)], 6, owner=B)
    assert store.doom_pending(4, owner=A) == 2
    assert store.doom_pending(4, owner=A) == 0  # already doomed
    store.complete_step(6, owner=B)
    assert readable(store, [K(2), K(3)]) == [True, True]
    store.complete_step(6, owner=A)
    assert [store.contains(k) for k in (K(0), K(1))] == [False, False]
    assert store.statistics().events.save_failures == 2
    assert store.used_slots == 2


def test_owner_zero_is_the_default(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0)], 2)
    store.prepare_save([K(1)], 2, owner=A)
    assert store.session_holds(0) == (0, 1)
    store.complete_step(2, owner=0)
    assert readable(store, [K(0), K(1)]) == [True, False]
    store.pin([K(0)], 3, owner=0)
    assert store.session_holds(0) == (1, 0)
    store.complete_step(3)
    assert store.session_holds(0) == (0, 0)


# --- end_session -----------------------------------------------------------------


def test_end_session_frees_exactly_the_dead_owners_slots(make_store) -> None:
    store = make_store()
    save_ready(store, [K(0), K(1)], 1, owner=B)
    store.prepare_save([K(10)], 1, owner=B)  # B's PENDING, same step as A's
    used = store.used_slots
    assert store.pin([K(0), K(1)], 1, owner=A) != [None, None]
    assert None not in store.prepare_save([K(2), K(3), K(4)], 1, owner=A)
    assert store.used_slots == used + 3
    assert store.session_holds(A) == (2, 3)

    assert store.end_session(A) == (2, 3)
    assert store.used_slots == used
    assert store.session_holds(A) == (0, 0)
    assert store.statistics().pinned_slots == 0
    assert [store.contains(k) for k in (K(2), K(3), K(4))] == [False] * 3
    # B is untouched: its READY entries stay, its PENDING one settles.
    assert readable(store, [K(0), K(1)]) == [True, True]
    store.complete_step(1, owner=B)
    assert readable(store, [K(10)]) == [True]
    assert store.end_session(A) == (0, 0)


def test_late_complete_step_of_an_ended_session_publishes_nothing(make_store) -> None:
    store = make_store()
    store.prepare_save([K(0), K(1)], 3, owner=A)
    assert store.end_session(A) == (0, 2)
    # Another client saves one of the same keys in the same step number.
    [slot] = store.prepare_save([K(0)], 3, owner=B)
    assert slot is not None
    store.complete_step(3, owner=A)  # the dead client's report, arriving late
    assert readable(store, [K(0), K(1)]) == [False, False]
    assert not store.contains(K(1))
    assert store.session_holds(B) == (0, 1)
    store.complete_step(3, owner=B)
    assert readable(store, [K(0)]) == [True]


def test_end_session_releases_pins_so_entries_can_be_evicted(make_store) -> None:
    store = make_store()  # evicts above 19 slots used, down to 17
    keys = [K(i) for i in range(19)]
    save_ready(store, keys, 1, owner=B)
    assert None not in store.pin(keys, 8, owner=A)
    # Everything is pinned by A: nothing can be evicted for B's new keys.
    new = [K(100 + i) for i in range(4)]
    got = store.prepare_save(new, 2, owner=B)
    assert got.placed == 1
    store.abandon_saves(2, owner=B)
    assert store.used_slots == 19
    assert store.end_session(A) == (19, 0)
    got = store.prepare_save(new, 3, owner=B)
    assert None not in got and got.placed == 4
    assert store.evictions > 0


def test_pins_of_a_step_open_past_the_lease_are_released_once(make_store) -> None:
    """An instance whose engine is stuck while its session lives: the pins
    of its open step end (their blocks can be evicted again), the others'
    stay, and its late completion of that step releases nothing twice."""
    store = make_store()  # evicts above 19 slots used, down to 17
    keys = [K(i) for i in range(19)]
    save_ready(store, keys, 1, owner=B)
    assert None not in store.pin(keys, 8, owner=A)
    assert store.pin([K(0)], 3, owner=B) is not None
    cut = time.monotonic()  # the lease's start: steps first pinned before it have outlived it
    assert store.expire_pins(cut - 60) == 0  # nothing is that old
    assert store.session_holds(A) == (19, 0)
    newer = store.pin([K(1)], 9, owner=A)  # a later step of A, pinned after the cut
    assert store.expire_pins(cut) == 19 + 1  # A's step 8 and B's step 3
    assert store.counters()["pins_expired"] == 20
    assert store.session_holds(A) == (1, 0) and store.session_holds(B) == (0, 0)
    assert newer != [None]
    # A's late report of step 8: nothing of it is left to release; step 9's pin holds.
    store.complete_step(8, owner=A)
    store.clear()  # doomed where still pinned: K(1) by A's step 9, the others go
    assert store.contains(K(1)) and store.used_slots == 1
    store.complete_step(9, owner=A)
    assert store.used_slots == 0


def test_an_owner_that_completes_steps_keeps_the_pins_of_its_open_one(make_store) -> None:
    """Slow, not stuck: a step longer than the lease while the next step's
    pins are taken. The owner completed a step since the cut: its pins stay."""
    store = make_store()
    save_ready(store, [K(0), K(1)], 1, owner=B)
    assert None not in store.pin([K(0)], 7, owner=A)
    assert None not in store.pin([K(1)], 8, owner=A)
    cut = time.monotonic()
    store.complete_step(7, owner=A)  # progress after the cut
    assert store.expire_pins(cut) == 0
    assert store.session_holds(A) == (1, 0)
    store.complete_step(8, owner=A)
    assert store.session_holds(A) == (0, 0) and store.statistics().pinned_slots == 0


def test_end_session_drops_doomed_entries_it_leaves_free(make_store) -> None:
    store = make_store()
    save_ready(store, [K(0), K(1), K(2)], 1, owner=B)
    store.pin([K(0), K(1)], 4, owner=A)
    store.pin([K(1)], 4, owner=B)
    store.prepare_save([K(3)], 4, owner=A)
    store.clear()  # K(0), K(1), K(3) are in use: doomed; K(2) goes now
    assert store.used_slots == 3
    assert store.end_session(A) == (2, 1)
    assert not store.contains(K(0)) and not store.contains(K(3))
    assert store.contains(K(1))  # still pinned by B
    assert store.used_slots == 1
    store.complete_step(4, owner=B)
    assert store.used_slots == 0


def test_session_holds_counts_every_pin_and_pending_entry(make_store) -> None:
    store = make_store()
    save_ready(store, [K(0), K(1)], 1, owner=B)
    store.prepare_save([K(5)], 1, owner=B)
    assert store.pin([K(0), K(0), K(1), K(5), K(9)], 2, owner=A)[3:] == [None, None]
    store.pin([K(1)], 3, owner=A)
    store.prepare_save([K(6), K(7)], 2, owner=A)
    store.prepare_save([K(8), K(6)], 3, owner=A)  # K(6) held already: one new entry
    assert store.session_holds(A) == (4, 3)
    assert store.session_holds(B) == (0, 1)
    store.complete_step(2, owner=A)
    assert store.session_holds(A) == (1, 1)
    stats = store.statistics()
    assert (stats.pinned_slots, stats.pending_slots) == (1, 2)
    assert store.end_session(A) == (1, 1)
    assert store.session_holds(A) == (0, 0)
    stats = store.statistics()
    assert (stats.pinned_slots, stats.pending_slots) == (0, 1)
    assert readable(store, [K(6), K(7), K(8)]) == [True, True, False]


def test_slots_held_after_a_dead_session_count_as_used_for_eviction(make_store) -> None:
    store = make_store()  # 20 slots: evict above 19, down to 17
    save_ready(store, [K(i) for i in range(10)], 1, owner=A)
    b_slots = store.prepare_save([K(100 + i) for i in range(9)], 1, owner=B)
    assert None not in b_slots
    # B died mid-save: its 9 slots are held (its workers may still write).
    assert store.end_session(B, hold_until=1e9) == (0, 9)
    assert store.held_slots == 9
    # While held, a slot's header still names its key (a restart holds it again), unreadable.
    assert set(store.tier.written_slots()) >= set(b_slots)
    assert not any(store.tier.is_sealed(slot, K(100 + i)) for i, slot in enumerate(b_slots))
    # A's next save of 5 blocks: one slot is free; the held ones are used
    # slots all the same, so the store evicts A's older blocks to make room
    # instead of placing one block and dropping four.
    slots = store.prepare_save([K(200 + i) for i in range(5)], 2, owner=A)
    assert None not in slots
    assert not set(slots) & set(b_slots)
    assert store.statistics().events.evictions >= 4
    store.complete_step(2, owner=A)
    assert store.release_held(1e9) == 9 and store.held_slots == 0
    assert not set(store.tier.written_slots()) & set(b_slots)  # free again, naming nothing
    assert None not in store.prepare_save([K(300 + i) for i in range(5)], 3, owner=A)
