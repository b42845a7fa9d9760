"""The connector's scheduler half over a real store (32 DRAM slots in /dev/shm):
resets, saves that find no room or are doomed, waits for promotions.

vLLM is stood in for by small request, block and output objects with the
fields the scheduler half reads; steps are driven by hand in the order vLLM
calls the hooks (lookup, alloc, plan, output).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from kvtier.connector.meta import StepReport
from kvtier.connector.scheduler import SchedulerSide
from kvtier.keys import KeyNamespace, KeyRun
from kvtier.store import Probe, TieredStore
from tests.unit.helpers import BLOCK
from tests.unit.helpers import FakeBlocks as Blocks
from tests.unit.helpers import FakeRequest as Req

SLOTS = 32


class Manager:
    """vLLM's KV cache manager: the device blocks of each request."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_blocks(self, req_id: str) -> Blocks:
        return Blocks(self.blocks[req_id])


@dataclass
class Output:
    num_scheduled_tokens: dict[str, int]


@dataclass
class StepOutput:
    kv_connector_worker_meta: StepReport | None
    invalid_block_ids: set[int] = field(default_factory=set)


NS = KeyNamespace("m", "torch.float32", "cpu", BLOCK)


@pytest.fixture
def store(make_tier, capacity_for) -> TieredStore:
    tier = make_tier(capacity_for(SLOTS, 4096), 4096)
    return TieredStore(tier)


@pytest.fixture
def side(store: TieredStore) -> SchedulerSide:
    s = SchedulerSide(store, NS, BLOCK, ranks=1)
    s.kv_cache_manager = Manager()
    return s


def tokens(n_blocks: int, base: int = 0) -> list[int]:
    return list(range(base, base + n_blocks * BLOCK + 1))  # one more: a lookup never covers the last token


def plan_step(side: SchedulerSide, sched: dict[str, int], reqs: dict[str, Req]):
    """Build a step's plan and advance the requests as vLLM does after scheduling."""
    plan = side.build_connector_meta(Output(sched))
    for rid, n in sched.items():
        reqs[rid].num_computed_tokens += n
    return plan


def finish(side: SchedulerSide, step: int, failed=(), invalid=()) -> None:
    side.update_connector_output(StepOutput(StepReport(done={step: 1}, failed_slots=list(failed)), set(invalid)))


def saved_keys(plan) -> list[bytes]:
    return [c.key for c in plan.saves]


# --- reset (issue 7, item 1) -----------------------------------------------------


def test_after_a_reset_nothing_from_before_matches(side: SchedulerSide, store: TieredStore) -> None:
    old = Req("old", tokens(3))
    side.on_new_request(old)
    side.kv_cache_manager.blocks["old"] = [10, 11, 12, 13]
    plan = plan_step(side, {"old": 3 * BLOCK}, {"old": old})  # saves of blocks 0..2 in flight
    assert len(plan.saves) == 3
    keys_before = side._keys(side._state(old), 3 * BLOCK)
    assert side.reset_cache() == 3  # the three PENDING saves, doomed
    finish(side, plan.step)  # the workers wrote them after the reset
    assert store.probe(keys_before) == Probe(0, 0)
    assert store.statistics().used_slots == 0
    # The request kept running through the reset: its KV is from the old
    # weights, so it is saved no more.
    old.all_token_ids += list(range(100, 100 + BLOCK))
    side.kv_cache_manager.blocks["old"].append(14)
    assert plan_step(side, {"old": BLOCK}, {"old": old}).saves == []  # block 3 became full: not saved
    # A new request with the same tokens gets other keys and no hit ...
    new = Req("new", tokens(3))
    assert side.get_num_new_matched_tokens(new, 0) == (0, False)
    keys_after = side._keys(side._state(new), 3 * BLOCK)
    assert not set(keys_after) & set(keys_before)
    # ... and what it saves is found by the next request.
    side.kv_cache_manager.blocks["new"] = [20, 21, 22, 23]
    plan = plan_step(side, {"new": 3 * BLOCK}, {"new": new})
    assert saved_keys(plan) == keys_after
    finish(side, plan.step)
    assert side.get_num_new_matched_tokens(Req("again", tokens(3)), 0) == (3 * BLOCK, False)


