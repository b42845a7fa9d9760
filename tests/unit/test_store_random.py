"""kvtier.store under random calls: the lookup against its plain definition.

The store's probe counts leading plain READY keys by C calls over a set it
keeps of the keys that are not (store.py, ``_odd``), or, for a long probe,
in the ready index the set keeps in step (kvtier/ready_index.py): each test
runs both ways (a store with the index, every probe of keys in one buffer
through it, and one without), the keys of half the probes in one buffer
as the meta service hands them over (``PackedKeys``). Here two owners make
random calls (saves, completed and failed steps, pins, promotions,
discards, doomed steps, abandoned saves, ended sessions, resets, expired
pins, probes whose recency is refreshed some calls later, as the meta
service refreshes after its answer) on a real arena of 24 slots over an SSD tier of 40 whose writes fail
at random while some runs. Before every call the set must match the
entries, and every probe must give what the plain walk over the entries
gives (``expected_probe``): leading keys READY in DRAM (ready), then
those on SSD or being promoted (total), stopping at a doomed, PENDING or
missing key.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
from collections.abc import Sequence

import pytest
import torch

from kvtier import store as store_module
from kvtier.keys import PackedKeys
from kvtier.store import EntryState, TieredStore
from kvtier.tier.dram import checksum
from kvtier.tier.ssd import IoOps

pytestmark = pytest.mark.timeout(300)

PAGE = 4096
KEYS = [i.to_bytes(16, "big") for i in range(60)]


class FlakyWrites(IoOps):
    """SSD writes that fail with EIO with probability ``fail``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.fail = 0.0

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.rng.random() < self.fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().pwritev(fd, buffers, offset)


def expected_probe(store: TieredStore, keys: Sequence[bytes]) -> tuple[int, int]:
    """(ready, total) by the plain walk over the store's entries (under its lock)."""
    ready = total = 0
    for key in keys:
        e = store._entries.get(key)
        if e is None:
            s = store._ssd_entries.get(key)
            if store.ssd is not None and s is not None and s.ready:
                total += 1
                continue
            break
        if e.doomed:
            break
        if e.state is EntryState.READY:
            ready += ready == total
            total += 1
        elif e.state is EntryState.PROMOTING:
            total += 1
        else:
            break
    return ready, total


def pin_counts(store: TieredStore) -> dict[bytes, int]:
    """How many pins every key has, from the pins the store holds per owner and step."""
    held: dict[bytes, int] = {}
    for steps in store._pins.values():
        for _, keys in steps.values():
            for key in keys:
                held[key] = held.get(key, 0) + 1
    return held


