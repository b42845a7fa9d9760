"""The guards between a bad block and a user's answer, each checked where it acts.

Every test here kills a mutant that survived the rest of the unit suite
(docs/reliability.md, "Mutants"): the worker's checksum check, the
scheduler discarding keys the workers found corrupt, dooming saves planned
after a failed load, and refusing a step that not every rank finished.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.connector.meta import BlockCopy, StepPlan, StepReport
from kvtier.connector.scheduler import SchedulerSide
from kvtier.connector.worker import WorkerSide
from kvtier.keys import KeyNamespace
from kvtier.store import TieredStore
from tests.unit.helpers import BLOCK, FakeBlocks, FakeRequest


def save(w: WorkerSide, tier, step: int, block_id: int, slot: int, key: bytes) -> None:
    plan = StepPlan(step=step, arena=tier.path, saves=[BlockCopy(block_id, slot, key)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    assert w.get_block_ids_with_load_errors() == set()
    assert w.build_report().failed_slots == []
    tier.publish(slot)  # what the index does once the step is reported


# "copying": the CPU path, each block checked as it is copied; "after": the
# check on a thread during the forward pass (device copies; here forced by
# taking memmove away).
@pytest.mark.parametrize("checked", ["copying", "after"])
def test_a_sealed_block_whose_bytes_changed_fails_its_checksum_and_drops_the_steps_saves(worker_and_tier, checked,
                                                                                       monkeypatch):
    if checked == "after":
        monkeypatch.setattr("kvtier.connector.copy._MEMMOVE", False)
    w, tier, kv = worker_and_tier
    save(w, tier, 0, block_id=2, slot=0, key=b"a" * 16)
    expected = kv[2].clone()
    tier.rank_view(0, 0)[7] ^= 0x40  # the header still says sealed: only the checksum can tell
    kv[9].zero_()
    plan = StepPlan(step=1, arena=tier.path, loads=[BlockCopy(9, 0, b"a" * 16)],
                    saves=[BlockCopy(3, 1, b"b" * 16), BlockCopy(4, 2, b"c" * 16)])
    w.start_load_kv(plan)
    assert w.get_block_ids_with_load_errors() == {9}
    w.wait_for_save(plan)  # blocks 3 and 4 were computed beside a bad block: not kept
    report = w.build_report()
    assert report.corrupt_keys == [b"a" * 16]
    assert report.failed_slots == [1, 2]
    assert not tier.is_sealed(1, b"b" * 16) and not tier.is_sealed(2, b"c" * 16)
    assert not torch.equal(kv[9], expected)  # copied, but reported: vLLM recomputes it
    assert (w._verifying_copies == [] and w._pool is None) if checked == "copying" else w._pool is not None
    assert w.get_kv_connector_stats().data.get("blocks_loaded", 0) == 0  # a load error, not a load


def test_an_intact_block_loads_without_error(worker_and_tier):
    w, tier, kv = worker_and_tier
    save(w, tier, 0, block_id=2, slot=0, key=b"a" * 16)
    expected = kv[2].clone()
    kv[9].zero_()
    plan = StepPlan(step=1, arena=tier.path, loads=[BlockCopy(9, 0, b"a" * 16)])
    w.start_load_kv(plan)
    assert w.get_block_ids_with_load_errors() == set()
    assert torch.equal(kv[9], expected)
    assert w.build_report().corrupt_keys == []


@pytest.mark.parametrize("checked", ["copying", "after"])
def test_a_block_sealed_but_not_published_is_never_loaded(worker_and_tier, checked, monkeypatch):
    """A slot sealed for the key whose step the index never completed (or
    whose save it doomed: computed beside a block that failed its load) is
    no block to load, even with intact checksums: a loader whose pin was
    lost can meet one when the slot went to another instance's save of the
    same key."""
    if checked == "after":
        monkeypatch.setattr("kvtier.connector.copy._MEMMOVE", False)
    w, tier, kv = worker_and_tier
    save(w, tier, 0, block_id=2, slot=0, key=b"a" * 16)
    tier.publish(0, False)  # doomed by the index
    kv[9].zero_()
    w.start_load_kv(StepPlan(step=1, arena=tier.path, loads=[BlockCopy(9, 0, b"a" * 16)]))
    assert w.get_block_ids_with_load_errors() == {9}
    assert not kv[9].any()  # never copied


def _header_back(tier) -> None:
    raw = bytes(tier._headers[0:1].view("u1"))
    tier.clear(0, b"x" * 16)  # another block's turn in the slot...
    tier.restore_header(0, raw)  # ...then this block, promoted back with its header
    tier.publish(0)


def _refilled(tier) -> None:
    tier.clear(0, b"x" * 16)  # another block's turn in the slot, its bytes written (this hash fails too)
    tier.rank_view(0, 0).numpy()[:] = 0x5A


@pytest.mark.parametrize("meanwhile", [_header_back, _refilled], ids=["header-back", "refilled"])
def test_a_slot_reused_during_its_copy_fails_the_load_without_blaming_the_block(worker_and_tier, monkeypatch,
                                                                                meanwhile):
    """The CPU path: a slot reused while it was copied (a loader whose pin
    was lost) is a load error, not a good load, even if its header came
    back as it was (the block promoted back into it); and not a corrupt
    block either, even if its hash fails: the index may hold the key in
    another slot by then, and forgetting it would drop a good block."""
    import kvtier.connector.worker as worker_module

    w, tier, kv = worker_and_tier
    save(w, tier, 0, block_id=2, slot=0, key=b"a" * 16)
    copy = worker_module.scatter_checked

    def reused(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        meanwhile(tier)
        return copy(*args, **kw)

    monkeypatch.setattr(worker_module, "scatter_checked", reused)
    w.start_load_kv(StepPlan(step=1, arena=tier.path, loads=[BlockCopy(9, 0, b"a" * 16)]))
    assert w.get_block_ids_with_load_errors() == {9}
    assert w.build_report().corrupt_keys == []
    assert w.get_kv_connector_stats().data.get("blocks_loaded", 0) == 0


@pytest.fixture
def side(make_tier, capacity_for) -> SchedulerSide:
    tier = make_tier(capacity_for(32, 4096), 4096)
    return SchedulerSide(TieredStore(tier), KeyNamespace("m", "torch.float32", "cpu", BLOCK), BLOCK, ranks=2)


class Manager:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_blocks(self, req_id: str) -> FakeBlocks:
        return FakeBlocks(self.ids)


class Output:
    def __init__(self, **sched: int) -> None:
        self.num_scheduled_tokens = sched


class StepOutput:
    def __init__(self, report: StepReport | None, invalid: set[int] | None = None) -> None:
        self.kv_connector_worker_meta = report
        self.invalid_block_ids = invalid or set()


def prefill(side: SchedulerSide, req: FakeRequest, block_ids: list[int]) -> StepPlan:
    """Plan one step that computes the whole prompt of ``req`` (its full blocks are saved)."""
    side.kv_cache_manager = Manager(block_ids)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    plan = side.build_connector_meta(Output(**{req.request_id: req.num_tokens}))
    req.num_computed_tokens = req.num_tokens
    return plan


def test_keys_the_workers_found_corrupt_are_forgotten(side: SchedulerSide) -> None:
    req = FakeRequest("r", list(range(3 * BLOCK + 1)))
    plan = prefill(side, req, [1, 2, 3, 4])
    assert len(plan.saves) == 3
    side.update_connector_output(StepOutput(StepReport(done={plan.step: 2})))
    keys = side._reqs["r"].keys
    assert side.store.lookup(keys) == 3
    side.update_connector_output(StepOutput(StepReport(corrupt_keys=[keys[1]])))
    assert side.store.lookup(keys) == 1


def test_a_step_is_readable_once_every_rank_reported_it_whatever_the_outputs(side: SchedulerSide) -> None:
    """On a device each rank reports a step when its own copies end: the two
    ranks' reports may come in different outputs. Nothing is readable
    before the second; nothing is dropped because they were apart."""
    req = FakeRequest("r", list(range(3 * BLOCK + 1)))
    plan = prefill(side, req, [1, 2, 3, 4])
    assert len(plan.saves) == 3
    keys = side._reqs["r"].keys
    side.update_connector_output(StepOutput(StepReport(done={plan.step: 1})))  # one rank of two
    assert side.store.lookup(keys) == 0
    assert side._settled_step < plan.step  # a finished request's blocks stay held meanwhile
    side.update_connector_output(StepOutput(None))  # a step's output with no report
    side.update_connector_output(StepOutput(StepReport(done={plan.step: 1})))  # the other rank
    assert side.store.lookup(keys) == 3 and side._settled_step == plan.step


def test_a_slot_one_rank_failed_stays_failed_when_the_other_reports_later(side: SchedulerSide) -> None:
    req = FakeRequest("r", list(range(3 * BLOCK + 1)))
    plan = prefill(side, req, [1, 2, 3, 4])
    keys = side._reqs["r"].keys
    side.update_connector_output(StepOutput(StepReport(done={plan.step: 1}, failed_slots=[plan.saves[1].slot])))
    side.update_connector_output(StepOutput(StepReport(done={plan.step: 1, plan.step + 1: 2})))
    assert side.store.lookup(keys) == 1  # the block after the failed one is not reachable either
    assert not side.store.contains(keys[1]) and side.store.contains(keys[2])


def test_saves_planned_after_a_failed_load_never_become_readable(side: SchedulerSide) -> None:
    a = FakeRequest("a", list(range(3 * BLOCK + 1)))
    b = FakeRequest("b", list(range(100, 100 + 3 * BLOCK + 1)))
    first = prefill(side, a, [1, 2, 3, 4])
    # Asynchronous scheduling: the next step is planned before the first one's output arrives.
    second = prefill(side, b, [5, 6, 7, 8])
    assert len(second.saves) == 3
    # Step one failed a load; its workers dropped its saves. Step two may
    # have attended to what step one computed from the bad block.
    side.update_connector_output(StepOutput(StepReport(done={first.step: 2}, failed_slots=[
        c.slot for c in first.saves]), invalid={1}))
    side.update_connector_output(StepOutput(StepReport(done={second.step: 2})))
    assert side.store.lookup(side._reqs["b"].keys) == 0
    assert side.store.lookup(side._reqs["a"].keys) == 0


@pytest.mark.parametrize("published", [True, False])
def test_only_a_published_block_that_fails_its_seal_is_reported_corrupt(make_tier, capacity_for,
                                                                        published: bool) -> None:
    """A slot naming the key but not sealed by every rank is the index's
    block gone bad only if the index published it; unpublished, it was
    cleared since the plan (dropped, held, or being saved again): a miss,
    and the key, maybe held elsewhere, is not blamed."""
    tier = make_tier(capacity_for(8, 4096), 4096)
    w = WorkerSide(rank=0, num_blocks=16, verify_checksums=True)
    w.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 8)})
    tier.clear(0, b"a" * 16)
    if published:
        tier.publish(0)
    w.start_load_kv(StepPlan(step=1, arena=tier.path, loads=[BlockCopy(9, 0, b"a" * 16)]))
    assert w.get_block_ids_with_load_errors() == {9}
    assert w.build_report().corrupt_keys == ([b"a" * 16] if published else [])


def test_a_slot_not_sealed_for_the_key_is_never_copied_even_without_checksums(make_tier, capacity_for):
    """With checksums off (an embedded pool may turn them off), the header
    check before the copy is the only guard: a slot sealed for another key
    must not reach vLLM's block."""
    tier = make_tier(capacity_for(8, 4096), 4096)
    w = WorkerSide(rank=0, num_blocks=16, verify_checksums=False)
    kv = torch.arange(16 * 2 * BLOCK * 8, dtype=torch.float32).reshape(16, 2, BLOCK, 8)
    w.register_kv_caches({"l0": kv})
    save(w, tier, 0, block_id=2, slot=0, key=b"a" * 16)
    kv[9].zero_()
    plan = StepPlan(step=1, arena=tier.path, loads=[BlockCopy(9, 0, b"z" * 16)])  # the slot holds "a"
    w.start_load_kv(plan)
    assert w.get_block_ids_with_load_errors() == {9}
    assert torch.equal(kv[9], torch.zeros_like(kv[9]))  # nothing was copied into it
    # The slot was given to another block since the plan (a pin that
    # outlived its lease): a miss, and "z" is not blamed (it may be held elsewhere).
    assert w.build_report().corrupt_keys == []


