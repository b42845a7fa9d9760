"""kvtier.tier.ssd_index: the compact in-memory index of the SSD tier.

Pure data structure, no disk: hash collisions and deletes (backward shift),
fixed capacity, LRU victims in batches, reuse of free and dirty slots, and
adoption of what recovery found. A randomized run against a dict checks the
hash table over many operations, including the vectorised rebuild that a
large removal takes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.tier.ssd import BlockRecord, SsdLocation
from kvtier.tier.ssd_index import SlotState, SsdIndex


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def put(index: SsdIndex, key: bytes, checksum: int = 7, seq: int = 1) -> int:
    """Take a slot, write ``key`` into it and publish it, as the store does for a demotion."""
    got = index.take()
    assert got is not None
    slot, _ = got
    index.begin_write(key, slot)
    index.publish(slot, checksum, seq)
    return slot


def colliding(index: SsdIndex, n: int) -> list[bytes]:
    """``n`` keys with the same home position in ``index``'s hash table."""
    by_home: dict[int, list[bytes]] = {}
    i = 0
    while True:
        key = K(i)
        group = by_home.setdefault(index.bucket(key), [])
        group.append(key)
        if len(group) == n:
            return group
        i += 1


def test_slots_are_handed_out_in_order_and_capacity_is_fixed() -> None:
    index = SsdIndex(4)
    assert [put(index, K(i)) for i in range(4)] == [0, 1, 2, 3]
    assert index.take() is None  # full: no growth
    assert len(index) == 4


