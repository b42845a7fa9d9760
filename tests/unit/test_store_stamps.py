"""The meta service's probes: keys in one buffer, runs found in the ready
index, their recency noted as stamps and moved into the LRU order later.

A store with the ready index (as the service makes it) is driven next to
one without, given the same calls; wherever a recency order is read (the
policy's order after refresh(), what an eviction frees) both must agree.
PROBE_VECTOR_MIN is 1 here, so short runs go the service's way too."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvtier import store as store_module
from kvtier.keys import PackedKeys
from kvtier.policy import LruPolicy
from kvtier.ready_index import memory_bytes
from kvtier.store import TieredStore
from kvtier.tier import DramTier

SLOTS = 40
RANK_BYTES = 4096


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def P(keys: list[bytes]) -> PackedKeys:
    return PackedKeys(b"".join(keys))


@pytest.fixture(autouse=True)
def every_probe_vectorised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "PROBE_VECTOR_MIN", 1)


@pytest.fixture
def pair(make_tier_of, shm_path: str, capacity_for) -> Callable[..., tuple[TieredStore, LruPolicy, TieredStore,
                                                                          LruPolicy]]:
    """Two stores of SLOTS slots: with the ready index (probes as the service
    makes them) and without (probes refreshed at once), with their policies."""
    made: list[TieredStore] = []
    tiers: list[DramTier] = []

    def make(high_pct: float = 95.0, low_pct: float = 85.0):
        a, b = LruPolicy(), LruPolicy()
        tiers.append(DramTier.create(shm_path + "-plain", capacity_for(SLOTS, RANK_BYTES), RANK_BYTES))
        sa = TieredStore(make_tier_of(SLOTS, RANK_BYTES), high_pct, low_pct, a, ready_index=True)
        sb = TieredStore(tiers[-1], high_pct, low_pct, b)
        made.extend([sa, sb])
        return sa, a, sb, b

    yield make
    for s in made:
        s.close()
    for t in tiers:
        t.close()


def save_ready(stores: list[TieredStore], keys: list[bytes], step: int) -> None:
    for s in stores:
        assert None not in s.prepare_save(keys, step)
        s.complete_step(step)


def test_a_stamped_run_moves_the_order_only_when_it_is_read(pair) -> None:
    served, sp, plain, pp = pair()
    a, b = [K(i) for i in range(10)], [K(100 + i) for i in range(10)]
    save_ready([served, plain], a, 0)
    save_ready([served, plain], b, 1)
    before = list(sp.victims())
    got = served.probe(P(a + [K(999)]), refresh=False)
    assert (got.ready, got.total) == (10, 10)
    assert served._stamped == 10 and not served._unrefreshed  # a stamp, not a run kept for later
    assert list(sp.victims()) == before
    served.settle()  # below STAMPS_PENDING_MAX: still not moved
    assert list(sp.victims()) == before
    assert plain.probe(a + [K(999)]).ready == 10
    served.refresh()
    assert list(sp.victims()) == list(pp.victims()) == b[::-1] + a[::-1]
    assert served.odd_keys_consistent()


def test_settle_moves_the_stamps_past_the_limit(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    served, sp, plain, pp = pair()
    a, b = [K(i) for i in range(10)], [K(100 + i) for i in range(10)]
    save_ready([served, plain], a, 0)
    save_ready([served, plain], b, 1)
    monkeypatch.setattr(store_module, "STAMPS_PENDING_MAX", 15)
    for _ in range(3):  # 30 stamped, 10 blocks: under the limit once repeats count once
        served.probe(P(a), refresh=False)
        served.settle()
    assert list(sp.victims()) == a[::-1] + b[::-1]
    served.probe(P(b), refresh=False)
    served.probe(P(a[:6]), refresh=False)  # 16 blocks stamped: past the limit
    served.settle()
    assert served._stamped == 0
    for keys in (b, a[:6]):
        plain.probe(keys)
    assert list(sp.victims()) == list(pp.victims())


def test_eviction_reads_the_stamps_first(pair) -> None:
    # 40 slots, high mark 38, low 34. A prefix probed through the service
    # just before the pool fills is as safe from eviction as a refreshed one.
    served, sp, plain, pp = pair(high_pct=95, low_pct=85)
    old = [K(i) for i in range(18)]
    hot = [K(100 + i) for i in range(18)]
    save_ready([served, plain], old, 0)
    save_ready([served, plain], hot, 1)
    served.probe(P(old), refresh=False)
    plain.probe(old)
    save_ready([served, plain], [K(500 + i) for i in range(4)], 2)  # past the high mark: evicts
    held_served = [k for k in old + hot if served.contains(k)]
    assert held_served == [k for k in old + hot if plain.contains(k)]
    assert all(served.contains(k) for k in old)  # the probed prefix stayed; the other went first
    assert list(sp.victims()) == list(pp.victims())
    assert served.odd_keys_consistent()


def test_a_block_that_leaves_takes_its_stamp(pair) -> None:
    # A stamped block dropped, and its slot given to a new block before the
    # stamps are read: the new block is not moved by the old one's stamp.
    served, sp, plain, pp = pair()
    a = [K(i) for i in range(10)]
    save_ready([served, plain], a, 0)
    save_ready([served, plain], [K(50)], 1)
    served.probe(P(a), refresh=False)
    plain.probe(a)
    slot = served._entries[a[3]].slot
    for s in (served, plain):
        assert s.discard([a[3]]) == 1  # found corrupt: dropped
    save_ready([served, plain], [K(60)], 2)
    served.settle()  # as the service does after a CompleteStep: the index knows K(60) at that slot
    assert served._entries[K(60)].slot == slot  # the slot a[3] left (last freed, first taken)
    served.refresh()
    # Blocks saved after a probe and before its stamps are read rank older
    # than the run it counted (a probe announces a load: its blocks count
    # as the last used); K(60) is not moved by a[3]'s stamp.
    rest = [k for k in a if k != a[3]]
    assert list(sp.victims()) == [K(50), K(60)] + rest[::-1]
    assert list(pp.victims()) == [K(50)] + rest[::-1] + [K(60)]
    assert served.odd_keys_consistent()


def test_a_run_kept_for_later_keeps_its_place_among_stamped_runs(pair) -> None:
    # A probe whose keys come as bytes objects goes key by key and its run
    # is kept whole (as one with a block on SSD or being read back is);
    # stamped runs probed before and after it come out in probe order.
    served, sp, plain, pp = pair()
    a, b, c = [K(i) for i in range(5)], [K(100 + i) for i in range(5)], [K(200 + i) for i in range(5)]
    save_ready([served, plain], a + b + c, 0)
    served.probe(P(a), refresh=False)
    served.probe(b, refresh=False)
    served.probe(P(c[:4]), refresh=False)
    assert len(served._unrefreshed) == 1 and served._stamped == 9
    for keys in (a, b, c[:4]):
        plain.probe(keys)
    served.refresh()
    assert list(sp.victims()) == list(pp.victims()) == [c[4]] + a[::-1] + b[::-1] + c[3::-1]
    assert served.odd_keys_consistent()


def test_the_ready_index_is_made_at_the_first_long_probe(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pool whose probes are all short never keeps the index; the first
    # long one makes it from what the store holds then, in every state.
    monkeypatch.setattr(store_module, "PROBE_VECTOR_MIN", 4)
    served, sp, plain, pp = pair()
    a = [K(i) for i in range(10)]
    save_ready([served], a, 0)
    served.prepare_save([K(50), K(51)], 1)  # PENDING
    served.pin([a[2]], 2)
    assert served.discard([a[2]]) == 1  # pinned: doomed, not dropped
    assert served.probe(P(a[:3]), refresh=False).ready == 2  # short: key by key
    assert served._ready is None and served.odd_keys_consistent()
    got = served.probe(P(a[:2] + [a[3], a[4]]), refresh=False)
    assert served._ready is not None and (got.ready, got.total) == (4, 4)
    assert served.odd_keys_consistent()
    assert served._ready.held() == {k: served._entries[k].slot for k in a if k != a[2]}
    assert served.probe(P(a), refresh=False).ready == 2  # stops at the doomed block
    served.complete_step(2)  # the pin ends: the doomed block goes
    served.complete_step(1)  # K(50), K(51) READY
    assert served.probe(P([K(50), K(51), a[0], a[1]]), refresh=False).ready == 4
    assert served.odd_keys_consistent()


def test_a_run_counted_in_the_shared_index_is_counted_and_stamped_as_the_service_s_own(pair) -> None:
    # The meta service's Touch: an instance counted the run in the shared
    # ready index and sends its slots. Counted as a lookup, and the same
    # recency as a probe; a slot that left since, or no slot, is passed over.
    served, sp, plain, pp = pair()
    served.share_ready(memoryview(bytearray(memory_bytes(SLOTS))))
    a, b = [K(i) for i in range(10)], [K(100 + i) for i in range(10)]
    save_ready([served, plain], a, 0)
    save_ready([served, plain], b, 1)
    served.refresh()  # the saves' changes in the index
    n, slots = served._ready.run_of(P(a).array())
    assert n == 10
    before = served.statistics().events
    served.touched(slots)
    after = served.statistics().events
    assert (after.lookups - before.lookups, after.lookup_hits - before.lookup_hits) == (1, 10)
    plain.probe(a)
    served.refresh()
    assert list(sp.victims()) == list(pp.victims()) == b[::-1] + a[::-1]
    # b's run, one of its blocks gone since it was counted, and slots that are none.
    n, slots = served._ready.run_of(P(b).array())
    for s in (served, plain):
        assert s.discard([b[3]]) == 1
    served.touched(np.concatenate([slots, [-1, SLOTS + 5]]))
    assert served._stamped == 9  # b[3]'s slot, free now, is not stamped
    plain.probe(b[4:])
    plain.probe(b[:3])
    served.refresh()
    assert list(sp.victims()) == list(pp.victims())
    assert served.odd_keys_consistent()


def test_only_a_block_that_leaves_the_shared_index_makes_its_flush_urgent(
        pair, monkeypatch: pytest.MonkeyPatch) -> None:
    # Instances read the meta service's index without a call: a block that
    # leaves it goes at the next settle; new PENDING blocks (never in it)
    # and blocks made READY wait for READY_LAG_S (a flush costs 0.15-0.6 ms).
    served, _, _, _ = pair()
    served.share_ready(memoryview(bytearray(memory_bytes(SLOTS))))
    ready = served._ready
    monkeypatch.setattr(store_module, "READY_LAG_S", 3600.0)
    a = [K(i) for i in range(6)]
    save_ready([served], a, 0)
    served.settle()
    assert ready.changes and ready.run_of(P(a).array())[0] == 0  # READY, not in the index yet
    served.refresh()  # applies them whatever the lag
    assert ready.run_of(P(a).array())[0] == 6 and ready.leaving == 0
    assert None not in served.prepare_save([K(50), K(51)], 1)
    served.settle()
    assert ready.leaving == 0 and ready.changes  # not due: no block a reader counts has left
    assert served.discard([a[2]]) == 1
    assert ready.leaving == 1
    served.settle()
    assert not ready.changes and ready.run_of(P(a).array())[0] == 2
    served.complete_step(1)  # K(50), K(51) READY
    monkeypatch.setattr(store_module, "READY_LAG_S", 0.0)
    served.flush_ready()  # the service's timer, no call to settle
    assert not ready.changes and ready.run_of(P([K(50), K(51)]).array())[0] == 2
    assert served.odd_keys_consistent()


def test_a_short_run_counted_in_the_shared_index_is_refreshed_at_the_settle_as_a_short_probe(
        pair, monkeypatch: pytest.MonkeyPatch) -> None:
    # Below PROBE_VECTOR_MIN the service's probe refreshes a run once the
    # call is settled; a run an instance counted (a Touch) must come out as
    # recent, not be stamped and moved after blocks saved later.
    monkeypatch.setattr(store_module, "PROBE_VECTOR_MIN", 64)
    served, sp, plain, pp = pair()
    served.share_ready(memoryview(bytearray(memory_bytes(SLOTS))))
    a, b, c = [K(i) for i in range(8)], [K(100 + i) for i in range(8)], [K(200 + i) for i in range(8)]
    save_ready([served, plain], a, 0)
    save_ready([served, plain], b, 1)
    served.refresh()
    n, slots = served._ready.run_of(P(a).array())
    served.touched(slots)
    served.settle()
    plain.probe(a)
    save_ready([served, plain], c, 2)  # saved after the lookup: more recent than a
    served.refresh()
    assert list(sp.victims()) == list(pp.victims()) == b[::-1] + a[::-1] + c[::-1]
    assert served._stamped == 0 and served.odd_keys_consistent()
