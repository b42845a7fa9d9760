"""The worker's device-copy path on CPU tensors: saves settled after their
copies finish, reports in step order, delayed frees, inert start-up.

The CUDA stream is the one stand-in (:class:`Stream`, at the device
boundary): it performs the same copy functions as copy.StreamCopies,
synchronously, and hands out completion events the test finishes by hand,
as a device would finish them later. The arena, the layouts and the store
are real.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.connector.copy import gather_blocks, scatter_blocks
from kvtier.connector.meta import BlockCopy, StepPlan, StepReport
from kvtier.connector.scheduler import SchedulerSide
from kvtier.connector.worker import WorkerSide
from kvtier.store import TieredStore
from kvtier.tier.dram import DramTier, checksum
from tests.unit.test_scheduler import BLOCK, NS, Manager, Output, Req, StepOutput
KEY_A, KEY_B, KEY_C = b"a" * 16, b"b" * 16, b"c" * 16


class Event:
    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


class Stream:
    """copy.StreamCopies' calls, with events that complete when the test says."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.saved_layers: list[int] = []
        self.waited_layers: list[int] = []
        self.fences = 0  # begin_step: vLLM's stream waits for the copies queued so far
        self.closes = 0  # close: the host waits for every copy queued

    def begin_step(self) -> None:
        self.fences += 1

    def load(self, layers, layout, block_ids, slots, slot_ids) -> None:
        for i, bm in enumerate(layers):
            scatter_blocks([bm], layout, block_ids, slots, slot_ids, first_layer=i)

    def wait_layer(self, index: int) -> None:
        self.waited_layers.append(index)

    def wait_loads(self) -> None:
        pass

    def save_layer(self, index, bm, layout, block_ids, slots, slot_ids) -> None:
        self.saved_layers.append(index)
        gather_blocks([bm], layout, block_ids, slots, slot_ids, first_layer=index)

    def end_saves(self) -> Event:
        self.events.append(Event())
        return self.events[-1]

    def close(self) -> None:
        self.closes += 1

    def map_slots(self, slots, mapped=None) -> None:  # noqa: ANN001 - kernels over a mapped arena: CUDA only
        self.mapped = mapped is not None


@pytest.fixture
def device_worker(make_tier, capacity_for):
    tier = make_tier(capacity_for(8, 4096), 4096)
    w = WorkerSide(rank=0, num_blocks=16)
    kv = {f"l{i}": torch.randn(16, 2, BLOCK, 8) for i in range(2)}
    w.register_kv_caches(kv)
    w._copies = stream = Stream()  # what register_kv_caches sets for CUDA tensors
    return w, tier, stream


def step(w: WorkerSide, plan: StepPlan, announce: tuple[str, ...] = ("l0", "l1")):
    """One engine step as vLLM's runner calls the worker; returns the report vLLM gets."""
    w.start_load_kv(plan)
    for name in announce:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, plan)
    w.wait_for_save(plan)
    w.get_block_ids_with_load_errors()
    return w.build_report()


def test_a_save_is_sealed_and_reported_only_after_its_copies_finish(device_worker) -> None:
    # Before: wait_for_save copied every layer with .cpu() and sealed at
    # once; the host waited for the whole forward pass.
    w, tier, stream = device_worker
    plan = StepPlan(step=1, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A)])
    assert step(w, plan) is None  # the report waits for the copies
    assert stream.saved_layers == [0, 1] and stream.fences == 1
    assert not tier.is_sealed(0, KEY_A)
    assert step(w, StepPlan(step=2, arena=tier.path)) is None  # a later step waits behind it
    stream.events[0].finished = True
    report = step(w, StepPlan(step=3, arena=tier.path, saves=[BlockCopy(4, 1, KEY_B)]))
    assert report is not None and report.done == {1: 1} and report.failed_slots == []
    assert tier.verify(0, KEY_A, 0)
    stream.events[1].finished = True
    report = step(w, StepPlan(step=4, arena=tier.path))  # nothing to copy: no report of its own
    assert report.done == {3: 1} and tier.verify(1, KEY_B, 0)