def test_get_gives_a_view_of_the_slot() -> None:
    index = SsdIndex(8, locate=lambda g: SsdLocation(g % 2, g // 2))
    put(index, K(1), checksum=11, seq=3)
    slot = put(index, K(2), checksum=22, seq=4)
    e = index.get(K(2))
    assert e is not None and e.slot == slot
    assert e.ready and e.pins == 0
    assert e.loc == SsdLocation(1, 0)
    assert e.rec == BlockRecord(K(2), 4, 22)
    assert index.get(K(3)) is None
    assert K(1) in index and K(3) not in index
    with pytest.raises(KeyError):
        index[K(3)]


def test_a_key_being_written_is_held_but_not_ready() -> None:
    index = SsdIndex(4)
    slot, dirty = index.take()
    assert not dirty
    index.begin_write(K(5), slot)
    e = index[K(5)]
    assert not e.ready and e.rec is None
    assert len(index) == 1
    assert index.victims(4).tolist() == []  # never evicted while written
    index.publish(slot, 1, 1)
    assert index[K(5)].ready


def test_colliding_keys_are_all_found_and_survive_deletes_in_any_order() -> None:
    index = SsdIndex(64)
    keys = colliding(index, 6)
    slots = {key: put(index, key) for key in keys}
    for key in keys:
        assert index[key].slot == slots[key]
    # Delete from the middle of the probe run, then its head, then its tail:
    # backward shift must keep every other member reachable.
    for victim in (keys[2], keys[0], keys[5]):
        assert index.remove(victim) == slots.pop(victim)
        assert victim not in index
        for key, slot in slots.items():
            assert index[key].slot == slot
    assert len(index) == 3


def test_delete_moves_back_only_members_whose_home_allows_it() -> None:
    # Two runs that meet: keys homed at h and at h+1 interleave in the table.
    index = SsdIndex(64)
    a = colliding(index, 3)
    h = index.bucket(a[0])
    b = [K(i) for i in range(10_000, 100_000) if index.bucket(K(i)) == (h + 1) & index._mask][:2]
    for key in a[:1] + b + a[1:]:
        put(index, key)
    index.remove(a[0])
    for key in a[1:] + b:
        assert key in index
    index.remove(b[0])
    for key in a[1:] + b[1:]:
        assert key in index


def test_victims_are_the_least_recently_used_ready_unpinned_slots() -> None:
    index = SsdIndex(16)
    for i in range(8):
        put(index, K(i))  # recency in insertion order
    index.touch([K(0), K(1)])  # K0 most recent, then K1
    index[K(2)].pins += 1  # being promoted
    assert index.victims(3).tolist() == [index[K(i)].slot for i in (3, 4, 5)]
    assert index.victims(100).tolist() == [index[K(i)].slot for i in (3, 4, 5, 6, 7, 1, 0)]
    index[K(2)].pins -= 1
    assert index.victims(1).tolist() == [index[K(2)].slot]
    assert index.victims(0).tolist() == []


def test_touch_makes_a_prefix_head_the_most_recent() -> None:
    index = SsdIndex(8)
    for i in range(4):
        put(index, K(i))
    index.touch([K(0), K(1), K(2), K(3), K(99)])  # a prefix, front to back; K99 is not held
    # Under pressure the tail of the prefix goes first.
    assert index.victims(4).tolist() == [index[K(i)].slot for i in (3, 2, 1, 0)]


def test_removed_slots_come_back_dirty_and_are_reused_first() -> None:
    index = SsdIndex(4)
    for i in range(3):
        put(index, K(i))
    slot = index.remove(K(1))
    assert index.state(slot) is SlotState.DIRTY  # its header still names K1 on disk
    assert index.take() == (slot, True)
    index.release([slot], dirty=True)
    assert index.take() == (slot, True)
    index.release([slot], dirty=False)  # e.g. an invalidation emptied its header
    assert index.take() == (slot, False)
    assert index.take() == (3, False)  # never used: clean
    assert index.take() is None


def test_slots_whose_write_failed_are_taken_after_every_other_in_the_order_they_failed() -> None:
    index = SsdIndex(6)
    slots = [put(index, K(i)) for i in range(4)]  # 0..3; 4 and 5 free
    index.remove_slot(slots[2], last=True)
    index.remove_slot(slots[0], last=True)
    index.remove(K(1))  # freed as usual: reused first
    assert index.free_count == 5 and len(index) == 1
    assert [index.take() for _ in range(5)] == [(1, True), (4, False), (5, False), (2, True), (0, True)]
    assert index.take() is None and index.free_count == 0
    index.release([2, 0, 1], dirty=True)
    index.remove_slot(slots[3], last=True)
    # A reset empties the headers of every dirty slot, those taken last too.
    assert sorted(index.take_dirty().tolist()) == [0, 1, 2, 3]
    assert index.free_count == 0
    index.release([0, 1, 2, 3], dirty=False)
    assert index.free_count == 4


def test_writing_a_key_again_frees_its_older_slot_dirty() -> None:
    index = SsdIndex(4)
    first = put(index, K(1))
    slot, _ = index.take()
    assert index.begin_write(K(1), slot) == first
    assert len(index) == 1 and index[K(1)].slot == slot
    assert index.state(first) is SlotState.DIRTY
    assert index.take() == (first, True)


def test_removal_without_freeing_waits_for_release() -> None:
    index = SsdIndex(2)
    a, b = put(index, K(1)), put(index, K(2))
    index.remove_many(np.array([a, b], dtype=np.int32), free=False)  # headers being emptied
    assert len(index) == 0 and index.take() is None
    index.release(np.array([a, b]), dirty=False)
    assert sorted([index.take(), index.take()]) == [(a, False), (b, False)]


def test_pins_go_with_the_key_not_the_slot() -> None:
    index = SsdIndex(2)
    slot = put(index, K(1))
    index[K(1)].pins += 1
    index.remove(K(1))  # e.g. found corrupt while a promotion held it
    index.release([index.take()[0]], dirty=True)
    put(index, K(2))
    assert index[K(2)].pins == 0  # the stranger in the slot is not pinned
    assert index[K(2)].slot == slot


def test_ready_unpinned_and_bulk_removal_rebuild_the_table() -> None:
    index = SsdIndex(1000)
    for i in range(900):
        put(index, K(i))
    index[K(5)].pins += 1
    slot, _ = index.take()
    index.begin_write(K(5000), slot)  # being written: kept
    drop = index.ready_unpinned()
    assert drop.size == 899
    index.remove_many(drop)  # a large share: the hash table is rebuilt
    assert len(index) == 2
    assert K(5) in index and K(5000) in index
    assert all(K(i) not in index for i in range(900) if i != 5)
    assert put(index, K(7)) in set(drop.tolist())  # freed slots come back


def test_adopt_keeps_the_newest_copy_of_each_key() -> None:
    index = SsdIndex(8)
    slots = np.array([0, 1, 2, 3, 5])
    keys = np.frombuffer(K(1) + K(1) + K(2) + K(1) + K(3), dtype=np.uint8).reshape(-1, 16)
    seqs = np.array([5, 9, 6, 7, 1], dtype=np.uint64)
    sums = np.array([50, 90, 60, 70, 10], dtype=np.uint64)
    assert index.adopt(slots, keys, seqs, sums, unreadable=[6, 1]) == 3
    assert {k: index[k].rec for k in (K(1), K(2), K(3))} == {
        K(1): BlockRecord(K(1), 9, 90), K(2): BlockRecord(K(2), 6, 60), K(3): BlockRecord(K(3), 1, 10)}
    assert index[K(1)].slot == 1
    # Stale copies and unreadable headers are dirty (slot 1 holds K1: not unreadable any more).
    assert [index.state(s) for s in range(8)] == [
        SlotState.DIRTY, SlotState.READY, SlotState.READY, SlotState.DIRTY, SlotState.FREE, SlotState.READY,
        SlotState.DIRTY, SlotState.FREE]
    # Free slots are taken lowest first; recency follows the sequence numbers.
    assert [index.take() for _ in range(4)] == [(0, True), (3, True), (4, False), (6, True)]
    assert index.victims(3).tolist() == [5, 2, 1]


def test_random_operations_agree_with_a_dict() -> None:
    rng = random.Random(7)
    index = SsdIndex(300)
    keys = [rng.randbytes(16) for _ in range(600)] + [K(i) for i in range(200)]
    held: dict[bytes, int] = {}
    for _ in range(20_000):
        op = rng.random()
        if op < 0.45:
            key = rng.choice(keys)
            got = index.take()
            if got is None:
                continue
            old = index.begin_write(key, got[0])
            assert old == held.get(key)
            held[key] = got[0]
            index.publish(got[0], 1, 1)
        elif op < 0.75 and held:
            key = rng.choice(list(held))
            assert index.remove(key) == held.pop(key)
        elif op < 0.78 and held:
            batch = index.victims(rng.randrange(1, len(held) + 1))
            for slot in batch.tolist():
                del held[index.key(slot)]
            index.remove_many(batch)
        else:
            key = rng.choice(keys)
            e = index.get(key)
            assert (e.slot if e else None) == held.get(key)
        assert len(index) == len(held)
    for key, slot in held.items():
        assert index[key].slot == slot


def test_resident_bytes_stay_under_64_per_slot() -> None:
    for n in (1000, 786_433, 1 << 20):  # the hash table is largest just above 3/4 of a power of two
        assert SsdIndex(n).resident_bytes() / n <= 64


def test_batch_removal_in_place_keeps_every_other_key_reachable() -> None:
    # Batches of 16 up to 1/16 of the keys are deleted in place, vectorised
    # (_delete_many): every key after a hole in its probe run is inserted
    # again. Checked against a dict over many batches on a full table.
    rng = random.Random(11)
    index = SsdIndex(4096)
    held: dict[bytes, int] = {}
    for round_ in range(40):
        while True:
            got = index.take()
            if got is None:
                break
            key = rng.randbytes(16) if round_ % 2 else K(rng.randrange(1 << 20))
            if key in held:
                index.release([got[0]], dirty=got[1])
                break
            index.begin_write(key, got[0])
            index.publish(got[0], 1, 1)
            held[key] = got[0]
        n = rng.randrange(16, len(held) // 16)
        batch = np.array(rng.sample(sorted(held.values()), n), dtype=np.int32)
        for slot in batch.tolist():
            del held[index.key(slot)]
        index.remove_many(batch)
        assert len(index) == len(held)
        for key, slot in held.items():
            assert index[key].slot == slot
        assert not any(index.state(int(s)) >= SlotState.WRITING for s in batch)


def test_batch_lookups_agree_with_one_key_at_a_time() -> None:
    # find_many / ready_many walk every key's probe run at once (a long
    # prompt's lookup); they must say what _find says for each key, with
    # collisions, deletes, keys being written, unknown and odd-length keys.
    rng = random.Random(11)
    index = SsdIndex(400)
    keys = colliding(index, 12) + [rng.randbytes(16) for _ in range(500)]
    for key in keys[:380]:
        put(index, key)
    for key in rng.sample(keys[:380], 120):
        index.remove(key)
    writing = index.take()
    assert writing is not None
    index.begin_write(keys[390], writing[0])  # held, not ready
    asked = rng.sample(keys, 300) + [b"short", K(10**6)]
    for batch in (asked, asked[:5], asked[:100]):
        want = [index._find(k)[1] if len(k) == 16 else -1 for k in batch]
        assert index.find_many(batch).tolist() == want
        assert index.ready_many(batch) == [s >= 0 and index.state(s) is SlotState.READY for s in want]
    assert index.find_many([]).tolist() == []


@pytest.mark.parametrize("n", [3, 200])  # key by key, and the batch form
def test_touch_of_many_keys_orders_like_the_loop(n: int) -> None:
    index = SsdIndex(512)
    keys = [K(i) for i in range(n + 10)]
    for key in keys:
        put(index, key)
    index.touch(keys[:n] + [keys[0], K(10**6)])  # a prefix, a repeat, an unknown key
    order = index.victims(n + 10).tolist()
    # Untouched first, then the prefix from its tail to its head.
    assert order == [index[k].slot for k in keys[n:]] + [index[k].slot for k in reversed(keys[:n])]