def test_keys_after_a_reset_differ_from_those_of_a_restart_and_of_other_resets(side: SchedulerSide,
                                                                              store: TieredStore) -> None:
    req = Req("r", tokens(2))
    fresh = side._keys(side._state(req), 2 * BLOCK)
    side.reset_cache()
    first = side._keys(side._state(Req("r1", tokens(2))), 2 * BLOCK)
    side.reset_cache()
    second = side._keys(side._state(Req("r2", tokens(2))), 2 * BLOCK)
    # A restart starts from the plain namespace seed again: the keys of a fresh process.
    restarted = SchedulerSide(store, NS, BLOCK, ranks=1)
    assert restarted._keys(restarted._state(Req("r3", tokens(2))), 2 * BLOCK) == fresh
    assert len({tuple(fresh), tuple(first), tuple(second)}) == 3


# --- saves that find no room or are doomed (issue 7, item 8) ------------------------------


def test_a_block_that_got_no_slot_is_planned_again(side: SchedulerSide, store: TieredStore) -> None:
    others = [bytes([i]) * 16 for i in range(SLOTS - 1)]
    store.prepare_save(others, step=-5)  # 31 slots PENDING: one slot left, nothing evictable
    req = Req("r", tokens(4))
    side.on_new_request(req)
    side.kv_cache_manager.blocks["r"] = [10, 11, 12, 13, 14]
    keys = side._keys(side._state(req), 4 * BLOCK)
    plan = plan_step(side, {"r": 4 * BLOCK}, {"r": req})
    assert [(c.block_id, c.key) for c in plan.saves] == [(10, keys[0])]
    store.complete_step(-5)  # the other saves land: evictable now
    finish(side, plan.step)
    plan = plan_step(side, {"r": 1}, {"r": req})  # a decode step
    assert [(c.block_id, c.key) for c in plan.saves] == [(11, keys[1]), (12, keys[2]), (13, keys[3])]
    finish(side, plan.step)
    assert store.probe(keys) == Probe(4, 4)


def test_saves_doomed_after_a_failed_load_are_planned_again(side: SchedulerSide, store: TieredStore) -> None:
    r1, r2 = Req("r1", tokens(2)), Req("r2", tokens(2, base=1000))
    reqs = {"r1": r1, "r2": r2}
    side.on_new_request(r1)
    side.on_new_request(r2)
    side.kv_cache_manager.blocks.update(r1=[10, 11, 12], r2=[20, 21, 22])
    k1 = side._keys(side._state(r1), 2 * BLOCK)
    k2 = side._keys(side._state(r2), 2 * BLOCK)
    p0 = plan_step(side, {"r1": 2 * BLOCK}, reqs)
    p1 = plan_step(side, {"r2": 2 * BLOCK}, reqs)  # planned before step 0's output (async scheduling)
    assert saved_keys(p0) == k1 and saved_keys(p1) == k2
    # A load of step 0 failed: its saves were dropped by the workers, step 1's are doomed.
    finish(side, p0.step, failed=[c.slot for c in p0.saves], invalid={99})
    p2 = plan_step(side, {"r1": 1, "r2": 1}, reqs)
    assert saved_keys(p2) == k1  # r2's doomed entries have not gone yet: not planned, not skipped
    finish(side, p1.step)  # step 1 ends: its doomed saves are dropped, never readable
    assert store.probe(k2) == Probe(0, 0)
    p3 = plan_step(side, {"r1": 1, "r2": 1}, reqs)
    assert saved_keys(p3) == k2
    finish(side, p2.step)
    finish(side, p3.step)
    assert store.probe(k1) == Probe(2, 2) and store.probe(k2) == Probe(2, 2)


def test_saves_abandoned_by_a_failed_plan_are_planned_again(side: SchedulerSide, store: TieredStore) -> None:
    r1, r2 = Req("r1", tokens(2)), Req("r2", tokens(2, base=1000))
    reqs = {"r1": r1, "r2": r2}
    side.on_new_request(r1)
    side.on_new_request(r2)
    side.kv_cache_manager.blocks.update(r1=[10, 11, 12], r2=[20])  # r2's blocks: too few, planning fails
    k1 = side._keys(side._state(r1), 2 * BLOCK)
    with pytest.raises(IndexError):
        side.build_connector_meta(Output({"r1": 2 * BLOCK, "r2": 2 * BLOCK}))
    failed = side.failed_step_plan()
    assert failed.saves == [] and store.statistics().used_slots == 0
    for req in reqs.values():
        req.num_computed_tokens += 2 * BLOCK
    side.kv_cache_manager.blocks["r2"] = [20, 21, 22]
    plan = plan_step(side, {"r1": 1, "r2": 1}, reqs)
    assert saved_keys(plan)[:2] == k1 and len(plan.saves) == 4


# --- waits for promotions (issue 7, item 9) ---------------------------------------------