def run(rng: random.Random, store: TieredStore, io: FlakyWrites, calls: int) -> int:
    """Random calls; returns the number of probes checked."""
    steps = {0: 0, 1: 0}
    open_steps: dict[int, list[tuple[int, list[int]]]] = {0: [], 1: []}
    probes = 0

    def run_of(longest: int) -> list[bytes]:
        start = rng.randrange(len(KEYS))
        return [KEYS[(start + j) % len(KEYS)] for j in range(rng.randrange(1, longest))]

    for i in range(calls):
        with store._lock:
            assert store.odd_keys_consistent(), f"call {i}: the odd set differs from the entries"
            assert pin_counts(store) == {k: e.pins for k, e in store._entries.items() if e.pins}, \
                f"call {i}: entries' pin counts differ from the pins held"
            st = store.statistics()  # counted from the odd set and the pin lists, not a walk
            assert (st.pending_slots, st.pinned_slots) == (
                sum(1 for e in store._entries.values() if e.state is not EntryState.READY),
                sum(1 for e in store._entries.values() if e.pins)), f"call {i}: statistics differ from the entries"
        if rng.random() < 0.2:
            store.refresh()  # the runs probed without refresh since: some of their keys may have gone
        owner = rng.choice([0, 1])
        x = rng.random()
        if x < 0.3:
            keys = run_of(12)
            if rng.random() < 0.2:
                keys += keys[:3]  # a key asked twice
            refresh = rng.random() < 0.5
            with store._lock:
                want = expected_probe(store, keys)
                got = store.probe(PackedKeys(b"".join(keys)) if rng.random() < 0.5 else keys, refresh=refresh)
            assert (got.ready, got.total) == want, f"call {i}: probe {got} where the entries say {want}"
            probes += 1
        elif x < 0.55:
            keys = run_of(10)
            step = steps[owner]
            steps[owner] += 1
            slots = store.prepare_save(keys, step, owner=owner)
            for key, slot in zip(keys, slots):
                if slot is not None and rng.random() < 0.95:  # some workers never seal their slot
                    view = store.tier.rank_view(slot, 0)
                    view.copy_(torch.frombuffer(bytearray(hashlib.shake_256(key).digest(PAGE)), dtype=torch.uint8))
                    store.tier.seal(slot, key, 0, checksum(view, key))
            open_steps[owner].append((step, [s for s in slots if s is not None]))
        elif x < 0.75:
            if open_steps[owner]:
                step, slots = rng.choice(open_steps[owner])
                open_steps[owner] = [o for o in open_steps[owner] if o[0] > step]
                store.complete_step(step, [s for s in slots if rng.random() < 0.1], owner=owner)
            else:
                store.complete_step(steps[owner], owner=owner)
        elif x < 0.82:
            keys = run_of(6)
            if rng.random() < 0.5:
                keys = run_of(12)[: rng.randrange(1, 12)]  # often the run a probe just counted
            with store._lock:
                want = [e.slot if e is not None and e.state is EntryState.READY and not e.doomed else None
                        for e in map(store._entries.get, keys)]
                got_slots = store.pin(keys, steps[owner], owner=owner)
            assert got_slots == want, f"call {i}: pin {got_slots} where the entries say {want}"
        elif x < 0.88:
            store.promote(run_of(8))
        elif x < 0.91:
            store.discard([rng.choice(KEYS)])
        elif x < 0.93:
            store.doom_pending(rng.randrange(max(1, steps[owner])), owner=owner)
        elif x < 0.95:
            if open_steps[owner]:
                store.abandon_saves(open_steps[owner].pop(0)[0], owner=owner)
        elif x < 0.96:
            store.end_session(owner)
            open_steps[owner] = []
        elif x < 0.965:
            store.clear()
        elif x < 0.98:
            io.fail = rng.choice([0.0, 0.0, 0.5, 1.0])
        elif x < 0.99:
            assert store.wait_idle()
        else:
            store.expire_pins(float("inf"))
    assert store.wait_idle()
    with store._lock:
        assert store.odd_keys_consistent()
    return probes


@pytest.mark.parametrize(("ready_index", "vector_min"), [(False, store_module.PROBE_VECTOR_MIN), (True, 1)],
                         ids=["key-by-key", "ready-index"])
@pytest.mark.parametrize("seed", range(6))
def test_random_calls_keep_the_probe_equal_to_the_plain_walk(seed: int, ready_index: bool, vector_min: int,
                                                             make_tier_of, make_ssd,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # With the ready index, every probe of keys in one buffer goes through it (vector_min 1).
    monkeypatch.setattr(store_module, "PROBE_VECTOR_MIN", vector_min)
    rng = random.Random(seed)
    io = FlakyWrites(rng)
    ssd, recovered = make_ssd(40, PAGE, io=io)
    store = TieredStore(make_tier_of(24, PAGE), high_pct=90, low_pct=70, ssd=ssd, recovered=recovered,
                        dram_watermark_pct=100, demote_queue_blocks=rng.choice([1, 2, 4, 8]),
                        ready_index=ready_index)
    assert store._ready is None  # made at the first probe of keys in one buffer (ready_index)
    try:
        assert run(rng, store, io, calls=1500) > 300
        assert (store._ready is not None) == ready_index
    finally:
        store.close()