def test_blocks_found_bad_before_a_copy_fails_are_still_reported_corrupt(worker_and_tier, monkeypatch):
    # The CPU load path checks block by block; if a later copy raises, the
    # whole step's loads are errors, and a block already found bad is still
    # one the index must forget.
    w, tier, kv = worker_and_tier
    save(w, tier, 0, block_id=2, slot=0, key=b"a" * 16)
    save(w, tier, 1, block_id=3, slot=1, key=b"b" * 16)
    tier.rank_view(0, 0)[5] ^= 0x01  # block a: bad bytes under a good header
    import ctypes

    import kvtier.connector.copy as copy_mod
    calls = {"n": 0}
    real = ctypes.memmove

    def memmove(dst, src, n):
        calls["n"] += 1
        if calls["n"] > 1:  # the second block's copy fails
            raise OSError("copy failed")
        return real(dst, src, n)

    monkeypatch.setattr(copy_mod.ctypes, "memmove", memmove)
    plan = StepPlan(step=2, arena=tier.path, loads=[BlockCopy(9, 0, b"a" * 16), BlockCopy(10, 1, b"b" * 16)])
    w.start_load_kv(plan)
    assert w.get_block_ids_with_load_errors() == {9, 10}
    w.wait_for_save(plan)
    assert w.build_report().corrupt_keys == [b"a" * 16]