def test_at_most_one_wait_per_scheduler_pass(side: SchedulerSide, store: TieredStore, monkeypatch) -> None:
    # Every lookup finds its prefix on SSD, on its way to DRAM.
    monkeypatch.setattr(store, "probe", lambda keys: Probe(0, len(keys)))
    monkeypatch.setattr(store, "promote", lambda keys: len(keys))
    waits = []
    monkeypatch.setattr(store, "wait_progress", lambda timeout_s: waits.append(timeout_s))
    reqs = [Req(f"r{i}", tokens(2, base=100 * i)) for i in range(5)]
    for req in reqs:
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert waits == [side.promote_poll_s]
    for req in reqs:  # vLLM asks again in the same pass: no more waits
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(waits) == 1
    side.build_connector_meta(Output({}))  # the pass ends
    for req in reqs:
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(waits) == 2


def test_blocks_that_became_ready_since_the_lookup_are_counted(side: SchedulerSide, store: TieredStore,
                                                               monkeypatch) -> None:
    # The lookup saw 1 block ready and 2 on their way (fetched from the
    # cluster or promoted from SSD); by the promote call they had all
    # arrived, so nothing was left to move. The hit is the 3 blocks there
    # now, not the 1 of the stale lookup (seen in bench/cluster.py ttft: 32
    # of 127 blocks loaded, 95 recomputed, no error counted).
    req = Req("r", tokens(3, base=500))
    keys = side._keys(side._state(req), req.num_tokens - 1)
    assert len(store.prepare_save(keys, 0)) == 3
    store.complete_step(0)
    real_probe = store.probe
    calls = []

    def probe(ks):
        calls.append(len(ks))
        return Probe(1, 3) if len(calls) == 1 else real_probe(ks)

    monkeypatch.setattr(store, "probe", probe)
    assert store.promote(keys[1:]) == 0  # nothing to move: all READY
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, False)


def test_blocks_on_ssd_that_vllm_holds_itself_are_not_waited_for(side: SchedulerSide, store: TieredStore,
                                                                 monkeypatch) -> None:
    # The pool holds blocks 0-2 and 10-11 in DRAM, 3-9 on SSD only; vLLM's
    # own cache holds blocks 0-9. Only 10-11 are loaded: the request is
    # answered at once, with nothing promoted, instead of waiting for 3-9.
    req = Req("r", tokens(12, base=900))
    keys = side._keys(side._state(req), req.num_tokens - 1)
    where = {k: "dram" if i < 3 or i >= 10 else "ssd" for i, k in enumerate(keys)}

    def probe(ks):
        held = list(itertools.takewhile(where.__contains__, ks))
        ready = list(itertools.takewhile(lambda k: where[k] == "dram", held))
        return Probe(len(ready), len(held))

    promoted = []
    monkeypatch.setattr(store, "probe", probe)
    monkeypatch.setattr(store, "promote", lambda ks: promoted.append(list(ks)) or len(ks))
    assert side.get_num_new_matched_tokens(req, 10 * BLOCK) == (2 * BLOCK, False)
    assert promoted == []
    # Without vLLM's blocks the SSD part is needed: it is promoted and waited for.
    monkeypatch.setattr(store, "wait_progress", lambda timeout_s: None)
    assert side.get_num_new_matched_tokens(Req("s", tokens(12, base=900)), 0) == (None, False)
    assert promoted == [keys[3:12]]


def test_the_wait_is_longer_only_when_nothing_else_runs(side: SchedulerSide, store: TieredStore,
                                                        monkeypatch) -> None:
    # A request waits for its prefix to arrive in DRAM. While other requests
    # run, each pass waits at most promote_poll_s (their steps wait on it);
    # after a pass that scheduled nothing, idle_poll_s (it ends at the first
    # finished copy), so that the pool is not asked every millisecond.
    monkeypatch.setattr(store, "probe", lambda keys: Probe(0, len(keys)))
    monkeypatch.setattr(store, "promote", lambda keys: len(keys))
    waits = []
    monkeypatch.setattr(store, "wait_progress", lambda timeout_s: waits.append(timeout_s))
    side.kv_cache_manager.blocks["busy"] = []
    waiting = Req("w", tokens(2, base=700))
    side.build_connector_meta(Output({"busy": 1}))  # a pass that ran another request
    assert side.get_num_new_matched_tokens(waiting, 0) == (None, False)
    side.build_connector_meta(Output({}))  # a pass that ran nothing
    assert side.get_num_new_matched_tokens(waiting, 0) == (None, False)
    side.build_connector_meta(Output({"busy": 1}))
    assert side.get_num_new_matched_tokens(waiting, 0) == (None, False)
    assert waits == [side.promote_poll_s, side.idle_poll_s, side.promote_poll_s]
    assert side.idle_poll_s > side.promote_poll_s