def test_layers_vllm_did_not_announce_are_saved_in_wait_for_save(device_worker) -> None:
    w, tier, stream = device_worker
    plan = StepPlan(step=1, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A)])
    step(w, plan, announce=("l1",))
    assert sorted(stream.saved_layers) == [0, 1]
    stream.events[0].finished = True
    assert step(w, StepPlan(step=2, arena=tier.path)).done == {1: 1}
    assert tier.verify(0, KEY_A, 0)  # both layers' bytes are in the slot


def test_saves_of_a_step_whose_load_failed_are_failed_once_their_copies_end(device_worker) -> None:
    w, tier, stream = device_worker
    tier.clear(2, KEY_C)
    tier.publish(2)  # published for KEY_C, never sealed: the load fails, the block is corrupt
    plan = StepPlan(step=1, arena=tier.path, loads=[BlockCopy(5, 2, KEY_C)], saves=[BlockCopy(3, 0, KEY_A)])
    w.start_load_kv(plan)
    for name in ("l0", "l1"):
        w.save_kv_layer(name, plan)
    w.wait_for_save(plan)
    assert w.get_block_ids_with_load_errors() == {5}
    assert w.build_report() is None  # the slot is still being written: not given back yet
    stream.events[0].finished = True
    report = step(w, StepPlan(step=2, arena=tier.path))
    assert report.done == {1: 1} and report.failed_slots == [0] and report.corrupt_keys == [KEY_C]
    assert not tier.is_sealed(0, KEY_A)


@pytest.mark.parametrize("bad_slot", [8, -1])  # past the 8-slot arena's end; negative: indexed from the end
@pytest.mark.parametrize("announce", [("l0", "l1"), ()])  # vLLM announces each layer, or none
def test_device_saves_naming_a_slot_outside_the_arena_copy_nothing(device_worker, bad_slot, announce) -> None:
    w, tier, stream = device_worker
    plan = StepPlan(step=1, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A), BlockCopy(4, bad_slot, KEY_B)])
    report = step(w, plan, announce=announce)
    assert stream.saved_layers == []
    assert report is not None and report.done == {1: 1} and report.failed_slots == [0, bad_slot]
    assert not tier.is_sealed(0, KEY_A) and not tier.is_sealed(7, KEY_B)
    assert w.get_kv_connector_stats().data["save_errors"] == 2  # counted once
    plan = StepPlan(step=2, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A)])  # the next step saves as before
    assert step(w, plan, announce=announce) is None
    stream.events[-1].finished = True
    assert step(w, StepPlan(step=3, arena=tier.path)).done == {2: 1} and tier.verify(0, KEY_A, 0)


def test_a_delayed_free_is_reported_once_its_saves_are_settled(device_worker) -> None:
    w, tier, stream = device_worker
    step(w, StepPlan(step=1, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A)]))
    w.start_load_kv(StepPlan(step=2, arena=tier.path, delayed={"req-1": 1}))
    assert w.get_finished() is None  # step 1's copies still read the request's blocks
    stream.events[0].finished = True
    assert w.get_finished() == {"req-1"}
    assert w.get_finished() is None  # reported once


def test_kv_caches_registered_again_end_the_copies_into_the_mapped_arena_first(device_worker) -> None:
    """A second register_kv_caches replaces the device stream (on CUDA): the
    copies queued on the old one must end, and the arena be let go, first;
    the next plan maps it again."""
    w, tier, stream = device_worker
    step(w, StepPlan(step=1, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A)]))
    assert w._tier is not None and stream.closes == 0
    w.register_kv_caches({f"l{i}": torch.randn(16, 2, BLOCK, 8) for i in range(2)})
    assert stream.closes == 1 and w._tier is None
    w._copies = stream
    stream.events[0].finished = True
    report = step(w, StepPlan(step=2, arena=tier.path, saves=[BlockCopy(4, 1, KEY_B)]))
    # Its copies ended before the mapping went, and the same arena is mapped again: sealed there.
    assert report.done == {1: 1} and report.failed_slots == [] and tier.verify(0, KEY_A, 0)
    stream.events[1].finished = True
    assert step(w, StepPlan(step=3, arena=tier.path)).failed_slots == [] and tier.verify(1, KEY_B, 0)


