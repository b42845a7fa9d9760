"""Connector statistics: what vLLM's connector-stats hook receives and what reaches /metrics."""

from __future__ import annotations

from kvtier.connector.stats import KvtierStats


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