# --- a failed load leaves vLLM's prefix cache ----------------------------------------


class EvictingManager(Manager):
    def __init__(self) -> None:
        super().__init__()
        self.evicted: set[int] = set()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted |= set(block_ids)


def test_a_failed_load_and_what_its_step_computed_on_it_leave_vllms_prefix_cache(
        side: SchedulerSide, store: TieredStore) -> None:
    side.kv_cache_manager = EvictingManager()
    first = Req("first", tokens(4))
    side.on_new_request(first)
    side.kv_cache_manager.blocks["first"] = [10, 11, 12, 13, 14]
    finish(side, plan_step(side, {"first": 4 * BLOCK}, {"first": first}).step)
    # A second request with the same 4 blocks and 2 more: loads 4, computes 2.
    again = Req("again", tokens(6))
    side.on_new_request(again)
    assert side.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, False)
    blocks = [20, 21, 22, 23, 24, 25, 26]
    side.kv_cache_manager.blocks["again"] = blocks
    side.update_state_after_alloc(again, Blocks(blocks), 4 * BLOCK)
    again.num_computed_tokens = 4 * BLOCK
    plan = plan_step(side, {"again": 2 * BLOCK + 1}, {"again": again})
    assert [c.block_id for c in plan.loads] == [20, 21, 22, 23]
    # The request is aborted; then the step's report says block 22 failed
    # its check. vLLM no longer looks at the request, so kvtier takes 22
    # and every block computed after it in that step out of the prefix
    # cache; 20 and 21 loaded fine and stay.
    del side.kv_cache_manager.blocks["again"]
    finish(side, plan.step, failed=[c.slot for c in plan.saves], invalid={22})
    assert side.kv_cache_manager.evicted == {22, 23, 24, 25, 26}


def test_a_failure_reported_without_a_step_report_dooms_every_unsettled_step(
        side: SchedulerSide, store: TieredStore) -> None:
    # Workers hold a step's report back until its saves are done (device
    # copies); with pipeline stages several steps are in flight, so a load
    # error that comes without a report may be from any unsettled step.
    reqs = {f"r{i}": Req(f"r{i}", tokens(2, base=1000 * i)) for i in range(3)}
    for i, (rid, r) in enumerate(reqs.items()):
        side.on_new_request(r)
        side.kv_cache_manager.blocks[rid] = [10 * i + 1, 10 * i + 2, 10 * i + 3]
    keys = {rid: side._keys(side._state(r), 2 * BLOCK) for rid, r in reqs.items()}
    plans = [plan_step(side, {rid: 2 * BLOCK}, reqs) for rid in reqs]
    side.update_connector_output(StepOutput(None, {99}))
    for p in plans:
        finish(side, p.step)
    assert [store.probe(k) for k in keys.values()] == [Probe(0, 0)] * 3


# --- keys sent as kept ------------------------------------------------------------


def test_lookups_and_pins_get_the_requests_keys_with_their_buffer(side: SchedulerSide, store: TieredStore,
                                                                  monkeypatch) -> None:
    # The keys go to the placement as a KeyRun whose buffer is the same keys
    # back to back (the pool's client sends it instead of joining them),
    # however the request's keys grew, and for a pin that starts past
    # vLLM's own hit.
    seen: list = []
    for name in ("probe", "pin"):
        real = getattr(store, name)

        def spy(keys, *args, real=real, **kw):
            seen.append(keys)
            return real(keys, *args, **kw)

        monkeypatch.setattr(store, name, spy)
    req = Req("r", tokens(2, base=900))
    side.on_new_request(req)  # keys of blocks 0-1
    req.all_token_ids += list(range(5000, 5000 + 3 * BLOCK))  # 3 more blocks: 5 in all, the prompt grew
    keys = side._keys(side._state(req), req.num_tokens - 1)
    assert len(keys) == 5
    assert len(store.prepare_save(keys, 0)) == 5
    store.complete_step(0)
    assert side.get_num_new_matched_tokens(req, 2 * BLOCK) == (3 * BLOCK, False)
    side.kv_cache_manager.blocks["r"] = list(range(10, 16))
    side.update_state_after_alloc(req, Blocks(list(range(10, 16))), 3 * BLOCK)
    assert [len(k) for k in seen] == [5, 3]  # the lookup of the whole prompt, the pin of blocks 2-4
    assert seen[1] == keys[2:]
    for k in seen:
        assert isinstance(k, KeyRun) and k.packed == b"".join(k)