def test_an_unreadable_kv_shape_leaves_the_worker_inert(make_tier, capacity_for) -> None:
    # Before: register_kv_caches raised and vLLM's start-up failed.
    tier = make_tier(capacity_for(8, 4096), 4096)
    w = WorkerSide(rank=0, num_blocks=16, block_tokens=BLOCK)
    w.register_kv_caches({"l0": torch.zeros(24, 2, BLOCK, 8)})  # 24 rows: neither 16 blocks nor a split
    assert w.layout is None and "kernel blocks" in w.inert_reason
    plan = StepPlan(step=0, arena=tier.path, loads=[BlockCopy(3, 0, KEY_A)], saves=[BlockCopy(5, 1, KEY_B)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    assert w.get_block_ids_with_load_errors() == {3}  # recomputed, never read from a slot
    assert w.build_report().failed_slots == [1]
    w.start_load_kv(StepPlan(step=1, arena=tier.path, delayed={"r": 0}))
    assert w.get_finished() == {"r"}  # an inert worker never holds vLLM's blocks


# --- the scheduler's half: delayed frees ------------------------------------------


@pytest.mark.parametrize("async_saves", [True, False], ids=["device", "cpu"])
def test_a_finished_request_waits_for_its_saves_on_a_device_only(make_tier, capacity_for, async_saves) -> None:
    tier = make_tier(capacity_for(16, 4096), 4096)
    side = SchedulerSide(TieredStore(tier), NS, BLOCK, ranks=1, kv_cache_manager=Manager(),
                         async_saves=async_saves)
    req = Req("r", list(range(2 * BLOCK + 1)))
    side.kv_cache_manager.blocks["r"] = [7, 8, 9]
    side.get_num_new_matched_tokens(req, 0)
    plan = side.build_connector_meta(Output({"r": 2 * BLOCK + 1}))
    assert [c.block_id for c in plan.saves] == [7, 8]
    delay, _ = side.request_finished(req, [7, 8, 9])
    assert delay is async_saves  # CPU saves are done when the step ends: nothing to wait for
    plan2 = side.build_connector_meta(Output({}))
    assert plan2.delayed == ({"r": plan.step} if async_saves else {})
    side.update_connector_output(StepOutput(StepReport(done={plan.step: 1})))
    other = Req("s", list(range(100, 100 + 2 * BLOCK + 1)))
    side.kv_cache_manager.blocks["s"] = [1, 2, 3]
    side.get_num_new_matched_tokens(other, 0)
    side.build_connector_meta(Output({"s": 2 * BLOCK + 1}))
    side.update_connector_output(StepOutput(StepReport(done={plan2.step + 1: 1})))
    assert side.request_finished(other, [1, 2, 3]) == (False, None)  # its step is settled already


def test_a_step_settled_before_vllm_took_its_report_keeps_its_failures(device_worker) -> None:
    w, tier, stream = device_worker
    tier.clear(2, KEY_C)  # the step's load fails: its saves are failed slots
    plan = StepPlan(step=1, arena=tier.path, loads=[BlockCopy(5, 2, KEY_C)], saves=[BlockCopy(3, 0, KEY_A)],
                    delayed={"r": 0})
    w.start_load_kv(plan)
    w.wait_for_save(plan)  # nothing queued: the step's load failed
    assert w.get_finished() == {"r"}  # settles step 1 before vLLM takes its report
    w.get_block_ids_with_load_errors()
    report = w.build_report()
    assert report.done == {1: 1} and report.failed_slots == [0]


def test_a_step_that_only_loads_is_reported_once_its_copies_end(device_worker) -> None:
    """The report lets the pool unpin the step's slots: while the host-to-device
    copies may still read them, it is held (a slot reused meanwhile would be
    copied into vLLM's blocks unchecked)."""
    w, tier, stream = device_worker
    tier.clear(2, KEY_C)
    tier.rank_view(2, 0).zero_()
    tier.seal(2, KEY_C, 0, checksum(tier.rank_view(2, 0), KEY_C))
    tier.publish(2)
    assert step(w, StepPlan(step=1, arena=tier.path, loads=[BlockCopy(5, 2, KEY_C)])) is None
    stream.events[0].finished = True
    assert step(w, StepPlan(step=2, arena=tier.path)).done == {1: 1}


class LateCopy:
    """A device load's completion event, for a DMA that runs late: its
    copies happen when it is waited for, after ``meanwhile``."""

    def __init__(self, copy, meanwhile) -> None:  # noqa: ANN001
        self.copy, self.meanwhile, self.done = copy, meanwhile, False

    def synchronize(self) -> None:
        if not self.done:
            self.meanwhile()
            self.copy()
            self.done = True

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("refill", [KEY_A, KEY_C], ids=["another key", "the same key"])
def test_a_device_load_is_checked_after_its_copy_read_the_slot(device_worker, refill: bytes) -> None:
    """A slot rewritten between the plan and the DMA (its pin lost with the
    session or expired, the slot reused: for another key, or refilled with
    the same key's bytes from another instance) is a load error: the check
    waits for the copies and compares the header with the one the plan was
    checked against, not with what it holds when the check runs."""
    w, tier, stream = device_worker
    tier.clear(2, KEY_C)
    tier.rank_view(2, 0).fill_(1)
    tier.seal(2, KEY_C, 0, checksum(tier.rank_view(2, 0), KEY_C))
    tier.publish(2)

    def reused() -> None:  # another save into the same slot, sealed before the check runs
        tier.clear(2, refill)
        tier.rank_view(2, 0).fill_(2)
        tier.seal(2, refill, 0, checksum(tier.rank_view(2, 0), refill))
        tier.publish(2)

    late: list[LateCopy] = []

    def load(layers, layout, block_ids, slots, slot_ids) -> LateCopy:  # noqa: ANN001
        late.append(LateCopy(lambda: Stream.load(stream, layers, layout, block_ids, slots, slot_ids), reused))
        return late[-1]

    stream.load = load
    w.start_load_kv(StepPlan(step=1, arena=tier.path, loads=[BlockCopy(5, 2, KEY_C)]))
    errors = w.get_block_ids_with_load_errors()
    assert [c.done for c in late] == [True]  # the check waited for the copies
    assert errors == {5}
    assert w._report.corrupt_keys == []  # reused, not corrupt: the pool's block is not blamed


def test_saves_queued_into_an_arena_left_behind_are_not_sealed_in_the_next(device_worker, capacity_for,
                                                                            shm_path) -> None:
    """A plan naming another arena (a restarted meta service) while a step's
    saves into the old one are unsettled: they fail, and no slot of the new
    arena (other blocks) gets this key."""
    w, old, stream = device_worker
    new = DramTier.create(shm_path + "-new", capacity_for(8, 4096), 4096)
    try:
        assert step(w, StepPlan(step=1, arena=old.path, saves=[BlockCopy(3, 0, KEY_A)])) is None
        stream.events[0].finished = True
        report = step(w, StepPlan(step=2, arena=new.path, saves=[BlockCopy(4, 1, KEY_B)]))
        assert report is not None and report.done == {1: 1} and report.failed_slots == [0]
        assert not new.is_sealed(0, KEY_A) and not old.is_sealed(0, KEY_A)
        stream.events[1].finished = True
        assert step(w, StepPlan(step=3, arena=new.path)).failed_slots == []  # the new arena's own saves hold
        assert new.verify(1, KEY_B, 0)
    finally:
        try:
            w._close_arena()
        finally:  # the new arena goes even if the worker's close fails
            new.close()
            if os.path.exists(shm_path + "-new"):
                os.unlink(shm_path + "-new")


def test_with_microbatches_a_steps_saves_are_queued_after_the_forward(make_tier, capacity_for) -> None:
    """Dual-batch overlap runs a layer's attention once per microbatch, each
    followed by save_kv_layer: the first call comes before the second
    microbatch wrote the layer, so nothing is queued until wait_for_save."""
    tier = make_tier(capacity_for(8, 4096), 4096)
    w = WorkerSide(rank=0, num_blocks=16, saves_per_layer=False)
    w.register_kv_caches({f"l{i}": torch.randn(16, 2, BLOCK, 8) for i in range(2)})
    w._copies = stream = Stream()
    plan = StepPlan(step=1, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A)])
    w.start_load_kv(plan)
    for name in ("l0", "l1"):
        w.save_kv_layer(name, plan)
        assert stream.saved_layers == []
    w.wait_for_save(plan)
    assert stream.saved_layers == [0, 1]


