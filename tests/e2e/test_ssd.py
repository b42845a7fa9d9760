"""The SSD tier inside a real vLLM CPU engine: demotion, rewarm, restart recovery."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tools.server import VllmServer
from tests.e2e.conftest import (BLOCK, PROMOTE_WAIT, assert_loads_succeeded, complete, delta, hit_after_eviction,
                                server_options, tokens)

pytestmark = pytest.mark.e2e

EXT_HITS = "vllm:external_prefix_cache_hits_total"
DISK = 'vllm:prompt_tokens_cached_by_source_total{source="disk"}'
DEVICE = 'vllm:prompt_tokens_cached_by_source_total{source="device"}'


def ssd_options(model: str, ssd: Path, **extra: object):
    # float32 blocks of the tiny model are 512 KiB: 16 MiB of DRAM holds ~31
    # blocks, less than one prompt plus the fillers, so repeats come from SSD.
    cfg = {"dram_size": "16MB", "ssd_path": str(ssd), "ssd_size": "256MB", **PROMOTE_WAIT, **extra}
    return server_options(model, cfg)


def test_repeat_hits_on_ssd_and_survives_restart(tiny_model: str, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd.img"
    a = tokens(21, 20 * BLOCK + 5)
    with VllmServer(ssd_options(tiny_model, ssd), log_path=tmp_path / "ssd1.log") as srv:
        # The fillers push A out of the device cache and out of DRAM.
        device_hit, again, before, after = hit_after_eviction(srv, a, 2100)
        assert delta(after, before, DEVICE) == 0
        assert delta(after, before, EXT_HITS) == 20 * BLOCK
        assert_loads_succeeded(before, after, 20 * BLOCK)
        assert delta(after, before, DISK) > 0, "expected blocks promoted from SSD"
        assert delta(after, before, "kvtier_blocks_promoted_total") > 0
        assert delta(before, {}, "kvtier_blocks_demoted_total") > 0
        # The moves in flight are on vLLM's /metrics as gauges (their value is whatever is in flight now).
        assert {"kvtier_blocks_moving_to_ssd", "kvtier_blocks_moving_from_ssd"} <= set(after)
        assert again["text"] == device_hit["text"]
        assert "kvtier: SSD tier on" in srv.log_text()

    # A full restart on the same file: the index is recovered from disk and
    # the first repeat of A hits from SSD. (force_new_disk starting the tier
    # empty is tests/unit/test_placement.py: the same plumbing, no engine.)
    with VllmServer(ssd_options(tiny_model, ssd), log_path=tmp_path / "ssd2.log") as srv:
        assert "blocks recovered" in srv.log_text()
        before = srv.metrics()
        after_restart = complete(srv, a)
        after = srv.metrics()
        assert delta(after, before, EXT_HITS) == 20 * BLOCK
        assert delta(after, before, DISK) == 20 * BLOCK
        assert_loads_succeeded(before, after, 20 * BLOCK)
        assert delta(after, before, "kvtier_blocks_promoted_total") == 20
        assert after_restart["text"] == device_hit["text"]
