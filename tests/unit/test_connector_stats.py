"""Connector statistics: what vLLM's connector-stats hook receives and what reaches /metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvtier.connector.connector as connector
from kvtier.connector.connector import KvtierConnector
from kvtier.connector.stats import KvtierStats
from kvtier.connector.worker import WorkerSide
from tests.unit.vllm_configs import BLOCK, kv_cache_config, vllm_config


def test_events_sum_and_gauges_take_the_latest() -> None:
    a = KvtierStats({"blocks_saved": 3, "bytes_saved": 300, "save_seconds": 1e-6, "dram_slots_used": 5})
    b = KvtierStats({"blocks_saved": 2, "bytes_saved": 200, "save_seconds": 1e-6, "dram_slots_used": 9})
    merged = a.aggregate(b)
    assert merged.data == {"blocks_saved": 5, "bytes_saved": 500, "save_seconds": 2e-6, "dram_slots_used": 9}
    out = merged.reduce()
    assert out["blocks_saved"] == 5 and out["dram_slots_used"] == 9
    assert out["save_GBps"] == 0.25  # 500 bytes in 2 us


def test_a_report_of_gauges_alone_is_not_empty() -> None:
    # vLLM drops a scheduler report that says it is empty; tier usage can
    # change with no event counted, and must still reach /metrics.
    assert not KvtierStats({"dram_slots_used": 7, "dram_slots_total": 100}).is_empty()
    assert not KvtierStats({"evictions": 1}).is_empty()
    assert KvtierStats({"evictions": 0}).is_empty()
    assert KvtierStats({}).is_empty()


# --- the engine's time in the connector's hooks -------------------------------------------


class _Clock:
    """Stands for the connector's clock: time passes only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(connector, "time", c)
    return c


def _taking(clock: _Clock, seconds: float, result):
    def hook(*args):
        clock.now += seconds  # a call the engine waits for
        return result
    return hook


def test_scheduler_hook_time_goes_out_with_the_statistics_or_alone_after_a_while(tmp_path, clock) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    conn = KvtierConnector(vllm_config(extra={"dram_size": "8MB", "shm_dir": str(shm)}),
                           KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        req = SimpleNamespace(request_id="r", num_tokens=4 * BLOCK + 1)
        conn._scheduler.get_num_new_matched_tokens = _taking(clock, 0.25, (0, False))
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        first = conn.get_kv_connector_stats()  # the tiers' gauges are new: a report, the hook's time with it
        assert first is not None and first.data["scheduler_hook_seconds"] == 0.25
        assert "worker_hook_seconds" not in first.data
        assert first.reduce()["scheduler_hook_seconds"] == 0.25
        # Nothing else to report: the time waits for the next report...
        conn.get_num_new_matched_tokens(req, 0)
        conn.get_num_new_matched_tokens(req, 0)
        assert conn.get_kv_connector_stats() is None
        # ... or goes out alone once HOOK_FLUSH_S has passed since the last, all of it, once.
        clock.now += connector.HOOK_FLUSH_S
        alone = conn.get_kv_connector_stats()
        assert alone is not None and not alone.is_empty()
        assert alone.data == {"scheduler_hook_seconds": 0.5}
        clock.now += connector.HOOK_FLUSH_S
        assert conn.get_kv_connector_stats() is None
    finally:
        conn.shutdown()


def test_worker_hook_time_is_reported_as_the_workers(clock, monkeypatch) -> None:
    # A worker half without vLLM's process groups (its rank is all the hooks need).
    monkeypatch.setattr(connector, "build_worker_side", lambda *args: WorkerSide(0, 64))
    conn = KvtierConnector(vllm_config(extra={"dram_size": "8MB"}), KVConnectorRole.WORKER, kv_cache_config())
    conn._worker.get_block_ids_with_load_errors = _taking(clock, 0.125, set())
    assert conn.get_block_ids_with_load_errors() == set()
    assert conn.get_kv_connector_stats() is None  # nothing copied, and under HOOK_FLUSH_S
    clock.now += connector.HOOK_FLUSH_S
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data == {"worker_hook_seconds": 0.125}
    # Summed over ranks and intervals as any counter.
    assert stats.aggregate(KvtierStats({"worker_hook_seconds": 0.5})).data == {"worker_hook_seconds": 0.625}


def test_a_failing_shutdown_does_not_stop_vllms(tmp_path, monkeypatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    conn = KvtierConnector(vllm_config(extra={"dram_size": "8MB", "shm_dir": str(shm)}),
                           KVConnectorRole.SCHEDULER, kv_cache_config())
    real = conn._scheduler.shutdown

    def broken() -> None:
        real()
        raise RuntimeError("a device error while closing")

    monkeypatch.setattr(conn._scheduler, "shutdown", broken)
    conn.shutdown()  # logged, not raised into vLLM's shutdown
    assert not any(shm.iterdir())  # what it did close stays closed


def test_the_worker_half_imports_and_counts_where_vllm_is_not_installed() -> None:
    """A GPU machine with torch alone runs the copy path (tests/cuda,
    bench/gpu_check.py): the worker's modules fall back to their own marker
    classes when vLLM is not installed, in a process of their own here."""
    import subprocess
    import sys

    code = """
import importlib.abc, importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.split('.')[0] == 'vllm' else real(name, package)
class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] == 'vllm':
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoVllm())
from kvtier.connector.meta import BlockCopy, StepPlan, StepReport
from kvtier.connector.stats import KvtierStats
from kvtier.connector.worker import WorkerSide
assert not any(m.split('.')[0] == 'vllm' for m in sys.modules)
w = WorkerSide(rank=0, num_blocks=4)
plan = StepPlan(step=1, arena='/nonexistent', loads=[BlockCopy(0, 0, bytes(16))])
w.start_load_kv(plan)
assert w.get_block_ids_with_load_errors() == {0}
stats = w.get_kv_connector_stats().aggregate(KvtierStats({'load_errors': 2}))
print(stats.reduce()['load_errors'], StepReport(done={1: 1}).done)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "{1:", "1}"]