def test_the_arena_is_pinned_beside_the_step_and_released_after_it(device_worker, monkeypatch) -> None:
    """Registering a large arena takes about 0.1 s a GB: on a thread of its
    own, while the first step's copies go through pageable memory; the
    mapping is released only once the registration has ended."""
    import threading

    from kvtier.connector import worker as worker_module

    w, tier, stream = device_worker
    may_finish, calls, released = threading.Event(), [], []

    class Region:
        def release(self) -> None:
            released.append(True)

    def slow_pin(ptr: int, size: int, unit: int, mapped: bool):
        calls.append((ptr, size, unit, mapped))
        may_finish.wait(30)
        return Region(), ""

    monkeypatch.setattr(worker_module, "pin_host_memory", slow_pin)
    plan = StepPlan(step=1, arena=tier.path, saves=[BlockCopy(3, 0, KEY_A)])
    assert step(w, plan) is None  # the step ran while the registration is under way
    assert stream.saved_layers == [0, 1] and w._pinned is None
    # The worker's own mapping, registered in parts of whole slots, mapped for the copy kernels.
    assert calls == [(w._tier._slots.data_ptr(), w._tier._slots.numel(), w._tier.slot_stride, True)]
    closer = threading.Thread(target=w._close_arena)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive() and not released  # waits for the registration before unmapping
    may_finish.set()
    closer.join(30)
    assert not closer.is_alive() and released == [True] and w._tier is None


