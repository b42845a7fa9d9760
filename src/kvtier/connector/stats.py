"""Connector statistics through vLLM's connector-stats hook and Prometheus.

Worker halves count what they copied (blocks, bytes, seconds, load errors);
the scheduler half adds what the index saw (evictions, slots in use); each
half adds the time the engine spent in its hooks. vLLM
aggregates both per interval, logs :meth:`KvtierStats.reduce` as "KV
Transfer metrics: ..." and feeds :class:`KvtierPromMetrics`, which exports
``kvtier_*`` series on vLLM's /metrics.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

if importlib.util.find_spec("vllm") is not None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
else:  # the worker's copy path without vLLM installed (tests/cuda, bench/gpu_check.py); a vLLM
    # that is installed but lacks these names fails here, as before

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """vLLM's stats container (its ``data`` field), where vLLM is not installed."""

        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data

    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]  # made by vLLM only

# Counters summed across workers and intervals.
COUNTERS = (
    "blocks_loaded", "bytes_loaded", "load_seconds", "load_errors",
    "blocks_saved", "bytes_saved", "save_seconds", "save_errors",
    "evictions", "corrupt_blocks",
    "blocks_demoted", "demote_failures", "evicted_without_copy",
    "blocks_promoted", "promote_failures", "ssd_corrupt_blocks", "ssd_read_errors",
    "ssd_evictions", "ssd_write_give_ups", "moves_stalled",
    # The cluster tier (counted apart): blocks fetched from other nodes, published, and the
    # ones the cluster said it held but that could not be used, by cause.
    "cluster_hits", "cluster_fetched", "cluster_gone", "cluster_corrupt", "cluster_fetch_errors",
    "cluster_published", "cluster_publish_failures", "cluster_publish_skipped", "cluster_down",
    "cluster_lost", "cluster_vanished",
    # Wall time vLLM's engine spent in the connector's hooks (its workers' summed over ranks).
    "scheduler_hook_seconds", "worker_hook_seconds",
)
# Gauges: the latest value wins. The blocks moving: being written to SSD
# or published to the cluster, being read back into DRAM from either.
GAUGES = ("dram_slots_used", "dram_slots_total", "ssd_slots_used", "ssd_slots_total",
          "blocks_moving_to_ssd", "blocks_moving_from_ssd", "blocks_moving_to_cluster", "blocks_moving_from_cluster")


class KvtierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, value: float) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        merged = dict(self.data)
        for k, v in other.data.items():
            merged[k] = v if k in GAUGES else merged.get(k, 0) + v
        return KvtierStats(merged)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in COUNTERS + GAUGES if k in d}
        if d.get("load_seconds"):
            out["load_GBps"] = round(d.get("bytes_loaded", 0) / d["load_seconds"] / 1e9, 3)
        if d.get("save_seconds"):
            out["save_GBps"] = round(d.get("bytes_saved", 0) / d["save_seconds"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        # vLLM drops the scheduler's stats when they are empty: a report that
        # carries only gauges (tier usage changed, no event) must get through.
        return not any(self.data.get(k) for k in COUNTERS) and not any(k in self.data for k in GAUGES)


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name in COUNTERS:
            metric = self._counter_cls(name=f"kvtier_{name}", documentation=f"kvtier {name.replace('_', ' ')}",
                                       labelnames=labelnames)
            self._counters[name] = {idx: metric.labels(*vals) for idx, vals in per_engine_labelvalues.items()}
        self._gauges = {}
        for name in GAUGES:
            metric = self._gauge_cls(name=f"kvtier_{name}", documentation=f"kvtier {name.replace('_', ' ')}",
                                     labelnames=labelnames, multiprocess_mode="mostrecent")
            self._gauges[name] = {idx: metric.labels(*vals) for idx, vals in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            v = transfer_stats_data.get(name)
            if v:
                per_engine[engine_idx].inc(v)
        for name, per_engine in self._gauges.items():
            if name in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[name])
