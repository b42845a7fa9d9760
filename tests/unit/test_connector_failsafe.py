"""The connector's halves when something goes wrong: loads vLLM counts on become load errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvtier.connector.meta import BlockCopy, StepPlan
from kvtier.connector.scheduler import SchedulerSide
from kvtier.connector.worker import WorkerSide
from kvtier.keys import KeyNamespace
from kvtier.store import TieredStore
from kvtier.tier import DramTier
from tests.unit.helpers import BLOCK, FakeBlocks, FakeRequest


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

    class Manager:  # ... and planning it fails: too few block ids
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
    assert side.store.used_slots == used  # no slot was left waiting for a writer


def test_a_reset_whose_store_fails_still_changes_every_key(side: SchedulerSide,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    req = FakeRequest("r", list(range(4 * BLOCK + 1)))
    before = side._keys(side._state(req), req.num_tokens - 1)

    def broken() -> int:
        raise OSError("the store could not be reset")

    monkeypatch.setattr(side.store, "reset", broken)
    with pytest.raises(OSError):
        side.reset_cache()
    after = side._keys(side._state(FakeRequest("r2", list(range(4 * BLOCK + 1)))), req.num_tokens - 1)
    assert not set(before) & set(after)


def test_a_request_that_skips_reading_the_prefix_cache_is_not_looked_up(side: SchedulerSide) -> None:
    req = FakeRequest("r", list(range(4 * BLOCK + 1)))
    held(side, req)
    skip = FakeRequest("s", list(range(4 * BLOCK + 1)))
    skip.skip_reading_prefix_cache = True  # type: ignore[attr-defined] - vLLM's Request has it
    lookups = side.store.statistics().events.lookups
    assert side.get_num_new_matched_tokens(skip, 0) == (0, False)
    assert side.store.statistics().events.lookups == lookups  # nothing asked of the pool (nor promoted, nor waited for)
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, False)


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


def test_saves_of_a_step_with_a_failed_load_are_all_dropped(worker_and_tier) -> None:
    w, tier, kv = worker_and_tier
    tier.clear(0, b"a" * 16)
    tier.publish(0)  # published for key a, never sealed: the load must fail, the block is corrupt
    plan = StepPlan(step=5, arena=tier.path, loads=[BlockCopy(1, 0, b"a" * 16)],
                    saves=[BlockCopy(2, 1, b"b" * 16), BlockCopy(3, 2, b"c" * 16)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)  # blocks 2, 3 may have attended to block 1: none is kept
    assert w.get_block_ids_with_load_errors() == {1}
    report = w.build_report()
    assert report.failed_slots == [1, 2]
    assert report.corrupt_keys == [b"a" * 16]
    assert not tier.is_sealed(1, b"b" * 16) and not tier.is_sealed(2, b"c" * 16)


def test_a_failed_load_is_reported_with_the_next_step_too(worker_and_tier) -> None:
    """A request planned before the failure reached vLLM (asynchronous
    scheduling) may have hit the block in vLLM's prefix cache and computed
    on it: reported again, the block rolls that request back as well."""
    w, tier, kv = worker_and_tier
    tier.clear(0, b"a" * 16)  # published for key a, never sealed: the load fails
    plan = StepPlan(step=5, arena=tier.path, loads=[BlockCopy(1, 0, b"a" * 16)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    assert w.get_block_ids_with_load_errors() == {1}
    w.build_report()
    for step, want in ((6, {1}), (7, set())):
        plan = StepPlan(step=step, arena=tier.path)
        w.start_load_kv(plan)
        w.wait_for_save(plan)
        assert w.get_block_ids_with_load_errors() == want, step
        w.build_report()
    assert w.get_kv_connector_stats().data["load_errors"] == 1  # one failed load, counted once


def test_a_clean_step_saves_and_seals(worker_and_tier) -> None:
    w, tier, kv = worker_and_tier
    plan = StepPlan(step=6, arena=tier.path, saves=[BlockCopy(2, 1, b"b" * 16)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    assert w.get_block_ids_with_load_errors() == set()
    assert w.build_report().failed_slots == []
    assert tier.verify(1, b"b" * 16, 0)


def test_a_late_write_between_a_save_s_copy_and_its_seal_makes_the_block_a_miss(worker_and_tier,
                                                                                   monkeypatch) -> None:
    # A worker of an ended session, whose slot the pool gave to this save,
    # writes into it right after the save's copy and before its checksum.
    # The seal is of what the save copied, so the load that follows fails
    # its check and vLLM recomputes; it never gets the late writer's bytes.
    w, tier, kv = worker_and_tier
    real, once = DramTier.rank_view, []

    def late_write(self, slot: int, rank: int = 0):
        part = real(self, slot, rank)
        if not once:
            once.append(slot)
            part.fill_(7)
        return part

    monkeypatch.setattr(DramTier, "rank_view", late_write)
    plan = StepPlan(step=6, arena=tier.path, saves=[BlockCopy(2, 1, b"b" * 16)])
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    assert once == [1] and w.build_report().failed_slots == []
    tier.publish(1)  # what the index does once the step is reported
    load = StepPlan(step=7, arena=tier.path, loads=[BlockCopy(5, 1, b"b" * 16), BlockCopy(6, 2, b"c" * 16)])
    # Slot 2: the same save, no late writer: its load is good (so the miss
    # above is the late write's, not the test's).
    save = StepPlan(step=8, arena=tier.path, saves=[BlockCopy(3, 2, b"c" * 16)])
    w.start_load_kv(save)
    w.wait_for_save(save)
    w.build_report()
    tier.publish(2)
    w.start_load_kv(load)
    assert w.get_block_ids_with_load_errors() == {5}
    assert torch.equal(kv[6], kv[3])


def test_save_failures_after_the_report_was_taken_still_reach_it(worker_and_tier) -> None:
    # With speculative decoding vLLM takes the worker's report before wait_for_save.
    w, tier, kv = worker_and_tier
    plan = StepPlan(step=7, arena="/nonexistent/arena", saves=[BlockCopy(2, 1, b"b" * 16)])
    w.start_load_kv(plan)
    report = w.build_report()
    w.wait_for_save(plan)
    assert report is not None and report.failed_slots == [1]


@dataclass
class FakeLora:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass
class RichRequest(FakeRequest):
    lora_request: FakeLora | None = None
    cache_salt: str | None = None
    mm_features: list | None = None
    prompt_embeds: object | None = None


def test_lora_and_cache_salt_give_other_keys_than_the_plain_prompt(side: SchedulerSide, tmp_path) -> None:
    tokens = list(range(3 * BLOCK + 1))
    plain = side._keys(side._state(RichRequest("p", tokens)), 3 * BLOCK)
    for name in ("sql", "chat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_model.safetensors").write_bytes(name.encode() * 100)
    sql, chat = FakeLora("sql", 1, str(tmp_path / "sql")), FakeLora("chat", 2, str(tmp_path / "chat"))
    lora = side._keys(side._state(RichRequest("l", tokens, lora_request=sql)), 3 * BLOCK)
    lora2 = side._keys(side._state(RichRequest("l2", tokens, lora_request=chat)), 3 * BLOCK)
    salted = side._keys(side._state(RichRequest("s", tokens, cache_salt="tenant-a")), 3 * BLOCK)
    assert len({tuple(plain), tuple(lora), tuple(lora2), tuple(salted)}) == 4
    # ... and a plain prompt never hits what an adapter's request saved.
    side.store.prepare_save(lora, step=0)
    side.store.complete_step(0)
    assert side.get_num_new_matched_tokens(RichRequest("p2", tokens), 0) == (0, False)
    assert side.get_num_new_matched_tokens(RichRequest("l3", tokens, lora_request=sql), 0) \
        == (3 * BLOCK, False)


def test_multimodal_and_embedding_requests_are_neither_looked_up_nor_saved(side: SchedulerSide) -> None:
    tokens = list(range(3 * BLOCK + 1))
    side.store.prepare_save(side._keys(side._state(RichRequest("p", tokens)), 3 * BLOCK), step=0)
    side.store.complete_step(0)
    mm = RichRequest("m", tokens, mm_features=["image"])
    assert side.get_num_new_matched_tokens(mm, 0) == (0, False)
    emb = RichRequest("e", tokens, prompt_embeds=object())
    assert side.get_num_new_matched_tokens(emb, 0) == (0, False)


def test_a_session_that_gains_an_image_is_no_longer_saved_or_looked_up(side: SchedulerSide) -> None:
    # A streaming-input session: vLLM adds the next part, with an image, to
    # the same request object after its first text-only part was seen.
    tokens = list(range(3 * BLOCK + 1))
    text_keys = side._keys(side._state(RichRequest("other", tokens)), 3 * BLOCK)
    side.store.prepare_save(text_keys, step=0)
    side.store.complete_step(0)
    session = RichRequest("s", tokens)
    assert side.get_num_new_matched_tokens(session, 0) == (3 * BLOCK, False)
    session.mm_features = ["image"]
    session.all_token_ids = tokens + list(range(BLOCK))

    class Manager:
        def get_blocks(self, req_id: str) -> FakeBlocks:
            return FakeBlocks(list(range(10, 16)))

    class Output:
        num_scheduled_tokens = {"s": 2 * BLOCK}

    side.kv_cache_manager = Manager()
    session.num_computed_tokens = 3 * BLOCK
    assert side.build_connector_meta(Output()).saves == []
    assert side.get_num_new_matched_tokens(session, 0) == (0, False)


def test_a_step_with_failed_copies_rewinds_its_requests_so_recomputed_blocks_are_saved(side: SchedulerSide) -> None:
    from kvtier.connector.meta import StepReport

    req = FakeRequest("r", list(range(5 * BLOCK + 1)))
    keys = side._keys(side._state(req), req.num_tokens - 1)
    side.store.prepare_save(keys[:3], step=-1)
    side.store.complete_step(-1)
    ext, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9, 10]), ext)
    req.num_computed_tokens = ext

    class Manager:
        def get_blocks(self, req_id: str) -> FakeBlocks:
            return FakeBlocks([5, 6, 7, 8, 9, 10])

    class Output:
        num_scheduled_tokens = {"r": 2 * BLOCK + 1}

    side.kv_cache_manager = Manager()
    plan = side.build_connector_meta(Output())
    assert [c.block_id for c in plan.saves] == [8, 9]

    class StepOutput:  # block 6 failed to load; the workers dropped the step's saves
        kv_connector_worker_meta = StepReport(done={plan.step: 1}, failed_slots=[c.slot for c in plan.saves])
        invalid_block_ids = {6}

    side.update_connector_output(StepOutput())
    side.store.discard([keys[1]])
    # vLLM recomputes from block 1 on; the next step plans those saves again.
    req.num_computed_tokens = 5 * BLOCK

    class Next:
        num_scheduled_tokens = {"r": 1}

    again = side.build_connector_meta(Next())
    assert sorted(c.block_id for c in again.saves) == [6, 8, 9]


def test_stats_of_a_pool_never_reached_are_zeros_not_an_error(side: SchedulerSide, monkeypatch) -> None:
    # A meta service down since the instance started has given no counters
    # yet: vLLM's per-step statistics still come, with empty gauges, instead
    # of an exception every step.
    monkeypatch.setattr(side.store, "counters", lambda: {})
    stats = side.get_kv_connector_stats()
    assert stats is not None and stats.data.get("dram_slots_used") == 0


def test_a_failure_dropping_outputs_in_flight_leaves_the_saves_since_doomed(side: SchedulerSide,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping the in-flight outputs of rolled-back requests comes last of
    a failed load's handling: should it raise (another vLLM's Request), the
    saves planned since the failed step are doomed all the same."""
    from kvtier.connector.meta import StepReport

    doomed: list[int] = []
    monkeypatch.setattr(side.store, "doom_pending", doomed.append)

    def broken(invalid: set[int]) -> None:
        raise AttributeError("a Request without num_in_flight_tokens")

    monkeypatch.setattr(side, "_drop_outputs_in_flight", broken)

    class StepOutput:
        kv_connector_worker_meta = StepReport(done={3: 1}, failed_slots=[])
        invalid_block_ids = {6}

    side.update_connector_output(StepOutput())
    assert doomed == [3]
