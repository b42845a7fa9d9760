"""The connector's halves when something goes wrong: loads vLLM counts on become load errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvtier.connector.meta import BlockCopy, StepPlan
from kvtier.connector.scheduler import SchedulerSide
from kvtier.connector.worker import WorkerSide
from kvtier.keys import KeyNamespace
from kvtier.store import TieredStore

BLOCK = 4


@dataclass
class FakeRequest:
    """The fields of vLLM's Request that the scheduler half reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeBlocks:
    ids: list[int] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@pytest.fixture
def side(make_tier, capacity_for) -> SchedulerSide:
    tier = make_tier(capacity_for(32, 4096), 4096)
    store = TieredStore(tier)
    return SchedulerSide(store, KeyNamespace("m", "torch.float32", "cpu", BLOCK), BLOCK, ranks=1)


def held(side: SchedulerSide, req: FakeRequest) -> None:
    """Put the request's first full blocks in the pool, as a finished save would."""
    keys = side._keys(side._state(req), req.num_tokens - 1)
    side.store.prepare_save(keys, step=-1)
    side.store.complete_step(-1)


def test_a_failed_load_plan_reports_every_external_block(side: SchedulerSide) -> None:
    req = FakeRequest("r", list(range(4 * BLOCK + 1)))
    held(side, req)
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, False)
    blocks = FakeBlocks([10, 11, 12, 13, 14])
    side.fail_load(req, blocks, 4 * BLOCK)
    plan = side.failed_step_plan()
    assert [(c.block_id, c.slot) for c in plan.loads] == [(10, -1), (11, -1), (12, -1), (13, -1)]
    assert plan.saves == []


def test_loads_survive_a_planning_failure_half_way(side: SchedulerSide) -> None:
    req = FakeRequest("r", list(range(5 * BLOCK + 1)))
    keys = side._keys(side._state(req), req.num_tokens - 1)
    side.store.prepare_save(keys[:3], step=-1)  # the pool holds the first three blocks
    side.store.complete_step(-1)
    ext, _ = side.get_num_new_matched_tokens(req, 0)
    assert ext == 3 * BLOCK
    side.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9, 10]), ext)
    req.num_computed_tokens = ext  # as vLLM sets it when it schedules the request

    class Output:
        num_scheduled_tokens = {"r": 2 * BLOCK + 1}  # two more blocks become full: a save is planned

    class Manager:  # ... and planning it fails after the slots were taken: too few block ids
        def get_blocks(self, req_id: str) -> FakeBlocks:
            return FakeBlocks([5, 6, 7])

    side.kv_cache_manager = Manager()
    with pytest.raises(IndexError):
        side.build_connector_meta(Output())
    used = side.store.used_slots
    plan = side.failed_step_plan()
    assert [c.block_id for c in plan.loads] == [5, 6, 7]
    assert all(c.slot == -1 for c in plan.loads)
    assert plan.saves == []
    assert side.store.used_slots == used - 2  # the two saves planned before the failure are dropped


def test_worker_reports_failed_loads_and_saves() -> None:
    w = WorkerSide(rank=0, num_blocks=16)
    plan = StepPlan(step=3, arena="/nonexistent", loads=[BlockCopy(1, 0, b"k" * 16), BlockCopy(2, 1, b"j" * 16)],
                    saves=[BlockCopy(4, 2, b"s" * 16)])
    w.fail_loads(plan)
    w.fail_saves(plan)
    assert w.get_block_ids_with_load_errors() == {1, 2}
    report = w.build_report()
    assert report is not None and report.done == {3: 1} and report.failed_slots == [2]


def test_worker_without_an_arena_turns_loads_into_errors() -> None:
    import torch

    w = WorkerSide(rank=0, num_blocks=16)
    w.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 8)})
    plan = StepPlan(step=0, arena="/nonexistent/arena", loads=[BlockCopy(3, 0, b"k" * 16)],
                    saves=[BlockCopy(5, 1, b"s" * 16)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    assert w.get_block_ids_with_load_errors() == {3}
    report = w.build_report()
    assert report is not None and report.failed_slots == [1]
