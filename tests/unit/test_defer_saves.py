"""``defer_saves`` (CPU): a step's saves are copied at the start of the next
step, from vLLM's ``handle_preemptions`` (before vLLM writes any KV in that
step), not at the end of the step that computed them; the step's report,
and the frees the scheduler delayed for it, wait for the copies."""

from __future__ import annotations

import torch

from kvtier.connector.meta import BlockCopy, StepPlan

KEY_B = b"b" * 16


def step(w, plan: StepPlan, preempt_hook: bool = True):
    """One engine step as vLLM's worker runs it: handle_preemptions (unless
    ``preempt_hook`` is False), loads, the forward pass, saves, finished
    requests, load errors, the report. Returns (finished, report)."""
    if preempt_hook:
        w.copy_deferred_saves()
    w.start_load_kv(plan)
    w.wait_for_save(plan)
    finished = w.get_finished()
    w.get_block_ids_with_load_errors()
    return finished, w.build_report()


def test_a_step_s_saves_are_copied_at_the_next_step_s_start_and_reported_with_it(worker_and_tier) -> None:
    w, tier, kv = worker_and_tier
    w.defer_saves = True
    _, report = step(w, StepPlan(step=6, arena=tier.path, saves=[BlockCopy(2, 1, KEY_B)]))
    # Not copied yet, and not reported: the store would publish the slot.
    assert report is None
    assert not tier.is_sealed(1, KEY_B)
    _, report = step(w, StepPlan(step=7, arena=tier.path))
    assert report is not None and report.done == {6: 1} and report.failed_slots == []
    assert tier.verify(1, KEY_B, 0)
    # What the slot holds is block 2's KV: loaded into block 5, the same bytes.
    tier.publish(1)
    step(w, StepPlan(step=8, arena=tier.path, loads=[BlockCopy(5, 1, KEY_B)]))
    assert torch.equal(kv[5], kv[2])
    assert w.get_kv_connector_stats().data["blocks_saved"] == 1


def test_a_delayed_free_waits_for_the_deferred_copy(worker_and_tier) -> None:
    w, tier, kv = worker_and_tier
    w.defer_saves = True
    finished, _ = step(w, StepPlan(step=6, arena=tier.path, saves=[BlockCopy(2, 1, KEY_B)],
                                   delayed={"r": 6}))
    assert finished is None  # its blocks are still to be read
    finished, _ = step(w, StepPlan(step=7, arena=tier.path))
    assert finished == {"r"} and tier.verify(1, KEY_B, 0)


def test_without_handle_preemptions_deferred_saves_are_dropped_never_copied(worker_and_tier) -> None:
    """A vLLM that does not call handle_preemptions zeroes new blocks before
    any other hook of the step: the deferred saves may read overwritten
    blocks, so they are given up (reported failed) and saves are copied
    within their step from then on."""
    w, tier, kv = worker_and_tier
    w.defer_saves = True
    step(w, StepPlan(step=6, arena=tier.path, saves=[BlockCopy(2, 1, KEY_B)]))
    _, report = step(w, StepPlan(step=7, arena=tier.path, saves=[BlockCopy(3, 2, b"c" * 16)]),
                     preempt_hook=False)
    assert report is not None and report.done == {6: 1, 7: 1} and report.failed_slots == [1]
    assert not tier.is_sealed(1, KEY_B)
    assert tier.verify(2, b"c" * 16, 0) and not w.defer_saves
    assert w.get_kv_connector_stats().data["save_errors"] == 1


def test_a_step_whose_report_was_taken_first_is_saved_within_the_step(worker_and_tier) -> None:
    # With speculative decoding vLLM takes the worker's report before
    # wait_for_save: nothing would carry deferred saves, so they are copied at once.
    w, tier, kv = worker_and_tier
    w.defer_saves = True
    plan = StepPlan(step=7, arena=tier.path, saves=[BlockCopy(2, 1, KEY_B)])
    w.copy_deferred_saves()
    w.start_load_kv(plan)
    report = w.build_report()
    w.wait_for_save(plan)
    assert report is not None and report.failed_slots == []
    assert tier.verify(1, KEY_B, 0)
    assert w.build_report() is None  # nothing held


def test_the_slot_gets_the_block_as_it_is_at_the_next_step_s_start(worker_and_tier) -> None:
    """The contract: the copy reads the block when the next step starts, so
    nothing may write it in between (vLLM writes KV only after that hook)."""
    w, tier, kv = worker_and_tier
    w.defer_saves = True
    step(w, StepPlan(step=6, arena=tier.path, saves=[BlockCopy(2, 1, KEY_B)]))
    kv[2].fill_(3.0)
    step(w, StepPlan(step=7, arena=tier.path))
    tier.publish(1)
    step(w, StepPlan(step=8, arena=tier.path, loads=[BlockCopy(5, 1, KEY_B)]))
    assert bool((kv[5] == 3.0).all())


def test_a_deferred_copy_that_raises_is_reported_failed_never_good(worker_and_tier, monkeypatch) -> None:
    from kvtier.connector import worker as worker_module

    w, tier, kv = worker_and_tier
    w.defer_saves = True
    step(w, StepPlan(step=6, arena=tier.path, saves=[BlockCopy(2, 1, KEY_B)]))

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(worker_module, "written_runs", broken)
    _, report = step(w, StepPlan(step=7, arena=tier.path))
    assert report is not None and report.done == {6: 1} and report.failed_slots == [1]
    assert not tier.is_sealed(1, KEY_B)
    assert w.get_kv_connector_stats().data["save_errors"] == 1


def test_deferral_is_off_where_vllm_writes_kv_before_handle_preemptions() -> None:
    """Its model runner V2 zeroes and copies blocks before the hook, and so
    does V1 for a KV cache whose new blocks are zeroed (Mamba, mixed
    precisions): there saves stay within their step."""
    from types import SimpleNamespace

    from kvtier.config import KvtierConfig
    from kvtier.connector.connector import defers_saves, saves_settle_later

    on, off = KvtierConfig(defer_saves=True), KvtierConfig()
    v1, v2 = SimpleNamespace(use_v2_model_runner=False), SimpleNamespace(use_v2_model_runner=True)
    plain, zeroed = SimpleNamespace(needs_kv_cache_zeroing=False), SimpleNamespace(needs_kv_cache_zeroing=True)
    assert defers_saves(v1, plain, on) and saves_settle_later(v1, plain, on)
    assert not defers_saves(v1, plain, off) and not saves_settle_later(v1, plain, off)
    assert not defers_saves(v2, plain, on) and not saves_settle_later(v2, plain, on)
    assert not defers_saves(v1, zeroed, on) and not saves_settle_later(v1, zeroed, on)
