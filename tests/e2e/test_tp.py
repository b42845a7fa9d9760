"""Tensor parallelism (2 CPU ranks): each rank writes its share of a block, and a hit needs both."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tools.server import VllmServer
from tests.e2e.conftest import BLOCK, assert_loads_succeeded, delta, hit_after_eviction, server_options, tokens

pytestmark = pytest.mark.e2e


def test_two_ranks_share_slots_and_hit_like_the_device_cache(tiny_model: str, tmp_path: Path) -> None:
    # One core per rank: vLLM CPU cannot bind two workers' threads on one NUMA node by itself.
    opts = server_options(tiny_model, {"dram_size": "128MB"}, extra_args=["--tensor-parallel-size", "2"],
                          env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_LOG_STATS_INTERVAL": "1"})
    with VllmServer(opts, log_path=tmp_path / "tp2.log") as srv:
        device_hit, again, before, after = hit_after_eviction(srv, tokens(31, 22 * BLOCK + 9), 3100)
        log = srv.log_text()
    assert delta(after, before, "vllm:external_prefix_cache_hits_total") == 22 * BLOCK
    assert_loads_succeeded(before, after, 22 * BLOCK, ranks=2)
    assert again["text"] == device_hit["text"]
    # Each rank holds half the KV heads; the slot holds both halves.
    assert log.count("kvtier: 2 layers, cpu layout, 65536 bytes per block per layer") == 2
    assert "slots of 262144 bytes" in log
