"""Grouped-query attention (8 query heads, 2 KV heads): the slot layout follows the KV heads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.tools.server import VllmServer
from tests.e2e.conftest import BLOCK, assert_loads_succeeded, delta, hit_after_eviction, server_options, tokens

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gqa_server(gqa_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("logs") / "vllm-gqa.log"
    # bfloat16 here: a kvtier hit is compared with a device hit of the same
    # blocks, which is bit-identical KV whatever the dtype.
    opts = server_options(gqa_model, {"dram_size": "128MB"}, dtype="bfloat16")
    with VllmServer(opts, log_path=log) as srv:
        yield srv


def test_gqa_prefix_from_dram_matches_device_hit(gqa_server: VllmServer) -> None:
    device_hit, again, before, after = hit_after_eviction(gqa_server, tokens(11, 20 * BLOCK + 17), 1100)
    assert delta(after, before, "vllm:external_prefix_cache_hits_total") == 20 * BLOCK
    assert_loads_succeeded(before, after, 20 * BLOCK)
    assert again["text"] == device_hit["text"]
    assert "kvtier: 2 layers, cpu layout, 16384 bytes per block per layer" in gqa_server.log_text()