def test_with_microbatches_a_failed_load_still_holds_the_report_until_the_copies_end(make_tier,
                                                                                    capacity_for) -> None:
    """A step with a load that failed queues none of its saves; its other
    loads are still being copied from their slots: the report (which lets
    the pool unpin them) waits for the copies all the same."""
    tier = make_tier(capacity_for(8, 4096), 4096)
    w = WorkerSide(rank=0, num_blocks=16, saves_per_layer=False)
    w.register_kv_caches({f"l{i}": torch.randn(16, 2, BLOCK, 8) for i in range(2)})
    w._copies = stream = Stream()
    tier.rank_view(1, 0).zero_()
    tier.seal(1, KEY_B, 0, checksum(tier.rank_view(1, 0), KEY_B))  # a good block
    tier.publish(1)
    tier.clear(2, KEY_C)  # published for KEY_C, never sealed: its load fails
    plan = StepPlan(step=1, arena=tier.path, loads=[BlockCopy(4, 1, KEY_B), BlockCopy(5, 2, KEY_C)],
                    saves=[BlockCopy(3, 0, KEY_A)])
    assert step(w, plan) is None
    assert stream.saved_layers == []  # the failed load: nothing of the step is saved
    stream.events[-1].finished = True
    report = step(w, StepPlan(step=2, arena=tier.path))
    assert report.done == {1: 1} and report.failed_slots == [0]
