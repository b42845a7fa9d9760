"""kvtier.store under pressure, with an SSD tier: resets while blocks move,
lookups racing demotions, saves that find no room, a failing disk, and the
work a step does.

A real DRAM arena of 10 slots in /dev/shm and a real SSD tier of 16 slots
on a file in ``tmp_path``, through :class:`GateIo`, which can hold reads or
writes at a gate and fail writes (counting each try). Unless a test says
otherwise the DRAM marks are high 8, low 5 (cleaning from 3 blocks up) and
there is no DRAM watermark. Tests wait for I/O with ``wait_idle``, never by
sleeping.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from kvtier.policy import LruPolicy
from kvtier.store import DEMOTE_GIVE_UP, Moving, Probe, TieredStore
from kvtier.tier import DramTier
from kvtier.tier.dram import checksum
from kvtier.tier.ssd import IoOps, SsdTier
from kvtier.tools.server import poll_until
from tests.unit.helpers import ssd_stores

pytestmark = pytest.mark.timeout(120)  # a lost wakeup fails the test instead of hanging the run

PAGE = 4096
DRAM_SLOTS = 10
SSD_SLOTS = 16


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(key: bytes) -> bytes:
    return hashlib.shake_256(key).digest(PAGE)


class GateIo(IoOps):
    """The SSD tier's OS calls with gates and a write failure switch.

    ``reads`` / ``writes``: a preadv / pwritev waits until its event is set
    (both start set). ``fail_writes``: pwritev raises EIO; ``failed_writes``
    counts those tries (a batch's first write fails it, so one per batch).
    """

    def __init__(self) -> None:
        self.reads = threading.Event()
        self.writes = threading.Event()
        self.reads.set()
        self.writes.set()
        self.fail_writes = False
        self.failed_writes = 0

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        assert self.reads.wait(60)
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        assert self.writes.wait(60)
        if self.fail_writes:
            self.failed_writes += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().pwritev(fd, buffers, offset)


@pytest.fixture
def dram(make_tier_of) -> DramTier:
    return make_tier_of(DRAM_SLOTS, PAGE)


@pytest.fixture
def io() -> GateIo:
    return GateIo()


@pytest.fixture
def open_ssd(make_ssd, io: GateIo):
    """Open (or, called again, reopen) the SSD tier of 16 slots through ``io``."""
    return lambda: make_ssd(SSD_SLOTS, PAGE, io=io)


@pytest.fixture
def make_store(dram: DramTier, open_ssd, io: GateIo) -> Iterator[Callable[..., TieredStore]]:
    """``make_store(**kwargs)``: a store over ``dram`` and a new SSD tier; closed at teardown."""
    with ssd_stores(dram, open_ssd, io) as make:
        yield make


def fill(store: TieredStore, keys: list[bytes], slots: list[int | None]) -> None:
    """What workers do with the slots of a save: fill and seal each one handed out."""
    for key, slot in zip(keys, slots):
        if slot is not None:
            view = store.tier.rank_view(slot, 0)
            view.copy_(torch.frombuffer(bytearray(block(key)), dtype=torch.uint8))
            store.tier.seal(slot, key, 0, checksum(view, key))


def save(store: TieredStore, keys: list[bytes], step: int) -> list[int | None]:
    slots = store.prepare_save(keys, step)
    fill(store, keys, slots)
    store.complete_step(step)
    return slots


def save_each(store: TieredStore, keys: list[bytes], first_step: int = 0, *, idle: bool = True) -> None:
    """One key per step; with ``idle``, waiting for the I/O each step starts."""
    for i, key in enumerate(keys):
        assert save(store, [key], first_step + i) != [None]
        if idle:
            assert store.wait_idle()


def ssd_keys(store: TieredStore) -> set[bytes]:
    """Keys whose SSD copies a restart would bring back: the headers on disk."""
    store.close()
    store.ssd.close()
    ssd, recovered = SsdTier.open(store.ssd.paths, None, PAGE)
    try:
        if hasattr(recovered, "keys") and not isinstance(recovered, list):
            return {bytes(k) for k in recovered.keys}
        return {rec.key for _, rec in recovered}
    finally:
        ssd.close()


KEYS = [K(i) for i in range(40)]


# --- reset (issue 7, item 1) ------------------------------------------------------


def test_reset_with_a_promotion_and_a_demotion_in_flight(make_store, io: GateIo) -> None:
    store = make_store()
    save_each(store, KEYS[:9])  # K0..K3 on SSD only, K4..K8 in DRAM
    assert store.probe(KEYS[:4]) == Probe(0, 4)
    io.reads.clear()
    assert store.promote([KEYS[0]]) == 1  # PROMOTING, its read held at the gate
    io.writes.clear()
    save_each(store, [KEYS[20]], first_step=20, idle=False)  # cleaning starts writing K20 to SSD
    # DRAM: K4..K8 dropped, K0 and K20 doomed; SSD: the copies of K1..K8 dropped, K0's kept while it is read.
    assert store.clear() == 7 + 8
    assert store.probe([KEYS[0]]) == Probe(0, 0)
    assert store.probe([KEYS[20]]) == Probe(0, 0)
    io.reads.set()
    io.writes.set()
    assert store.wait_idle()
    # Both ended after the reset: neither copy is readable in DRAM or on SSD ...
    assert store.probe([KEYS[0]]) == Probe(0, 0) and store.probe([KEYS[20]]) == Probe(0, 0)
    assert store.pin([KEYS[0], KEYS[20]], step=30) == [None, None]
    assert store.promote([KEYS[0], KEYS[20]]) == 0
    assert not store.contains(KEYS[0]) and not store.contains(KEYS[20])
    c = store.counters()
    assert (c["dram_slots_used"], c["ssd_slots_used"]) == (0, 0)
    # ... nor after a restart: their headers were emptied on disk.
    assert ssd_keys(store) == set()


def test_moves_in_flight_are_counted_until_they_end(make_store, io: GateIo) -> None:
    store = make_store()
    save_each(store, KEYS[:9])  # K0..K3 on SSD only, K4..K8 in DRAM
    assert store.moving() == Moving()
    io.reads.clear()
    assert store.promote(KEYS[:2]) == 2  # both reads held at the gate
    assert store.moving() == Moving(from_ssd=2, jobs=1)  # one batch
    io.writes.clear()
    save_each(store, [KEYS[20]], first_step=20, idle=False)  # cleaning starts writing to SSD
    moving = store.moving()
    assert moving.to_ssd >= 1 and moving.from_ssd == 2 and moving.jobs >= 2
    c = store.counters()  # the same counts, as the gauges vLLM's /metrics gets
    assert (c["blocks_moving_to_ssd"], c["blocks_moving_from_ssd"]) == (moving.to_ssd, 2)
    io.reads.set()
    assert poll_until(lambda: store.moving().from_ssd == 0, 30)
    assert store.moving().to_ssd == moving.to_ssd  # its writes are still held
    io.writes.set()
    assert store.wait_idle()
    assert store.moving() == Moving()
    c = store.counters()
    assert (c["blocks_moving_to_ssd"], c["blocks_moving_from_ssd"]) == (0, 0)
    assert store.probe(KEYS[:2]) == Probe(2, 2)  # read back into DRAM


def test_reset_with_a_pinned_block_being_demoted(make_store, io: GateIo) -> None:
    store = make_store()
    io.writes.clear()
    save_each(store, KEYS[:3], idle=False)  # from 3 blocks up: K0..K2 being written
    store.pin([KEYS[0]], step=5)  # and K0 read by a load of step 5
    assert store.clear() == 3  # none could go at once
    assert store.probe(KEYS[:3]) == Probe(0, 0)
    io.writes.set()
    assert store.wait_idle()
    assert store.counters()["ssd_slots_used"] == 0
    assert store.counters()["demote_failures"] == 0  # refused, not failed
    assert store.statistics().used_slots == 1  # K0's slot, until its reader is done
    store.complete_step(5)
    assert store.statistics().used_slots == 0
    assert ssd_keys(store) == set()


# --- a lookup keeps what it reported (issue 7, item 7) -------------------------------------


def test_a_probed_block_is_not_freed_by_its_demotion_before_it_is_pinned(make_store, io: GateIo) -> None:
    store = make_store()
    io.writes.clear()
    save_each(store, KEYS[:8], idle=False)  # 8 blocks, copies of all held at the gate
    assert save(store, [KEYS[8]], 8) != [None]  # evicts K0..K3: freed once their copies land
    assert store.probe([KEYS[0]]) == Probe(1, 1)  # reported to vLLM as a hit ...
    io.writes.set()
    assert store.wait_idle()  # ... the copies land ...
    [slot] = store.pin([KEYS[0]], step=9)  # ... and the hit is still there to load
    assert slot is not None and store.tier.verify(slot, KEYS[0], 0)
    assert store.pin([KEYS[1]], step=9) == [None]  # not looked up: freed as planned
    assert store.probe([KEYS[1]]) == Probe(0, 1)
    store.complete_step(9)


def test_a_probed_block_outlives_an_eviction_that_comes_before_its_deferred_refresh(make_store) -> None:
    # The meta service answers a probe before it refreshes the run's recency
    # (probe(refresh=False), then refresh()); another instance's save that
    # evicts in between must still find the run refreshed.
    store = make_store()
    save_each(store, KEYS[:8])  # 8 blocks, their SSD copies written: the coldest go first
    assert store.probe([KEYS[0]], refresh=False) == Probe(1, 1)  # reported to vLLM as a hit ...
    assert save(store, KEYS[8:10], 8) != [None, None]  # ... another instance's save evicts ...
    assert not all(map(store.contains, KEYS[1:8]))
    [slot] = store.pin([KEYS[0]], step=9)  # ... and the hit is still there to load
    assert slot is not None and store.tier.verify(slot, KEYS[0], 0)
    store.complete_step(9)
    store.refresh()  # the service's own refresh, late: nothing changes
    assert store.contains(KEYS[0])


# --- saves that find no room (issue 7, item 8) --------------------------------------


def test_no_room_while_demotions_free_it_is_not_mistaken_for_held(make_store, io: GateIo) -> None:
    store = make_store()
    io.writes.clear()
    save_each(store, KEYS[:8], idle=False)  # 8 of 10 slots, copies held at the gate
    # Eviction counts K0..K5 as freed (once copied) and leaves 2 free slots now.
    slots = store.prepare_save(KEYS[8:11], step=8)
    assert slots[0] is not None and slots[1] is not None and slots[2] is None
    assert slots.placed == 2
    fill(store, KEYS[8:11], slots)
    store.complete_step(8)
    io.writes.set()
    assert store.wait_idle()
    again = store.prepare_save(KEYS[8:11], step=9)  # the next step plans K10 again
    assert again[:2] == [None, None] and again[2] is not None and again.placed == 3


# --- a failing disk ---------------------------------------------------------------------


def write_tries_by_step(store: TieredStore, io: GateIo, steps: range) -> list[int]:
    """Complete ``steps`` one by one, waiting for their I/O; the steps (counted
    from 1 over the store's life) in which a write was tried."""
    tried = []
    for s in steps:
        before = io.failed_writes
        store.complete_step(s)
        assert store.wait_idle()
        if io.failed_writes > before:
            assert io.failed_writes == before + 1  # one batch at a time
            tried.append(s + 1)
    return tried


def test_failed_demotions_back_off_and_give_up(make_store, io: GateIo, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="kvtier.store")
    store = make_store(high_pct=100, low_pct=50)  # high 10, low 5: cleaning from the first block
    io.fail_writes = True
    save(store, KEYS[:3], step=0)  # step 1: the first try
    assert store.wait_idle()
    assert io.failed_writes == 1
    tried = [1] + write_tries_by_step(store, io, range(1, 200))
    # Back-off of 2, 4, 8, 16, 32 steps, then no more tries.
    assert tried == [1, 3, 7, 15, 31, 63]
    assert len(tried) == DEMOTE_GIVE_UP
    c = store.counters()
    assert (c["demote_failures"], c["blocks_demoted"], c["ssd_write_give_ups"]) == (3 * DEMOTE_GIVE_UP, 0, 1)
    assert len([r for r in caplog.records if "no more blocks are written to SSD" in r.getMessage()]) == 1
    # The blocks stay readable in DRAM; later evictions free without a copy.
    assert store.probe(KEYS[:3]) == Probe(3, 3)
    save_each(store, KEYS[3:11], first_step=200)
    assert io.failed_writes == DEMOTE_GIVE_UP
    c = store.counters()
    assert c["evictions"] == c["evicted_without_copy"] > 0


def test_a_written_batch_resets_the_back_off(make_store, io: GateIo) -> None:
    store = make_store(high_pct=100, low_pct=50)
    io.fail_writes = True
    save(store, KEYS[:3], step=0)
    assert store.wait_idle()
    assert write_tries_by_step(store, io, range(1, 5)) == [3]  # second try at step 3, next at 7
    io.fail_writes = False
    for s in range(5, 7):
        store.complete_step(s)  # steps 6, 7: the try at step 7 succeeds
        assert store.wait_idle()
    assert store.counters()["blocks_demoted"] == 3
    io.fail_writes = True
    save(store, [KEYS[3]], step=7)  # step 8: a new block, tried at once, fails
    assert store.wait_idle()
    assert io.failed_writes == 3
    assert write_tries_by_step(store, io, range(8, 20)) == [10, 14]  # back to 2, then 4
    assert store.counters()["ssd_write_give_ups"] == 0


# --- per-step cost (issue 7, item 10) -----------------------------------------------


class CountingLru(LruPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.walked = 0

    def victims(self):
        for key in super().victims():
            self.walked += 1
            yield key


def test_a_slice_of_a_run_looks_for_copied_blocks_among_a_few_slices_only(
        make_tier_of, open_ssd, io: GateIo, monkeypatch: pytest.MonkeyPatch) -> None:
    # Freeing fast (at the DRAM watermark), eviction first frees blocks
    # already copied to SSD, looking for them in the colder half of DRAM.
    # A run is done a slice a save: each slice looks at most 8 slices deep,
    # or a run would walk half of a 340,000-block pool once per slice.
    monkeypatch.setattr(TieredStore, "EVICT_SLICE", 1)
    policy = CountingLru()
    with ssd_stores(make_tier_of(64, PAGE), open_ssd, io) as make:
        # high 51, low 32, watermark 32: past the watermark, freeing fast
        store = make(high_pct=80, low_pct=50, dram_watermark_pct=50, policy=policy)
        io.writes.clear()  # no copy ends: none of the blocks is on SSD yet
        save_each(store, [K(i) for i in range(51)], idle=False)
        assert store.counters()["evictions"] == 0
        policy.walked = 0
        save(store, [K(100)], step=100)  # past the high mark: its own room and one more
        assert store.counters()["evictions"] == 2  # freed once their copies land
        assert policy.walked <= 8 + 4  # 8 looked at for copies (not 25: half of DRAM), then the two
        io.writes.set()
        assert store.wait_idle()
        assert store.counters()["dram_slots_used"] == 50


def test_steps_do_not_walk_blocks_already_copied(make_store) -> None:
    # Above the clean mark every completed step used to walk the whole LRU
    # order (44 ms at 50k blocks) to find the few blocks without a copy.
    policy = CountingLru()
    store = make_store(policy=policy)
    save_each(store, KEYS[:7])  # 7 blocks, below high 8; copied ahead from 3 blocks up
    assert store.counters()["blocks_demoted"] == 7
    policy.walked = 0
    for s in range(10, 20):
        store.complete_step(s)
        assert store.wait_idle()
    assert policy.walked == 0
    save_each(store, [KEYS[7]], first_step=20)  # one new block: copied, nothing else looked at
    assert store.counters()["blocks_demoted"] == 8
    assert policy.walked == 0


def test_cleaning_starts_from_the_coldest_blocks_after_lookups_far_below_the_clean_mark(
        make_tier_of, open_ssd, io: GateIo) -> None:
    # 64 slots, high 57, low 51: cleaning from 46 blocks up. Far below that
    # (under 40) lookups leave the order of the blocks without an SSD copy
    # as it is, and the first cleaning sorts it again from the LRU order.
    with ssd_stores(make_tier_of(64, PAGE), open_ssd, io) as make:
        store = make(high_pct=90, low_pct=80, demote_queue_blocks=2)
        keys = [K(i) for i in range(46)]
        save(store, keys[:20], step=0)
        assert store.probe(keys[:10]) == Probe(10, 10)  # K0..K9 used again: K19..K10 are now the coldest
        save(store, keys[20:], step=1)  # 46 blocks: cleaning copies the two coldest (the queue's room)
        assert store.wait_idle()
        assert store.counters()["blocks_demoted"] == 2
        assert {k for k in keys if (store.key_info(k) or {}).get("ssd")} == {K(19), K(18)}


def test_cleaning_copies_the_prefix_saved_first_in_a_step_first_as_eviction_frees_it(
        make_tier_of, open_ssd, io: GateIo) -> None:
    # Two requests save in one step (two calls): the first one's blocks are
    # the colder in the LRU order, and cleaning copies from its tail too.
    with ssd_stores(make_tier_of(64, PAGE), open_ssd, io) as make:
        store = make(high_pct=90, low_pct=80, demote_queue_blocks=2)
        keys = [K(i) for i in range(46)]
        first, second = keys[:23], keys[23:]
        for part in (first, second):
            fill(store, part, store.prepare_save(part, 0))
        store.complete_step(0)  # 46 blocks: above the clean mark (45)
        assert store.wait_idle()
        assert store.counters()["blocks_demoted"] == 2
        assert {k for k in keys if (store.key_info(k) or {}).get("ssd")} == {K(22), K(21)}
        # Eviction agrees: it frees the same blocks first.
        save(store, [K(i) for i in range(100, 112)], step=1)  # over the high mark (57)
        assert store.wait_idle()
        assert not store.contains(K(22)) and not store.contains(K(21)) and store.contains(K(45))


def test_cleaning_copies_a_saved_prefix_from_its_tail_as_eviction_frees_it(make_tier_of, open_ssd, io: GateIo) -> None:
    with ssd_stores(make_tier_of(64, PAGE), open_ssd, io) as make:
        store = make(high_pct=90, low_pct=80, demote_queue_blocks=2)
        keys = [K(i) for i in range(46)]
        save(store, keys, step=0)  # one prefix of 46 blocks: above the clean mark (45)
        assert store.wait_idle()
        assert store.counters()["blocks_demoted"] == 2
        assert {k for k in keys if (store.key_info(k) or {}).get("ssd")} == {K(45), K(44)}
