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


# --- the engine's time in the connector's hooks -------------------------------------------


def test_hook_time_goes_out_with_the_statistics_or_alone_after_a_while(tmp_path, monkeypatch) -> None:
    import time as _time
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import kvtier.connector.connector as connector
    from kvtier.connector.connector import KvtierConnector
    from tests.unit.vllm_configs import BLOCK, kv_cache_config, vllm_config

    shm = tmp_path / "shm"
    shm.mkdir()
    conn = KvtierConnector(vllm_config(extra={"dram_size": "8MB", "shm_dir": str(shm)}),
                           KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        req = SimpleNamespace(request_id="r", num_tokens=4 * BLOCK + 1, all_token_ids=list(range(4 * BLOCK + 1)),
                              num_computed_tokens=0, mm_features=None, prompt_embeds=None, lora_request=None,
                              cache_salt=None)
        slow = conn._scheduler.get_num_new_matched_tokens

        def lookup(*args):
            _time.sleep(0.02)  # a lookup the engine waits for
            return slow(*args)

        conn._scheduler.get_num_new_matched_tokens = lookup
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        first = conn.get_kv_connector_stats()  # the tiers' gauges are new: a report, the hook's time with it
        assert first is not None and first.data["scheduler_hook_seconds"] >= 0.02
        assert "worker_hook_seconds" not in first.data
        assert first.reduce()["scheduler_hook_seconds"] == first.data["scheduler_hook_seconds"]
        # Nothing else to report: the time waits for the next report...
        conn.get_num_new_matched_tokens(req, 0)
        assert conn.get_kv_connector_stats() is None
        # ... or goes out alone once HOOK_FLUSH_S has passed, all of it, once.
        monkeypatch.setattr(connector, "HOOK_FLUSH_S", 0.0)
        alone = conn.get_kv_connector_stats()
        assert alone is not None and not alone.is_empty()
        assert alone.data.keys() == {"scheduler_hook_seconds"} and alone.data["scheduler_hook_seconds"] >= 0.02
    finally:
        conn.shutdown()