@pytest.mark.parametrize("bad_slot", ["past the end", "negative"])
def test_a_save_naming_a_slot_outside_the_arena_copies_nothing(worker_and_tier, monkeypatch, bad_slot):
    # A CPU save copies to raw addresses: a slot the mapped arena does not
    # have (a placement that disagrees with this worker about the arena)
    # would be written past the mapping. The step's saves fail instead.
    w, tier, kv = worker_and_tier
    bad = tier.num_slots if bad_slot == "past the end" else -2
    copied = []
    monkeypatch.setattr("kvtier.connector.worker.gather_sealed", lambda *a, **k: copied.append(a[4]))
    monkeypatch.setattr("kvtier.connector.worker.gather_blocks", lambda *a, **k: copied.append(a[4]))
    plan = StepPlan(step=0, arena=tier.path, saves=[BlockCopy(3, 1, b"b" * 16), BlockCopy(4, bad, b"c" * 16)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    assert copied == []
    assert w.build_report().failed_slots == [1, bad]
    assert not tier.is_sealed(1, b"b" * 16)
    assert w.get_kv_connector_stats().data["save_errors"] == 2
    monkeypatch.undo()
    save(w, tier, 1, block_id=3, slot=1, key=b"b" * 16)  # the next step's saves, in the arena, are kept
    assert tier.is_sealed(1, b"b" * 16)
